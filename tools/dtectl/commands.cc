#include "tools/dtectl/commands.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "store/cached_store.h"
#include "store/dtype.h"
#include "store/ops/commit.h"
#include "store/ops/export.h"
#include "store/ops/gc.h"
#include "store/ops/stats.h"
#include "store/ops/verify.h"
#include "store/store.h"
#include "tools/dtectl/open_store.h"
#include "tools/dtectl/progress.h"
#include "tools/dtectl/stats_fp8.h"

namespace dte::cli {
namespace {

using nlohmann::json;

int Usage(const char* cmd, const std::string& message) {
  std::cerr << "dtectl " << cmd << ": error: " << message << "\n";
  return 2;
}

int Fail(const char* cmd, const Status& s) {
  std::cerr << "dtectl " << cmd << ": error: " << s.message() << "\n";
  if (s.code() == Code::kAlreadyExists) return 3;
  if (s.code() == Code::kCorruption) return 4;
  return 1;
}

void NoteRetry(const char* cmd, const Status& s, uint64_t version) {
  std::cerr << "dtectl " << cmd << ": note: " << s.message()
            << "; dropped the blob cache's chunks of " << VersionName(version)
            << " and its chain, reading again\n";
}

// What the blob cache did for the command (null without one).
json CacheJson(Store& store) {
  CachedStore* cache = store.blob_cache();
  if (cache == nullptr) return nullptr;
  const BlobCacheStats s = cache->Stats();
  return json{{"dir", cache->dir()},
              {"hits", s.hits},
              {"fetches", s.fetches},
              {"fetched_bytes", s.fetched_bytes},
              {"written", s.written},
              {"written_bytes", s.written_bytes},
              {"write_errors", s.write_errors},
              {"dropped", s.dropped}};
}

std::string Percent(uint64_t part, uint64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f%%",
                whole ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0);
  return buf;
}

std::string Rate(uint64_t bytes, double secs) {
  return HumanBytes(secs > 0 ? static_cast<double>(bytes) / secs : 0) + "/s";
}

json VersionJson(const Manifest& m) {
  return json{{"version", m.version},
              {"parent", m.parent ? json(*m.parent) : json(nullptr)},
              {"kind", m.anchor() ? "anchor" : "delta"},
              {"revision", m.revision},
              {"tensors", m.stats.tensors},
              {"elements", m.stats.elements},
              {"changed_elements", m.stats.changed_elements},
              {"stored_bytes", m.stats.stored_bytes},
              {"dense_bytes", m.stats.dense_bytes},
              {"files", m.files.size()},
              {"created", m.created}};
}

Result<uint64_t> ParseVersionArg(Store& store, const std::string& arg) {
  if (arg == "latest") {
    ASSIGN_OR_RETURN(auto latest, store.Latest());
    if (!latest) return NotFound("store " + store.uri() + " has no versions");
    return *latest;
  }
  std::string digits = arg.size() > 1 && arg[0] == 'v' ? arg.substr(1) : arg;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      digits.size() > 12) {
    return InvalidArgument("bad version \"" + arg + "\" (a number, vNNNNNNNN or latest)");
  }
  return std::stoull(digits);
}

// The versions log shows, ascending: the newest a.limit of those numbered
// a.since or higher.
std::vector<std::pair<uint64_t, std::string>> LogSelection(
    const std::map<uint64_t, std::string>& versions, const LogArgs& a) {
  auto first = a.since ? versions.lower_bound(*a.since) : versions.begin();
  std::vector<std::pair<uint64_t, std::string>> out(first, versions.end());
  if (a.limit && out.size() > *a.limit) {
    out.erase(out.begin(), out.end() - static_cast<ptrdiff_t>(*a.limit));
  }
  return out;
}

}  // namespace

namespace {

json CommitJson(const CommitResult& r, double secs, Store& store) {
  return json{{"version", r.version},
              {"parent", r.parent ? json(*r.parent) : json(nullptr)},
              {"kind", r.parent ? "delta" : "anchor"},
              {"anchor_reason", r.anchor_reason},
              {"full_table", r.full_table},
              {"full_bytes", r.full_bytes},
              {"join_reason", r.join_reason},
              {"join_table", r.join_table},
              {"join_bytes", r.join_bytes},
              {"join_error", r.join_error},
              {"parent_snapshot_blocks", r.parent_snapshot_blocks},
              {"snapshot", r.snapshot},
              {"tensors", r.tensors},
              {"elements", r.elements},
              {"changed_elements", r.changed_elements},
              {"stored_bytes", r.stored_bytes},
              {"dense_bytes", r.dense_bytes},
              {"input_bytes", r.input_bytes},
              {"seconds", secs},
              {"blob_cache", CacheJson(store)}};
}

// The one-line summary of a commit, on stderr.
void PrintCommit(const char* cmd, const CommitResult& r, double secs) {
  std::string kind = r.parent ? "delta of " + VersionName(*r.parent) : "anchor: " + r.anchor_reason;
  if (r.full_table) {
    kind += ", full copy " + HumanBytes(static_cast<double>(r.full_bytes)) + " (" +
            r.anchor_reason + ")";
  }
  if (!r.join_reason.empty()) {
    kind += r.join_table ? ", join table " + HumanBytes(static_cast<double>(r.join_bytes))
                         : ", no join table: " + r.join_error;
  }
  std::cerr << cmd << ": " << VersionName(r.version) << " (" << kind << "), "
            << Percent(r.changed_elements, r.elements) << " of " << r.elements
            << " elements changed, stored " << HumanBytes(static_cast<double>(r.stored_bytes))
            << " (" << Percent(r.stored_bytes, r.dense_bytes) << " of dense "
            << HumanBytes(static_cast<double>(r.dense_bytes)) << "), read "
            << HumanBytes(static_cast<double>(r.input_bytes)) << " in " << secs << " s ("
            << Rate(r.input_bytes, secs) << ")\n";
}

}  // namespace

int RunCommit(const Common& c, const CommitArgs& a, bool import) {
  const char* cmd = import ? "import" : "commit";
  auto store = OpenStore(c, cmd, import, BlobReads::kCached);
  if (!store.ok()) return Fail(cmd, store.status());
  Progress progress(cmd, c.quiet);
  CommitOptions o;
  o.version = a.version;
  o.force_anchor = import || a.anchor;
  o.anchor_policy = AnchorPolicy{a.anchor_budget, a.anchor_every, a.join_budget};
  o.keep_snapshots = a.keep_snapshots;
  o.snapshot_every = a.snapshot_every;
  o.progress = progress.Callback();
  if (Status s = CheckAnchorPolicy(o.anchor_policy); !s.ok()) return Fail(cmd, s);
  auto r = CommitDirectory(**store, a.dir, o);
  if (!r.ok() && RetryAfterCorruption(**store, r.status())) {
    // The parent is the latest version: its chain is what the commit read.
    auto latest = (*store)->Latest();
    if (latest.ok() && *latest) {
      NoteRetry(cmd, r.status(), **latest);
      DropCachedChain(**store, **latest);
    }
    r = CommitDirectory(**store, a.dir, o);
  }
  double secs = progress.Finish();
  if (!r.ok()) return Fail(cmd, r.status());
  if (c.json) {
    std::cout << CommitJson(*r, secs, **store).dump() << "\n";
    return 0;
  }
  std::cout << r->version << "\n";
  PrintCommit(cmd, *r, secs);
  return 0;
}

int RunLog(const Common& c, const LogArgs& a) {
  if (a.limit && *a.limit == 0) return Usage("log", "--limit must be at least 1");
  // Opening loads no version: a limited log reads only the manifests it
  // prints.
  auto store = OpenStore(c, "log", false, BlobReads::kCached);
  if (!store.ok()) return Fail("log", store.status());
  auto versions = (*store)->ListCommitted();
  if (!versions.ok()) return Fail("log", versions.status());
  json out = json::array();
  int worst = 0;
  if (!c.json) {
    std::printf("%-10s %-10s %-6s %8s %14s %10s %12s %12s %8s  %s\n", "VERSION", "PARENT", "KIND",
                "TENSORS", "ELEMENTS", "CHANGED", "STORED", "DENSE", "RATIO", "CREATED");
  }
  for (const auto& [num, key] : LogSelection(*versions, a)) {
    auto v = (*store)->GetVersionAt(num, key);
    if (!v.ok()) {  // show the others; the exit status reports the damage
      worst = Fail("log", v.status());
      continue;
    }
    const Manifest& m = (*v)->manifest;
    if (c.json) {
      out.push_back(VersionJson(m));
      continue;
    }
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%.1fx",
                  m.stats.stored_bytes ? static_cast<double>(m.stats.dense_bytes) /
                                             static_cast<double>(m.stats.stored_bytes)
                                       : 0.0);
    std::printf("%-10s %-10s %-6s %8llu %14llu %10s %12s %12s %8s  %s\n", VersionName(num).c_str(),
                m.parent ? VersionName(*m.parent).c_str() : "-", m.anchor() ? "anchor" : "delta",
                static_cast<unsigned long long>(m.stats.tensors),
                static_cast<unsigned long long>(m.stats.elements),
                Percent(m.stats.changed_elements, m.stats.elements).c_str(),
                HumanBytes(static_cast<double>(m.stats.stored_bytes)).c_str(),
                HumanBytes(static_cast<double>(m.stats.dense_bytes)).c_str(), ratio,
                m.created.c_str());
  }
  if (c.json) std::cout << out.dump(1) << "\n";
  return worst;
}

namespace {

void PrintStatsHeader(const Common& c, const StatsArgs& a) {
  if (a.csv) {
    std::printf(
        "version,kind,group,tensors,elements,changed,changed_fraction,blocks,blocks_changed,"
        "stored_bytes,dense_bytes,version_stored_bytes\n");
  } else if (c.json) {
    std::printf("[");
  } else {
    std::printf("%-10s %-6s %-48s %8s %14s %10s %12s %12s\n", "VERSION", "KIND", "GROUP", "TENSORS",
                "ELEMENTS", "CHANGED", "STORED", "DENSE");
  }
}

json StatsRowJson(const StatsRow& r, double fraction) {
  return json{{"version", r.version},
              {"kind", r.stored_as},
              {"group", r.group},
              {"tensors", r.tensors},
              {"elements", r.elements},
              {"changed", r.changed},
              {"changed_fraction", fraction},
              {"blocks", r.blocks},
              {"blocks_changed", r.blocks_changed},
              {"stored_bytes", r.stored_bytes},
              {"dense_bytes", r.dense_bytes},
              {"version_stored_bytes", r.version_stored_bytes}};
}

void PrintStatsCsv(const StatsRow& r, double fraction) {
  std::string group = r.group;  // tensor names hold no commas or quotes in practice
  if (group.find_first_of(",\"") != std::string::npos) {
    std::string quoted = "\"";
    for (char ch : group) quoted += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    group = quoted + "\"";
  }
  std::printf(
      "%llu,%s,%s,%llu,%llu,%llu,%.9g,%llu,%llu,%llu,%llu,%llu\n",
      static_cast<unsigned long long>(r.version), r.stored_as.c_str(), group.c_str(),
      static_cast<unsigned long long>(r.tensors), static_cast<unsigned long long>(r.elements),
      static_cast<unsigned long long>(r.changed), fraction,
      static_cast<unsigned long long>(r.blocks), static_cast<unsigned long long>(r.blocks_changed),
      static_cast<unsigned long long>(r.stored_bytes),
      static_cast<unsigned long long>(r.dense_bytes),
      static_cast<unsigned long long>(r.version_stored_bytes));
}

// One row of stats for version `num`, as --json (after a comma unless
// first), --csv or text.
void PrintStatsRow(const Common& c, const StatsArgs& a, uint64_t num, const StatsRow& r,
                   bool first) {
  const double fraction =
      r.elements ? static_cast<double>(r.changed) / static_cast<double>(r.elements) : 0.0;
  if (c.json) {
    std::printf("%s\n%s", first ? "" : ",", StatsRowJson(r, fraction).dump().c_str());
  } else if (a.csv) {
    PrintStatsCsv(r, fraction);
  } else {
    std::printf("%-10s %-6s %-48s %8llu %14llu %10s %12s %12s\n", VersionName(num).c_str(),
                r.stored_as.c_str(), r.group.c_str(), static_cast<unsigned long long>(r.tensors),
                static_cast<unsigned long long>(r.elements), Percent(r.changed, r.elements).c_str(),
                HumanBytes(static_cast<double>(r.stored_bytes)).c_str(),
                HumanBytes(static_cast<double>(r.dense_bytes)).c_str());
  }
}

}  // namespace

int RunStats(const Common& c, const StatsArgs& a) {
  if (c.json && a.csv) return Usage("stats", "give --json or --csv, not both");
  const std::optional<StatsGroup> by = ParseStatsGroup(a.by);
  if (!by) return Usage("stats", "--by must be tensor, layer, kind, layer-kind or version");
  if (a.fp8 && *by != StatsGroup::kTensor && *by != StatsGroup::kVersion) {
    return Usage("stats", "--fp8 shows rows --by tensor or --by version");
  }
  if (a.fp8 && a.fp8_block == 0) return Usage("stats", "--fp8-block must be at least 1");
  VersionRange range;
  if (!a.versions.empty()) {
    auto r = ParseVersionRange(a.versions);
    if (!r.ok()) return Usage("stats", r.status().message());
    range = *r;
  }
  auto store = OpenStore(c, "stats", false, BlobReads::kCached);
  if (!store.ok()) return Fail("stats", store.status());
  auto listed = (*store)->ListCommitted();
  if (!listed.ok()) return Fail("stats", listed.status());
  auto selected = SelectVersions(*listed, range, (*store)->uri());
  if (!selected.ok()) return Fail("stats", selected.status());
  if (a.fp8) return RunStatsFp8(c, a, **store, *selected);
  // One version at a time (manifest and block table, no payload), each row
  // printed as it comes: memory stays one version's, whatever the range.
  PrintStatsHeader(c, a);
  bool first = true;
  for (const auto& [num, key] : *selected) {
    auto v = (*store)->GetVersionAt(num, key);
    if (!v.ok()) {
      if (c.json) std::printf("]\n");
      return Fail("stats", v.status());
    }
    auto rows = VersionStats(**v, *by);
    if (!rows.ok()) {
      if (c.json) std::printf("]\n");
      return Fail("stats", rows.status());
    }
    for (const StatsRow& r : *rows) {
      PrintStatsRow(c, a, num, r, first);
      first = false;
    }
  }
  if (c.json) std::printf("\n]\n");
  return 0;
}

int RunReport(const Common& c, const std::string& versions, const std::string& out,
              uint64_t fp8_block) {
  // The script: $DTE_REPORT_SCRIPT, the installed copy, or the source tree's.
  std::string script;
  if (const char* env = std::getenv("DTE_REPORT_SCRIPT"); env && *env) {
    script = env;
  } else {
    for (const char* candidate : {DTE_REPORT_SCRIPT, DTE_REPORT_SCRIPT_SOURCE}) {
      if (::access(candidate, R_OK) == 0) {
        script = candidate;
        break;
      }
    }
  }
  if (script.empty()) {
    return Fail("report", NotFound(std::string("the report script is not installed (looked for ") +
                                   DTE_REPORT_SCRIPT + " and " + DTE_REPORT_SCRIPT_SOURCE +
                                   "; set DTE_REPORT_SCRIPT)"));
  }
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return Fail("report", ErrnoStatus("reading /proc/self/exe", errno));
  self[n] = '\0';
  // The project's interpreter: its environment's (tools/setup.sh), where
  // matplotlib is installed, unless told otherwise.
  const char* py = std::getenv("DTE_PYTHON");
  const char* kVenv = "/opt/dte/venv/bin/python";
  const std::string python = py && *py ? py : ::access(kVenv, X_OK) == 0 ? kVenv : "python3";
  std::vector<std::string> args = {python,  script,  "--dtectl", self,          "--store",
                                   c.store, "--out", out,        "--cache-dir", c.cache_dir};
  if (!versions.empty()) args.insert(args.end(), {"--versions", versions});
  if (!c.endpoint.empty()) args.insert(args.end(), {"--endpoint", c.endpoint});
  if (fp8_block) args.insert(args.end(), {"--fp8", "--fp8-block", std::to_string(fp8_block)});
  std::vector<char*> argv;
  for (std::string& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  return Fail("report", ErrnoStatus("running " + python + " " + script, errno));
}

namespace {

json TensorDiffJson(const TensorDiff& d) {
  json t{{"name", d.name},     {"dtype", DTypeName(d.dtype)},
         {"status", d.status}, {"elements", d.elements},
         {"differ", d.differ}, {"blocks_read", d.blocks_read},
         {"max_ulp", nullptr}, {"ulps", nullptr},
         {"nan", nullptr}};
  if (d.floating) {
    json ulps = json::array();
    for (size_t k = 0; k < d.ulps.size(); ++k) {
      // Bucket k holds distances up to 2^k; the last one everything above.
      ulps.push_back({{"le", k < TensorDiff::kDiffBuckets ? json(uint64_t{1} << k) : json(nullptr)},
                      {"count", d.ulps[k]}});
    }
    t["max_ulp"] = d.max_ulp;
    t["ulps"] = std::move(ulps);
    t["nan"] = d.nan;
  }
  return t;
}

void PrintTensorDiff(const TensorDiff& d) {
  std::string hist = "-", max_ulp = "-";
  if (d.floating && d.differ) {
    uint64_t more = d.nan;
    for (size_t k = 4; k < d.ulps.size(); ++k) more += d.ulps[k];
    hist = std::to_string(d.ulps[0]) + "/" + std::to_string(d.ulps[1]) + "/" +
           std::to_string(d.ulps[2]) + "/" + std::to_string(d.ulps[3]) + "/" + std::to_string(more);
    max_ulp = std::to_string(d.max_ulp);
  }
  std::printf("%-56s %-5s %-14s %12llu %10s %8llu %8s  %s\n", d.name.c_str(), DTypeName(d.dtype),
              d.status.c_str(), static_cast<unsigned long long>(d.differ),
              Percent(d.differ, d.elements).c_str(), static_cast<unsigned long long>(d.blocks_read),
              max_ulp.c_str(), hist.c_str());
}

}  // namespace

int RunDiff(const Common& c, const std::string& a, const std::string& b) {
  auto store = OpenStore(c, "diff", false, BlobReads::kCached);
  if (!store.ok()) return Fail("diff", store.status());
  auto va = ParseVersionArg(**store, a);
  if (!va.ok()) return Fail("diff", va.status());
  auto vb = ParseVersionArg(**store, b);
  if (!vb.ok()) return Fail("diff", vb.status());
  auto diffs = DiffVersions(**store, *va, *vb);
  if (!diffs.ok()) return Fail("diff", diffs.status());
  uint64_t elements = 0, differ = 0;
  for (const TensorDiff& d : *diffs) {
    elements += d.elements;
    differ += d.differ;
  }
  if (c.json) {
    json tensors = json::array();
    for (const TensorDiff& d : *diffs) tensors.push_back(TensorDiffJson(d));
    json j{{"a", *va},
           {"b", *vb},
           {"elements", elements},
           {"differ", differ},
           {"tensors", std::move(tensors)}};
    std::cout << j.dump(1) << "\n";
    return 0;
  }
  std::printf("%-56s %-5s %-14s %12s %10s %8s %8s  %s\n", "TENSOR", "DTYPE", "STATUS", "DIFFER",
              "OF", "BLOCKS", "MAX_ULP", "ULPS 1/2/<=4/<=8/more");
  for (const TensorDiff& d : *diffs) PrintTensorDiff(d);
  std::printf("%s -> %s: %llu of %llu elements differ (%s)\n", VersionName(*va).c_str(),
              VersionName(*vb).c_str(), static_cast<unsigned long long>(differ),
              static_cast<unsigned long long>(elements), Percent(differ, elements).c_str());
  return 0;
}

int RunExport(const Common& c, const std::string& version, const std::string& out) {
  auto store = OpenStore(c, "export", false, BlobReads::kCached);
  if (!store.ok()) return Fail("export", store.status());
  auto num = ParseVersionArg(**store, version);
  if (!num.ok()) return Fail("export", num.status());
  Progress progress("export", c.quiet);
  auto r = ExportVersion(**store, *num, out, progress.Callback());
  if (!r.ok() && RetryAfterCorruption(**store, r.status())) {
    NoteRetry("export", r.status(), *num);
    DropCachedChain(**store, *num);  // a failed export leaves nothing behind
    r = ExportVersion(**store, *num, out, progress.Callback());
  }
  double secs = progress.Finish();
  if (!r.ok()) return Fail("export", r.status());
  if (c.json) {
    json j{{"version", r->version}, {"files", r->files}, {"bytes", r->bytes},
           {"seconds", secs},       {"out", out},        {"blob_cache", CacheJson(**store)}};
    std::cout << j.dump() << "\n";
  } else {
    std::cout << "export: " << VersionName(r->version) << " -> " << out << ", " << r->files
              << " files, " << HumanBytes(static_cast<double>(r->bytes)) << " in " << secs << " s ("
              << Rate(r->bytes, secs) << ")\n";
  }
  return 0;
}

int RunVerify(const Common& c, std::optional<uint64_t> version) {
  // verify checks the store's own bytes: a cached copy proves nothing.
  auto store = OpenStore(c, "verify", false, BlobReads::kFromStore);
  if (!store.ok()) return Fail("verify", store.status());
  Progress progress("verify", c.quiet);
  auto r = VerifyStore(**store, version, progress.Callback());
  double secs = progress.Finish();
  if (!r.ok()) return Fail("verify", r.status());
  for (const auto& p : r->problems) std::cerr << "dtectl verify: problem: " << p << "\n";
  if (c.json) {
    std::cout << json{{"ok", r->ok()},           {"versions", r->versions},
                      {"blobs", r->blobs},       {"blob_bytes", r->blob_bytes},
                      {"files", r->files},       {"tensors", r->tensors},
                      {"problems", r->problems}, {"seconds", secs}}
                     .dump()
              << "\n";
  } else {
    std::cout << "verify: " << (r->ok() ? "ok" : "FAILED") << ", " << r->versions << " versions, "
              << r->files << " files, " << r->tensors << " tensors, " << r->blobs << " blobs ("
              << HumanBytes(static_cast<double>(r->blob_bytes)) << "), " << r->problems.size()
              << " problems, " << secs << " s\n";
  }
  return r->ok() ? 0 : 4;
}

int RunGc(const Common& c, const GcArgs& a) {
  const GcOptions o{a.keep_last, a.keep_every, a.anchor_budget, a.grace_seconds, a.dry_run};
  if (Status s = CheckGcOptions(o); !s.ok()) return Usage("gc", s.message());
  auto store = OpenStore(c, "gc", false, BlobReads::kCached);
  if (!store.ok()) return Fail("gc", store.status());
  Progress progress("gc", c.quiet);
  auto r = CollectGarbage(**store, o, progress.Callback());
  double secs = progress.Finish();
  if (!r.ok()) return Fail("gc", r.status());
  if (c.json) {
    std::cout << json{{"kept", r->versions_kept},
                      {"removed", r->versions_removed},
                      {"rebased", r->versions_rebased},
                      {"blobs_deleted", r->blobs_deleted},
                      {"bytes_freed", r->bytes_freed},
                      {"dry_run", a.dry_run},
                      {"temp_files_deleted", r->temp_files_deleted},
                      {"exchange_objects_deleted", r->exchange_objects_deleted},
                      {"seconds", secs}}
                     .dump()
              << "\n";
  } else {
    std::cout << "gc: " << (a.dry_run ? "would keep " : "kept ") << r->versions_kept
              << " versions, removed " << r->versions_removed << ", rebased " << r->versions_rebased
              << ", deleted " << r->blobs_deleted << " blobs ("
              << HumanBytes(static_cast<double>(r->bytes_freed)) << "), " << r->temp_files_deleted
              << " stale temp files, in " << secs << " s\n";
  }
  return 0;
}

int RunReindex(const Common& c) {
  StoreOptions o;
  o.uri = c.store;
  // Insisted on: the index is what reindex rebuilds. Clearing it forgets
  // the blob cache's chunks too, so no blob cache is opened (the next one
  // to open deletes their files).
  o.cache_dir = c.cache_dir;
  o.patient_listing = true;
  auto store = Store::Open(o);
  if (!store.ok()) return Fail("reindex", store.status());
  Status s = (*store)->SyncIndex(true);
  if (!s.ok()) return Fail("reindex", s);
  auto versions = (*store)->ListVersions();
  if (!versions.ok()) return Fail("reindex", versions.status());
  if (c.json) {
    std::cout << json{{"versions", versions->size()}, {"index", (*store)->CachePath()}}.dump()
              << "\n";
  } else {
    std::cout << "reindex: " << versions->size() << " versions indexed in " << (*store)->CachePath()
              << "/index\n";
  }
  return 0;
}

}  // namespace dte::cli
