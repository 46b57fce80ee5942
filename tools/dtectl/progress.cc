#include "tools/dtectl/progress.h"

#include <unistd.h>

#include <cstdio>

#include "store/base/units.h"

namespace dte::cli {

std::string HumanBytes(double bytes) {
  return FormatByteSize(bytes > 0 ? static_cast<uint64_t>(bytes) : 0);
}

Progress::Progress(std::string what, bool quiet)
    : what_(std::move(what)),
      enabled_(!quiet && ::isatty(STDERR_FILENO)),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

Progress::~Progress() { Finish(); }

std::function<void(uint64_t, uint64_t)> Progress::Callback() {
  if (!enabled_) return nullptr;
  return [this](uint64_t done, uint64_t total) { Draw(done, total); };
}

double Progress::Elapsed() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::Draw(uint64_t done, uint64_t total) {
  auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::milliseconds(100) && done < total) return;
  last_ = now;
  double secs = Elapsed();
  double pct = total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
  std::fprintf(stderr, "\r%s %s / %s  %3.0f%%  %s/s   ", what_.c_str(),
               HumanBytes(static_cast<double>(done)).c_str(),
               HumanBytes(static_cast<double>(total)).c_str(), pct,
               HumanBytes(secs > 0 ? static_cast<double>(done) / secs : 0).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

double Progress::Finish() {
  if (drawn_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    drawn_ = false;
  }
  return Elapsed();
}

}  // namespace dte::cli
