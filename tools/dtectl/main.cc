// dtectl: import, commit, log, export, verify, gc and reindex dte stores;
// apply and status on dtefs mounts.
#include <CLI/CLI.hpp>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "store/base/units.h"
#include "store/cached_store.h"
#include "tools/dtectl/commands.h"

namespace {

using dte::cli::Common;

const char* EnvOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Count options: whole numbers only (CLI11 alone reads "-1" as 2^64 - 1).
const CLI::Validator kCount(
    [](std::string& s) -> std::string {
      if (!s.empty() && s.size() <= 19 && s.find_first_not_of("0123456789") == std::string::npos) {
        return "";
      }
      return "not a whole number: \"" + s + "\"";
    },
    "N");

// Size options as text until they are parsed.
struct SizeText {
  std::string blob_cache = "4GiB";
  std::string blob_chunk = "4MiB";
};

void AddCommon(CLI::App* cmd, Common* c, SizeText* sizes, bool json) {
  cmd->add_option("--store", c->store, "Store: a directory or s3://bucket/prefix (env DTE_STORE)");
  cmd->add_option("--endpoint", c->endpoint,
                  "S3 endpoint URL for s3:// stores (env AWS_ENDPOINT_URL)");
  cmd->add_option("--cache-dir", c->cache_dir,
                  "Host-local index and caches (env DTE_CACHE_DIR, default ~/.cache/dte)");
  cmd->add_option("--blob-cache-size", sizes->blob_cache,
                  "s3:// stores: bound of the local disk cache that blob reads go through and "
                  "uploads are kept in (default 4GiB; 0: none)");
  cmd->add_option("--blob-chunk-size", sizes->blob_chunk,
                  "s3:// stores: blobs are fetched and cached in aligned pieces of this size "
                  "(default 4MiB; a multiple of 64KiB)");
  cmd->add_flag("-q,--quiet", c->quiet, "No progress output");
  if (json) cmd->add_flag("--json", c->json, "Print the result as JSON");
}

// Parses the size options into c; false (after a message) if one is bad.
bool ParseSizes(const SizeText& sizes, Common* c) {
  auto cache = dte::ParseByteSize(sizes.blob_cache);
  if (!cache.ok()) {
    std::cerr << "dtectl: error: bad --blob-cache-size \"" << sizes.blob_cache << "\"\n";
    return false;
  }
  auto chunk = dte::ParseByteSize(sizes.blob_chunk);
  if (!chunk.ok() || *chunk == 0 || *chunk % dte::kCachePageBytes != 0 ||
      *chunk > (uint64_t{1} << 30)) {
    std::cerr << "dtectl: error: bad --blob-chunk-size \"" << sizes.blob_chunk
              << "\": a multiple of 64KiB, at most 1GiB\n";
    return false;
  }
  c->blob_cache_bytes = *cache;
  c->blob_chunk_bytes = *chunk;
  return true;
}

// The command line: every command's options and arguments, and the
// commands that were given.
struct Dtectl {
  CLI::App app{"dtectl: every version of a policy as checkpoint files"};
  Common c;
  SizeText sizes;
  dte::cli::CommitArgs ca;
  dte::cli::LogArgs lg;
  dte::cli::StatsArgs sa;
  std::string report_versions, report_out;
  bool report_fp8 = false;
  uint64_t report_fp8_block = 128;
  std::string diff_a, diff_b;
  std::string export_version, out;
  std::optional<uint64_t> verify_version;
  dte::cli::GcArgs ga;
  std::optional<uint32_t> cache_keep;
  dte::cli::LiveArgs la;
  CLI::App *import = nullptr, *commit = nullptr, *log = nullptr, *stats = nullptr,
           *report = nullptr, *diff = nullptr, *exp = nullptr, *verify = nullptr, *gc = nullptr,
           *reindex = nullptr, *cache = nullptr, *apply = nullptr, *status = nullptr;

  Dtectl();
  // import and commit.
  void AddCommitCommands();
  // log, stats, report and diff.
  void AddReadCommands();
  // export, verify, gc, reindex and cache.
  void AddStoreCommands();
  // apply and status, which take a mount point, not a store.
  void AddMountCommands();
  // The command given, once parsed; its exit code.
  int Run();
  int RunOnStore();
};

Dtectl::Dtectl() {
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every command");
  c.store = EnvOr("DTE_STORE", "");
  AddCommitCommands();
  AddReadCommands();
  AddStoreCommands();
  AddMountCommands();
}

void Dtectl::AddCommitCommands() {
  auto add_commit = [&](const char* name, const char* help) {
    CLI::App* cmd = app.add_subcommand(name, help);
    AddCommon(cmd, &c, &sizes, true);
    cmd->add_option("DIR", ca.dir, "Hugging Face checkpoint directory")->required();
    cmd->add_option("--version", ca.version, "Version number (default: latest + 1)");
    return cmd;
  };
  import = add_commit("import", "Store a checkpoint as a full (anchor) version");
  commit = add_commit("commit", "Store a checkpoint as a delta against the latest");
  commit->add_flag("--anchor", ca.anchor, "Store full weights instead of a delta");
  commit->add_option("--anchor-budget", ca.anchor_budget,
                     "Also store the version whole (zstd) once the deltas since the last full "
                     "version add up to this many times the model's dense size (default 1.0; "
                     "0: never)");
  commit
      ->add_option("--anchor-every", ca.anchor_every,
                   "Also store the version whole once this many versions passed since the "
                   "last full one (default 0: never)")
      ->check(CLI::NonNegativeNumber);
  commit->add_option("--join-budget", ca.join_budget,
                     "Also store a join table (a full copy kept outside the manifest, only the "
                     "newest two stay) once the deltas since the last full copy add up to this "
                     "many times the model's dense size, so late joiners read latest quickly "
                     "(default 0.125; 0: never)");
  for (CLI::App* cmd : {import, commit}) {
    cmd->add_option("--keep-snapshots", ca.keep_snapshots,
                    "Leave a snapshot of the new version in the cache directory for the next "
                    "commit, keeping the newest N there (default 3; 0: none)")
        ->check(CLI::NonNegativeNumber);
  }
  commit
      ->add_option("--snapshot-every", ca.snapshot_every,
                   "Leave a snapshot only of a version stored whole and of one with no "
                   "snapshot among its last N-1 ancestors on this host, so the next commit "
                   "reads its parent from a snapshot plus at most N-1 deltas (default 8; "
                   "1: every version)")
      ->check(CLI::PositiveNumber);
}

void Dtectl::AddReadCommands() {
  log = app.add_subcommand("log", "List versions");
  AddCommon(log, &c, &sizes, true);
  log->add_option("--limit", lg.limit, "Only the newest N versions (of those --since selects)")
      ->check(kCount);
  log->add_option("--since", lg.since, "Only versions numbered V or higher")->check(kCount);

  stats = app.add_subcommand(
      "stats", "Changed elements and stored bytes per version and tensor, layer or kind");
  AddCommon(stats, &c, &sizes, true);
  stats->add_option("--versions", sa.versions, "A..B, A.., ..B or one version (default: all)");
  stats->add_option("--by", sa.by, "Rows per tensor (default), layer, kind, layer-kind or version")
      ->check(CLI::IsMember({"tensor", "layer", "kind", "layer-kind", "version"}));
  stats->add_flag("--csv", sa.csv, "Print CSV (a header line, then one line per row)");
  stats->add_flag("--fp8", sa.fp8,
                  "FP8 bytes and scales that changed, beside the BF16 elements, under both "
                  "scale rules (tensors the FP8 policy quantizes; --by tensor or version)");
  stats->add_option("--fp8-block", sa.fp8_block, "FP8 block size N (N x N; default 128)")
      ->check(CLI::PositiveNumber);

  report = app.add_subcommand(
      "report", "Write one self-contained HTML page with plots of how the policy moves");
  AddCommon(report, &c, &sizes, false);
  report->add_option("--versions", report_versions, "A..B, A.., ..B or one version (default: all)");
  report->add_option("-o,--out", report_out, "The HTML file to write")->required();
  report->add_flag("--fp8", report_fp8, "Also plot the FP8 change set per version (stats --fp8)");
  report->add_option("--fp8-block", report_fp8_block, "FP8 block size N (N x N; default 128)")
      ->check(CLI::PositiveNumber);

  diff = app.add_subcommand("diff",
                            "Per tensor: the elements that differ between two versions, in ulps");
  AddCommon(diff, &c, &sizes, true);
  diff->add_option("A", diff_a, "A version number or 'latest'")->required();
  diff->add_option("B", diff_b, "A version number or 'latest'")->required();
}

void Dtectl::AddStoreCommands() {
  exp = app.add_subcommand("export", "Write a version as a plain model directory");
  AddCommon(exp, &c, &sizes, true);
  exp->add_option("--version", export_version, "Version number or 'latest'")->required();
  exp->add_option("OUT_DIR", out, "Output directory (must not exist or be empty)")->required();

  verify = app.add_subcommand("verify", "Check every blob, chain and tensor hash");
  AddCommon(verify, &c, &sizes, true);
  verify->add_option("--version", verify_version, "Only this version (and its chain)");

  gc = app.add_subcommand("gc", "Keep the newest versions, reclaim the rest");
  AddCommon(gc, &c, &sizes, true);
  gc->add_option("--keep-last", ga.keep_last, "Versions to keep")->required()->check(kCount);
  gc->add_option("--keep-every", ga.keep_every,
                 "Also keep every older version whose number is a multiple of K "
                 "(default 0: none)")
      ->check(kCount);
  gc->add_option("--anchor-budget", ga.anchor_budget,
                 "A rebased delta also gets a full table where a commit onto its new parent "
                 "would (commit's --anchor-budget; default 1.0; 0: never)");
  gc->add_option("--grace-seconds", ga.grace_seconds,
                 "Never delete unreferenced blobs younger than this (commits in flight)");
  gc->add_flag("--dry-run", ga.dry_run, "Only report what would be kept, removed and rebased");

  reindex = app.add_subcommand("reindex", "Rebuild the local index from the store");
  AddCommon(reindex, &c, &sizes, true);

  cache = app.add_subcommand("cache", "Show (and prune) this host's snapshots of the store");
  AddCommon(cache, &c, &sizes, true);
  cache
      ->add_option("--keep-snapshots", cache_keep,
                   "Delete all but the snapshots of the newest N versions")
      ->check(CLI::NonNegativeNumber);
}

void Dtectl::AddMountCommands() {
  apply = app.add_subcommand("apply", "Make a version live in place on a dtefs mount");
  apply->add_option("MOUNT", la.mount, "dtefs mount point")->required();
  apply->add_option("--version", la.version, "Version number or 'latest' (default)");
  apply->add_flag("--json", la.json, "Print the result as JSON");
  apply->add_flag("-q,--quiet", la.quiet, "No output on success");
  status = app.add_subcommand("status", "Show the live state of a dtefs mount");
  status->add_option("MOUNT", la.mount, "dtefs mount point")->required();
  status->add_flag("--json", la.json, "Print the result as JSON");
}

int Dtectl::Run() {
  if (*apply) return dte::cli::RunApply(la);
  if (*status) return dte::cli::RunStatus(la);
  if (c.store.empty()) {
    std::cerr << "dtectl: error: no store given (use --store or set DTE_STORE)\n";
    return 2;
  }
  if (!ParseSizes(sizes, &c)) return 2;
  if (c.cache_dir.empty()) c.cache_dir = dte::DefaultCacheDir();
  if (!c.endpoint.empty()) {
    // S3 stores read their endpoint from the environment; the flag wins
    // over both variables. No thread runs yet.
    ::setenv("AWS_ENDPOINT_URL_S3", c.endpoint.c_str(), 1);
    ::setenv("AWS_ENDPOINT_URL", c.endpoint.c_str(), 1);
  }
  return RunOnStore();
}

int Dtectl::RunOnStore() {
  if (*import) return dte::cli::RunCommit(c, ca, true);
  if (*commit) return dte::cli::RunCommit(c, ca, false);
  if (*log) return dte::cli::RunLog(c, lg);
  if (*stats) return dte::cli::RunStats(c, sa);
  if (*diff) return dte::cli::RunDiff(c, diff_a, diff_b);
  if (*report) {
    return dte::cli::RunReport(c, report_versions, report_out, report_fp8 ? report_fp8_block : 0);
  }
  if (*exp) return dte::cli::RunExport(c, export_version, out);
  if (*verify) return dte::cli::RunVerify(c, verify_version);
  if (*gc) return dte::cli::RunGc(c, ga);
  if (*reindex) return dte::cli::RunReindex(c);
  if (*cache) return dte::cli::RunCache(c, cache_keep);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Dtectl cli;
  try {
    cli.app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = cli.app.exit(e);
    return code == 0 ? 0 : 2;
  }
  return cli.Run();
}
