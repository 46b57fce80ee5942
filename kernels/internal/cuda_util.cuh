// Shared plumbing for the CUDA backend's .cu files: the one place where
// cudaError_t becomes CudaStatus, a grid-stride launcher for element-wise work
// and an order-preserving compaction over CUB's DeviceSelect.
//
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cub/device/device_select.cuh>
#include <string>

#include "kernels/cuda.h"

namespace dte::kernels::cuda_internal {

inline CudaStatus FromCuda(cudaError_t e, const char* op) {
  if (e == cudaSuccess) return {};
  // Reset the thread's last-error slot so this failure is not reported again
  // by the launch check of some later, successful call.
  cudaGetLastError();
  return {static_cast<int>(e),
          std::string(op) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

inline CudaStatus BadArgument(const char* op, const std::string& why) {
  return {kCudaBadArgument, std::string(op) + ": " + why};
}

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

inline bool ValidWidth(int width) { return width == 1 || width == 2 || width == 4 || width == 8; }

template <typename Op>
__global__ void ForEachIndexKernel(uint64_t n, Op op) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    op(i);
  }
}

// Runs op(i) for i in [0, n) on `stream`.
template <typename Op>
cudaError_t LaunchForEachIndex(uint64_t n, cudaStream_t stream, const Op& op) {
  if (n == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  // The grid-stride loop lets a bounded grid cover any n; 2^16 blocks of 256
  // threads oversubscribe every current GPU.
  const uint64_t blocks = std::min<uint64_t>((n + kThreads - 1) / kThreads, uint64_t{1} << 16);
  ForEachIndexKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(n, op);
  return cudaGetLastError();
}

// Order-preserving compaction of the indices i in [0, n) with pred(i): the
// j-th selected i is handed to write(j, i), and the count stored to *d_count.
// With d_workspace == nullptr only sets workspace_bytes (CUB's convention).
template <typename Pred, typename Write>
cudaError_t SelectIndices(void* d_workspace, size_t& workspace_bytes, uint64_t n, Pred pred,
                          Write write, uint64_t* d_count, cudaStream_t stream) {
  thrust::counting_iterator<uint64_t> first(0);
  return cub::DeviceSelect::If(d_workspace, workspace_bytes, first,
                               thrust::make_tabulate_output_iterator(write), d_count,
                               static_cast<int64_t>(n), pred, stream);
}

// Validates a caller's workspace against the query for the same arguments.
template <typename Pred, typename Write>
CudaStatus CheckedSelect(const char* op, void* d_workspace, size_t workspace_bytes, uint64_t n,
                         Pred pred, Write write, uint64_t* d_count, cudaStream_t stream) {
  // Nothing to select: no workspace is needed, whatever the query says.
  if (n == 0) return FromCuda(cudaMemsetAsync(d_count, 0, sizeof(uint64_t), stream), op);
  size_t needed = 0;
  CudaStatus st = FromCuda(SelectIndices(nullptr, needed, n, pred, write, d_count, stream), op);
  if (!st.ok()) return st;
  if (d_workspace == nullptr || workspace_bytes < needed) {
    return BadArgument(op, "workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                               std::to_string(needed));
  }
  return FromCuda(SelectIndices(d_workspace, needed, n, pred, write, d_count, stream), op);
}

}  // namespace dte::kernels::cuda_internal
