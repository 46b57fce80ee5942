// Making a built version visible: the last steps every publisher shares
// (CommitDirectory in sync/commit.cc and the AdamW-inverting Publisher in
// sync/publisher.cc).
//
// Thread-safety: stateless; the Store and BlobSink passed in follow their own
// rules (one BlobSink per version being built).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "store/manifest.h"
#include "store/status.h"
#include "store/store.h"
#include "sync/internal/blob_sink.h"

namespace dte::internal {

// The full table of a policy anchor being built (sync/anchor_policy.h): a
// dense record for every block, their payloads in one blob.
//
// Thread-safety: not thread-safe; one per version being built.
class FullTableBuilder {
 public:
  static Result<std::unique_ptr<FullTableBuilder>> Start(BlobSink* sink, size_t blocks);
  // Block `record` as `dense` (an EncodeBlock without a parent). Records
  // may come in any order, one call at a time.
  Status Append(size_t record, const EncodedBlock& dense);
  // Stores the payload blob and the table, with each record's hash taken
  // from `records` (the version's own table), and sets m->full.
  Status Finish(BlobSink* sink, const std::vector<BlockRecord>& records, Manifest* m);
  const std::vector<BlockRecord>& records() const { return records_; }
  uint64_t payload_bytes() const { return spool_ ? spool_->size() : payload_bytes_; }

 private:
  std::unique_ptr<Spool> spool_;
  std::vector<BlockRecord> records_;
  uint64_t payload_bytes_ = 0;
};

// Fills m's stats from its files and the blobs `sink` added, records its
// distance from the nearest self-contained version (`parent_distance`: its
// parent's; ignored for a self-contained m), stores the block
// table, and creates m's manifest exclusively: the version exists exactly
// when this returns Ok. Fails with AlreadyExists, writing no manifest, when
// the store's latest version is no longer `expected_latest` (another
// publisher committed meanwhile, so m's parent is stale) or when m.version
// was taken. On success the version is also remembered in the store's caches.
// `full_records` are the records of m.full (empty without one).
Status PublishVersion(Store* store, BlobSink* sink, Manifest* m,
                      const std::vector<BlockRecord>& records,
                      const std::vector<BlockRecord>& full_records,
                      const AnchorDistance& parent_distance,
                      const std::optional<uint64_t>& expected_latest);

}  // namespace dte::internal
