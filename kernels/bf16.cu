// CUDA FP32 <-> BF16 array conversion over the shared element math.
#include "kernels/bf16_math.h"
#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"

namespace dte::kernels {
namespace {

struct ToBf16 {
  const float* in;
  uint16_t* out;
  __device__ void operator()(uint64_t i) const { out[i] = Fp32ToBf16Bits(in[i]); }
};

struct ToFp32 {
  const uint16_t* in;
  float* out;
  __device__ void operator()(uint64_t i) const { out[i] = Bf16BitsToFp32(in[i]); }
};

}  // namespace

CudaStatus CudaCastFp32ToBf16(const float* d_in, uint16_t* d_out, size_t n, void* stream) {
  return cuda_internal::FromCuda(
      cuda_internal::LaunchForEachIndex(n, cuda_internal::AsStream(stream), ToBf16{d_in, d_out}),
      "CUDA FP32 to BF16 cast");
}

CudaStatus CudaCastBf16ToFp32(const uint16_t* d_in, float* d_out, size_t n, void* stream) {
  return cuda_internal::FromCuda(
      cuda_internal::LaunchForEachIndex(n, cuda_internal::AsStream(stream), ToFp32{d_in, d_out}),
      "CUDA BF16 to FP32 cast");
}

}  // namespace dte::kernels
