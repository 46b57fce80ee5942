// Terminal progress for long commands: "\r<what> 1.2/2.0 GiB 60% 850 MB/s".
//
// Shown only when stderr is a terminal and --quiet is not given; redrawn at
// most ten times a second. Thread-safety: not thread-safe; owned by main.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace dte::cli {

std::string HumanBytes(double bytes);

class Progress {
 public:
  Progress(std::string what, bool quiet);
  ~Progress();
  // The callback the library calls with (done, total) bytes.
  std::function<void(uint64_t, uint64_t)> Callback();
  // Clears the line; returns seconds since construction.
  double Finish();
  double Elapsed() const;

 private:
  void Draw(uint64_t done, uint64_t total);

  std::string what_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace dte::cli
