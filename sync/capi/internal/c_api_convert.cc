#include "sync/capi/internal/c_api_convert.h"

#include <nlohmann/json.hpp>

#include "sync/capi/internal/c_api_glue.h"
#include "sync/push/push_server.h"

namespace dte::capi {
namespace {

dte::DType ToDType(int32_t d) {
  switch (d) {
    case DTE_DTYPE_F32:
      return dte::DType::kF32;
    case DTE_DTYPE_BF16:
      return dte::DType::kBF16;
    case DTE_DTYPE_F16:
      return dte::DType::kF16;
    case DTE_DTYPE_F64:
      return dte::DType::kF64;
    default:
      return dte::DType::kU8;
  }
}

}  // namespace

dte::TensorRef ToRef(const dte_array& a) {
  dte::TensorRef r;
  r.data = a.data;
  r.dtype = ToDType(a.dtype);
  if (a.shape != nullptr && a.ndim > 0) r.shape.assign(a.shape, a.shape + a.ndim);
  return r;
}

int ToStep(const dte_adamw_step& in, dte::AdamWStep* h) {
  h->lr = in.lr;
  h->beta1 = in.beta1;
  h->beta2 = in.beta2;
  h->eps = in.eps;
  h->weight_decay = in.weight_decay;
  h->step = in.step;
  h->amsgrad = in.amsgrad != 0;
  h->maximize = in.maximize != 0;
  if (in.order < 0 || in.order > DTE_ORDER_TORCH_CUDA_FUSED_FP32) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown AdamW order " + std::to_string(in.order));
  }
  h->order = static_cast<dte::kernels::AdamWOrder>(in.order);
  return DTE_OK;
}

int ToLayout(const dte_mcore_layout& in, dte::ParallelLayout* out) {
  if (in.norms != DTE_MCORE_NORMS_TE && in.norms != DTE_MCORE_NORMS_LOCAL) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown MCore norms " + std::to_string(in.norms));
  }
  if (in.experts != DTE_MCORE_EXPERTS_SEQUENTIAL && in.experts != DTE_MCORE_EXPERTS_GROUPED) {
    return FailWith(DTE_INVALID_ARGUMENT, "unknown MCore experts " + std::to_string(in.experts));
  }
  out->tp = in.tp;
  out->ep = in.ep;
  out->etp = in.etp;
  if (in.vocab_divisible_by > 0) out->vocab_divisible_by = in.vocab_divisible_by;
  out->norms = in.norms == DTE_MCORE_NORMS_LOCAL ? dte::McoreNorms::kLocal
                                                 : dte::McoreNorms::kTransformerEngine;
  out->experts = in.experts == DTE_MCORE_EXPERTS_GROUPED ? dte::McoreExperts::kGrouped
                                                         : dte::McoreExperts::kSequential;
  return DTE_OK;
}

void FillResult(const dte::PublishResult& r, dte_publish_result* out) {
  if (out == nullptr) return;
  *out = dte_publish_result{
      r.version,         r.parent,       r.tensors,
      r.elements,        r.changed,      r.flagged,
      r.false_positives, r.uncertain,    r.stored_bytes,
      r.state_bytes,     r.parent_bytes, r.from_weights ? DTE_PATH_WEIGHTS : DTE_PATH_ADAMW};
}

std::string PushJson(const dte::PublishResult& r) {
  if (r.push) return dte::PushReportJson(*r.push);
  if (r.push_error.empty()) return "null";
  return nlohmann::json{{"error", r.push_error}}.dump();
}

}  // namespace dte::capi
