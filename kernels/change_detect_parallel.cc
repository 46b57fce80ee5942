// Multi-threaded CPU change detection and scatter over the kernels thread pool.
#include <cstring>

#include "kernels/change_detect.h"
#include "kernels/internal/change_scan.h"
#include "kernels/internal/compact.h"
#include "kernels/parallel.h"
#include "kernels/width.h"

namespace dte::kernels {

size_t CountChangesParallel(const void* old_data, const void* new_data, size_t n, int width) {
  const auto* a = static_cast<const uint8_t*>(old_data);
  const auto* b = static_cast<const uint8_t*>(new_data);
  return DispatchWidth(width, [&](auto w) {
    constexpr int W = w.value;
    return internal::ParallelCount(n, [&](size_t begin, size_t end) {
      return internal::CountDiffs<W>(a + begin * W, b + begin * W, end - begin);
    });
  });
}

size_t DetectChangesParallel(const void* old_data, const void* new_data, size_t n, int width,
                             uint64_t* idx_out, void* val_out) {
  const auto* a = static_cast<const uint8_t*>(old_data);
  const auto* b = static_cast<const uint8_t*>(new_data);
  auto* v = static_cast<uint8_t*>(val_out);
  return DispatchWidth(width, [&](auto w) {
    constexpr int W = w.value;
    auto run = [&](size_t begin, size_t end) {
      return internal::DetectDiffs<W>(a + begin * W, b + begin * W, end - begin, begin,
                                      idx_out + begin, v + begin * W);
    };
    auto move = [&](size_t from, size_t to, size_t count) {
      std::memmove(idx_out + to, idx_out + from, count * sizeof(uint64_t));
      std::memmove(v + to * W, v + from * W, count * W);
    };
    return internal::ParallelCompact(n, run, move);
  });
}

void ScatterParallel(void* dst, int width, const uint64_t* idx, const void* vals, size_t count) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* v = static_cast<const uint8_t*>(vals);
  DispatchWidth(width, [&](auto w) {
    constexpr int W = w.value;
    ParallelFor(count, internal::kCompactChunk, [&](size_t begin, size_t end) {
      for (size_t k = begin; k < end; ++k) std::memcpy(d + idx[k] * W, v + k * W, W);
    });
  });
}

}  // namespace dte::kernels
