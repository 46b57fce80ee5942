// A rigorous, cheap screen that decides most elements before any AdamW
// inversion: which certainly kept their BF16 bits, and for most of the rest
// what their old bits were.
//
// Stage 1, the unsigned bound. For an element with
// theta = RN(RN(x * decay) + u) (u the update the step added), the true
// previous weight x satisfies |x - theta| <= B with
//   B = (|u| + |theta| * (|1 - decay| + 2^-22 max(decay, 1))) / (decay (1 - 2^-24))
// (one rounding of the sum, relative error <= 2^-24 |theta|; one of the
// product, <= 2^-24 relative; docs/engine.md). The fused CUDA orders' decay
// fma(-lr_wd, x, x) is within 2^-23 + 2^-50 of x * decay (decay =
// fp32(1 - lr_wd)), which the 2^-22 term and the allowance below cover.
// If theta's distance to both BF16 rounding ties of its BF16 value exceeds
// B, every such x rounds to the same BF16 bits: the element did not change
// (CertainlyUnchanged). The bound
// is evaluated in FP32 with a 2^-19 relative and 2^-140 absolute allowance
// for its own rounding. The elements it does not rule out are the
// candidates ("flagged").
//
// Stage 2, the signed estimate, for the candidates only (ScreenOldBits):
// x = (theta - u + e) / decay with |e| a few ulps, so c = RN(RN(theta - u) *
// RN(1 / decay)) is within E = 2^-23 (|u| + |theta|) / decay + 2^-21 |c|
// (+ 2^-140, twice the bound docs/engine.md derives, for decay >= 0.5) of
// x. If c lies farther than E from both ties of its own BF16 cell, that
// cell is x's: the old bits are Fp32ToBf16Bits(c), unchanged or a change,
// proven without any preimage search. Only the candidates with a tie within
// E of c (under 1% of them in practice) are left undecided for the exact
// resolution (kernels/adamw_resolve_math.h).
//
// Neither stage needs a bit-exact model of the update beyond u, which is
// computed exactly as the step computed it (for the fused multiply-add
// orders, |u| within 2^-24, inside the allowances).
//
// The AVX2 and AVX-512 forms first test a cheaper over-estimate of B (no
// square root or division: the fast paths, engine_screen_avx.cc) and
// evaluate B and the signed estimate only for what that does not rule out,
// so every width gives exactly the results of the scalar functions below.
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
  // The vector widths' cheaper over-estimates of the bound (the fast paths,
  // engine_screen_avx.cc), used when `fast`; an element they do not rule
  // out gets the exact CertainlyUnchanged. s is 1/bc2_sqrt, or inv_bc2_sqrt
  // for kTorchCudaSingleTensor.
  float fast_k = 0;    // (1 + 2^-9) |neg_step_size| / s, rounded up
  float fast_k1 = 0;   // k1 (1 + 2^-16), rounded up
  float fast_inv = 0;  // inv (1 + 2^-16), rounded up
  // AVX2's, in units of 2^-16 FP32 ulps of theta:
  float ulp_k = 0;  // 2^16 (1 + 2^-9) |neg_step_size| inv / s, rounded up
  float ulp_c = 0;  // 2^16 (2^24 k1 inv (1 + 2^-10) + 2), rounded up
  bool fast = false;
  // The signed estimate (ScreenOldBits), used when `signed_ok` (decay in
  // [0.5, 2]); otherwise every candidate is left undecided.
  float rdecay = 0;  // RN(1 / decay)
  float est_k = 0;   // 2^-23 inv: the estimate's error per |u| + |theta|
  bool signed_ok = false;
};

ScreenScalars MakeScreenScalars(const kernels::AdamWScalars& s);

// The update of the step for (m, v), as the step computed it (for the
// fused multiply-add orders, the rounded product).
DTE_HD float ScreenUpdate(float m, float v, const kernels::AdamWScalars& s) {
  if (kernels::AdamWAddsRoundedUpdate(s.order)) return kernels::AdamWRoundedUpdate(m, v, s);
  return kernels::rn::Mul(s.neg_step_size, kernels::rn::Div(m, kernels::AdamWDenom(v, s)));
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

// ScreenOldBits' verdict when the signed estimate does not decide.
inline constexpr uint32_t kScreenUndecided = 0x10000;

// For a candidate (an element CertainlyUnchanged does not rule out): its old
// BF16 bits as proven by the signed estimate (equal to Fp32ToBf16Bits(theta)
// when it did not change), or kScreenUndecided. Undecided whenever theta or
// the estimate is NaN, infinite, below 2^-100 or near the top of the range.
DTE_HD uint32_t ScreenOldBits(float theta, float m, float v, const ScreenScalars& c) {
  using kernels::BitsToFloat;
  using kernels::FloatBits;
  namespace rn = kernels::rn;
  if (!c.signed_ok) return kScreenUndecided;
  const uint32_t a_bits = FloatBits(theta) & 0x7FFFFFFFu;
  const float u = ScreenUpdate(m, v, c.s);
  const float est = rn::Mul(rn::Add(theta, -u), c.rdecay);
  const uint32_t e_bits = FloatBits(est) & 0x7FFFFFFFu;
  if (a_bits < 0x0D800000u || a_bits >= 0x7F000000u) return kScreenUndecided;
  if (e_bits < 0x0D800000u || e_bits >= 0x7F000000u) return kScreenUndecided;
  const float a = BitsToFloat(a_bits), ae = BitsToFloat(e_bits);
  const float au = BitsToFloat(FloatBits(u) & 0x7FFFFFFFu);
  const float err =
      rn::Add(rn::Add(rn::Mul(rn::Add(au, a), c.est_k), rn::Mul(ae, 0x1p-21f)), 0x1p-140f);
  const uint32_t base = ((e_bits + 0x7FFFu + ((e_bits >> 16) & 1u)) >> 16) << 16;
  // Exact, as in CertainlyUnchanged.
  const float below = rn::Add(ae, -BitsToFloat(base - 0x8000u));
  const float above = rn::Add(BitsToFloat(base + 0x8000u), -ae);
  if (!(below > err && above > err)) return kScreenUndecided;  // also for a NaN err
  return ((FloatBits(est) >> 16) & 0x8000u) | (base >> 16);
}

// What the screen found in a range: `flagged` candidates (elements
// CertainlyUnchanged does not rule out), of which `kept` were not proven
// unchanged by ScreenOldBits; flagged - kept are the screen's proven false
// positives.
struct ScreenCounts {
  size_t flagged = 0;
  size_t kept = 0;
};

// Room the outputs below need beyond n, for whole-vector stores.
inline constexpr size_t kScreenSlack = 16;

// Screens elements [0, n): writes, in increasing order, the index of each
// kept candidate to idx_out and its ScreenOldBits (old bits, or
// kScreenUndecided) to old_out (both with room for n + kScreenSlack).
// Multi-threaded; vectorized (below), bit-identical to the scalar form.
ScreenCounts ScreenCandidates(const float* theta, const float* m, const float* v, size_t n,
                              const ScreenScalars& c, uint64_t* idx_out, uint32_t* old_out);

// The encoder's fused pass over a range small enough to stay in cache, on
// the calling thread: as ScreenCandidates for [0, n) (n < 2^31) with
// chunk-relative 32-bit indices, and writes kernels::Fp32ToBf16Bits(theta[i])
// to bf16_out[i] for every i.
//
// On x86-64 both functions pick, once per process, the widest of AVX-512,
// AVX2 and SSE2 the CPU supports. Every width performs the same IEEE
// operations (square root, division, multiplication, addition: exactly
// rounded, never contracted) on each element, so results never depend on
// the CPU.
ScreenCounts ScreenAndCast(const float* theta, const float* m, const float* v, size_t n,
                           const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                           uint16_t* bf16_out);

// The vector widths, for tests that check every width the CPU supports
// against the scalar functions.
enum class ScreenIsa : uint8_t { kScalar = 0, kSse2 = 1, kAvx2 = 2, kAvx512 = 3 };

// The widest width this CPU (and build) supports; the one used above.
ScreenIsa BestScreenIsa();

// ScreenAndCast with the given width, which must not exceed BestScreenIsa();
// bf16_out may be null (no cast).
ScreenCounts ScreenAndCastWith(ScreenIsa isa, const float* theta, const float* m, const float* v,
                               size_t n, const ScreenScalars& c, uint32_t* idx_out,
                               uint32_t* old_out, uint16_t* bf16_out);

// u_out[i] = ScreenUpdate(m[i], v[i], c.s) for i in [0, n), computed by the
// given width's vector form (the one its bound and signed estimate use),
// for tests; isa must not exceed BestScreenIsa().
void ScreenUpdatesWith(ScreenIsa isa, const float* m, const float* v, size_t n,
                       const ScreenScalars& c, float* u_out);

}  // namespace dte::internal
