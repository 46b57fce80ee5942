// dtectl apply and dtectl status: live apply on a dtefs mount through the
// ioctls on MOUNT/.dte/control (sync/live/live_client.h, docs/live.md).
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "store/manifest.h"
#include "sync/live/live_client.h"
#include "tools/dtectl/commands.h"
#include "tools/dtectl/progress.h"

namespace dte::cli {
namespace {

using nlohmann::json;

int Fail(const char* cmd, const Status& s) {
  std::cerr << "dtectl " << cmd << ": error: " << s.message() << "\n";
  return 1;
}

// "latest" -> nullopt; "7", "v00000007" -> 7.
Result<std::optional<uint64_t>> ParseVersion(const std::string& arg) {
  if (arg == "latest") return std::optional<uint64_t>();
  std::string digits = arg.size() > 1 && arg[0] == 'v' ? arg.substr(1) : arg;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      digits.size() > 12) {
    return InvalidArgument("bad version \"" + arg + "\" (a number, vNNNNNNNN or latest)");
  }
  return std::optional<uint64_t>(std::stoull(digits));
}

// DTE_LIVE_LATEST stands for "none" in the out fields.
json VersionJson(uint64_t v) { return v == DTE_LIVE_LATEST ? json(nullptr) : json(v); }
std::string VersionText(uint64_t v) { return v == DTE_LIVE_LATEST ? "none" : VersionName(v); }

double Seconds(uint64_t ns) { return static_cast<double>(ns) / 1e9; }

json CountsJson(const dte_live_counts& c) {
  return json{{"from_version", VersionJson(c.from_version)},
              {"to_version", VersionJson(c.to_version)},
              {"entries", c.entries},
              {"bytes", c.bytes},
              {"pages", c.pages},
              {"receivers", c.receivers},
              {"buffers", c.buffers},
              {"elapsed_ns", c.elapsed_ns},
              {"decode_ns", c.decode_ns},
              {"scatter_ns", c.scatter_ns},
              {"pagecache_ns", c.pagecache_ns},
              {"blocks", c.blocks},
              {"compared_blocks", c.compared_blocks},
              {"seconds", Seconds(c.elapsed_ns)}};
}

// "v00000003 -> v00000007: 1234567 entries, 2.40 MiB to 2 receivers (4
// buffers), 512 pages in place, 0.183 s"
std::string CountsLine(const dte_live_counts& c) {
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.3f s", Seconds(c.elapsed_ns));
  return VersionText(c.from_version) + " -> " + VersionText(c.to_version) + ": " +
         std::to_string(c.entries) + " entries, " + HumanBytes(static_cast<double>(c.bytes)) +
         " to " + std::to_string(c.receivers) + " receivers (" + std::to_string(c.buffers) +
         " buffers), " + std::to_string(c.pages) + " pages in place, " + secs;
}

// RFC 3339 UTC of a time in seconds since the epoch.
std::string TimeText(int64_t t) {
  std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  char buf[32];
  if (::gmtime_r(&tt, &tm) == nullptr || std::strftime(buf, sizeof(buf), "%FT%TZ", &tm) == 0) {
    return std::to_string(t);
  }
  return buf;
}

json StatusJson(const std::string& mount, const dte_live_status& s) {
  const std::string message(s.last_message, strnlen(s.last_message, sizeof(s.last_message)));
  return json{{"mount", mount},
              {"live_version", VersionJson(s.live_version)},
              {"latest_version", VersionJson(s.latest_version)},
              {"applying", s.applying != 0},
              {"receivers", s.receivers},
              {"buffers", s.buffers},
              {"applies", s.applies},
              {"failed_applies", s.failed_applies},
              {"last_apply_time", s.last_apply_time ? json(s.last_apply_time) : json(nullptr)},
              {"last_error", s.last_error},
              {"last_message", message},
              {"last", CountsJson(s.last)}};
}

void PrintStatus(const std::string& mount, const dte_live_status& s) {
  const std::string message(s.last_message, strnlen(s.last_message, sizeof(s.last_message)));
  std::cout << "mount:          " << mount << "\n"
            << "live version:   " << VersionText(s.live_version) << "\n"
            << "latest version: " << VersionText(s.latest_version) << "\n"
            << "applying:       " << (s.applying ? "yes" : "no") << "\n"
            << "receivers:      " << s.receivers << " (" << s.buffers << " buffers)\n"
            << "applies:        " << s.applies << " (" << s.failed_applies << " failed)\n"
            << "last apply:     " << (s.last_apply_time ? TimeText(s.last_apply_time) : "none")
            << "\n";
  // The counts are those of the last successful apply; none has taken no time.
  if (s.last.elapsed_ns != 0) std::cout << "last applied:   " << CountsLine(s.last) << "\n";
  std::cout << "last error:     ";
  if (s.last_error == 0) {
    std::cout << "none\n";
  } else {
    std::cout << std::strerror(s.last_error) << (message.empty() ? "" : ": ") << message << "\n";
  }
}

}  // namespace

int RunApply(const LiveArgs& a) {
  auto version = ParseVersion(a.version);
  if (!version.ok()) {
    std::cerr << "dtectl apply: error: " << version.status().message() << "\n";
    return 2;
  }
  auto r = live::Apply(a.mount, *version);
  if (!r.ok()) return Fail("apply", r.status());
  if (a.json) {
    json j = CountsJson(r->counts);
    j["mount"] = a.mount;
    std::cout << j.dump() << "\n";
  } else if (!a.quiet) {
    std::cout << "applied " << CountsLine(r->counts) << "\n";
  }
  return 0;
}

int RunStatus(const LiveArgs& a) {
  auto s = live::GetStatus(a.mount);
  if (!s.ok()) return Fail("status", s.status());
  if (a.json) {
    std::cout << StatusJson(a.mount, *s).dump() << "\n";
  } else {
    PrintStatus(a.mount, *s);
  }
  return 0;
}

}  // namespace dte::cli
