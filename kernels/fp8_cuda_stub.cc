// The CUDA FP8 calls in builds without CUDA: they report kCudaNotBuilt.
#if !defined(DTE_HAVE_CUDA)

#include <string>

#include "kernels/fp8_cuda.h"

namespace dte::kernels {

CudaStatus CudaFp8Quantize(const Fp8Layout&, const uint16_t*, uint8_t*, float*, void*) {
  return {kCudaNotBuilt, "CUDA FP8 quantize: dte was built without CUDA support"};
}

CudaStatus CudaFp8Dequantize(const Fp8Layout&, const uint8_t*, const float*, float*, void*) {
  return {kCudaNotBuilt, "CUDA FP8 dequantize: dte was built without CUDA support"};
}

}  // namespace dte::kernels

#endif  // !defined(DTE_HAVE_CUDA)
