// FP8 receivers of a live apply (sync/live/live.h): registering their E4M3
// and scale buffers against the receiver's FP8 plan.
#include <string_view>

#include "sync/live/internal/live_fp8.h"

namespace dte::live {
namespace internal {

uint32_t Fp8BlockOf(const dte_live_register& r) {
  return r.fp8_block == 0 ? static_cast<uint32_t>(kernels::kFp8DefaultBlock) : r.fp8_block;
}

bool IsFp8Registration(const dte_live_register& r, const std::string& name, bool in_layout) {
  if (std::string(r.dtype, strnlen(r.dtype, sizeof r.dtype)) == kFp8DTypeName) return true;
  static constexpr std::string_view kScale = ".weight_scale_inv";
  return !in_layout && name.size() > kScale.size() && name.ends_with(kScale);
}

}  // namespace internal

namespace {

Result<Fp8ReceiverOptions> OptionsOf(const dte_live_register& r, const Fp8Policy& policy,
                                     const std::string& what) {
  if (r.fp8_scale_rule > DTE_LIVE_FP8_POW2) {
    return InvalidArgument(what + ": unknown FP8 scale rule " + std::to_string(r.fp8_scale_rule) +
                           " (0: plain, 1: power of two)");
  }
  Fp8ReceiverOptions o;
  o.policy = policy;
  o.block_rows = o.block_cols = internal::Fp8BlockOf(r);
  o.rule = r.fp8_scale_rule == DTE_LIVE_FP8_POW2 ? kernels::Fp8ScaleRule::kPowerOfTwo
                                                 : kernels::Fp8ScaleRule::kPlain;
  return o;
}

std::string ShapeText(const std::vector<uint64_t>& v) {
  return ShapeString(std::vector<int64_t>(v.begin(), v.end()));
}

Status CheckFp8Shape(const dte_live_register& r, const char* dtype,
                     const std::vector<uint64_t>& want, const std::string& what) {
  const std::string given(r.dtype, strnlen(r.dtype, sizeof r.dtype));
  std::vector<uint64_t> shape;
  for (uint32_t d = 0; d < std::min<uint32_t>(r.ndim, DTE_LIVE_MAX_DIMS); ++d) {
    shape.push_back(r.shape[d] < 0 ? UINT64_MAX : static_cast<uint64_t>(r.shape[d]));
  }
  if (given == dtype && r.ndim <= DTE_LIVE_MAX_DIMS && shape == want) return Status::Ok();
  return InvalidArgument(what + ": " + given + " " + ShapeText(shape) +
                         " given, the FP8 layout has " + dtype + " " + ShapeText(want));
}

}  // namespace

void Live::SetFp8Policy(Fp8Policy policy) {
  MutexLock lock(&receivers_mu_);
  fp8_policy_ = std::move(policy);
}

Result<Live::BufferSpec> Live::Fp8Spec(const dte_live_register& r, const std::string& name,
                                       const Plan& plan,
                                       std::shared_ptr<const Fp8ReceiverPlan>* fp8,
                                       const std::string& what) {
  if (!*fp8) {
    ASSIGN_OR_RETURN(const Fp8ReceiverOptions o, OptionsOf(r, fp8_policy_, what));
    auto made = MakeFp8ReceiverPlan(plan.plan, r.rank, o);
    if (!made.ok()) return made.status().WithContext(what);
    *fp8 = std::make_shared<const Fp8ReceiverPlan>(std::move(made).value());
  }
  const Fp8ReceiverPlan& p = **fp8;
  const bool bytes = std::string(r.dtype, strnlen(r.dtype, sizeof r.dtype)) == kFp8DTypeName;
  // A scale buffer names its weight: "<module>.weight_scale_inv".
  static constexpr std::string_view kScaleSuffix = "_scale_inv";
  const std::string weight = bytes ? name : name.substr(0, name.size() - kScaleSuffix.size());
  const auto& tensors = plan.plan.receiver_tensors[static_cast<size_t>(r.rank)];
  auto it = std::find_if(tensors.begin(), tensors.end(),
                         [&](const PlanTensor& t) { return t.name == weight; });
  if (it == tensors.end()) {
    const std::string layout = LayoutText({r.tp, r.fuse_qkv != 0, r.fuse_gate_up != 0}, r.rank);
    return NotFound(what + ": " + (bytes ? "no such tensor" : "no weight \"" + weight + "\"") +
                    " in layout " + layout);
  }
  const auto i = static_cast<uint32_t>(it - tensors.begin());
  const Fp8ReceiverTensor& t = p.tensors[i];
  if (!t.fp8) {
    return InvalidArgument(what + ": \"" + weight + "\" is not held in FP8 (" +
                           std::string(Fp8DecisionName(t.decision)) +
                           "); register it as the layout has it");
  }
  if (bytes) {
    RETURN_IF_ERROR(CheckFp8Shape(r, kFp8DTypeName, it->shape, what));
    return BufferSpec{i, Buffer::Role::kFp8Bytes, 1, ShapeElements(it->shape)};
  }
  RETURN_IF_ERROR(CheckFp8Shape(r, "F32", t.scale_shape, what));
  return BufferSpec{i, Buffer::Role::kFp8Scales, 4, ShapeElements(t.scale_shape)};
}

}  // namespace dte::live
