// Prefetcher: pulls the newest version's blob ranges into the blob cache
// (store/cached_store.h) in the background, so loaders of `latest` read
// local disk instead of the object store.
//
// Whenever `latest` moves, it plans every chunk the new version needs: its
// files' safetensors headers and raw blobs, its block table, and for every
// block the records of its chain back to a dense record, or to a version
// with a local snapshot (whose blocks need no blob). It then fetches the
// chunks not cached yet, kParallelFetches at a time (one range GET each;
// memory: one chunk per fetch). If `latest` moves again meanwhile, it starts
// over with the newer version, whose chain holds most of what was already
// fetched. A version needing more than the cache's capacity is not
// prefetched (reported once). A failure is reported once per version and
// retried after the next poll; while the store does not answer
// (Filesystem::StoreFailing) nothing is tried.
//
// It never runs on a FUSE request thread: its threads run at nice 10 and the
// lowest best-effort I/O priority.
//
// Thread-safety: Wake() and Stats() may be called from any thread; construct
// and destroy from one thread. Destruction stops the work (fetches under way
// finish first) and joins the threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fs/filesystem.h"
#include "store/base/thread_annotations.h"
#include "store/cached_store.h"
#include "store/snapshot.h"

namespace dte::fs {

inline constexpr int kParallelFetches = 4;

struct PrefetchStats {
  std::optional<uint64_t> version;  // being, or last, prefetched
  uint64_t chunks = 0, bytes = 0;   // to fetch for it: not cached when planned
  uint64_t chunks_done = 0, bytes_done = 0;
  bool done = false;           // every chunk of `version` is cached
  uint64_t versions_done = 0;  // by this daemon
  std::string last_error;
};

// The chunks version v needs (see above), in key order. `snapshots` may be
// null. NotFound if a parent in the chain does not load.
Result<std::vector<ChunkId>> PlanPrefetch(Store* store, CachedStore* cache, SnapshotSet* snapshots,
                                          const std::shared_ptr<const Version>& v);

class Prefetcher {
 public:
  // `snapshots` may be null. None of the pointers is owned; all must
  // outlive the Prefetcher.
  Prefetcher(Store* store, Filesystem* fs, CachedStore* cache, SnapshotSet* snapshots);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Looks at `latest` again soon (the poller calls it after every poll).
  void Wake() { wake_ = true; }
  PrefetchStats Stats() const EXCLUDES(mu_);

 private:
  void Run();
  // Ok once every chunk of v is cached; Busy when `latest` moved or stop.
  Status Prefetch(const std::shared_ptr<const Version>& v) EXCLUDES(mu_);
  Status FetchAll(const std::vector<ChunkId>& chunks, const std::string& key) EXCLUDES(mu_);
  bool Superseded(const std::string& key);
  void Fail(const std::shared_ptr<const Version>& v, const Status& s) EXCLUDES(mu_);

  Store* const store_;
  Filesystem* const fs_;
  CachedStore* const cache_;
  SnapshotSet* const snapshots_;
  std::atomic<bool> wake_{true}, stop_{false};
  std::string reported_;  // manifest key whose failure was reported (worker thread only)

  mutable Mutex mu_;
  PrefetchStats stats_ GUARDED_BY(mu_);

  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace dte::fs
