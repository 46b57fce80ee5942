// Per-element AdamW parameter update and its inversion, shared by the CPU and
// CUDA backends. Host-side setup (AdamWParams -> AdamWScalars) lives in
// kernels/adamw.h; the derivation is in docs/kernels.md.
//
// PyTorch's non-fused AdamW (amsgrad=False, maximize=False) updates one FP32
// parameter as
//   p     = theta_prev * decay                      decay = fp32(1 - lr*wd)
//   denom = sqrt(v) / bc2_sqrt + eps                v: exp_avg_sq after the step
//   theta = p + (-step_size) * m / denom            m: exp_avg after the step
// with every scalar computed in double by Python and rounded to FP32 when
// applied. The association and rounding of the last two lines differ between
// PyTorch's CPU and CUDA kernels; AdamWOrder selects which one to mirror.
//
// Inversion: given theta, m and v after the step, AdamWInvertElement returns
// a value q with AdamWForwardElement(q, m, v) == theta whenever such a q
// exists (it does for inputs a matching PyTorch step produced). It undoes the
// update line from theta - update (or, failing that, the exact residual) and
// then the decay, each time moving by up to four FP32 ulps until the forward
// map reproduces theta exactly. Where several FP32 values map to the same
// theta, q may differ from the true previous value; against torch 1.13 CPU
// 89-99.9% of weights came back bit-exact and the rest within 2 ulps of
// max(|theta|, |prev|), and no BF16 change was misjudged (docs/kernels.md).
// Only kTorchCpu has been checked against PyTorch: the CUDA orders are
// modelled on PyTorch's CUDA kernels and were never run against them.
//
// Every operation is an explicitly rounded FP32 operation (rn::Mul, ...) so
// nvcc's default multiply-add contraction cannot alter results; the kernels
// library is also compiled with -ffp-contract=off on the host.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/bf16_math.h"
#include "kernels/hd.h"
#include "kernels/rn_math.h"

namespace dte::kernels {

// Which PyTorch kernel's operation order produced theta.
enum class AdamWOrder : uint8_t {
  // torch CPU tensors, foreach=False or True (both run the same CPU kernels):
  // denom = sqrt(v) / bc2_sqrt + eps; theta = p + ((-step_size) * m) / denom.
  kTorchCpu = 0,
  // torch CUDA tensors, foreach=True (the default on GPUs): division by the
  // scalar is a true division; the final line is one fused multiply-add,
  // theta = fma(-step_size, m / denom, p).
  kTorchCudaForeach = 1,
  // torch CUDA tensors, foreach=False: dividing by the scalar bc2_sqrt is a
  // multiplication by its reciprocal (taken in double, rounded to FP32);
  // theta as for kTorchCudaForeach.
  kTorchCudaSingleTensor = 2,
};

// The FP32 scalars one step applies, as PyTorch rounds them.
struct AdamWScalars {
  float decay;          // fp32(1 - lr * weight_decay)
  float neg_step_size;  // fp32(-(lr / (1 - beta1^step)))
  float bc2_sqrt;       // fp32(sqrt(1 - beta2^step))
  float inv_bc2_sqrt;   // fp32(1 / sqrt(1 - beta2^step)) (kTorchCudaSingleTensor only)
  float eps;            // fp32(eps)
  AdamWOrder order;
};

namespace adamw_internal {

// The position of finite x in the order of FP32 values with -0 just below
// +0 (keys -1 and 0). Every order's forward map is monotone non-decreasing
// in this order, and BF16 rounding keeps -0 and +0 apart (0x8000, 0x0000),
// so the walks below visit both zeros.
DTE_HD int32_t OrderKey(float x) {
  const uint32_t u = FloatBits(x);
  return (u >> 31) != 0 ? -static_cast<int32_t>(u & 0x7FFFFFFFu) - 1 : static_cast<int32_t>(u);
}

// The FP32 neighbour of finite x towards +inf (up) or -inf (!up) in that
// order: the neighbour of +0 below is -0.
DTE_HD float StepUlp(float x, bool up) {
  const int32_t k = OrderKey(x) + (up ? 1 : -1);
  return BitsToFloat(k >= 0 ? static_cast<uint32_t>(k)
                            : 0x80000000u | static_cast<uint32_t>(-(k + 1)));
}

// Moves x by ulps until forward(x) has target's bits; forward must be
// monotone non-decreasing. Returns x unchanged if that takes more than
// kMaxSteps.
template <typename Forward>
DTE_HD float RefinePreimage(float x, float target, const Forward& forward) {
  constexpr int kMaxSteps = 4;
  const uint32_t want = FloatBits(target);
  float y = x;
  for (int i = 0; i < kMaxSteps; ++i) {
    const float f = forward(y);
    if (FloatBits(f) == want) return y;
    if (!IsFiniteBits(FloatBits(f)) || !IsFiniteBits(FloatBits(y))) break;
    y = StepUlp(y, OrderKey(f) < OrderKey(target));
  }
  return FloatBits(forward(y)) == want ? y : x;
}

// p -> theta, the second line of the update, for each order.
struct AddUpdateCpu {
  float u;
  DTE_HD float operator()(float p) const { return rn::Add(p, u); }
};

struct AddUpdateFma {
  float neg_step_size;
  float q;
  DTE_HD float operator()(float p) const { return rn::Fma(neg_step_size, q, p); }
};

template <typename AddUpdate>
struct DecayThenUpdate {
  float decay;
  AddUpdate add_update;
  DTE_HD float operator()(float x) const { return add_update(rn::Mul(x, decay)); }
};

// Undoes add_update, starting from the rounded algebraic inverse p_round or,
// if no preimage is within reach of it, from the exact residual p_exact; then
// undoes the decay.
template <typename AddUpdate>
DTE_HD float Invert(float theta, float p_round, float p_exact, float decay,
                    const AddUpdate& add_update) {
  float p = RefinePreimage(p_round, theta, add_update);
  if (FloatBits(add_update(p)) != FloatBits(theta)) {
    p = RefinePreimage(p_exact, theta, add_update);
  }
  // For RL-sized lr * wd the decay often rounds to exactly 1.0f.
  if (decay == 1.0f) return p;
  // Several p may satisfy the first step and not all are products x * decay
  // (just below a power of two the products skip every other value), so the
  // second step refines against the whole forward map.
  return RefinePreimage(rn::Div(p, decay), theta, DecayThenUpdate<AddUpdate>{decay, add_update});
}

}  // namespace adamw_internal

// sqrt(v) / bc2_sqrt + eps, rounded as `s.order` rounds it.
DTE_HD float AdamWDenom(float v, const AdamWScalars& s) {
  const float r = rn::Sqrt(v);
  const float scaled = s.order == AdamWOrder::kTorchCudaSingleTensor ? rn::Mul(r, s.inv_bc2_sqrt)
                                                                     : rn::Div(r, s.bc2_sqrt);
  return rn::Add(scaled, s.eps);
}

// theta_prev -> theta: one parameter update, bit-identical to PyTorch's for
// the same m, v (the moments after the step) and order.
DTE_HD float AdamWForwardElement(float theta_prev, float m, float v, const AdamWScalars& s) {
  const float p = rn::Mul(theta_prev, s.decay);
  const float denom = AdamWDenom(v, s);
  if (s.order == AdamWOrder::kTorchCpu)
    return rn::Add(p, rn::Div(rn::Mul(s.neg_step_size, m), denom));
  return rn::Fma(s.neg_step_size, rn::Div(m, denom), p);
}

// theta -> an estimate of theta_prev (see the header comment for the
// guarantee). NaN and infinite inputs propagate without refinement.
DTE_HD float AdamWInvertElement(float theta, float m, float v, const AdamWScalars& s) {
  const float denom = AdamWDenom(v, s);
  if (s.order == AdamWOrder::kTorchCpu) {
    const float u = rn::Div(rn::Mul(s.neg_step_size, m), denom);
    const float p0 = rn::Add(theta, -u);
    return adamw_internal::Invert(theta, p0, p0, s.decay, adamw_internal::AddUpdateCpu{u});
  }
  const float q = rn::Div(m, denom);
  // Prefer theta - RN(step * q) to the exact residual: when the previous value
  // is tiny next to the update (a zero-initialized weight) a whole interval of
  // values are preimages, and this start picks the round one, 0 for a weight
  // that was exactly 0.
  const float p_round = rn::Add(theta, -rn::Mul(s.neg_step_size, q));
  const float p_exact = rn::Fma(-s.neg_step_size, q, theta);
  return adamw_internal::Invert(theta, p_round, p_exact, s.decay,
                                adamw_internal::AddUpdateFma{s.neg_step_size, q});
}

// True when x lies within margin_ulps FP32 ulps of a BF16 rounding boundary
// (a value whose low 16 bits are 0x8000, halfway between two BF16 values, or
// the boundary between -0 and +0, whose BF16 bits differ), so an error of
// that many ulps in x could change Fp32ToBf16Bits(x). In relative terms
// margin_ulps ulps are between margin_ulps * 2^-24 and margin_ulps * 2^-23
// of |x|. NaN and +-inf count as near.
DTE_HD bool NearBf16Boundary(float x, uint32_t margin_ulps) {
  const uint32_t u = FloatBits(x);
  if (!IsFiniteBits(u)) return true;
  if ((u & 0x7FFFFFFFu) <= margin_ulps) return true;
  const uint32_t low = u & 0xFFFFu;
  const uint32_t distance = low >= 0x8000u ? low - 0x8000u : 0x8000u - low;
  return distance <= margin_ulps;
}

// The fused detector's per-element verdict.
enum class AdamWChange : uint8_t {
  kUnchanged = 0,
  kChanged = 1,       // BF16 of theta differs from BF16 of the reconstruction
  kNearBoundary = 2,  // equal BF16, but the reconstruction is too close to a
                      // boundary (or theta is not finite) to be sure
};

// kNearBoundary is only returned with use_margin.
DTE_HD AdamWChange AdamWClassify(float theta, float m, float v, const AdamWScalars& s,
                                 bool use_margin, uint32_t margin_ulps) {
  const float prev = AdamWInvertElement(theta, m, v, s);
  if (Fp32ToBf16Bits(prev) != Fp32ToBf16Bits(theta)) return AdamWChange::kChanged;
  if (use_margin && (NearBf16Boundary(prev, margin_ulps) || !IsFiniteBits(FloatBits(theta)))) {
    return AdamWChange::kNearBoundary;
  }
  return AdamWChange::kUnchanged;
}

// True when the fused detector reports the element.
DTE_HD bool AdamWElementChanged(float theta, float m, float v, const AdamWScalars& s,
                                bool use_margin, uint32_t margin_ulps) {
  return AdamWClassify(theta, m, v, s, use_margin, margin_ulps) != AdamWChange::kUnchanged;
}

}  // namespace dte::kernels
