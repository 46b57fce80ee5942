// dtefs: mount a dte store; every version is a read-only checkpoint directory.
//
//   dtefs STORE MOUNTPOINT [-f] [--cache-dir DIR] [--cache-size N] [--poll-ms N] [-o opts]
//
// Also the program the fuse3 mount helper runs for `mount -t fuse.dtefs` and
// fstab lines: `dtefs STORE MOUNTPOINT -o rw,allow_other,...`; there the
// dtefs options can be given as cache_dir=DIR, cache_size=N, poll_ms=N.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fs/dtefs.h"
#include "store/units.h"

namespace {

// A size such as 64MiB or 64M (see store/units.h).
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

// Splits -o lists at commas and takes out the dtefs options given there.
bool TakeMountOptions(const std::vector<std::string>& lists, dte::fs::MountOptions* o,
                      std::string* size_text) {
  for (const std::string& list : lists) {
    std::stringstream in(list);
    for (std::string opt; std::getline(in, opt, ',');) {
      if (opt.rfind("cache_dir=", 0) == 0) {
        o->cache_dir = opt.substr(10);
      } else if (opt.rfind("cache_size=", 0) == 0) {
        *size_text = opt.substr(11);
      } else if (opt.rfind("poll_ms=", 0) == 0) {
        uint64_t ms = 0;
        if (!ParseSize(opt.substr(8), &ms) || ms == 0 || ms > UINT32_MAX) return false;
        o->poll_ms = static_cast<uint32_t>(ms);
      } else if (!opt.empty()) {
        o->fuse_options.push_back(opt);
      }
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dtefs: mount a dte store; every version is a checkpoint directory"};
  dte::fs::MountOptions o;
  std::string size_text = "256MiB";
  std::vector<std::string> opts;
  app.add_option("STORE", o.store, "Store: a directory or s3://bucket/prefix")->required();
  app.add_option("MOUNTPOINT", o.mountpoint, "Directory to mount on")->required();
  app.add_flag("-f,--foreground", o.foreground, "Stay in the foreground");
  app.add_flag("-d,--debug", o.debug, "Trace FUSE requests (implies -f)");
  app.add_option("--cache-dir", o.cache_dir,
                 "Host-local index (env DTE_CACHE_DIR, default ~/.cache/dte)");
  app.add_option("--cache-size", size_text, "Block cache size, e.g. 256MiB (default 256MiB)");
  app.add_option("--poll-ms", o.poll_ms, "How often to look for new versions (default 500)");
  app.add_option("-o", opts, "Mount options, comma-separated (allow_other, ro, ...)");
  CLI11_PARSE(app, argc, argv);
  if (o.cache_dir.empty()) o.cache_dir = dte::DefaultCacheDir();
  if (!TakeMountOptions(opts, &o, &size_text) || !ParseSize(size_text, &o.cache_bytes)) {
    std::cerr << "dtefs: bad --cache-size, cache_size= or poll_ms= value\n";
    return 2;
  }
  if (o.debug) o.foreground = true;
  o.store = Absolute(o.store);
  o.mountpoint = Absolute(o.mountpoint);
  o.cache_dir = Absolute(o.cache_dir);
  dte::Status s = dte::fs::Serve(o);
  if (!s.ok()) {
    std::cerr << s.message() << "\n";
    return 1;
  }
  return 0;
}
