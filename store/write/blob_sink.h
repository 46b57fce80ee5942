// BlobSink: the content-addressed blobs one commit writes.
//
// Small blobs are put from memory; large ones are spooled to a temp file
// while being hashed, then moved into place under their hash. A blob that
// already exists is not written again (it is touched, so gc's grace window
// protects it until the manifest that reuses it exists).
//
// Thread-safety: not thread-safe; one per commit, used by its writer thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "store/hash.h"
#include "store/manifest.h"
#include "store/object_store.h"

namespace dte::internal {

class Spool {
 public:
  ~Spool();
  Status Append(const void* data, size_t len);
  uint64_t size() const { return size_; }

 private:
  friend class BlobSink;
  Spool(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  Status Flush();

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  Hasher128 hasher_;
  std::string buf_;
};

// Fills *rec from an encoded block: its kind and changed count, and for a
// block with a payload, the payload appended to `spool` (blob `blob_index`
// of the version) at the spool's current end.
Status AppendEncodedBlock(const EncodedBlock& block, uint32_t blob_index, Spool* spool,
                          BlockRecord* rec);

class BlobSink {
 public:
  explicit BlobSink(ObjectStore* objects) : objects_(objects) {}

  Result<BlobRef> PutBytes(std::string_view data);
  Result<std::unique_ptr<Spool>> NewSpool();
  // Closes the spool and stores it under its hash.
  Result<BlobRef> Finish(std::unique_ptr<Spool> spool);

  // A blob of the same version written by another writer (a distributed
  // publish's other ranks): Refresh checks and touches it too, and it counts
  // in added_bytes() when ref.added.
  void Include(const BlobRef& ref);

  const std::vector<BlobRef>& added() const { return added_; }
  uint64_t added_bytes() const;

  // Touches every blob this sink wrote or reused and checks it is still
  // there, right before the manifest naming them is created: gc spares
  // blobs younger than its grace window, and a long commit's early blobs may
  // have aged past it. NotFound naming the blob if one has gone.
  Status Refresh();

 private:
  Result<BlobRef> Adopt(const Hash128& hash, uint64_t size, const std::string* data,
                        const std::string* path);

  ObjectStore* objects_;
  std::vector<BlobRef> added_;
  std::vector<BlobRef> used_;  // added or reused
};

}  // namespace dte::internal
