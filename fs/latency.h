// A latency histogram with fixed bounds, cheap enough for every read: one
// relaxed atomic increment per observation and bucket scan of a dozen
// bounds. Exported in the Prometheus format by fs/metrics.h.
//
// Thread-safety: Observe and Take from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace dte::fs {

class LatencyHistogram {
 public:
  // Upper bounds in seconds (the last bucket, +Inf, is implied).
  static constexpr std::array<double, 14> kBounds = {1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                                     5e-3, 0.01, 0.05, 0.1,    0.5,  1,    10};

  void Observe(std::chrono::nanoseconds d) {
    const double s = std::chrono::duration<double>(d).count();
    size_t b = 0;
    while (b < kBounds.size() && s > kBounds[b]) ++b;
    buckets_[b].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<uint64_t>(d.count() > 0 ? d.count() : 0),
                      std::memory_order_relaxed);
  }

  struct Snapshot {
    std::array<uint64_t, kBounds.size() + 1> counts{};  // per bucket, not cumulative
    double sum_seconds = 0;
  };
  Snapshot Take() const {
    Snapshot s;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      s.counts[b] = buckets_[b].load(std::memory_order_relaxed);
    }
    s.sum_seconds = static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9;
    return s;
  }

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> sum_ns_{0};
};

}  // namespace dte::fs
