// The changed set of a live apply (sync/live/live.h, step 2), shared by the files
// that compute it and the ones that write it: receiver buffers
// (live_scatter.cc) and the page cache of live/ (live_pages.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "sync/live/live.h"

namespace dte::live {

// The changes of one block of a tensor. Entry i sets element idx[i] (block
// relative, increasing): to vals[i] (width bytes) where Whole(i), else to
// its live value plus vals[i], a wrapping difference (ApplyElement,
// kernels/remap_math.h).
struct Live::BlockChange {
  uint32_t block = 0;
  bool values = false;  // every entry holds the target's value
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals;
  std::vector<uint8_t> whole;  // empty, or per entry: 1 = vals holds the value
  bool Whole(size_t i) const { return values || (!whole.empty() && whole[i] != 0); }
};

// The changed blocks of one tensor, in block order.
struct Live::Changes {
  uint32_t file = 0, tensor = 0;
  int width = 0;
  uint64_t block_elements = 0;
  std::vector<BlockChange> blocks;
};

namespace internal {

using Clock = std::chrono::steady_clock;

inline uint64_t Nanos(Clock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count());
}

}  // namespace internal
}  // namespace dte::live
