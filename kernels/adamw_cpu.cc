// CPU array forms of the AdamW update, inversion and fused change detection.
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "kernels/adamw.h"
#include "kernels/adamw_resolve_math.h"
#include "kernels/bf16_math.h"
#include "kernels/internal/compact.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

// The inversion costs a few dozen FP32 operations per element; smaller
// ranges would spend more on hand-off than on work.
constexpr size_t kAdamWGrain = size_t{1} << 15;

std::string Describe(const char* field, double value, const char* rule) {
  return std::string("AdamW ") + field + " = " + std::to_string(value) + ": " + rule;
}

// kTorchCudaFused (torch 2.4 to 2.10): the kernel computes 1 - beta1^step
// and sqrt(1 - beta2^step) once per tensor in FP64 from the FP32 step count
// (the device's pow and sqrt; libm's here, docs/engine.md "Fused AdamW")
// and hands both to the element math as FP32 values; step_size = lr / bc1
// is an FP64 division rounded to FP32; lr, weight_decay and eps stay FP64.
void SetFusedF64Scalars(const AdamWParams& p, AdamWScalars* s) {
  const double step = static_cast<float>(p.step);
  const auto bc1 = static_cast<float>(1.0 - std::pow(p.beta1, step));
  s->bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(p.beta2, step)));
  s->neg_step_size = -static_cast<float>(p.lr / static_cast<double>(bc1));
  s->fused_decay = p.weight_decay != 0;
  s->lr_wd = p.lr * p.weight_decay;
  s->decay = static_cast<float>(1.0 - s->lr_wd);
  s->eps_f64 = p.eps;
}

// powf(base, e) correctly rounded: the FP64 power is within 2^-52 of the
// exact one, so rounding it to FP32 gives the correctly rounded result
// except within 2^-28 ulp of a tie.
float PowF32(float base, float e) {
  return static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(e)));
}

// lr32 * wd32, rounded to FP32 as kTorchCudaFusedFp32's kernel takes it.
float FusedF32Product(const AdamWParams& p) {
  return static_cast<float>(p.lr) * static_cast<float>(p.weight_decay);
}

// kTorchCudaFusedFp32 (torch 2.11 on): every argument rounded to FP32 and
// the bias corrections in FP32 from the device's powf, taken here to be
// correctly rounded (tools/gpu_check.sh compares torch's on the GPU).
void SetFusedF32Scalars(const AdamWParams& p, AdamWScalars* s) {
  const auto step = static_cast<float>(p.step);
  const float bc1 = 1.0f - PowF32(static_cast<float>(p.beta1), step);
  s->bc2_sqrt = std::sqrt(1.0f - PowF32(static_cast<float>(p.beta2), step));
  s->neg_step_size = -(static_cast<float>(p.lr) / bc1);
  s->eps = static_cast<float>(p.eps);
  s->fused_decay = static_cast<float>(p.weight_decay) != 0.0f;
  s->lr_wd = FusedF32Product(p);
  s->decay = static_cast<float>(1.0 - s->lr_wd);
}

}  // namespace

std::string AdamWParamsError(const AdamWParams& p) {
  if (!(p.lr >= 0) || !std::isfinite(p.lr)) return Describe("lr", p.lr, "must be finite and >= 0");
  if (!(p.eps >= 0) || !std::isfinite(p.eps)) {
    return Describe("eps", p.eps, "must be finite and >= 0");
  }
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return Describe("beta1", p.beta1, "must be in [0, 1)");
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return Describe("beta2", p.beta2, "must be in [0, 1)");
  if (!std::isfinite(p.weight_decay)) {
    return Describe("weight_decay", p.weight_decay, "must be finite");
  }
  if (p.step < 1) return "AdamW step = " + std::to_string(p.step) + ": must be >= 1";
  if (!(static_cast<float>(1.0 - p.lr * p.weight_decay) > 0.0f)) {
    return Describe("lr * weight_decay", p.lr * p.weight_decay,
                    "must leave a positive decay factor 1 - lr * weight_decay");
  }
  if (p.order == AdamWOrder::kTorchCudaFusedFp32 && !(FusedF32Product(p) < 1.0f)) {
    return Describe("lr * weight_decay", p.lr * p.weight_decay,
                    "must stay below 1 when rounded to FP32 (the FP32 fused kernel's decay)");
  }
  return {};
}

AdamWScalars MakeAdamWScalars(const AdamWParams& p) {
  // Mirrors torch/optim/adamw.py: Python floats are doubles, `beta ** step`
  // with a float step is C pow, and each result becomes an FP32 scalar only
  // when applied to the FP32 tensor.
  const double step = static_cast<double>(p.step);
  const double bias_correction1 = 1.0 - std::pow(p.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(p.beta2, step);
  const double step_size = p.lr / bias_correction1;
  const double bc2_sqrt = std::sqrt(bias_correction2);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  s.neg_step_size = static_cast<float>(-step_size);
  s.bc2_sqrt = static_cast<float>(bc2_sqrt);
  // PyTorch's CUDA division by a CPU scalar multiplies by the scalar's
  // reciprocal, taken in double and then rounded to FP32 (checked against
  // torch 2.11 on an H200: the reciprocal of the FP32 scalar mismatches).
  s.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  s.eps = static_cast<float>(p.eps);
  s.order = p.order;
  s.fused_decay = false;
  s.lr_wd = 0;
  s.eps_f64 = 0;
  if (p.order == AdamWOrder::kTorchCudaFused) SetFusedF64Scalars(p, &s);
  if (p.order == AdamWOrder::kTorchCudaFusedFp32) SetFusedF32Scalars(p, &s);
  return s;
}

void AdamWForward(const float* theta_prev, const float* m, const float* v, size_t n,
                  const AdamWParams& p, float* theta_out) {
  const AdamWScalars s = MakeAdamWScalars(p);
  ParallelFor(n, kAdamWGrain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      theta_out[i] = AdamWForwardElement(theta_prev[i], m[i], v[i], s);
    }
  });
}

void AdamWInvert(const float* theta, const float* m, const float* v, size_t n, const AdamWParams& p,
                 float* prev_out) {
  const AdamWScalars s = MakeAdamWScalars(p);
  ParallelFor(n, kAdamWGrain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) prev_out[i] = AdamWInvertElement(theta[i], m[i], v[i], s);
  });
}

AdamWDetectResult AdamWInvertDetect(const float* theta, const float* m, const float* v, size_t n,
                                    const AdamWParams& p, const AdamWDetectOptions& options,
                                    uint64_t* idx_out, uint16_t* bf16_out) {
  const AdamWScalars s = MakeAdamWScalars(p);
  const bool margin = options.report_near_boundary;
  const uint32_t ulps = options.margin_ulps;
  std::atomic<size_t> near{0};
  auto run = [&](size_t begin, size_t end) {
    size_t k = begin, near_here = 0;
    for (size_t i = begin; i < end; ++i) {
      const AdamWChange c = AdamWClassify(theta[i], m[i], v[i], s, margin, ulps);
      if (c == AdamWChange::kUnchanged) continue;
      idx_out[k] = i;
      bf16_out[k] = Fp32ToBf16Bits(theta[i]);
      ++k;
      near_here += c == AdamWChange::kNearBoundary;
    }
    near.fetch_add(near_here, std::memory_order_relaxed);
    return k - begin;
  };
  auto move = [&](size_t from, size_t to, size_t count) {
    std::memmove(idx_out + to, idx_out + from, count * sizeof(uint64_t));
    std::memmove(bf16_out + to, bf16_out + from, count * sizeof(uint16_t));
  };
  AdamWDetectResult result;
  result.count = internal::ParallelCompact(n, run, move);
  result.near_boundary = near.load();
  return result;
}

size_t AdamWFindChanges(const float* theta, const float* m, const float* v, size_t n,
                        const AdamWParams& p, uint32_t margin_ulps, uint64_t* idx_out,
                        uint16_t* bf16_out) {
  const AdamWScalars s = MakeAdamWScalars(p);
  auto run = [&](size_t begin, size_t end) {
    size_t k = begin;
    for (size_t i = begin; i < end; ++i) {
      if (!AdamWElementKept(theta[i], m[i], v[i], s, margin_ulps)) continue;
      idx_out[k] = i;
      bf16_out[k] = Fp32ToBf16Bits(theta[i]);
      ++k;
    }
    return k - begin;
  };
  auto move = [&](size_t from, size_t to, size_t count) {
    std::memmove(idx_out + to, idx_out + from, count * sizeof(uint64_t));
    std::memmove(bf16_out + to, bf16_out + from, count * sizeof(uint16_t));
  };
  return internal::ParallelCompact(n, run, move);
}

}  // namespace dte::kernels
