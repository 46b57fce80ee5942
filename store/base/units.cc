#include "store/base/units.h"

#include <unistd.h>

#include <array>
#include <charconv>
#include <cstdio>
#include <cstdlib>

namespace dte {
namespace {

struct Suffix {
  std::string_view name;
  uint64_t factor;
};

constexpr std::array<Suffix, 13> kSuffixes = {{
    {"KiB", 1ull << 10},
    {"MiB", 1ull << 20},
    {"GiB", 1ull << 30},
    {"TiB", 1ull << 40},
    {"KB", 1'000ull},
    {"MB", 1'000'000ull},
    {"GB", 1'000'000'000ull},
    {"TB", 1'000'000'000'000ull},
    {"B", 1},
    {"K", 1ull << 10},
    {"M", 1ull << 20},
    {"G", 1ull << 30},
    {"T", 1ull << 40},
}};

}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  uint64_t factor = 1;
  std::string_view number = text;
  for (const Suffix& s : kSuffixes) {
    if (text.size() > s.name.size() && text.ends_with(s.name)) {
      factor = s.factor;
      number = text.substr(0, text.size() - s.name.size());
      break;
    }
  }
  double value = 0;
  auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
  if (ec != std::errc() || end != number.data() + number.size() || !(value >= 0) ||
      value * static_cast<double>(factor) > 0x1p62) {
    return InvalidArgument("bad byte size \"" + std::string(text) +
                           "\" (expected e.g. 8MiB, 2GiB, 5GB or a byte count)");
  }
  return static_cast<uint64_t>(value * static_cast<double>(factor));
}

std::string FormatByteSize(uint64_t bytes) {
  constexpr std::array<const char*, 5> kUnits = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < kUnits.size()) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s", value, kUnits[unit]);
  }
  return buf;
}

std::string DefaultCacheDir() {
  if (const char* d = std::getenv("DTE_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/dte";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/dte";
  return "/tmp/dte-cache-" + std::to_string(::getuid());
}

}  // namespace dte
