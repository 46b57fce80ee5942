// CudaRemapScatter in builds without CUDA: reports kCudaNotBuilt.
#if !defined(DTE_HAVE_CUDA)

#include <string>

#include "kernels/remap_cuda.h"

namespace dte::kernels {

CudaStatus CudaRemapScatter(const RemapPlan&, const uint64_t*, const void*, size_t, int, void*,
                            void*) {
  return {kCudaNotBuilt, "CUDA remap scatter: dte was built without CUDA support"};
}

CudaStatus CudaRemapApply(const RemapPlan&, const uint64_t*, const void*, const uint8_t*, bool,
                          size_t, int, void*, void*) {
  return {kCudaNotBuilt, "CUDA remap apply: dte was built without CUDA support"};
}

}  // namespace dte::kernels

#endif  // !defined(DTE_HAVE_CUDA)
