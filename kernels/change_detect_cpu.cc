// Single-threaded CPU change detection, scatter and gather.
#include <cstring>

#include "kernels/change_detect.h"
#include "kernels/internal/change_scan.h"
#include "kernels/width.h"

namespace dte::kernels {
namespace {

template <int W>
void CopyElement(uint8_t* dst, const uint8_t* src) {
  std::memcpy(dst, src, W);  // Constant size: compiles to one load and store.
}

}  // namespace

size_t CountChanges(const void* old_data, const void* new_data, size_t n, int width) {
  const auto* a = static_cast<const uint8_t*>(old_data);
  const auto* b = static_cast<const uint8_t*>(new_data);
  return DispatchWidth(width, [&](auto w) { return internal::CountDiffs<w.value>(a, b, n); });
}

size_t DetectChanges(const void* old_data, const void* new_data, size_t n, int width,
                     uint32_t* idx_out, void* val_out) {
  const auto* a = static_cast<const uint8_t*>(old_data);
  const auto* b = static_cast<const uint8_t*>(new_data);
  auto* v = static_cast<uint8_t*>(val_out);
  return DispatchWidth(
      width, [&](auto w) { return internal::DetectDiffs<w.value>(a, b, n, 0, idx_out, v); });
}

void Scatter(void* dst, int width, const uint32_t* idx, const void* vals, size_t count) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* v = static_cast<const uint8_t*>(vals);
  DispatchWidth(width, [&](auto w) {
    for (size_t k = 0; k < count; ++k) {
      CopyElement<w.value>(d + static_cast<size_t>(idx[k]) * w.value, v + k * w.value);
    }
  });
}

void Gather(const void* src, int width, const uint32_t* idx, size_t count, void* vals_out) {
  const auto* s = static_cast<const uint8_t*>(src);
  auto* v = static_cast<uint8_t*>(vals_out);
  DispatchWidth(width, [&](auto w) {
    for (size_t k = 0; k < count; ++k) {
      CopyElement<w.value>(v + k * w.value, s + static_cast<size_t>(idx[k]) * w.value);
    }
  });
}

}  // namespace dte::kernels
