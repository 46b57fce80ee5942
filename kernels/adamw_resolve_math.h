// Per-element resolution of the AdamW-inverting publisher: for an element the
// fused detector (AdamWInvertDetect) reported, or the screen
// (sync/publish/internal/engine_screen.h) left undecided, decide exactly what its
// BF16 value was before the step, without any copy of the old weights. Shared
// by the CPU backend and the CUDA one (CudaAdamWFindChanges, kernels/cuda.h).
//
// The forward update x -> AdamWForwardElement(x, m, v) is monotone
// non-decreasing in x (a product with a positive decay, or the fused CUDA
// orders' x - lr*wd*x with lr*wd < 1 in one fused multiply-add, then a
// rounded sum or fused multiply-add; rounding is monotone). So the FP32 values mapping to
// theta form one interval [lo, hi], and the true previous weight lies in it
// whenever theta came from that update. Walking out from the reconstruction
// q one ulp at a time finds lo and hi (a handful of ulps wide in practice;
// wide only when the update dwarfs the weight). If every value of the
// interval rounds to the same BF16 bits, those are the old bits, exactly;
// otherwise (or when the walk gives up, or a value is not finite) the old
// bits are unknown. docs/engine.md gives the error analysis.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/bf16_math.h"
#include "kernels/hd.h"

namespace dte::kernels {

enum class OldBits : uint8_t {
  kUnchanged = 0,  // provably the same BF16 bits as theta: not a change
  kKnown = 1,      // provably `bits`, which differ from theta's
  kUnknown = 2,    // the preimage interval straddles a BF16 boundary (or worse)
};

struct ResolvedOld {
  OldBits state = OldBits::kUnknown;
  uint16_t bits = 0;
};

// How far the walk goes each way before declaring the old bits unknown.
inline constexpr int kMaxPreimageWalk = 32;

// The end of the preimage interval of theta containing q under `forward`
// (x -> theta for this element's m, v), towards +inf (up) or -inf; false if
// it is more than kMaxPreimageWalk ulps away.
template <typename Forward>
DTE_HD bool PreimageEnd(float q, float theta, const Forward& forward, bool up, float* end) {
  const uint32_t target = FloatBits(theta);
  float x = q;
  for (int i = 0; i < kMaxPreimageWalk; ++i) {
    const float y = adamw_internal::StepUlp(x, up);
    if (!IsFiniteBits(FloatBits(y)) || FloatBits(forward(y)) != target) {
      *end = x;
      return true;
    }
    x = y;
  }
  return false;
}

// Classifies from the reconstruction q and the element's forward map.
template <typename Forward>
DTE_HD ResolvedOld ResolveWith(float theta, float q, const Forward& forward) {
  if (!IsFiniteBits(FloatBits(theta)) || !IsFiniteBits(FloatBits(q)) ||
      FloatBits(forward(q)) != FloatBits(theta)) {
    return {};
  }
  float lo = q, hi = q;
  if (!PreimageEnd(q, theta, forward, false, &lo) || !PreimageEnd(q, theta, forward, true, &hi)) {
    return {};
  }
  // BF16 rounding is monotone, so equal ends mean the whole interval agrees
  // (ends of opposite sign never have equal bits).
  const uint16_t a = Fp32ToBf16Bits(lo);
  if (a != Fp32ToBf16Bits(hi)) return {};
  if (a == Fp32ToBf16Bits(theta)) return {OldBits::kUnchanged, a};
  return {OldBits::kKnown, a};
}

namespace adamw_internal {

// WithDecay's callable for ResolveOldBf16: the rounded-update orders'
// forward map with this element's update.
struct ResolveRoundedUpdate {
  float theta, q;
  AddRoundedUpdate add;
  template <typename Decay>
  DTE_HD ResolvedOld operator()(const Decay& decay) const {
    return ResolveWith(theta, q, DecayThenUpdate<Decay, AddRoundedUpdate>{decay, add});
  }
};

}  // namespace adamw_internal

// The old BF16 bits of one element. The forward map is
// AdamWForwardElement with the update computed once.
DTE_HD ResolvedOld ResolveOldBf16(float theta, float m, float v, const AdamWScalars& s) {
  namespace ai = adamw_internal;
  const float q = AdamWInvertElement(theta, m, v, s);
  if (AdamWAddsRoundedUpdate(s.order)) {
    return ai::WithDecay(s, ai::ResolveRoundedUpdate{theta, q, {AdamWRoundedUpdate(m, v, s)}});
  }
  const ai::AddUpdateFma add{s.neg_step_size, rn::Div(m, AdamWDenom(v, s))};
  return ResolveWith(theta, q, ai::DecayThenUpdate<ai::DecayMul, ai::AddUpdateFma>{{s.decay}, add});
}

// True when a publisher must store the element: the fused detector reports it
// (AdamWElementChanged with the near-boundary margin of margin_ulps) and the
// exact resolution does not prove it unchanged. Every element whose BF16 bits
// the step changed is kept; a kept element that did not change is one whose
// old bits cannot be proven (ResolveOldBf16's kUnknown).
DTE_HD bool AdamWElementKept(float theta, float m, float v, const AdamWScalars& s,
                             uint32_t margin_ulps) {
  return AdamWElementChanged(theta, m, v, s, true, margin_ulps) &&
         ResolveOldBf16(theta, m, v, s).state != OldBits::kUnchanged;
}

}  // namespace dte::kernels
