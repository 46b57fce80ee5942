#include "sync/publish/internal/engine_screen.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/parallel.h"
#include "sync/publish/internal/engine_screen_update_x86.h"
#include "sync/publish/internal/engine_screen_x86.h"

#if defined(DTE_SCREEN_X86)
#include <immintrin.h>
#endif

namespace dte::internal {
namespace screen_detail {

ScreenCounts ScreenScalarRange(const float* theta, const float* m, const float* v, size_t i,
                               size_t n, const ScreenScalars& c, uint32_t* idx_out,
                               uint32_t* old_out, uint16_t* bf16_out, ScreenCounts r) {
  for (; i < n; ++i) {
    const uint16_t now = kernels::Fp32ToBf16Bits(theta[i]);
    if (bf16_out != nullptr) bf16_out[i] = now;
    if (CertainlyUnchanged(theta[i], m[i], v[i], c)) continue;
    r.flagged++;
    const uint32_t old = ScreenOldBits(theta[i], m[i], v[i], c);
    if (old == now) continue;
    idx_out[r.kept] = static_cast<uint32_t>(i);
    old_out[r.kept++] = old;
  }
  return r;
}

ScreenCounts ClassifyScalar(const float* theta, const float* m, const float* v,
                            const ScreenScalars& c, uint32_t* idx, size_t k, uint32_t* old_out) {
  ScreenCounts r;
  for (size_t j = 0; j < k; ++j) {
    const uint32_t i = idx[j];
    if (CertainlyUnchanged(theta[i], m[i], v[i], c)) continue;
    r.flagged++;
    const uint32_t old = ScreenOldBits(theta[i], m[i], v[i], c);
    if (old == kernels::Fp32ToBf16Bits(theta[i])) continue;
    idx[r.kept] = i;  // r.kept <= j: in place
    old_out[r.kept++] = old;
  }
  return r;
}

#if defined(DTE_SCREEN_X86)
namespace {

// Appends i0 + (each set bit of keep) to idx_out[k...]; returns the new count.
inline size_t Emit(uint32_t keep, size_t i0, uint32_t* idx_out, size_t k) {
  for (; keep != 0; keep &= keep - 1)
    idx_out[k++] = static_cast<uint32_t>(i0) + static_cast<uint32_t>(__builtin_ctz(keep));
  return k;
}

}  // namespace

// Pass 1 performs CertainlyUnchanged's operations lane by lane, in the same
// order, and Fp32ToBf16Bits' integer steps; pass 2 is ClassifyScalar (the
// candidates are few).
ScreenCounts ScreenSse2(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                        uint16_t* bf16_out) {
  const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF), one = _mm_set1_epi32(1);
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
    const __m128 u = Update4(mm, vv, c);
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
  const ScreenCounts r = ClassifyScalar(theta, m, v, c, idx_out, k, old_out);
  return ScreenScalarRange(theta, m, v, i, n, c, idx_out, old_out, bf16_out, r);
}
#endif  // DTE_SCREEN_X86

}  // namespace screen_detail

namespace {

// Fixed sub-ranges, so results do not depend on the thread count.
constexpr size_t kScreenChunk = size_t{1} << 16;
// ScreenCandidates screens this many elements per ScreenAndCast call.
constexpr size_t kScreenSub = size_t{1} << 12;

float RoundUp(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f : std::nextafter(f, INFINITY);
}

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
  // The signed estimate's error bound assumes decay >= 0.5 (docs/engine.md).
  c.signed_ok = d >= 0.5;
  c.rdecay = 1.0f / s.decay;   // RN(1 / decay) in FP32, as the analysis assumes
  c.est_k = c.inv * 0x1p-23f;  // exact: a power-of-two scaling of a normal number
  // The fast path's preconditions (engine_screen_avx.cc); else only the exact bound.
  const double step = std::abs(static_cast<double>(s.neg_step_size));
  const double scale = s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                           ? static_cast<double>(s.inv_bc2_sqrt)
                           : 1.0 / static_cast<double>(s.bc2_sqrt);
  c.fast = d >= 0.5 && s.eps >= 0 && step / scale >= 0x1p-60 && step <= 1 && scale >= 1 &&
           std::isfinite(scale);
  if (!c.fast) return c;
  c.fast_k = RoundUp((1.0 + 0x1p-9) * step / scale);
  c.fast_k1 = RoundUp(static_cast<double>(c.k1) * (1.0 + 0x1p-16));
  c.fast_inv = RoundUp(static_cast<double>(c.inv) * (1.0 + 0x1p-16));
  c.ulp_k = RoundUp(0x1p16 * (1.0 + 0x1p-9) * step * static_cast<double>(c.inv) / scale);
  c.ulp_c = RoundUp(0x1p16 * (0x1p24 * static_cast<double>(c.k1) * c.inv * (1.0 + 0x1p-10) + 2));
  return c;
}

ScreenIsa BestScreenIsa() {
  static const ScreenIsa isa = DetectIsa();
  return isa;
}

ScreenCounts ScreenAndCastWith(ScreenIsa isa, const float* theta, const float* m, const float* v,
                               size_t n, const ScreenScalars& c, uint32_t* idx_out,
                               uint32_t* old_out, uint16_t* bf16_out) {
  namespace sd = screen_detail;
  if (!c.enabled) isa = ScreenIsa::kScalar;  // every element is a candidate
  switch (isa) {
#if defined(DTE_SCREEN_X86)
    case ScreenIsa::kAvx512:
      return sd::ScreenAvx512(theta, m, v, n, c, idx_out, old_out, bf16_out);
    case ScreenIsa::kAvx2:
      return sd::ScreenAvx2(theta, m, v, n, c, idx_out, old_out, bf16_out);
    case ScreenIsa::kSse2:
      return sd::ScreenSse2(theta, m, v, n, c, idx_out, old_out, bf16_out);
#endif
    default:
      return sd::ScreenScalarRange(theta, m, v, 0, n, c, idx_out, old_out, bf16_out, {});
  }
}

namespace {

#if defined(DTE_SCREEN_X86)
// ScreenUpdatesWith's whole vectors; each returns where the scalar tail starts.
size_t UpdatesSse2(const float* m, const float* v, size_t n, const ScreenScalars& c, float* u) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    _mm_storeu_ps(u + i, screen_detail::Update4(_mm_loadu_ps(m + i), _mm_loadu_ps(v + i), c));
  }
  return i;
}

DTE_AVX2 size_t UpdatesAvx2(const float* m, const float* v, size_t n, const ScreenScalars& c,
                            float* u) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(u + i,
                     screen_detail::Update8(_mm256_loadu_ps(m + i), _mm256_loadu_ps(v + i), c));
  }
  return i;
}

DTE_AVX512 size_t UpdatesAvx512(const float* m, const float* v, size_t n, const ScreenScalars& c,
                                float* u) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(u + i,
                     screen_detail::Update16(_mm512_loadu_ps(m + i), _mm512_loadu_ps(v + i), c));
  }
  return i;
}
#endif  // DTE_SCREEN_X86

}  // namespace

void ScreenUpdatesWith(ScreenIsa isa, const float* m, const float* v, size_t n,
                       const ScreenScalars& c, float* u_out) {
  size_t i = 0;
  switch (isa) {
#if defined(DTE_SCREEN_X86)
    case ScreenIsa::kAvx512:
      i = UpdatesAvx512(m, v, n, c, u_out);
      break;
    case ScreenIsa::kAvx2:
      i = UpdatesAvx2(m, v, n, c, u_out);
      break;
    case ScreenIsa::kSse2:
      i = UpdatesSse2(m, v, n, c, u_out);
      break;
#endif
    default:
      break;
  }
  for (; i < n; ++i) u_out[i] = ScreenUpdate(m[i], v[i], c.s);
}

ScreenCounts ScreenAndCast(const float* theta, const float* m, const float* v, size_t n,
                           const ScreenScalars& c, uint32_t* idx_out, uint32_t* old_out,
                           uint16_t* bf16_out) {
  return ScreenAndCastWith(BestScreenIsa(), theta, m, v, n, c, idx_out, old_out, bf16_out);
}

ScreenCounts ScreenCandidates(const float* theta, const float* m, const float* v, size_t n,
                              const ScreenScalars& c, uint64_t* idx_out, uint32_t* old_out) {
  const size_t chunks = (n + kScreenChunk - 1) / kScreenChunk;
  std::vector<ScreenCounts> counts(chunks);
  kernels::ParallelFor(chunks, 1, [&](size_t lo, size_t hi) {
    uint32_t local[kScreenSub + kScreenSlack], old[kScreenSub + kScreenSlack];
    for (size_t k = lo; k < hi; ++k) {
      const size_t begin = k * kScreenChunk, end = std::min(n, begin + kScreenChunk);
      ScreenCounts total;
      for (size_t s = begin; s < end; s += kScreenSub) {
        const size_t len = std::min(kScreenSub, end - s);
        const ScreenCounts found =
            ScreenAndCast(theta + s, m + s, v + s, len, c, local, old, nullptr);
        for (size_t j = 0; j < found.kept; ++j) {
          idx_out[begin + total.kept + j] = s + local[j];
          old_out[begin + total.kept + j] = old[j];
        }
        total.flagged += found.flagged;
        total.kept += found.kept;
      }
      counts[k] = total;
    }
  });
  ScreenCounts total;
  for (size_t k = 0; k < chunks; ++k) {
    if (total.kept != k * kScreenChunk && counts[k].kept != 0) {
      std::memmove(idx_out + total.kept, idx_out + k * kScreenChunk,
                   counts[k].kept * sizeof(uint64_t));
      std::memmove(old_out + total.kept, old_out + k * kScreenChunk,
                   counts[k].kept * sizeof(uint32_t));
    }
    total.flagged += counts[k].flagged;
    total.kept += counts[k].kept;
  }
  return total;
}

}  // namespace dte::internal
