// CUDA block-scaled FP8 quantization over the shared element math
// (kernels/fp8_math.h): one thread block per FP8 block at a time, which
// first reduces the block's largest BF16 magnitude, then quantizes it.
#include <algorithm>

#include "kernels/fp8_cuda.h"
#include "kernels/fp8_math.h"
#include "kernels/internal/cuda_util.cuh"

namespace dte::kernels {
namespace {

constexpr unsigned kThreads = 256;

// Plain-data copy of the layout for the kernels.
struct Geometry {
  uint64_t rows, cols, block_rows, block_cols, grid_cols, blocks;
  Fp8ScaleRule rule;
};

Geometry GeometryOf(const Fp8Layout& l) {
  return {l.rows, l.cols, l.block_rows, l.block_cols, l.grid_cols(), l.num_blocks(), l.rule};
}

__global__ void QuantizeKernel(Geometry g, const uint16_t* in, uint8_t* q, float* scale) {
  __shared__ unsigned int amax;
  for (uint64_t b = blockIdx.x; b < g.blocks; b += gridDim.x) {
    const uint64_t r0 = (b / g.grid_cols) * g.block_rows, c0 = (b % g.grid_cols) * g.block_cols;
    const uint64_t h = min(g.block_rows, g.rows - r0), w = min(g.block_cols, g.cols - c0);
    if (threadIdx.x == 0) amax = 0;
    __syncthreads();
    unsigned int local = 0;
    for (uint64_t k = threadIdx.x; k < h * w; k += blockDim.x) {
      local = max(local,
                  static_cast<unsigned int>(Bf16AbsBits(in[(r0 + k / w) * g.cols + c0 + k % w])));
    }
    atomicMax(&amax, local);
    __syncthreads();
    const float s = Fp8BlockScale(Bf16BitsToFp32(static_cast<uint16_t>(amax)), g.rule);
    if (threadIdx.x == 0) scale[b] = s;
    for (uint64_t k = threadIdx.x; k < h * w; k += blockDim.x) {
      const uint64_t i = (r0 + k / w) * g.cols + c0 + k % w;
      q[i] = QuantizeE4m3(Bf16BitsToFp32(in[i]), s);
    }
    __syncthreads();  // amax is reset for the next block only after all read it
  }
}

struct Dequantize {
  Geometry g;
  const uint8_t* q;
  const float* scale;
  float* out;
  __device__ void operator()(uint64_t i) const {
    const uint64_t r = i / g.cols, c = i % g.cols;
    out[i] = DequantizeE4m3(q[i], scale[(r / g.block_rows) * g.grid_cols + c / g.block_cols]);
  }
};

}  // namespace

CudaStatus CudaFp8Quantize(const Fp8Layout& layout, const uint16_t* d_bf16, uint8_t* d_q_out,
                           float* d_scale_out, void* stream) {
  constexpr const char* kOp = "CUDA FP8 quantize";
  const std::string why = Fp8LayoutError(layout);
  if (!why.empty()) return cuda_internal::BadArgument(kOp, why);
  const Geometry g = GeometryOf(layout);
  if (g.blocks == 0) return {};
  const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(g.blocks, uint64_t{1} << 16));
  QuantizeKernel<<<grid, kThreads, 0, cuda_internal::AsStream(stream)>>>(g, d_bf16, d_q_out,
                                                                         d_scale_out);
  return cuda_internal::FromCuda(cudaGetLastError(), kOp);
}

CudaStatus CudaFp8Dequantize(const Fp8Layout& layout, const uint8_t* d_q, const float* d_scale,
                             float* d_out, void* stream) {
  constexpr const char* kOp = "CUDA FP8 dequantize";
  const std::string why = Fp8LayoutError(layout);
  if (!why.empty()) return cuda_internal::BadArgument(kOp, why);
  const Geometry g = GeometryOf(layout);
  return cuda_internal::FromCuda(
      cuda_internal::LaunchForEachIndex(layout.num_elements(), cuda_internal::AsStream(stream),
                                        Dequantize{g, d_q, d_scale, d_out}),
      kOp);
}

}  // namespace dte::kernels
