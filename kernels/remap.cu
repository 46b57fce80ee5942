// CUDA index remapping (compaction over CUB) over the shared element math.
#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"
#include "kernels/remap_math.h"

namespace dte::kernels {
namespace {

struct InBox {
  RemapPlan plan;
  const uint64_t* src;
  __device__ bool operator()(uint64_t k) const {
    uint64_t unused;
    return RemapElement(plan, src[k], &unused);
  }
};

struct WriteRemapped {
  RemapPlan plan;
  const uint64_t* src;
  uint64_t* dst;
  uint64_t* pos;  // may be null
  __device__ void operator()(ptrdiff_t j, uint64_t k) const {
    RemapElement(plan, src[k], &dst[j]);
    if (pos != nullptr) pos[j] = k;
  }
};

}  // namespace

CudaStatus CudaRemapWorkspaceBytes(size_t n, size_t* bytes) {
  *bytes = 0;
  return cuda_internal::FromCuda(
      cuda_internal::SelectIndices(nullptr, *bytes, n, InBox{}, WriteRemapped{}, nullptr, nullptr),
      "CUDA remap workspace query");
}

CudaStatus CudaRemapIndices(void* d_workspace, size_t workspace_bytes, const RemapPlan& plan,
                            const uint64_t* d_src_idx, size_t n, uint64_t* d_dst_idx_out,
                            uint64_t* d_pos_out, uint64_t* d_count_out, void* stream) {
  // Unlike the CPU form this tests every index: a binary search for the box's
  // flat range would need the sorted input on the host.
  return cuda_internal::CheckedSelect("CUDA remap", d_workspace, workspace_bytes, n,
                                      InBox{plan, d_src_idx},
                                      WriteRemapped{plan, d_src_idx, d_dst_idx_out, d_pos_out},
                                      d_count_out, cuda_internal::AsStream(stream));
}

}  // namespace dte::kernels
