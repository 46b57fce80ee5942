// dtectl subcommands. Each returns the process exit status:
//   0 success, 1 error, 2 usage, 3 version conflict, 4 verification failed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dte::cli {

struct Common {
  std::string store;      // --store, or $DTE_STORE
  std::string cache_dir;  // --cache-dir, or $DTE_CACHE_DIR, or ~/.cache/dte
  std::string endpoint;   // --endpoint: S3 endpoint URL for s3:// stores
  // s3:// stores: --blob-cache-size (0: no blob cache) and --blob-chunk-size
  // of the local blob cache (tools/dtectl/open_store.h).
  uint64_t blob_cache_bytes = uint64_t{4} << 30;
  uint64_t blob_chunk_bytes = uint64_t{4} << 20;
  bool quiet = false;
  bool json = false;
};

struct CommitArgs {
  std::string dir;
  std::optional<uint64_t> version;
  bool anchor = false;
  double anchor_budget = 1.0;  // store/write/anchor_policy.h
  uint64_t anchor_every = 0;
  double join_budget = 0.125;
  uint32_t keep_snapshots = 3;
  uint32_t snapshot_every = 8;
};

// log: the newest `limit` versions (all: nullopt) of those numbered at
// least `since`.
struct LogArgs {
  std::optional<uint64_t> limit;
  std::optional<uint64_t> since;
};

struct GcArgs {
  uint64_t keep_last = 8;
  uint64_t keep_every = 0;  // 0: off
  double anchor_budget = 1.0;
  int64_t grace_seconds = 600;
  bool dry_run = false;
};

// stats: per version of `versions` (ParseVersionRange's text; empty: all),
// rows grouped `by` (tensor, layer, kind, layer-kind or version), as a table, JSON
// (Common::json) or CSV. With fp8, the FP8 changes of the tensors the FP8
// policy quantizes, in fp8_block x fp8_block blocks (tools/dtectl/stats_fp8.h).
struct StatsArgs {
  std::string versions;
  std::string by = "tensor";
  bool csv = false;
  bool fp8 = false;
  uint64_t fp8_block = 128;
};

int RunCommit(const Common& c, const CommitArgs& a, bool import);
int RunLog(const Common& c, const LogArgs& a);
int RunExport(const Common& c, const std::string& version, const std::string& out);
int RunVerify(const Common& c, std::optional<uint64_t> version);
int RunGc(const Common& c, const GcArgs& a);
int RunReindex(const Common& c);
int RunStats(const Common& c, const StatsArgs& a);
// report: runs the report script (sync/python/dte/report.py, $DTE_REPORT_SCRIPT)
// with $DTE_PYTHON (default /opt/dte/venv/bin/python, else python3), which reads
// `dtectl stats` and writes
// one self-contained HTML page to `out`; with fp8_block (not 0), also the
// FP8 change set per version in fp8_block x fp8_block blocks (stats --fp8).
int RunReport(const Common& c, const std::string& versions, const std::string& out,
              uint64_t fp8_block = 0);
// diff: per tensor, the elements that differ between versions a and b and
// their distances in units in the last place.
int RunDiff(const Common& c, const std::string& a, const std::string& b);
// Shows the store's snapshots in this host's cache and the disk left;
// with keep_snapshots, first deletes all but the newest that many.
int RunCache(const Common& c, std::optional<uint32_t> keep_snapshots);

// apply and status talk to a dtefs mount (tools/dtectl/live.cc), not to a
// store: no --store.
struct LiveArgs {
  std::string mount;
  std::string version = "latest";  // apply --version: N, vNNNNNNNN or latest
  bool json = false;
  bool quiet = false;
};

int RunApply(const LiveArgs& a);
int RunStatus(const LiveArgs& a);

}  // namespace dte::cli
