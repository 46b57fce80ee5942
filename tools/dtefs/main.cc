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
#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fs/dtefs.h"

namespace {

std::string DefaultCacheDir() {
  if (const char* d = std::getenv("DTE_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/dte";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/dte";
  return "/tmp/dte-cache-" + std::to_string(::getuid());
}

// A size with an optional K/M/G suffix (powers of 1024; "iB"/"B" allowed).
bool ParseSize(std::string text, uint64_t* out) {
  for (const char* tail : {"iB", "B"}) {
    if (text.size() > 2 && text.ends_with(tail)) text.resize(text.size() - std::strlen(tail));
  }
  uint64_t mult = 1;
  if (!text.empty()) {
    switch (std::toupper(static_cast<unsigned char>(text.back()))) {
      case 'K':
        mult = uint64_t{1} << 10;
        break;
      case 'M':
        mult = uint64_t{1} << 20;
        break;
      case 'G':
        mult = uint64_t{1} << 30;
        break;
    }
    if (mult != 1) text.pop_back();
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) return false;
  *out = std::stoull(text) * mult;
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
  if (o.cache_dir.empty()) o.cache_dir = DefaultCacheDir();
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
