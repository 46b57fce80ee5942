// The screen's AVX2 and AVX-512 widths (engine_screen_x86.h), compiled for
// those instruction sets function by function and chosen at run time, so the
// build stays baseline x86-64.
#include <algorithm>

#include "sync/publish/internal/engine_screen_update_x86.h"
#include "sync/publish/internal/engine_screen_x86.h"

#if defined(DTE_SCREEN_X86)
#include <immintrin.h>

namespace dte::internal::screen_detail {
namespace {

// Elements pass 1 prefetches ahead of the ones it reads.
constexpr size_t kPrefetchAhead = 512;

// Left-packing 8 lanes: for each 8-bit mask, the indices of its set lanes in
// increasing order, one per byte (the rest 0).
struct PackTable {
  uint64_t lanes[256];
  constexpr PackTable() : lanes() {
    for (int mask = 0; mask < 256; ++mask) {
      uint64_t x = 0;
      int k = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if ((mask >> lane) & 1) x |= static_cast<uint64_t>(lane) << (8 * k++);
      }
      lanes[mask] = x;
    }
  }
};
constexpr PackTable kPack;

// The permutation moving the lanes of `mask` to the front.
DTE_AVX2 inline __m256i PackPerm(int mask) {
  return _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&kPack.lanes[mask])));
}

// A magnitude's BF16 cell: its base (the BF16 value, as FP32 bits), the
// distances to the ties below and above (exact), and whether the magnitude
// is in the screen's range [2^-100, 0x7F000000) (the lanes of `ok`).
struct Cell8 {
  __m256 a, below, above;
  __m256i base, ok;
};

DTE_AVX2 inline Cell8 CellOf(__m256i a_bits) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a_bits, 16), _mm256_set1_epi32(1));
  Cell8 r;
  r.a = _mm256_castsi256_ps(a_bits);
  r.base = _mm256_slli_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a_bits, _mm256_set1_epi32(0x7FFF)), lsb),
                        16),
      16);
  r.below =
      _mm256_sub_ps(r.a, _mm256_castsi256_ps(_mm256_sub_epi32(r.base, _mm256_set1_epi32(0x8000))));
  r.above =
      _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(r.base, _mm256_set1_epi32(0x8000))), r.a);
  // a_bits is non-negative as a signed integer, so signed compares work.
  r.ok = _mm256_and_si256(_mm256_cmpgt_epi32(a_bits, _mm256_set1_epi32(0x0D7FFFFF)),
                          _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F000000), a_bits));
  return r;
}

// Lanes whose cell's ties are both farther than `bound` (ordered: false for
// NaN), among `ok`.
DTE_AVX2 inline __m256i Inside(const Cell8& e, __m256 bound) {
  const __m256 in = _mm256_and_ps(_mm256_cmp_ps(e.below, bound, _CMP_GT_OQ),
                                  _mm256_cmp_ps(e.above, bound, _CMP_GT_OQ));
  return _mm256_and_si256(_mm256_castps_si256(in), e.ok);
}

// CertainlyUnchanged and ScreenOldBits of 8 lanes, the same operations in
// the same order: the flagged lanes, the kept lanes (flagged and not proven
// unchanged) as bit masks, and every lane's ScreenOldBits in *old.
struct Verdict8 {
  int flagged, kept;
};

DTE_AVX2 inline Verdict8 Classify8(__m256 t, __m256 mm, __m256 vv, const ScreenScalars& c,
                                   __m256i* old) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), sign16 = _mm256_set1_epi32(0x8000);
  const __m256i t_bits = _mm256_castps_si256(t);
  const Cell8 now = CellOf(_mm256_and_si256(t_bits, abs_mask));
  const __m256 u = Update8(mm, vv, c);
  const __m256 au = _mm256_and_ps(u, _mm256_castsi256_ps(abs_mask));
  const __m256 bound =
      _mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(au, _mm256_mul_ps(now.a, _mm256_set1_ps(c.k1))),
                                  _mm256_set1_ps(c.inv)),
                    _mm256_set1_ps(0x1p-140f));
  const int flagged = ~_mm256_movemask_ps(_mm256_castsi256_ps(Inside(now, bound))) & 0xFF;
  const __m256i est_bits =
      _mm256_castps_si256(_mm256_mul_ps(_mm256_sub_ps(t, u), _mm256_set1_ps(c.rdecay)));
  const Cell8 was = CellOf(_mm256_and_si256(est_bits, abs_mask));
  const __m256 err =
      _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_add_ps(au, now.a), _mm256_set1_ps(c.est_k)),
                                  _mm256_mul_ps(was.a, _mm256_set1_ps(0x1p-21f))),
                    _mm256_set1_ps(0x1p-140f));
  __m256i decided = _mm256_and_si256(Inside(was, err), now.ok);
  if (!c.signed_ok) decided = _mm256_setzero_si256();
  const __m256i old_bits = _mm256_or_si256(
      _mm256_and_si256(_mm256_srli_epi32(est_bits, 16), sign16), _mm256_srli_epi32(was.base, 16));
  const __m256i new_bits = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(t_bits, 16), sign16),
                                           _mm256_srli_epi32(now.base, 16));
  *old =
      _mm256_blendv_epi8(_mm256_set1_epi32(static_cast<int>(kScreenUndecided)), old_bits, decided);
  const __m256i same = _mm256_and_si256(decided, _mm256_cmpeq_epi32(old_bits, new_bits));
  return {flagged, flagged & ~_mm256_movemask_ps(_mm256_castsi256_ps(same))};
}

// Pass 2 with gathers, 8 indices at a time (in place; the stores at the
// kept count never pass the indices still to be read). Indices must fit in
// int32. With bf16_out, also writes the cast of NaN lanes (0x7FC0).
DTE_AVX2 ScreenCounts ClassifyAvx2(const float* theta, const float* m, const float* v,
                                   const ScreenScalars& c, uint32_t* idx, size_t k,
                                   uint32_t* old_out, uint16_t* bf16_out) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  ScreenCounts r;
  for (size_t j = 0; j < k; j += 8) {
    const int live = static_cast<int>(std::min<size_t>(8, k - j));
    const auto* at = reinterpret_cast<const __m256i*>(idx + j);
    // Lanes past k load index 0 (a valid element) and are dropped below.
    const __m256i ii =
        live == 8 ? _mm256_loadu_si256(at)
                  : _mm256_maskload_epi32(reinterpret_cast<const int*>(idx + j),
                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(live), iota));
    const __m256 t = _mm256_i32gather_ps(theta, ii, 4);
    const __m256 mm = _mm256_i32gather_ps(m, ii, 4);
    const __m256 vv = _mm256_i32gather_ps(v, ii, 4);
    __m256i old;
    const Verdict8 e = Classify8(t, mm, vv, c, &old);
    const int live_mask = (1 << live) - 1;
    const int nan = _mm256_movemask_ps(_mm256_cmp_ps(t, t, _CMP_UNORD_Q)) & live_mask;
    if (nan != 0 && bf16_out != nullptr) {
      for (int lane = 0; lane < live; ++lane) {
        if ((nan >> lane) & 1) bf16_out[idx[j + lane]] = 0x7FC0;
      }
    }
    const int kept = e.kept & live_mask;
    r.flagged += static_cast<size_t>(__builtin_popcount(e.flagged & live_mask));
    const __m256i perm = PackPerm(kept);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + r.kept),
                        _mm256_permutevar8x32_epi32(ii, perm));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(old_out + r.kept),
                        _mm256_permutevar8x32_epi32(old, perm));
    r.kept += static_cast<size_t>(__builtin_popcount(kept));
  }
  return r;
}

// Hides a constant from the optimizer: under register pressure GCC then
// reloads it (one load, folded into its user) instead of rebuilding it with
// three instructions in the loop.
DTE_AVX2 inline __m256i Opaque(int x) {
  __m256i r = _mm256_set1_epi32(x);
  __asm__("" : "+x"(r));
  return r;
}

// The constants of the AVX2 pass 1 (see ScreenAvx2).
struct Pass1Consts {
  __m256i abs, exp, tie, range_off, range_max, m_min, v_min, ulp_base, one, round, eight;
  __m256i ulp_k, ulp_c, cap;
};

DTE_AVX2 inline Pass1Consts MakePass1Consts(const ScreenScalars& c) {
  Pass1Consts k;
  k.abs = Opaque(0x7FFFFFFF);
  k.exp = Opaque(0x7F800000);
  k.tie = Opaque(0x8000);
  k.range_off = Opaque(0x72800000);
  k.range_max = Opaque(static_cast<int>(0xF1800000u));
  k.m_min = Opaque(0x217FFFFF);
  k.v_min = Opaque(0x007FFFFF);
  k.ulp_base = Opaque(static_cast<int>(0x8A800000u));
  k.one = Opaque(1);
  k.round = Opaque(0x7FFF);
  k.eight = Opaque(8);
  k.ulp_k = Opaque(static_cast<int>(kernels::FloatBits(c.ulp_k)));
  k.ulp_c = Opaque(static_cast<int>(kernels::FloatBits(c.ulp_c)));
  k.cap = Opaque(static_cast<int>(kernels::FloatBits(0x1p30f)));
  return k;
}

// Fp32ToBf16Bits of 8 lanes in the low 16 bits of each, except NaN lanes,
// which pass 2 fixes (they are never ruled out, so they always reach it).
DTE_AVX2 inline __m256i Round8(__m256i bits, const Pass1Consts& k) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), k.one);
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, k.round), lsb), 16);
}

// The AVX2 fast path's verdict for 8 lanes (set where certainly unchanged):
// see ScreenAvx2.
DTE_AVX2 inline int FastSure8(__m256i t_bits, __m256 mm, __m256 vv, const Pass1Consts& k) {
  const __m256i e_bits = _mm256_and_si256(t_bits, k.exp);
  // 2^-100 <= |theta| < 0x7F000000 (unsigned compare of e_bits - 0x0D800000
  // with 0x71800000, as a signed one with both sides offset by 2^31).
  const __m256i in_range = _mm256_cmpgt_epi32(k.range_max, _mm256_add_epi32(e_bits, k.range_off));
  const __m256 m_abs = _mm256_and_ps(mm, _mm256_castsi256_ps(k.abs));
  const __m256i lane_ok = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_castps_si256(m_abs), k.m_min),
                                           _mm256_cmpgt_epi32(_mm256_castps_si256(vv), k.v_min));
  // 1 / ulp(theta), exact: biased exponent 277 - E.
  const __m256 inv_ulp = _mm256_castsi256_ps(_mm256_sub_epi32(k.ulp_base, e_bits));
  const __m256 x = _mm256_add_ps(
      _mm256_mul_ps(
          _mm256_mul_ps(_mm256_mul_ps(m_abs, _mm256_castsi256_ps(k.ulp_k)), _mm256_rsqrt_ps(vv)),
          inv_ulp),
      _mm256_castsi256_ps(k.ulp_c));
  // 2^16 |low16 - 0x8000|: the distance to the tie sharing theta's upper
  // 16 bits, in units of 2^-16 ulps; capped at 2^14 ulps.
  const __m256 d = _mm256_min_ps(
      _mm256_and_ps(_mm256_cvtepi32_ps(_mm256_slli_epi32(_mm256_xor_si256(t_bits, k.tie), 16)),
                    _mm256_castsi256_ps(k.abs)),
      _mm256_castsi256_ps(k.cap));
  const __m256i sure = _mm256_castps_si256(_mm256_cmp_ps(d, x, _CMP_GT_OQ));
  return _mm256_movemask_ps(
      _mm256_castsi256_ps(_mm256_and_si256(_mm256_and_si256(sure, in_range), lane_ok)));
}

// Where pass 1 stands: the next element, the indices collected, and the
// vector of i + lane.
struct Pass1State {
  size_t i, k;
  __m256i lanes;
};

// Appends the lanes of `keep` to idx_out (8 slots must be writable at p->k)
// and moves on by 8 elements.
DTE_AVX2 inline void Collect8(int keep, const Pass1Consts& kc, uint32_t* idx_out, Pass1State* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx_out + p->k),
                      _mm256_permutevar8x32_epi32(p->lanes, PackPerm(keep)));
  p->k += static_cast<size_t>(__builtin_popcount(keep));
  p->lanes = _mm256_add_epi32(p->lanes, kc.eight);
}

// Pass 1 with the fast path, two vectors (a cache line of each stream) at a
// time, while whole pairs remain. The hardware prefetchers alone leave this
// loop waiting on memory: a hint 2 KiB ahead on each stream (past n it is
// harmless: prefetches do not fault).
DTE_AVX2 void Pass1Pairs(const float* theta, const float* m, const float* v, size_t n,
                         const Pass1Consts& kc, uint32_t* idx_out, uint16_t* bf16_out,
                         Pass1State* p) {
  for (size_t i = p->i; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(theta + i + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + i + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + i + kPrefetchAhead), _MM_HINT_T0);
    const __m256i t0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(theta + i));
    const __m256i t1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(theta + i + 8));
    if (bf16_out != nullptr) {
      // packus interleaves the 128-bit halves; the permutation restores order.
      const __m256i r = _mm256_packus_epi32(Round8(t0, kc), Round8(t1, kc));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16_out + i),
                          _mm256_permute4x64_epi64(r, 0xD8));
    }
    // k <= i, so the 16 slots at k are within idx_out's n.
    Collect8(~FastSure8(t0, _mm256_loadu_ps(m + i), _mm256_loadu_ps(v + i), kc) & 0xFF, kc, idx_out,
             p);
    Collect8(~FastSure8(t1, _mm256_loadu_ps(m + i + 8), _mm256_loadu_ps(v + i + 8), kc) & 0xFF, kc,
             idx_out, p);
    p->i = i + 16;
  }
}

// Pass 1 one vector at a time (the fast path, or the exact bound without
// `fast`), while whole vectors remain.
DTE_AVX2 void Pass1Singles(const float* theta, const float* m, const float* v, size_t n,
                           const ScreenScalars& c, const Pass1Consts& kc, uint32_t* idx_out,
                           uint16_t* bf16_out, Pass1State* p) {
  for (size_t i = p->i; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_loadu_ps(theta + i), mm = _mm256_loadu_ps(m + i);
    const __m256 vv = _mm256_loadu_ps(v + i);
    const __m256i t_bits = _mm256_castps_si256(t);
    if (bf16_out != nullptr) {
      const __m256i r = Round8(t_bits, kc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bf16_out + i),
                       _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    __m256i unused;
    // k <= i, so the 8 slots at k are within idx_out's n.
    Collect8(
        c.fast ? ~FastSure8(t_bits, mm, vv, kc) & 0xFF : Classify8(t, mm, vv, c, &unused).flagged,
        kc, idx_out, p);
    p->i = i + 8;
  }
}

}  // namespace

// AVX2's fast path, lane by lane, in units of 2^-16 ulp(theta) (a power of
// two, so the scaling is exact): with D = |low16(theta) - 0x8000|,
//   sure  <=>  2^16 min(D, 2^14) > RN(RN(RN(RN(|m| ulp_k) r) / ulp(theta)) + ulp_c)
// where r is the CPU's reciprocal square root estimate of v (relative error
// below 2^-11 on every x86 CPU: 1.5 * 2^-12 for rsqrtps). theta's rounding
// cell has one tie with its upper 16 bits, exactly D ulps away, and the other
// at least 2^14 ulps away (0x8000 or more steps, each at least half an ulp),
// so min(D, 2^14) ulps bounds the distance to both. Where MakeScreenScalars
// set `fast` (decay >= 0.5, eps >= 0, |neg_step_size| <= 1,
// |neg_step_size| / s >= 2^-60, s >= 1) and for lanes with 2^-100 <= |theta|
// < 0x7F000000, |m| >= 2^-60 and v positive and not subnormal (or +inf,
// where r = u = 0), the update the step computed satisfies
//   |u| <= |neg_step_size m| / (s sqrt(v)) (1 + 2^-24)^5 + 2^-149,
// RN(|m| ulp_k) is normal, and every later underflow costs at most 2^-26
// ulps; with (1 + 2^-9)(1 - 2^-11) > (1 + 2^-10)(1 + 2^-24)^8, ulp_c's 2^-10
// margin on the decay term (|theta| / ulp(theta) < 2^24) and its 2 ulps for
// the absolute terms (ulp(theta) >= 2^-123), the right side exceeds
// CertainlyUnchanged's FP32 bound B in those units. So a lane the fast path
// rules out is ruled out by CertainlyUnchanged. NaN anywhere fails the
// ordered compare. The lanes not ruled out are collected (left-packed, in
// increasing order) and go through pass 2, which evaluates B itself and the
// signed estimate on them only (~3% of the lanes).
DTE_AVX2 ScreenCounts ScreenAvx2(const float* theta, const float* m, const float* v, size_t n,
                                 const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                                 uint16_t* bf16_out) {
  const Pass1Consts kc = MakePass1Consts(c);
  Pass1State p{0, 0, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)};
  if (c.fast) Pass1Pairs(theta, m, v, n, kc, idx_out, bf16_out, &p);
  Pass1Singles(theta, m, v, n, c, kc, idx_out, bf16_out, &p);
  const ScreenCounts r = ClassifyAvx2(theta, m, v, c, idx_out, p.k, old_out, bf16_out);
  return ScreenScalarRange(theta, m, v, p.i, n, c, idx_out, old_out, bf16_out, r);
}

namespace {

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
  const __m512 u = Update16(mm, vv, c);
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

}  // namespace

// Pass 1 with 16 lanes (the fast path, or the exact bound without `fast`),
// then pass 2 as for AVX2.
DTE_AVX512 ScreenCounts ScreenAvx512(const float* theta, const float* m, const float* v, size_t n,
                                     const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                                     uint16_t* bf16_out) {
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
  const ScreenCounts r = ClassifyAvx2(theta, m, v, c, idx_out, k, old_out, nullptr);
  return ScreenScalarRange(theta, m, v, i, n, c, idx_out, old_out, bf16_out, r);
}
#undef DTE_AVX512
#undef DTE_AVX2

}  // namespace dte::internal::screen_detail

#endif  // DTE_SCREEN_X86
