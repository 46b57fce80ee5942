// A rigorous, cheap screen that rules out most elements before any AdamW
// inversion: elements that certainly kept their BF16 bits.
//
// For an element with theta = RN(RN(x * decay) + u) (u the update the step
// added), the true previous weight x satisfies |x - theta| <= B with
//   B = (|u| + |theta| * (|1 - decay| + 2^-22 max(decay, 1))) / (decay (1 - 2^-24))
// (one rounding of the sum, relative error <= 2^-24 |theta|; one of the
// product, <= 2^-24 relative; docs/engine.md). If theta's distance to both
// BF16 rounding ties of its BF16 value exceeds B, every such x rounds to the
// same BF16 bits: the element did not change. The bound is evaluated in FP32
// with a 2^-19 relative and 2^-140 absolute allowance for its own rounding.
// It needs no preimage search and no bit-exact model of the update beyond u,
// which is computed exactly as the step computed it (for the fused
// multiply-add orders, |u| within 2^-23, inside the allowance).
//
// The AVX2 and AVX-512 forms first test a cheaper over-estimate of B (no
// square root or division; engine_screen.cc, "fast path") and evaluate B
// itself only for what that does not rule out, so they rule out exactly the
// elements CertainlyUnchanged rules out.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/bf16_math.h"
#include "kernels/hd.h"

namespace dte::internal {

struct ScreenScalars {
  kernels::AdamWScalars s;
  float k1 = 0;          // |1 - decay| + 2^-22 max(decay, 1), rounded up
  float inv = 0;         // (1 + 2^-19) / (decay (1 - 2^-24)), rounded up
  bool enabled = false;  // decay in (0, 2]; otherwise every element is a candidate
  // The vector widths' cheaper over-estimate of the bound (engine_screen.cc,
  // above ScreenAvx2), used when `fast`; an element it does not rule out
  // gets the exact CertainlyUnchanged. s is 1/bc2_sqrt, or inv_bc2_sqrt for
  // kTorchCudaSingleTensor.
  float fast_k = 0;    // (1 + 2^-9) |neg_step_size| / s, rounded up
  float fast_k1 = 0;   // k1 (1 + 2^-16), rounded up
  float fast_inv = 0;  // inv (1 + 2^-16), rounded up
  bool fast = false;
};

ScreenScalars MakeScreenScalars(const kernels::AdamWScalars& s);

// |update| of the step for (m, v), as the step computed it.
DTE_HD float ScreenUpdate(float m, float v, const kernels::AdamWScalars& s) {
  const float denom = kernels::AdamWDenom(v, s);
  if (s.order == kernels::AdamWOrder::kTorchCpu) {
    return kernels::rn::Div(kernels::rn::Mul(s.neg_step_size, m), denom);
  }
  return kernels::rn::Mul(s.neg_step_size, kernels::rn::Div(m, denom));
}

// True when the element certainly kept its BF16 bits (see above). NaN and
// infinite values, weights below 2^-100 or near the top of the range are
// never ruled out.
DTE_HD bool CertainlyUnchanged(float theta, float m, float v, const ScreenScalars& c) {
  using kernels::BitsToFloat;
  using kernels::FloatBits;
  if (!c.enabled) return false;
  const uint32_t a_bits = FloatBits(theta) & 0x7FFFFFFFu;
  if (a_bits < 0x0D800000u || a_bits >= 0x7F000000u) return false;
  const float a = BitsToFloat(a_bits);
  const float u = ScreenUpdate(m, v, c.s);
  const float au = BitsToFloat(FloatBits(u) & 0x7FFFFFFFu);
  const float bound = kernels::rn::Add(
      kernels::rn::Mul(kernels::rn::Add(au, kernels::rn::Mul(a, c.k1)), c.inv), 0x1p-140f);
  const uint32_t base = ((a_bits + 0x7FFFu + ((a_bits >> 16) & 1u)) >> 16) << 16;
  // Both differences are exact (Sterbenz): the ties lie within a factor 2 of a.
  const float below = kernels::rn::Add(a, -BitsToFloat(base - 0x8000u));
  const float above = kernels::rn::Add(BitsToFloat(base + 0x8000u), -a);
  return below > bound && above > bound;  // false for a NaN bound
}

// Writes, in increasing order, the indices i in [0, n) that are not
// CertainlyUnchanged to idx_out (room for n) and returns their number.
// Multi-threaded; vectorized (below), bit-identical to the scalar form.
size_t ScreenCandidates(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint64_t* idx_out);

// The encoder's fused pass over a range small enough to stay in cache, on
// the calling thread: writes the candidates of [0, n) (n < 2^32) as for
// ScreenCandidates to idx_out (room for n) and returns their number, and
// writes kernels::Fp32ToBf16Bits(theta[i]) to bf16_out[i] for every i.
//
// On x86-64 both functions pick, once per process, the widest of AVX-512,
// AVX2 and SSE2 the CPU supports. Every width performs the same IEEE
// operations (square root, division, multiplication, addition: exactly
// rounded, never contracted) on each element, so results never depend on
// the CPU.
size_t ScreenAndCast(const float* theta, const float* m, const float* v, size_t n,
                     const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out);

// The vector widths, for tests that check every width the CPU supports
// against CertainlyUnchanged.
enum class ScreenIsa : uint8_t { kScalar = 0, kSse2 = 1, kAvx2 = 2, kAvx512 = 3 };

// The widest width this CPU (and build) supports; the one used above.
ScreenIsa BestScreenIsa();

// ScreenAndCast with the given width, which must not exceed BestScreenIsa();
// bf16_out may be null (no cast).
size_t ScreenAndCastWith(ScreenIsa isa, const float* theta, const float* m, const float* v,
                         size_t n, const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out);

}  // namespace dte::internal
