// SnapshotSet: host-local materialized snapshots of versions.
//
// A snapshot holds every block of one version fully materialized (dense raw
// bytes), so that reading a version far from its anchor starts from the
// nearest snapshot back along its chain instead of from the anchor (see
// Materializer::SetBase). Snapshots are a cache: they live in a directory on
// this host, never in the store, and every block read from one is checked
// against the version's XXH3-64 block hash; a block that does not match
// (or a file that is short or unreadable) drops the whole snapshot and the
// read falls back to the store. File format: see the top of snapshot.cc.
//
// A snapshot is named by its version number and a content id (ContentId)
// computed from the version's block hashes only, so it stays valid when gc
// rewrites the version as a new manifest revision with the same content.
// Files are read with pread, never mapped, so the memory they use is the
// kernel's page cache, not the process's.
//
// Thread-safety: all methods may be called concurrently. Build() may run
// for many seconds; it writes to a temporary file and publishes the
// snapshot with one rename, so readers never see a partial one.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "store/base/posix_file.h"
#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/materialize.h"
#include "store/store.h"

namespace dte {

struct SnapshotStats {
  uint64_t count = 0;
  uint64_t bytes = 0;              // disk space allocated to the files
  std::vector<uint64_t> versions;  // ascending
  std::optional<uint64_t> building;
  uint64_t building_blocks_done = 0, building_blocks = 0;
  uint64_t block_reads = 0;    // blocks read and verified
  uint64_t hash_failures = 0;  // blocks that did not match (each dropped its snapshot)
  uint64_t built = 0;          // snapshots written by this process
  std::string last_error;      // of the most recent drop or failed read
};

class SnapshotSet;

// What a snapshot writer does with the pages it wrote.
enum class SnapshotPages {
  // Written back and dropped from the page cache window by window, as they
  // are written: a snapshot built in the background (dtefs, verify) neither
  // piles up dirty pages nor evicts what readers use. Writes go in order.
  kDropBehind,
  // Left in the page cache for the kernel to write back: a commit's
  // snapshot, which the next commit reads whole as its parent (a dropped
  // one would be read back from disk). Writes in any order.
  kKeep,
};

// A snapshot being written, block by block, by whoever has the bytes (a
// commit writing the version it builds, or SnapshotSet::Build). The file is
// a temporary one until Publish; destroying an unpublished writer removes
// it.
//
// Thread-safety: with SnapshotPages::kKeep, Write may be called
// concurrently for disjoint records; with kDropBehind, from one thread at a
// time, in order of records. Publish once, after every Write returned.
class SnapshotWriter {
 public:
  ~SnapshotWriter();
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  // Writes `len` bytes: the blocks from record `record` on, consecutive and
  // of one tensor (so contiguous in the file).
  Status Write(size_t record, const uint8_t* data, uint64_t len);
  // Makes the file the snapshot of v (which must be the version it was
  // begun for, every block written). The caller vouches for the bytes:
  // they are not read back; readers check each block against v's hashes.
  Status Publish(const Version& v);

 private:
  friend class SnapshotSet;
  struct State;
  explicit SnapshotWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class SnapshotSet : public BlockBase {
 public:
  // Opens `dir` (created if missing): removes temporary files that no
  // process is writing (left by a crash) and takes in the snapshot files
  // already there (of an earlier run).
  static Result<std::unique_ptr<SnapshotSet>> Open(const std::string& dir);
  ~SnapshotSet() override;

  // The content id of v: XXH3-128 over the format version, block size,
  // record count and every record's block hash.
  static Hash128 ContentId(const Version& v);
  static Hash128 ContentId(uint64_t block_bytes, const std::vector<BlockRecord>& records);
  // The file name of the snapshot of v ("v00000012.<content id>.snap").
  static std::string FileName(const Version& v);

  // BlockBase: block `record` of v from v's snapshot, if there is one with
  // v's content id and the block matches its hash.
  bool ReadBlock(const Version& v, size_t record, uint64_t len, uint8_t* dst) override
      EXCLUDES(mu_);

  // True if a snapshot of v (same content id) is present.
  bool Has(const Version& v) EXCLUDES(mu_);

  // Writes a snapshot of v, materializing every block through `reader` one
  // at a time (memory: one block), then publishes it. Returns Busy, leaving
  // nothing behind, once `cancel` becomes true; IOError if the directory's
  // filesystem lacks the space (the snapshot's size plus a reserve) or a
  // write fails; a read's error naming the block. Ok at once if v already
  // has a snapshot.
  Status Build(const std::shared_ptr<const Version>& v, Materializer* reader,
               const std::atomic<bool>& cancel) EXCLUDES(mu_);

  // Starts a snapshot of version `version` of `bytes` bytes (SnapshotSize)
  // with blocks of `block_bytes`. IOError if the directory's filesystem
  // lacks the space for it plus a reserve of 5% (the low-disk guard).
  Result<std::unique_ptr<SnapshotWriter>> Begin(uint64_t version, uint64_t block_bytes,
                                                uint64_t bytes,
                                                SnapshotPages pages = SnapshotPages::kDropBehind)
      EXCLUDES(mu_);

  // The size of the snapshot file of a version with this manifest.
  static uint64_t SnapshotSize(const Manifest& m);

  // Deletes the snapshot of `version`, if any.
  void Remove(uint64_t version) EXCLUDES(mu_);

  // Deletes all but the snapshots of the newest `keep` versions (oldest
  // first). Returns the versions deleted.
  std::vector<uint64_t> KeepNewest(size_t keep) EXCLUDES(mu_);

  // Deletes every snapshot that is not of one of `versions` with the same
  // content id (its version left the store, or changed content). Returns
  // the versions that have a snapshot.
  std::set<uint64_t> Retain(const std::map<uint64_t, std::shared_ptr<const Version>>& versions)
      EXCLUDES(mu_);

  SnapshotStats Stats() const EXCLUDES(mu_);
  const std::string& dir() const { return dir_; }

 private:
  friend class SnapshotWriter;
  struct Entry {
    uint64_t version = 0;
    Hash128 id;
    std::string path;
    ScopedFd fd;
    uint64_t bytes = 0;
    Mutex mu;
    std::optional<std::string> verified_key GUARDED_BY(mu);  // a manifest key found to have id
  };

  explicit SnapshotSet(std::string dir) : dir_(std::move(dir)) {}
  Status Scan() EXCLUDES(mu_);
  bool Matches(Entry* e, const Version& v) EXCLUDES(mu_);
  // Deletes e if it is still the snapshot of its version; a nonempty `why`
  // becomes last_error.
  void Drop(const std::shared_ptr<Entry>& e, const std::string& why) EXCLUDES(mu_);
  // Renames `tmp` to e's path and makes e the snapshot of its version.
  Status Publish(std::shared_ptr<Entry> e, const std::string& tmp) EXCLUDES(mu_);
  Status WriteBlocks(const std::shared_ptr<const Version>& v, Materializer* reader,
                     SnapshotWriter* writer, const std::atomic<bool>& cancel) EXCLUDES(mu_);

  const std::string dir_;
  std::atomic<uint64_t> block_reads_{0}, hash_failures_{0};
  mutable Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Entry>> entries_ GUARDED_BY(mu_);  // by version
  std::optional<uint64_t> building_ GUARDED_BY(mu_);
  uint64_t building_done_ GUARDED_BY(mu_) = 0;
  uint64_t building_total_ GUARDED_BY(mu_) = 0;
  uint64_t built_ GUARDED_BY(mu_) = 0;
  std::string last_error_ GUARDED_BY(mu_);
};

// The snapshot directory of a store's cache (CACHE_DIR/<store_id>/snapshots),
// shared by dtectl and dtefs; "" for a store opened without a cache
// directory.
std::string SnapshotDir(const Store& store);

// The store's snapshots, for reading from (a Materializer base); null
// without a cache directory or when it cannot be opened (a cache is never
// required).
std::unique_ptr<SnapshotSet> OpenStoreSnapshots(const Store& store);

// Why a new version whose parent is `parent` gets no snapshot in `set`
// under CommitOptions::snapshot_every `every` (store/ops/commit.h): the
// snapshot of a version at most every - 1 versions back; "" when one is
// due (none that close, or every <= 1).
std::string SnapshotNotDue(Store& store, SnapshotSet& set, std::shared_ptr<const Version> parent,
                           uint32_t every);

}  // namespace dte
