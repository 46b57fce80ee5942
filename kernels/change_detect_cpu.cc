#include "kernels/change_detect.h"

#include <cstring>

namespace dte::kernels {
namespace {

template <typename T>
size_t DetectT(const T* a, const T* b, size_t n, uint32_t* idx, T* vals) {
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) {
      idx[k] = static_cast<uint32_t>(i);
      vals[k] = b[i];
      ++k;
    }
  }
  return k;
}

template <typename T>
size_t CountT(const T* a, const T* b, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) k += a[i] != b[i];
  return k;
}

}  // namespace

size_t CountChanges(const void* o, const void* n_, size_t n, int width) {
  switch (width) {
    case 1: return CountT(static_cast<const uint8_t*>(o), static_cast<const uint8_t*>(n_), n);
    case 2: return CountT(static_cast<const uint16_t*>(o), static_cast<const uint16_t*>(n_), n);
    case 4: return CountT(static_cast<const uint32_t*>(o), static_cast<const uint32_t*>(n_), n);
    default: return CountT(static_cast<const uint64_t*>(o), static_cast<const uint64_t*>(n_), n);
  }
}

size_t DetectChanges(const void* o, const void* n_, size_t n, int width, uint32_t* idx,
                     void* vals) {
  switch (width) {
    case 1:
      return DetectT(static_cast<const uint8_t*>(o), static_cast<const uint8_t*>(n_), n, idx,
                     static_cast<uint8_t*>(vals));
    case 2:
      return DetectT(static_cast<const uint16_t*>(o), static_cast<const uint16_t*>(n_), n, idx,
                     static_cast<uint16_t*>(vals));
    case 4:
      return DetectT(static_cast<const uint32_t*>(o), static_cast<const uint32_t*>(n_), n, idx,
                     static_cast<uint32_t*>(vals));
    default:
      return DetectT(static_cast<const uint64_t*>(o), static_cast<const uint64_t*>(n_), n, idx,
                     static_cast<uint64_t*>(vals));
  }
}

void Scatter(void* dst, int width, const uint32_t* idx, const void* vals, size_t count) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* v = static_cast<const uint8_t*>(vals);
  for (size_t k = 0; k < count; ++k) {
    std::memcpy(d + static_cast<size_t>(idx[k]) * width, v + k * width, width);
  }
}

void Gather(const void* src, int width, const uint32_t* idx, size_t count, void* vals_out) {
  auto* s = static_cast<const uint8_t*>(src);
  auto* v = static_cast<uint8_t*>(vals_out);
  for (size_t k = 0; k < count; ++k) {
    std::memcpy(v + k * width, s + static_cast<size_t>(idx[k]) * width, width);
  }
}

}  // namespace dte::kernels
