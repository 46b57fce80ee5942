// CUDA change detection (compaction over CUB) and scatter.
#include <cstdint>

#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"

namespace dte::kernels {
namespace {

using cuda_internal::AsStream;
using cuda_internal::BadArgument;
using cuda_internal::FromCuda;

template <typename T>
struct DiffersAt {
  const T* a;
  const T* b;
  __device__ bool operator()(uint64_t i) const { return a[i] != b[i]; }
};

template <typename T>
struct WriteChange {
  const T* b;
  uint64_t* idx;
  T* vals;
  __device__ void operator()(ptrdiff_t k, uint64_t i) const {
    idx[k] = i;
    vals[k] = b[i];
  }
};

template <typename T>
struct ScatterOp {
  T* dst;
  const uint64_t* idx;
  const T* vals;
  __device__ void operator()(uint64_t k) const { dst[idx[k]] = vals[k]; }
};

// Calls fn(T{}) with T the unsigned integer of `width` bytes (validated).
template <typename Fn>
CudaStatus ForWidth(int width, const Fn& fn) {
  switch (width) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      return fn(uint64_t{});
  }
}

}  // namespace

CudaStatus CudaDetectChangesWorkspaceBytes(size_t n, int width, size_t* bytes) {
  constexpr const char* kOp = "CUDA change detection workspace query";
  if (!cuda_internal::ValidWidth(width)) return BadArgument(kOp, "width must be 1, 2, 4 or 8");
  return ForWidth(width, [&](auto zero) {
    using T = decltype(zero);
    *bytes = 0;
    return FromCuda(cuda_internal::SelectIndices(nullptr, *bytes, n, DiffersAt<T>{},
                                                 WriteChange<T>{}, nullptr, nullptr),
                    kOp);
  });
}

CudaStatus CudaDetectChanges(void* d_workspace, size_t workspace_bytes, const void* d_old,
                             const void* d_new, size_t n, int width, uint64_t* d_idx_out,
                             void* d_val_out, uint64_t* d_count_out, void* stream) {
  constexpr const char* kOp = "CUDA change detection";
  if (!cuda_internal::ValidWidth(width)) return BadArgument(kOp, "width must be 1, 2, 4 or 8");
  return ForWidth(width, [&](auto zero) {
    using T = decltype(zero);
    const auto* a = static_cast<const T*>(d_old);
    const auto* b = static_cast<const T*>(d_new);
    return cuda_internal::CheckedSelect(kOp, d_workspace, workspace_bytes, n, DiffersAt<T>{a, b},
                                        WriteChange<T>{b, d_idx_out, static_cast<T*>(d_val_out)},
                                        d_count_out, AsStream(stream));
  });
}

CudaStatus CudaScatter(void* d_dst, int width, const uint64_t* d_idx, const void* d_vals,
                       size_t count, void* stream) {
  constexpr const char* kOp = "CUDA scatter";
  if (!cuda_internal::ValidWidth(width)) return BadArgument(kOp, "width must be 1, 2, 4 or 8");
  return ForWidth(width, [&](auto zero) {
    using T = decltype(zero);
    const ScatterOp<T> op{static_cast<T*>(d_dst), d_idx, static_cast<const T*>(d_vals)};
    return FromCuda(cuda_internal::LaunchForEachIndex(count, AsStream(stream), op), kOp);
  });
}

}  // namespace dte::kernels
