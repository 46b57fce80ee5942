// dtefs: mount a dte store; every version is a read-only checkpoint directory.
//
//   dtefs STORE MOUNTPOINT [-f] [--cache-dir DIR] [--cache-size N] [--poll-ms N]
//         [--snapshot-every N] [--snapshots N] [--readahead-kb N]
//         [--endpoint URL] [--blob-cache-size N] [--blob-chunk-size N]
//         [--prefetch latest] [--log-file PATH]
//         [--fp8-scale plain|pow2] [--fp8-block N] [--fp8-keep MODULE]...
//         [--fp8-partial-blocks] [--no-fp8] [-o opts]
//
// Also the program the fuse3 mount helper runs for `mount -t fuse.dtefs` and
// fstab lines: `dtefs STORE MOUNTPOINT -o rw,allow_other,...`; there the
// dtefs options can be given as cache_dir=DIR, cache_size=N, poll_ms=N,
// snapshot_every=N, snapshots=N, readahead_kb=N, endpoint=URL,
// blob_cache_size=N, blob_chunk_size=N, prefetch=latest, log_file=PATH,
// metrics=ADDR, fp8_scale=plain|pow2, fp8_block=N, fp8_keep=MODULE[:MODULE...],
// fp8_partial_blocks, no_fp8.
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fs/dtefs.h"
#include "store/base/units.h"
#include "store/cached_store.h"

namespace {

// A size such as 64MiB or 64M (see store/base/units.h).
bool ParseSize(const std::string& text, uint64_t* out) {
  auto size = dte::ParseByteSize(text);
  if (!size.ok()) return false;
  *out = *size;
  return true;
}

std::string Absolute(const std::string& path) {
  if (path.find("://") != std::string::npos || path.empty()) return path;
  std::error_code ec;
  auto abs = std::filesystem::absolute(path, ec);
  return ec ? path : abs.lexically_normal().string();
}

// A count in [min, max].
template <typename T>
bool ParseCount(const std::string& text, uint64_t min, uint64_t max, T* out) {
  uint64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < min || n > max) return false;
  *out = static_cast<T>(n);
  return true;
}

constexpr uint64_t kMaxReadaheadKb = 1 << 20;  // 1 GiB

// Size options as text until they are parsed, and the other options that
// need checking after -o lists are merged in.
struct TextOptions {
  std::string cache_size = "256MiB";
  std::string blob_cache_size = "4GiB";
  std::string blob_chunk_size = "4MiB";
  std::string prefetch;
  std::string endpoint;
  std::string fp8_scale = "plain";
  std::vector<std::string> fp8_keep;
};

// The largest --fp8-block: a block row of a wide tensor is read whole (1024 rows
// of 28672 BF16 columns are 56 MiB).
constexpr uint64_t kMaxFp8Block = 1 << 10;

// fp8_keep=A:B into its modules, empty ones kept (ParseTextOptions refuses
// them, as it does an empty --fp8-keep).
void SplitModules(const std::string& list, std::vector<std::string>* out) {
  size_t from = 0;
  for (size_t colon; (colon = list.find(':', from)) != std::string::npos; from = colon + 1) {
    out->push_back(list.substr(from, colon - from));
  }
  out->push_back(list.substr(from));
}

// Splits -o lists at commas and takes out the dtefs options given there.
bool TakeMountOptions(const std::vector<std::string>& lists, dte::fs::MountOptions* o,
                      TextOptions* text) {
  auto value = [](const std::string& opt, const char* name) -> std::optional<std::string> {
    const std::string prefix = std::string(name) + "=";
    if (opt.rfind(prefix, 0) != 0) return std::nullopt;
    return opt.substr(prefix.size());
  };
  for (const std::string& list : lists) {
    std::stringstream in(list);
    for (std::string opt; std::getline(in, opt, ',');) {
      if (auto v = value(opt, "cache_dir")) {
        o->cache_dir = *v;
      } else if (auto v = value(opt, "cache_size")) {
        text->cache_size = *v;
      } else if (auto v = value(opt, "blob_cache_size")) {
        text->blob_cache_size = *v;
      } else if (auto v = value(opt, "blob_chunk_size")) {
        text->blob_chunk_size = *v;
      } else if (auto v = value(opt, "prefetch")) {
        text->prefetch = *v;
      } else if (auto v = value(opt, "log_file")) {
        o->log_file = *v;
      } else if (auto v = value(opt, "metrics")) {
        o->metrics_address = *v;
      } else if (auto v = value(opt, "endpoint")) {
        text->endpoint = *v;
      } else if (auto v = value(opt, "live_version")) {
        uint64_t n = 0;
        if (!ParseCount(*v, 0, UINT64_MAX - 2, &n)) return false;
        o->live_version = n;
      } else if (auto v = value(opt, "poll_ms")) {
        if (!ParseCount(*v, 1, UINT32_MAX, &o->poll_ms)) return false;
      } else if (auto v = value(opt, "snapshot_every")) {
        if (!ParseCount(*v, 0, UINT32_MAX, &o->snapshot_every)) return false;
      } else if (auto v = value(opt, "snapshots")) {
        if (!ParseCount(*v, 0, UINT32_MAX, &o->max_snapshots)) return false;
      } else if (auto v = value(opt, "fp8_scale")) {
        text->fp8_scale = *v;
      } else if (auto v = value(opt, "fp8_block")) {
        if (!ParseCount(*v, 1, kMaxFp8Block, &o->fp8_view.block_rows)) return false;
        o->fp8_view.block_cols = o->fp8_view.block_rows;
      } else if (auto v = value(opt, "fp8_keep")) {
        SplitModules(*v, &text->fp8_keep);
      } else if (opt == "fp8_partial_blocks") {
        o->fp8_view.policy.quantize_partial_blocks = true;
      } else if (opt == "no_fp8") {
        o->fp8 = false;
      } else if (auto v = value(opt, "readahead_kb")) {
        if (!ParseCount(*v, 0, kMaxReadaheadKb, &o->readahead_kb)) return false;
      } else if (!opt.empty()) {
        o->fuse_options.push_back(opt);
      }
    }
  }
  return true;
}

// The FP8 views' options given as text (ParseTextOptions).
bool ParseFp8TextOptions(const TextOptions& text, dte::fs::MountOptions* o) {
  if (text.fp8_scale != "plain" && text.fp8_scale != "pow2") {
    std::cerr << "dtefs: bad --fp8-scale (fp8_scale=) \"" << text.fp8_scale
              << "\": plain or pow2\n";
    return false;
  }
  o->fp8_view.rule = text.fp8_scale == "pow2" ? dte::kernels::Fp8ScaleRule::kPowerOfTwo
                                              : dte::kernels::Fp8ScaleRule::kPlain;
  for (const std::string& m : text.fp8_keep) {
    // The policy matches whole components of a module path (store/fp8_policy.h).
    if (m.empty() || m.find_first_of(". ,:/") != std::string::npos) {
      std::cerr << "dtefs: bad --fp8-keep (fp8_keep=) \"" << m
                << "\": one component of a module path, such as o_proj or mlp\n";
      return false;
    }
    o->fp8_view.policy.skip_modules.push_back(m);
  }
  return true;
}

// Parses and checks the options given as text; false (after a message) if
// one is bad.
bool ParseTextOptions(const TextOptions& text, dte::fs::MountOptions* o) {
  if (!ParseSize(text.cache_size, &o->cache_bytes)) {
    std::cerr << "dtefs: bad --cache-size (cache_size=) \"" << text.cache_size << "\"\n";
    return false;
  }
  if (!ParseSize(text.blob_cache_size, &o->blob_cache_bytes)) {
    std::cerr << "dtefs: bad --blob-cache-size (blob_cache_size=) \"" << text.blob_cache_size
              << "\"\n";
    return false;
  }
  if (!ParseSize(text.blob_chunk_size, &o->blob_chunk_bytes) ||
      o->blob_chunk_bytes % dte::kCachePageBytes != 0 || o->blob_chunk_bytes == 0 ||
      o->blob_chunk_bytes > (uint64_t{1} << 30)) {
    std::cerr << "dtefs: bad --blob-chunk-size (blob_chunk_size=) \"" << text.blob_chunk_size
              << "\": a multiple of 64KiB, at most 1GiB\n";
    return false;
  }
  if (!text.prefetch.empty() && text.prefetch != "latest") {
    std::cerr << "dtefs: bad --prefetch (prefetch=) \"" << text.prefetch
              << "\": the only target is \"latest\"\n";
    return false;
  }
  o->prefetch_latest = text.prefetch == "latest";
  return ParseFp8TextOptions(text, o);
}

// Every option of the command line, into o, text and opts (the -o lists).
void AddOptions(CLI::App* app, dte::fs::MountOptions* o, TextOptions* text,
                std::vector<std::string>* opts) {
  app->add_option("STORE", o->store, "Store: a directory or s3://bucket/prefix")->required();
  app->add_option("MOUNTPOINT", o->mountpoint, "Directory to mount on")->required();
  app->add_flag("-f,--foreground", o->foreground, "Stay in the foreground");
  app->add_flag("-d,--debug", o->debug, "Trace FUSE requests (implies -f)");
  app->add_option("--cache-dir", o->cache_dir,
                  "Host-local index (env DTE_CACHE_DIR, default ~/.cache/dte)");
  app->add_option("--cache-size", text->cache_size,
                  "Block cache size, e.g. 256MiB (default 256MiB)");
  app->add_option("--poll-ms", o->poll_ms, "How often to look for new versions (default 500)");
  app->add_option("--snapshot-every", o->snapshot_every,
                  "Snapshot a version this many versions from its anchor or last snapshot "
                  "(default 8; 0: no snapshots)");
  app->add_option("--snapshots", o->max_snapshots, "Keep at most this many snapshots (default 8)");
  app->add_option("--readahead-kb", o->readahead_kb,
                  "Kernel readahead of the mount in KiB, set when root (default 4096; 0: leave it)")
      ->check(CLI::Range(uint64_t{0}, kMaxReadaheadKb));
  app->add_option("--endpoint", text->endpoint,
                  "S3 endpoint URL for s3:// stores (env AWS_ENDPOINT_URL)");
  app->add_option("--blob-cache-size", text->blob_cache_size,
                  "s3:// stores: local disk cache of blob ranges (default 4GiB; 0: none)");
  app->add_option("--blob-chunk-size", text->blob_chunk_size,
                  "s3:// stores: blobs are fetched and cached in aligned pieces of this size "
                  "(default 4MiB; a multiple of 64KiB)");
  app->add_option("--prefetch", text->prefetch,
                  "s3:// stores: \"latest\" pulls every new latest version into the blob cache");
  app->add_option("--metrics", o->metrics_address,
                  "Serve Prometheus metrics at http://ADDR/metrics: HOST:PORT, or PORT for "
                  "127.0.0.1:PORT (default: none)");
  app->add_option("--log-file", o->log_file,
                  "Append messages here once mounted (default: stderr in the foreground, "
                  "CACHE_DIR/dtefs.log for a daemon)");
  app->add_option("--live-version", o->live_version,
                  "Version live/ shows at mount (default: the newest); dtectl apply moves it");
  app->add_option("--fp8-scale", text->fp8_scale,
                  "Scale rule of the FP8 views under fp8/: plain (amax / 448) or pow2 "
                  "(rounded up to a power of two, UE8M0) (default plain)");
  app->add_option_function<uint64_t>(
         "--fp8-block", [o](uint64_t n) { o->fp8_view.block_rows = o->fp8_view.block_cols = n; },
         "Block size N of the FP8 views: N x N elements per scale (default 128)")
      ->check(CLI::Range(uint64_t{1}, kMaxFp8Block));
  app->add_option("--fp8-keep", text->fp8_keep,
                  "Keep the weights of modules with this path component (e.g. o_proj) in "
                  "BF16 in the FP8 views, besides lm_head, embeddings, norms and routers; "
                  "repeatable")
      ->allow_extra_args(false);
  app->add_flag("--fp8-partial-blocks", o->fp8_view.policy.quantize_partial_blocks,
                "Also quantize weights whose rows or columns are not a multiple of the block "
                "(partial edge blocks; transformers cannot load them; default: kept in BF16)");
  app->add_flag_callback(
      "--no-fp8", [o] { o->fp8 = false; }, "Do not show fp8/");
  app->add_option("-o", *opts, "Mount options, comma-separated (allow_other, ro, ...)");
}

// The store keeps a descriptor open per blob of a version's chain (up to a
// quarter of the soft limit): take the hard limit, as servers do.
void RaiseFileLimit() {
  struct rlimit nofile {};
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
    nofile.rlim_cur = nofile.rlim_max;
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtefs: mount a dte store; every version is a checkpoint directory"};
  dte::fs::MountOptions o;
  TextOptions text;
  std::vector<std::string> opts;
  AddOptions(&app, &o, &text, &opts);
  CLI11_PARSE(app, argc, argv);
  RaiseFileLimit();
  if (o.cache_dir.empty()) o.cache_dir = dte::DefaultCacheDir();
  if (!TakeMountOptions(opts, &o, &text)) {
    std::cerr << "dtefs: bad -o value (poll_ms=, snapshot_every=, snapshots=, readahead_kb=, "
                 "live_version=, fp8_block=)\n";
    return 2;
  }
  if (!ParseTextOptions(text, &o)) return 2;
  if (!text.endpoint.empty()) {
    // S3 stores read their endpoint from the environment; the flag wins over
    // both variables. No thread runs yet.
    ::setenv("AWS_ENDPOINT_URL_S3", text.endpoint.c_str(), 1);
    ::setenv("AWS_ENDPOINT_URL", text.endpoint.c_str(), 1);
  }
  if (o.debug) o.foreground = true;
  o.store = Absolute(o.store);
  o.mountpoint = Absolute(o.mountpoint);
  o.cache_dir = Absolute(o.cache_dir);
  o.log_file = Absolute(o.log_file);
  dte::Status s = dte::fs::Serve(o);
  if (!s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  return 0;
}
