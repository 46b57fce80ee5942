// CUDA index remapping (compaction over CUB) and fused remap + scatter (a
// grid-stride launch) over the shared element math.
#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"
#include "kernels/remap_cuda.h"
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

// One thread per changed element: remap, then apply the element if it lies
// in the box (kernels/remap_math.h, shared with the CPU backend). A scatter
// is the apply with every element whole.
template <int W>
struct RemapApplyOp {
  RemapPlan plan;
  const uint64_t* src;
  const unsigned char* vals;
  const uint8_t* whole;
  bool all_whole;
  unsigned char* dst;
  __device__ void operator()(uint64_t k) const {
    RemapApplyElement<W>(plan, src[k], vals + k * W, whole ? whole[k] != 0 : all_whole, dst);
  }
};

template <int W>
CudaStatus LaunchRemapApply(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                            const uint8_t* d_whole, bool all_whole, size_t n, void* d_dst,
                            void* stream, const char* what) {
  const RemapApplyOp<W> op{plan,    d_src_idx, static_cast<const unsigned char*>(d_vals),
                           d_whole, all_whole, static_cast<unsigned char*>(d_dst)};
  return cuda_internal::FromCuda(
      cuda_internal::LaunchForEachIndex(n, cuda_internal::AsStream(stream), op), what);
}

CudaStatus RemapApplyWidth(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                           const uint8_t* d_whole, bool all_whole, size_t n, int width, void* d_dst,
                           void* stream, const char* what) {
  switch (width) {
    case 1:
      return LaunchRemapApply<1>(plan, d_src_idx, d_vals, d_whole, all_whole, n, d_dst, stream,
                                 what);
    case 2:
      return LaunchRemapApply<2>(plan, d_src_idx, d_vals, d_whole, all_whole, n, d_dst, stream,
                                 what);
    case 4:
      return LaunchRemapApply<4>(plan, d_src_idx, d_vals, d_whole, all_whole, n, d_dst, stream,
                                 what);
    case 8:
      return LaunchRemapApply<8>(plan, d_src_idx, d_vals, d_whole, all_whole, n, d_dst, stream,
                                 what);
    default:
      return cuda_internal::BadArgument(what, "width must be 1, 2, 4 or 8");
  }
}

}  // namespace

CudaStatus CudaRemapApply(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                          const uint8_t* d_whole, bool all_whole, size_t n, int width, void* d_dst,
                          void* stream) {
  return RemapApplyWidth(plan, d_src_idx, d_vals, d_whole, all_whole, n, width, d_dst, stream,
                         "CUDA remap apply");
}

CudaStatus CudaRemapScatter(const RemapPlan& plan, const uint64_t* d_src_idx, const void* d_vals,
                            size_t n, int width, void* d_dst, void* stream) {
  return RemapApplyWidth(plan, d_src_idx, d_vals, nullptr, true, n, width, d_dst, stream,
                         "CUDA remap scatter");
}

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
