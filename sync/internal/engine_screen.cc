#include "sync/internal/engine_screen.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/parallel.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <immintrin.h>
#define DTE_SCREEN_X86 1
#endif

namespace dte::internal {
namespace {

// Fixed sub-ranges, so results do not depend on the thread count.
constexpr size_t kScreenChunk = size_t{1} << 16;
// ScreenCandidates screens this many elements per ScreenAndCast call.
constexpr size_t kScreenSub = size_t{1} << 12;

float RoundUp(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f : std::nextafter(f, INFINITY);
}

// Elements [i, n) one at a time; k candidates so far. Returns the new count.
size_t ScreenScalar(const float* theta, const float* m, const float* v, size_t i, size_t n,
                    const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out, size_t k) {
  for (; i < n; ++i) {
    if (bf16_out != nullptr) bf16_out[i] = kernels::Fp32ToBf16Bits(theta[i]);
    if (!CertainlyUnchanged(theta[i], m[i], v[i], c)) idx_out[k++] = static_cast<uint32_t>(i);
  }
  return k;
}

#if defined(DTE_SCREEN_X86)
// Appends i0 + (each set bit of keep) to idx_out[k...]; returns the new count.
inline size_t Emit(uint32_t keep, size_t i0, uint32_t* idx_out, size_t k) {
  for (; keep != 0; keep &= keep - 1)
    idx_out[k++] = static_cast<uint32_t>(i0) + static_cast<uint32_t>(__builtin_ctz(keep));
  return k;
}

// Each width below performs CertainlyUnchanged's operations lane by lane, in
// the same order, and Fp32ToBf16Bits' integer steps.

size_t ScreenSse2(const float* theta, const float* m, const float* v, size_t n,
                  const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out) {
  const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF), one = _mm_set1_epi32(1);
  const bool cpu = c.s.order == kernels::AdamWOrder::kTorchCpu;
  const bool mul_bc2 = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor;
  size_t i = 0, k = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 t = _mm_loadu_ps(theta + i), mm = _mm_loadu_ps(m + i), vv = _mm_loadu_ps(v + i);
    const __m128i u_bits = _mm_castps_si128(t);
    const __m128i a_bits = _mm_and_si128(u_bits, abs_mask);
    if (bf16_out != nullptr) {
      const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u_bits, 16), one);
      __m128i r =
          _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u_bits, _mm_set1_epi32(0x7FFF)), lsb), 16);
      const __m128i nan = _mm_cmpgt_epi32(a_bits, _mm_set1_epi32(0x7F800000));
      r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7FC0)));
      r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);  // sign-extend, so the pack is exact
      _mm_storel_epi64(reinterpret_cast<__m128i*>(bf16_out + i), _mm_packs_epi32(r, r));
    }
    const __m128 a = _mm_castsi128_ps(a_bits);
    const __m128 root = _mm_sqrt_ps(vv);
    const __m128 scaled = mul_bc2 ? _mm_mul_ps(root, _mm_set1_ps(c.s.inv_bc2_sqrt))
                                  : _mm_div_ps(root, _mm_set1_ps(c.s.bc2_sqrt));
    const __m128 denom = _mm_add_ps(scaled, _mm_set1_ps(c.s.eps));
    const __m128 nss = _mm_set1_ps(c.s.neg_step_size);
    const __m128 u =
        cpu ? _mm_div_ps(_mm_mul_ps(nss, mm), denom) : _mm_mul_ps(nss, _mm_div_ps(mm, denom));
    const __m128 au = _mm_and_ps(u, _mm_castsi128_ps(abs_mask));
    const __m128 bound =
        _mm_add_ps(_mm_mul_ps(_mm_add_ps(au, _mm_mul_ps(a, _mm_set1_ps(c.k1))), _mm_set1_ps(c.inv)),
                   _mm_set1_ps(0x1p-140f));
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(a_bits, 16), one);
    const __m128i base = _mm_slli_epi32(
        _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(a_bits, _mm_set1_epi32(0x7FFF)), lsb), 16), 16);
    const __m128 lo = _mm_castsi128_ps(_mm_sub_epi32(base, _mm_set1_epi32(0x8000)));
    const __m128 hi = _mm_castsi128_ps(_mm_add_epi32(base, _mm_set1_epi32(0x8000)));
    const __m128 ok =
        _mm_and_ps(_mm_cmpgt_ps(_mm_sub_ps(a, lo), bound), _mm_cmpgt_ps(_mm_sub_ps(hi, a), bound));
    // a_bits is non-negative as a signed integer, so signed compares work.
    const __m128i in_range = _mm_and_si128(_mm_cmpgt_epi32(a_bits, _mm_set1_epi32(0x0D7FFFFF)),
                                           _mm_cmplt_epi32(a_bits, _mm_set1_epi32(0x7F000000)));
    const int unchanged = _mm_movemask_ps(_mm_and_ps(ok, _mm_castsi128_ps(in_range)));
    k = Emit(~static_cast<uint32_t>(unchanged) & 0xFu, i, idx_out, k);
  }
  return ScreenScalar(theta, m, v, i, n, c, idx_out, bf16_out, k);
}

// The fast path of the wider widths, lane by lane: the bound with the
// update's magnitude over-estimated from a reciprocal square root estimate
// (relative error below 2^-11 on every x86 CPU: 1.5 * 2^-12 for rsqrtps,
// 2^-14 for vrsqrt14ps) instead of a square root and two divisions,
//   B' = RN(RN(RN(RN(RN(|m| fast_k) r) + RN(a fast_k1)) fast_inv) + 2^-139).
// Where MakeScreenScalars set `fast` (decay >= 0.5, eps >= 0,
// 2^-60 <= |neg_step_size| <= 1, s >= 1) and for lanes with a in range,
// |m| >= 2^-60 and v a positive normal number, every intermediate of both
// bounds is normal or within 2^-150 (absolute) of its exact value, and
//   |u| <= |neg_step_size m| / (s sqrt(v)) (1 + 2^-24)^5 + 2^-149
// (the denominator only grows with eps); with fast_k r >= (1 + 2^-9)
// (1 - 2^-11) |neg_step_size| / (s sqrt(v)) and the 2^-16 margins on k1 and
// inv, B' exceeds CertainlyUnchanged's FP32 bound B by far more than their
// few roundings (2^-139 - 2^-140 covers the absolute terms). So a lane that
// passes with B' passes with B: it is ruled out exactly when
// CertainlyUnchanged rules it out. The lanes not ruled out this way get the
// exact bound, lane for lane CertainlyUnchanged: AVX2 re-evaluates the
// whole vector, AVX-512 collects them and confirms 16 at a time
// (ConfirmAvx512). NaN anywhere fails the ordered compares.

__attribute__((target("avx2"))) size_t ScreenAvx2(const float* theta, const float* m,
                                                  const float* v, size_t n, const ScreenScalars& c,
                                                  uint32_t* idx_out, uint16_t* bf16_out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), one = _mm256_set1_epi32(1);
  size_t i = 0, k = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_loadu_ps(theta + i), mm = _mm256_loadu_ps(m + i);
    const __m256 vv = _mm256_loadu_ps(v + i);
    const __m256i u_bits = _mm256_castps_si256(t);
    const __m256i a_bits = _mm256_and_si256(u_bits, abs_mask);
    if (bf16_out != nullptr) {
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u_bits, 16), one);
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u_bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      const __m256i nan = _mm256_cmpgt_epi32(a_bits, _mm256_set1_epi32(0x7F800000));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
      r = _mm256_srai_epi32(_mm256_slli_epi32(r, 16), 16);  // sign-extend: exact pack
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bf16_out + i),
                       _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    const __m256 a = _mm256_castsi256_ps(a_bits);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a_bits, 16), one);
    const __m256i base = _mm256_slli_epi32(
        _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(a_bits, _mm256_set1_epi32(0x7FFF)), lsb), 16),
        16);
    const __m256 below =
        _mm256_sub_ps(a, _mm256_castsi256_ps(_mm256_sub_epi32(base, _mm256_set1_epi32(0x8000))));
    const __m256 above =
        _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(base, _mm256_set1_epi32(0x8000))), a);
    __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(a_bits, _mm256_set1_epi32(0x0D7FFFFF)),
                                  _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F000000), a_bits));
    if (c.fast) {
      const __m256i m_abs = _mm256_and_si256(_mm256_castps_si256(mm), abs_mask);
      const __m256i v_bits = _mm256_castps_si256(vv);
      __m256i lane_ok =
          _mm256_and_si256(ok, _mm256_cmpgt_epi32(m_abs, _mm256_set1_epi32(0x217FFFFF)));
      lane_ok =
          _mm256_and_si256(lane_ok, _mm256_cmpgt_epi32(v_bits, _mm256_set1_epi32(0x007FFFFF)));
      lane_ok =
          _mm256_and_si256(lane_ok, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), v_bits));
      const __m256 au = _mm256_mul_ps(
          _mm256_mul_ps(_mm256_castsi256_ps(m_abs), _mm256_set1_ps(c.fast_k)), _mm256_rsqrt_ps(vv));
      const __m256 bound = _mm256_add_ps(
          _mm256_mul_ps(_mm256_add_ps(au, _mm256_mul_ps(a, _mm256_set1_ps(c.fast_k1))),
                        _mm256_set1_ps(c.fast_inv)),
          _mm256_set1_ps(0x1p-139f));
      const __m256 sure = _mm256_and_ps(_mm256_cmp_ps(below, bound, _CMP_GT_OQ),
                                        _mm256_cmp_ps(above, bound, _CMP_GT_OQ));
      if (_mm256_movemask_ps(_mm256_and_ps(sure, _mm256_castsi256_ps(lane_ok))) == 0xFF) continue;
    }
    const __m256 root = _mm256_sqrt_ps(vv);
    const __m256 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                              ? _mm256_mul_ps(root, _mm256_set1_ps(c.s.inv_bc2_sqrt))
                              : _mm256_div_ps(root, _mm256_set1_ps(c.s.bc2_sqrt));
    const __m256 denom = _mm256_add_ps(scaled, _mm256_set1_ps(c.s.eps));
    const __m256 nss = _mm256_set1_ps(c.s.neg_step_size);
    const __m256 u = c.s.order == kernels::AdamWOrder::kTorchCpu
                         ? _mm256_div_ps(_mm256_mul_ps(nss, mm), denom)
                         : _mm256_mul_ps(nss, _mm256_div_ps(mm, denom));
    const __m256 au = _mm256_and_ps(u, _mm256_castsi256_ps(abs_mask));
    const __m256 bound =
        _mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(au, _mm256_mul_ps(a, _mm256_set1_ps(c.k1))),
                                    _mm256_set1_ps(c.inv)),
                      _mm256_set1_ps(0x1p-140f));
    const __m256 sure = _mm256_and_ps(_mm256_cmp_ps(below, bound, _CMP_GT_OQ),
                                      _mm256_cmp_ps(above, bound, _CMP_GT_OQ));
    const int unchanged = _mm256_movemask_ps(_mm256_and_ps(sure, _mm256_castsi256_ps(ok)));
    k = Emit(~static_cast<uint32_t>(unchanged) & 0xFFu, i, idx_out, k);
  }
  return ScreenScalar(theta, m, v, i, n, c, idx_out, bf16_out, k);
}

#define DTE_AVX512 __attribute__((target("avx512f")))
// The maskz forms below: GCC 12's unmasked ones trip -Wmaybe-uninitialized.
constexpr __mmask16 kAll16 = 0xFFFF;

// theta's distances to the BF16 ties around it, and whether |theta| is in
// CertainlyUnchanged's range (the lanes of `ok`).
struct Ties16 {
  __m512 a, below, above;
  __mmask16 ok;
};

DTE_AVX512 inline Ties16 TiesOf(__m512 t) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i a_bits = _mm512_and_si512(_mm512_castps_si512(t), _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 a = _mm512_castsi512_ps(a_bits);
  const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll16, a_bits, 16), one);
  const __m512i base = _mm512_maskz_slli_epi32(
      kAll16,
      _mm512_maskz_srli_epi32(
          kAll16, _mm512_add_epi32(_mm512_add_epi32(a_bits, _mm512_set1_epi32(0x7FFF)), lsb), 16),
      16);
  Ties16 r;
  r.a = a;
  r.below =
      _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_sub_epi32(base, _mm512_set1_epi32(0x8000))));
  r.above =
      _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(base, _mm512_set1_epi32(0x8000))), a);
  r.ok = _mm512_cmpgt_epi32_mask(a_bits, _mm512_set1_epi32(0x0D7FFFFF));
  r.ok &= _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F000000), a_bits);
  return r;
}

// CertainlyUnchanged of 16 lanes.
DTE_AVX512 inline __mmask16 ExactUnchanged16(__m512 t, __m512 mm, __m512 vv,
                                             const ScreenScalars& c) {
  const Ties16 e = TiesOf(t);
  const __m512 root = _mm512_maskz_sqrt_ps(kAll16, vv);
  const __m512 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                            ? _mm512_mul_ps(root, _mm512_set1_ps(c.s.inv_bc2_sqrt))
                            : _mm512_div_ps(root, _mm512_set1_ps(c.s.bc2_sqrt));
  const __m512 denom = _mm512_add_ps(scaled, _mm512_set1_ps(c.s.eps));
  const __m512 nss = _mm512_set1_ps(c.s.neg_step_size);
  const __m512 u = c.s.order == kernels::AdamWOrder::kTorchCpu
                       ? _mm512_div_ps(_mm512_mul_ps(nss, mm), denom)
                       : _mm512_mul_ps(nss, _mm512_div_ps(mm, denom));
  const __m512 au =
      _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 bound =
      _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(au, _mm512_mul_ps(e.a, _mm512_set1_ps(c.k1))),
                                  _mm512_set1_ps(c.inv)),
                    _mm512_set1_ps(0x1p-140f));
  __mmask16 ok = e.ok & _mm512_cmp_ps_mask(e.below, bound, _CMP_GT_OQ);
  return ok & _mm512_cmp_ps_mask(e.above, bound, _CMP_GT_OQ);
}

// The fast path's verdict for 16 lanes: set where certainly unchanged.
DTE_AVX512 inline __mmask16 FastUnchanged16(__m512 t, __m512 mm, __m512 vv,
                                            const ScreenScalars& c) {
  const Ties16 e = TiesOf(t);
  const __m512i m_abs = _mm512_and_si512(_mm512_castps_si512(mm), _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i v_bits = _mm512_castps_si512(vv);
  __mmask16 sure = e.ok & _mm512_cmpgt_epi32_mask(m_abs, _mm512_set1_epi32(0x217FFFFF));
  sure &= _mm512_cmpgt_epi32_mask(v_bits, _mm512_set1_epi32(0x007FFFFF));
  sure &= _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7F800000), v_bits);
  const __m512 au =
      _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(m_abs), _mm512_set1_ps(c.fast_k)),
                    _mm512_maskz_rsqrt14_ps(kAll16, vv));
  const __m512 bound =
      _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(au, _mm512_mul_ps(e.a, _mm512_set1_ps(c.fast_k1))),
                                  _mm512_set1_ps(c.fast_inv)),
                    _mm512_set1_ps(0x1p-139f));
  sure &= _mm512_cmp_ps_mask(e.below, bound, _CMP_GT_OQ);
  return sure & _mm512_cmp_ps_mask(e.above, bound, _CMP_GT_OQ);
}

// Writes the indices i0 + lane of the lanes not in `unchanged` to
// idx_out[k...] (16 slots must be writable there); the new count.
DTE_AVX512 inline size_t Compress16(__mmask16 unchanged, size_t i0, uint32_t* idx_out, size_t k) {
  const __mmask16 keep = static_cast<__mmask16>(~unchanged);
  const __m512i lanes =
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i0)),
                       _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  _mm512_storeu_si512(idx_out + k, _mm512_maskz_compress_epi32(keep, lanes));
  return k + static_cast<size_t>(__builtin_popcount(keep));
}

// Filters the pending indices idx_out[0, k) (increasing) through
// ExactUnchanged16, in place and in order; the number left.
DTE_AVX512 size_t ConfirmAvx512(const float* theta, const float* m, const float* v,
                                const ScreenScalars& c, uint32_t* idx_out, size_t k) {
  size_t out = 0;
  for (size_t j = 0; j < k; j += 16) {
    const __mmask16 live = static_cast<__mmask16>(k - j >= 16 ? 0xFFFFu : (1u << (k - j)) - 1);
    const __m512i idx = _mm512_maskz_loadu_epi32(live, idx_out + j);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 t = _mm512_mask_i32gather_ps(zero, live, idx, theta, 4);
    const __m512 mm = _mm512_mask_i32gather_ps(zero, live, idx, m, 4);
    const __m512 vv = _mm512_mask_i32gather_ps(zero, live, idx, v, 4);
    const __mmask16 keep = live & static_cast<__mmask16>(~ExactUnchanged16(t, mm, vv, c));
    // out <= j: the compressed store never overtakes the pending ones.
    _mm512_mask_storeu_epi32(idx_out + out,
                             static_cast<__mmask16>((1u << __builtin_popcount(keep)) - 1),
                             _mm512_maskz_compress_epi32(keep, idx));
    out += static_cast<size_t>(__builtin_popcount(keep));
  }
  return out;
}

// With `fast`, every vector takes the fast path; the lanes it does not rule
// out are collected (increasing) and then confirmed with the exact bound 16
// at a time, so the costly square root and divisions run on ~3% of the
// lanes. Indices must fit in int32 (the gathers).
DTE_AVX512 size_t ScreenAvx512(const float* theta, const float* m, const float* v, size_t n,
                               const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out) {
  const __m512i one = _mm512_set1_epi32(1);
  size_t i = 0, k = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 t = _mm512_loadu_ps(theta + i), mm = _mm512_loadu_ps(m + i);
    const __m512 vv = _mm512_loadu_ps(v + i);
    if (bf16_out != nullptr) {
      const __m512i u_bits = _mm512_castps_si512(t);
      const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(kAll16, u_bits, 16), one);
      __m512i r = _mm512_maskz_srli_epi32(
          kAll16, _mm512_add_epi32(_mm512_add_epi32(u_bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
      const __mmask16 nan = _mm512_cmpgt_epi32_mask(
          _mm512_and_si512(u_bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
      r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16_out + i),
                          _mm512_maskz_cvtepi32_epi16(kAll16, r));
    }
    // k <= i, so the 16 slots at k are within idx_out's n.
    k = Compress16(c.fast ? FastUnchanged16(t, mm, vv, c) : ExactUnchanged16(t, mm, vv, c), i,
                   idx_out, k);
  }
  if (c.fast) k = ConfirmAvx512(theta, m, v, c, idx_out, k);
  return ScreenScalar(theta, m, v, i, n, c, idx_out, bf16_out, k);
}
#undef DTE_AVX512
#endif  // DTE_SCREEN_X86

ScreenIsa DetectIsa() {
#if defined(DTE_SCREEN_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return ScreenIsa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return ScreenIsa::kAvx2;
  return ScreenIsa::kSse2;
#else
  return ScreenIsa::kScalar;
#endif
}

}  // namespace

ScreenScalars MakeScreenScalars(const kernels::AdamWScalars& s) {
  ScreenScalars c;
  c.s = s;
  const double d = s.decay;
  c.enabled = d > 0 && d <= 2;
  if (!c.enabled) return c;
  c.k1 = RoundUp(std::abs(1.0 - d) + std::ldexp(std::max(d, 1.0), -22));
  c.inv = RoundUp((1.0 + std::ldexp(1.0, -19)) / (d * (1.0 - std::ldexp(1.0, -24))));
  // The fast path's preconditions (above ScreenAvx2); else only the exact bound.
  const double step = std::abs(static_cast<double>(s.neg_step_size));
  const double scale = s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                           ? static_cast<double>(s.inv_bc2_sqrt)
                           : 1.0 / static_cast<double>(s.bc2_sqrt);
  c.fast =
      d >= 0.5 && s.eps >= 0 && step >= 0x1p-60 && step <= 1 && scale >= 1 && std::isfinite(scale);
  if (!c.fast) return c;
  c.fast_k = RoundUp((1.0 + 0x1p-9) * step / scale);
  c.fast_k1 = RoundUp(static_cast<double>(c.k1) * (1.0 + 0x1p-16));
  c.fast_inv = RoundUp(static_cast<double>(c.inv) * (1.0 + 0x1p-16));
  return c;
}

ScreenIsa BestScreenIsa() {
  static const ScreenIsa isa = DetectIsa();
  return isa;
}

size_t ScreenAndCastWith(ScreenIsa isa, const float* theta, const float* m, const float* v,
                         size_t n, const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out) {
  if (!c.enabled) isa = ScreenIsa::kScalar;  // every element is a candidate
  switch (isa) {
#if defined(DTE_SCREEN_X86)
    case ScreenIsa::kAvx512:
      return ScreenAvx512(theta, m, v, n, c, idx_out, bf16_out);
    case ScreenIsa::kAvx2:
      return ScreenAvx2(theta, m, v, n, c, idx_out, bf16_out);
    case ScreenIsa::kSse2:
      return ScreenSse2(theta, m, v, n, c, idx_out, bf16_out);
#endif
    default:
      return ScreenScalar(theta, m, v, 0, n, c, idx_out, bf16_out, 0);
  }
}

size_t ScreenAndCast(const float* theta, const float* m, const float* v, size_t n,
                     const ScreenScalars& c, uint32_t* idx_out, uint16_t* bf16_out) {
  return ScreenAndCastWith(BestScreenIsa(), theta, m, v, n, c, idx_out, bf16_out);
}

size_t ScreenCandidates(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint64_t* idx_out) {
  const size_t chunks = (n + kScreenChunk - 1) / kScreenChunk;
  std::vector<size_t> counts(chunks);
  kernels::ParallelFor(chunks, 1, [&](size_t lo, size_t hi) {
    uint32_t local[kScreenSub];
    for (size_t k = lo; k < hi; ++k) {
      const size_t begin = k * kScreenChunk, end = std::min(n, begin + kScreenChunk);
      size_t count = 0;
      for (size_t s = begin; s < end; s += kScreenSub) {
        const size_t len = std::min(kScreenSub, end - s);
        const size_t found = ScreenAndCast(theta + s, m + s, v + s, len, c, local, nullptr);
        for (size_t j = 0; j < found; ++j) idx_out[begin + count + j] = s + local[j];
        count += found;
      }
      counts[k] = count;
    }
  });
  size_t total = 0;
  for (size_t k = 0; k < chunks; ++k) {
    if (total != k * kScreenChunk && counts[k] != 0) {
      std::memmove(idx_out + total, idx_out + k * kScreenChunk, counts[k] * sizeof(uint64_t));
    }
    total += counts[k];
  }
  return total;
}

}  // namespace dte::internal
