// CUDA AdamW inversion and fused invert + cast + compare + compact.
#include "kernels/adamw.h"
#include "kernels/adamw_math.h"
#include "kernels/adamw_resolve_math.h"
#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"

namespace dte::kernels {
namespace {

using cuda_internal::AsStream;
using cuda_internal::FromCuda;

struct InvertOp {
  const float* theta;
  const float* m;
  const float* v;
  AdamWScalars s;
  float* prev;
  __device__ void operator()(uint64_t i) const {
    prev[i] = AdamWInvertElement(theta[i], m[i], v[i], s);
  }
};

struct ChangedAt {
  const float* theta;
  const float* m;
  const float* v;
  AdamWScalars s;
  bool use_margin;
  uint32_t margin_ulps;
  __device__ bool operator()(uint64_t i) const {
    return AdamWElementChanged(theta[i], m[i], v[i], s, use_margin, margin_ulps);
  }
};

struct KeptAt {
  const float* theta;
  const float* m;
  const float* v;
  AdamWScalars s;
  uint32_t margin_ulps;
  __device__ bool operator()(uint64_t i) const {
    return AdamWElementKept(theta[i], m[i], v[i], s, margin_ulps);
  }
};

struct WriteBf16 {
  const float* theta;
  uint64_t* idx;
  uint16_t* bf16;
  __device__ void operator()(ptrdiff_t k, uint64_t i) const {
    idx[k] = i;
    bf16[k] = Fp32ToBf16Bits(theta[i]);
  }
};

// The workspace of SelectBf16 with predicate type Pred for n elements.
template <typename Pred>
CudaStatus SelectWorkspace(size_t n, size_t* bytes, const char* op) {
  *bytes = 0;
  return FromCuda(
      cuda_internal::SelectIndices(nullptr, *bytes, n, Pred{}, WriteBf16{}, nullptr, nullptr), op);
}

// Writes, in increasing i, each i < n where pred(i) holds and theta[i]'s
// BF16 bits, and their number to *d_count_out.
template <typename Pred>
CudaStatus SelectBf16(const char* op, void* d_workspace, size_t workspace_bytes, size_t n,
                      const Pred& pred, const float* d_theta, uint64_t* d_idx_out,
                      uint16_t* d_bf16_out, uint64_t* d_count_out, void* stream) {
  return cuda_internal::CheckedSelect(op, d_workspace, workspace_bytes, n, pred,
                                      WriteBf16{d_theta, d_idx_out, d_bf16_out}, d_count_out,
                                      AsStream(stream));
}

}  // namespace

CudaStatus CudaAdamWInvert(const float* d_theta, const float* d_m, const float* d_v, size_t n,
                           const AdamWParams& p, float* d_prev_out, void* stream) {
  const InvertOp op{d_theta, d_m, d_v, MakeAdamWScalars(p), d_prev_out};
  return FromCuda(cuda_internal::LaunchForEachIndex(n, AsStream(stream), op),
                  "CUDA AdamW inversion");
}

CudaStatus CudaAdamWInvertDetectWorkspaceBytes(size_t n, size_t* bytes) {
  return SelectWorkspace<ChangedAt>(n, bytes, "CUDA AdamW change detection workspace query");
}

CudaStatus CudaAdamWInvertDetect(void* d_workspace, size_t workspace_bytes, const float* d_theta,
                                 const float* d_m, const float* d_v, size_t n, const AdamWParams& p,
                                 const AdamWDetectOptions& options, uint64_t* d_idx_out,
                                 uint16_t* d_bf16_out, uint64_t* d_count_out, void* stream) {
  const ChangedAt pred{
      d_theta, d_m, d_v, MakeAdamWScalars(p), options.report_near_boundary, options.margin_ulps};
  return SelectBf16("CUDA AdamW change detection", d_workspace, workspace_bytes, n, pred, d_theta,
                    d_idx_out, d_bf16_out, d_count_out, stream);
}

CudaStatus CudaAdamWFindChangesWorkspaceBytes(size_t n, size_t* bytes) {
  return SelectWorkspace<KeptAt>(n, bytes, "CUDA AdamW change finding workspace query");
}

CudaStatus CudaAdamWFindChanges(void* d_workspace, size_t workspace_bytes, const float* d_theta,
                                const float* d_m, const float* d_v, size_t n, const AdamWParams& p,
                                uint32_t margin_ulps, uint64_t* d_idx_out, uint16_t* d_bf16_out,
                                uint64_t* d_count_out, void* stream) {
  const KeptAt pred{d_theta, d_m, d_v, MakeAdamWScalars(p), margin_ulps};
  return SelectBf16("CUDA AdamW change finding", d_workspace, workspace_bytes, n, pred, d_theta,
                    d_idx_out, d_bf16_out, d_count_out, stream);
}

}  // namespace dte::kernels
