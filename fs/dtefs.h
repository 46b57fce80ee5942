// dtefs: mount a dte store as a read-only tree of checkpoint directories.
//
// Serve() mounts the store at a directory (see fs/filesystem.h for the tree)
// and answers requests until the mount goes away: `fusermount3 -u`, SIGTERM
// or SIGINT. It then unmounts, stops the poller, the prefetcher
// (fs/prefetcher.h) and the snapshot worker (fs/snapshotter.h) and closes
// the store.
//
// Polling: every poll_ms the poller looks for new versions with one
// incremental listing (Filesystem::RefreshNew: one request on S3), and
// every FullListEvery(versions)-th poll, and every poll while the store does
// not answer, with a full listing (Filesystem::Refresh), which also notices
// removals.
//
// Thread-safety: Serve() is a blocking call; run one per mount point.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/fp8_view.h"

namespace dte::fs {

inline constexpr uint32_t kFullListEvery = 10;

// Polls between full listings of a store with `versions` versions:
// kFullListEvery per 1000 versions (one listing page on S3), so the
// listing requests per poll stay at most 1 + 1 / kFullListEvery however
// many versions the store holds.
inline uint64_t FullListEvery(uint64_t versions) {
  return kFullListEvery * std::max<uint64_t>(1, (versions + 999) / 1000);
}

struct MountOptions {
  std::string store;                           // local directory or s3://bucket/prefix
  std::string mountpoint;                      // an existing directory
  std::string cache_dir;                       // host-local index; empty: run without one
  uint64_t cache_bytes = uint64_t{256} << 20;  // block cache capacity
  uint32_t poll_ms = 500;                      // how often new versions are looked for
  // Materialized snapshots in <cache_dir>/<store_id>/snapshots (none without
  // a cache_dir): one every `snapshot_every` versions along a chain (0: no
  // snapshots), at most `max_snapshots` of them.
  uint32_t snapshot_every = 8;
  uint32_t max_snapshots = 8;
  uint32_t readahead_kb = 4096;  // the mount's kernel readahead (root only); 0: leave it
  // s3:// stores: the local blob cache in <cache_dir>/<store_id>/blobs
  // (store/cached_store.h; needs the index; 0: none), fetched and kept in
  // chunks of blob_chunk_bytes, and whether `latest` is prefetched into it.
  uint64_t blob_cache_bytes = uint64_t{4} << 30;
  uint64_t blob_chunk_bytes = uint64_t{4} << 20;
  bool prefetch_latest = false;
  // The version live/ shows at mount (nullopt: the newest); live apply moves
  // it (sync/live/live.h).
  std::optional<uint64_t> live_version;
  // fp8/: every version as a block-scaled FP8 checkpoint (fs/fp8_reader.h),
  // with these block sizes and scale rule; false hides the tree.
  bool fp8 = true;
  Fp8ViewOptions fp8_view;
  // Serve the Prometheus metrics (fs/metrics.h) on HOST:PORT, or on
  // 127.0.0.1:PORT when only a port is given; empty: no metrics.
  std::string metrics_address;
  bool foreground = false;  // false: daemonize once mounted
  // Where messages go (appended) once the mount is up. Empty: stderr in the
  // foreground; a daemon, whose stderr is gone, writes <cache_dir>/dtefs.log
  // (nowhere without a cache_dir).
  std::string log_file;
  bool debug = false;  // libfuse request tracing
  // Extra mount options (-o), already split at commas. Options that make no
  // sense for a read-only store mount (rw, dev, suid, ...) are dropped.
  std::vector<std::string> fuse_options;
};

// Returns when unmounted. Errors before the mount exists are returned (and,
// without `foreground`, happen before daemonizing, so the caller can print
// them).
Status Serve(const MountOptions& options);

// The mount options dtefs passes to libfuse: always read-only with 1 MiB
// reads, plus the user's options minus the ignored mount(8) generics.
std::vector<std::string> EffectiveMountOptions(const MountOptions& options);

}  // namespace dte::fs
