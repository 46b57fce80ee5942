// ScreenUpdate (engine_screen.h) of 4, 8 or 16 lanes, for the screen's SSE2,
// AVX2 and AVX-512 widths: the same IEEE operations in the same order as the
// scalar definition, so every width computes each element's update bit for
// bit as the step did (ScreenUpdatesWith checks it). The AVX2 and AVX-512
// forms carry their instruction set as a function attribute (the build stays
// baseline x86-64); callers must check the CPU first.
//
// Thread-safety: pure functions.
#pragma once

#include "sync/publish/internal/engine_screen_x86.h"

#if defined(DTE_SCREEN_X86)
#include <immintrin.h>

#define DTE_AVX2 __attribute__((target("avx2,popcnt")))
#define DTE_AVX512 __attribute__((target("avx512f,popcnt")))

namespace dte::internal::screen_detail {

// fp32(fp64(x) + eps) lane by lane: kTorchCudaFused's denominator.
inline __m128 AddEpsF64x4(__m128 x, double eps) {
  const __m128d e = _mm_set1_pd(eps);
  const __m128 lo = _mm_cvtpd_ps(_mm_add_pd(_mm_cvtps_pd(x), e));
  const __m128 hi = _mm_cvtpd_ps(_mm_add_pd(_mm_cvtps_pd(_mm_movehl_ps(x, x)), e));
  return _mm_movelh_ps(lo, hi);
}

inline __m128 Update4(__m128 mm, __m128 vv, const ScreenScalars& c) {
  const __m128 root = _mm_sqrt_ps(vv);
  const __m128 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                            ? _mm_mul_ps(root, _mm_set1_ps(c.s.inv_bc2_sqrt))
                            : _mm_div_ps(root, _mm_set1_ps(c.s.bc2_sqrt));
  const __m128 denom = c.s.order == kernels::AdamWOrder::kTorchCudaFused
                           ? AddEpsF64x4(scaled, c.s.eps_f64)
                           : _mm_add_ps(scaled, _mm_set1_ps(c.s.eps));
  const __m128 nss = _mm_set1_ps(c.s.neg_step_size);
  return kernels::AdamWAddsRoundedUpdate(c.s.order) ? _mm_div_ps(_mm_mul_ps(nss, mm), denom)
                                                    : _mm_mul_ps(nss, _mm_div_ps(mm, denom));
}

DTE_AVX2 inline __m256 AddEpsF64x8(__m256 x, double eps) {
  const __m256d e = _mm256_set1_pd(eps);
  const __m128 lo = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), e));
  const __m128 hi = _mm256_cvtpd_ps(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), e));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

DTE_AVX2 inline __m256 Update8(__m256 mm, __m256 vv, const ScreenScalars& c) {
  const __m256 root = _mm256_sqrt_ps(vv);
  const __m256 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                            ? _mm256_mul_ps(root, _mm256_set1_ps(c.s.inv_bc2_sqrt))
                            : _mm256_div_ps(root, _mm256_set1_ps(c.s.bc2_sqrt));
  const __m256 denom = c.s.order == kernels::AdamWOrder::kTorchCudaFused
                           ? AddEpsF64x8(scaled, c.s.eps_f64)
                           : _mm256_add_ps(scaled, _mm256_set1_ps(c.s.eps));
  const __m256 nss = _mm256_set1_ps(c.s.neg_step_size);
  return kernels::AdamWAddsRoundedUpdate(c.s.order) ? _mm256_div_ps(_mm256_mul_ps(nss, mm), denom)
                                                    : _mm256_mul_ps(nss, _mm256_div_ps(mm, denom));
}

// Through memory: GCC 12's 512-bit insert and extract trip
// -Wmaybe-uninitialized.
DTE_AVX512 inline __m512 AddEpsF64x16(__m512 x, double eps) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  const __m512d e = _mm512_set1_pd(eps);
  for (int half = 0; half < 2; ++half) {
    const __m512d wide = _mm512_maskz_cvtps_pd(0xFF, _mm256_load_ps(lanes + 8 * half));
    _mm256_store_ps(lanes + 8 * half, _mm512_maskz_cvtpd_ps(0xFF, _mm512_add_pd(wide, e)));
  }
  return _mm512_load_ps(lanes);
}

DTE_AVX512 inline __m512 Update16(__m512 mm, __m512 vv, const ScreenScalars& c) {
  const __m512 root = _mm512_maskz_sqrt_ps(0xFFFF, vv);
  const __m512 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                            ? _mm512_mul_ps(root, _mm512_set1_ps(c.s.inv_bc2_sqrt))
                            : _mm512_div_ps(root, _mm512_set1_ps(c.s.bc2_sqrt));
  const __m512 denom = c.s.order == kernels::AdamWOrder::kTorchCudaFused
                           ? AddEpsF64x16(scaled, c.s.eps_f64)
                           : _mm512_add_ps(scaled, _mm512_set1_ps(c.s.eps));
  const __m512 nss = _mm512_set1_ps(c.s.neg_step_size);
  return kernels::AdamWAddsRoundedUpdate(c.s.order) ? _mm512_div_ps(_mm512_mul_ps(nss, mm), denom)
                                                    : _mm512_mul_ps(nss, _mm512_div_ps(mm, denom));
}

}  // namespace dte::internal::screen_detail

#endif  // DTE_SCREEN_X86
