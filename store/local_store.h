// LocalStore: an ObjectStore in a local directory (or one on a shared
// filesystem such as NFS).
//
// Layout: the object `key` is the file ROOT/key; parent directories are made
// on demand and never removed. ROOT/tmp/ holds writes in flight and the spool
// files NewTempPath hands out, so keys whose first segment is "tmp" are
// reserved and rejected, and List never shows them.
//
// Atomicity and durability (what makes a commit crash-safe):
//  - Put writes a file in ROOT/tmp, fsyncs it, rename(2)s it over ROOT/key
//    and fsyncs every directory whose entries changed. PutFile does the same
//    with the caller's spool file (copying it first if it lives on another
//    filesystem). Readers see the old or the new object, never a mix.
//  - CreateExclusive writes and fsyncs a temp file, then link(2)s it to
//    ROOT/key. link fails if the name exists, so exactly one of any number of
//    racing creators (threads, processes, hosts sharing the filesystem) wins.
//  A crash at any point leaves the old object or the new one, at worst plus a
//  stray file in ROOT/tmp (see RemoveStaleTempFiles).
//
// Reads: Get, Size and ModifiedTime look the file up afresh, so they see the
// latest write from any process. GetRange and ReadRange go through a bounded
// LRU cache of open descriptors, because the read path issues many small
// range reads of the same blob. Keys this LocalStore replaces or deletes are
// evicted at once; a key replaced by another process may still be read from
// the old file until its descriptor ages out. That is harmless for
// content-addressed blobs (one key, one content); read keys that are
// overwritten in place with Get.
//
// Thread-safety: all methods may be called concurrently. The only lock is the
// descriptor cache's mutex, a leaf lock held for map operations only.
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/object_store.h"

namespace dte {

// The key grammar every ObjectStore enforces, because keys come from
// manifests and stores are untrusted input: '/'-separated segments of
// [A-Za-z0-9._-], each 1-255 bytes and neither "." nor "..", at most 1024
// bytes in all, no leading '/'. InvalidArgument naming the key otherwise.
Status ValidateObjectKey(std::string_view key);

// A List prefix: "" or a key's leading part. The segments before its last
// '/' obey the key grammar; the partial last segment only needs valid bytes.
Status ValidateObjectKeyPrefix(std::string_view prefix);

struct LocalStoreOptions {
  bool create = false;  // mkdir -p the root if it is missing
  // Capacity of the read descriptor cache; 0 disables it. A read of a
  // version walks the blobs of every version back to its full table (up to
  // the anchor budget's worth, often a hundred or more), so the cache holds
  // that many; it never takes more than a quarter of RLIMIT_NOFILE's soft
  // limit.
  size_t max_open_fds = 1024;
};

class LocalStore final : public ObjectStore {
 public:
  // Opens the store rooted at `root`: NotFound "store ROOT does not exist"
  // unless options.create. A read-only directory opens fine; writes to it
  // fail with errors naming the path.
  static Result<std::unique_ptr<LocalStore>> Open(const std::string& root,
                                                  const LocalStoreOptions& options = {});
  ~LocalStore() override;
  LocalStore(const LocalStore&) = delete;
  LocalStore& operator=(const LocalStore&) = delete;

  std::string Describe() const override { return root_; }
  Status Put(const std::string& key, std::string_view data) override;
  Status PutFile(const std::string& key, const std::string& path) override;
  Status CreateExclusive(const std::string& key, std::string_view data) override;
  Result<std::string> Get(const std::string& key) override;
  Result<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t len) override;
  Status ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) override;
  Result<std::optional<uint64_t>> Size(const std::string& key) override;
  Result<std::vector<std::string>> List(const std::string& prefix) override;
  // Names outside the store's grammar are foreign files here, skipped.
  Result<std::vector<std::string>> ListStoreKeys(const std::string& prefix) override;
  Status Delete(const std::string& key) override;
  Result<int64_t> ModifiedTime(const std::string& key) override;
  Status Touch(const std::string& key) override;
  // ROOT/tmp/<pid>-<random>-<counter>; the file is not created.
  Result<std::string> NewTempPath() override;

  // The directory as opened, without trailing '/'.
  const std::string& root() const { return root_; }

  // Deletes files in ROOT/tmp not modified for `min_age_seconds` (left by
  // crashed writers, or spool files never handed to PutFile). Returns how
  // many were removed. Pick an age longer than any write in flight.
  Result<uint64_t> RemoveStaleTempFiles(int64_t min_age_seconds);
  Result<uint64_t> RemoveStaleTemp(int64_t min_age_seconds) override {
    return RemoveStaleTempFiles(min_age_seconds);
  }

  // Descriptor cache introspection, for tests and statistics.
  size_t CachedFdCount() const;
  bool IsFdCached(const std::string& key) const;

 private:
  struct OpenFile;
  class FdCache;
  using OpenFilePtr = std::shared_ptr<const OpenFile>;

  LocalStore(std::string root, size_t max_open_fds);

  std::string PathOf(const std::string& key) const { return root_ + "/" + key; }
  Status CheckKey(const std::string& key) const;
  std::string TempName();
  Result<std::string> WriteTempFile(std::string_view data);
  Result<std::string> CopyToTempFile(const std::string& src);
  Result<bool> MoveSyncedFile(const std::string& src, const std::string& dst);
  Status LinkExclusive(const std::string& tmp, const std::string& key);
  Status MakeParents(const std::string& key, std::vector<std::string>* to_sync);
  Status FinishInstall(const std::string& path, std::vector<std::string> to_sync);
  Result<std::optional<struct stat>> StatObject(const std::string& key) const;
  Result<OpenFilePtr> OpenObject(const std::string& key) const;
  Result<OpenFilePtr> OpenForRange(const std::string& key, uint64_t offset, uint64_t len);
  Status TooShort(const std::string& key, uint64_t offset, uint64_t len, uint64_t size) const;
  Status ReadOpenFile(const OpenFile& file, const std::string& key, uint64_t offset, uint64_t len,
                      void* dst) const;
  Status Walk(const std::string& start, const std::string& prefix,
              std::vector<std::string>* keys) const;

  const std::string root_;
  const std::string tmp_dir_;
  const uint64_t temp_nonce_;  // random, so temp names differ between stores
  std::atomic<uint64_t> temp_counter_{0};
  const std::unique_ptr<FdCache> fd_cache_;
};

}  // namespace dte
