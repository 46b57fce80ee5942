// CUDA form of the fused remap + scatter (kernels/remap.h, RemapScatter).
//
// Same conventions as kernels/cuda.h (d_ device pointers, stream as void*,
// enqueue only); like it, this header includes nothing from CUDA. Built
// without CUDA, the call returns kCudaNotBuilt.
//
// Thread-safety: as kernels/cuda.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda.h"
#include "kernels/remap_math.h"

namespace dte::kernels {

// For each k < n whose d_src_idx[k] lies in the plan's box, copies element k
// (width bytes: 1, 2, 4 or 8) of d_vals to its destination index in d_dst.
// Indices must be distinct, so no two threads write one element. Unlike the
// CPU form it does not count the written elements (that would need a
// reduction; callers know their counts from RemapIndices or the protocol).
CudaStatus CudaRemapScatter(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                            size_t n, int width, void* d_dst, void* stream);

// The in-place form used by live apply: element k is applied with
// ApplyElement (kernels/remap_math.h) at its destination, whole where
// d_whole[k] != 0 (or, with d_whole null, where all_whole is true), else
// added as a wrapping difference. Indices must be distinct.
CudaStatus CudaRemapApply(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                          const uint8_t* d_whole, bool all_whole, size_t n, int width, void* d_dst,
                          void* stream);

}  // namespace dte::kernels
