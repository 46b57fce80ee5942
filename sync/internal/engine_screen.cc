#include "sync/internal/engine_screen.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/parallel.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dte::internal {
namespace {

// Fixed sub-ranges, so results do not depend on the thread count.
constexpr size_t kScreenChunk = size_t{1} << 16;

float RoundUp(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f : std::nextafter(f, INFINITY);
}

#if defined(__SSE2__)
// Bit i set when element i of the four at `i0` is certainly unchanged;
// the same operations as CertainlyUnchanged, four lanes at a time.
int UnchangedMask4(const float* theta, const float* m, const float* v, const ScreenScalars& c) {
  const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF);
  const __m128 t = _mm_loadu_ps(theta);
  const __m128 mm = _mm_loadu_ps(m);
  const __m128 vv = _mm_loadu_ps(v);
  const __m128i a_bits = _mm_and_si128(_mm_castps_si128(t), abs_mask);
  const __m128 a = _mm_castsi128_ps(a_bits);
  const __m128 r = _mm_sqrt_ps(vv);
  const __m128 scaled = c.s.order == kernels::AdamWOrder::kTorchCudaSingleTensor
                            ? _mm_mul_ps(r, _mm_set1_ps(c.s.inv_bc2_sqrt))
                            : _mm_div_ps(r, _mm_set1_ps(c.s.bc2_sqrt));
  const __m128 denom = _mm_add_ps(scaled, _mm_set1_ps(c.s.eps));
  const __m128 nss = _mm_set1_ps(c.s.neg_step_size);
  const __m128 u = c.s.order == kernels::AdamWOrder::kTorchCpu
                       ? _mm_div_ps(_mm_mul_ps(nss, mm), denom)
                       : _mm_mul_ps(nss, _mm_div_ps(mm, denom));
  const __m128 au = _mm_and_ps(u, _mm_castsi128_ps(abs_mask));
  const __m128 bound =
      _mm_add_ps(_mm_mul_ps(_mm_add_ps(au, _mm_mul_ps(a, _mm_set1_ps(c.k1))), _mm_set1_ps(c.inv)),
                 _mm_set1_ps(0x1p-140f));
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(a_bits, 16), _mm_set1_epi32(1));
  const __m128i base = _mm_slli_epi32(
      _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(a_bits, _mm_set1_epi32(0x7FFF)), lsb), 16), 16);
  const __m128 lo = _mm_castsi128_ps(_mm_sub_epi32(base, _mm_set1_epi32(0x8000)));
  const __m128 hi = _mm_castsi128_ps(_mm_add_epi32(base, _mm_set1_epi32(0x8000)));
  const __m128 ok =
      _mm_and_ps(_mm_cmpgt_ps(_mm_sub_ps(a, lo), bound), _mm_cmpgt_ps(_mm_sub_ps(hi, a), bound));
  // a_bits is non-negative as a signed integer, so signed compares work.
  const __m128i in_range = _mm_and_si128(_mm_cmpgt_epi32(a_bits, _mm_set1_epi32(0x0D7FFFFF)),
                                         _mm_cmplt_epi32(a_bits, _mm_set1_epi32(0x7F000000)));
  return _mm_movemask_ps(_mm_and_ps(ok, _mm_castsi128_ps(in_range)));
}
#endif

// Candidates of [begin, end), written from idx_out[begin] on; their number.
size_t ScreenRange(const float* theta, const float* m, const float* v, size_t begin, size_t end,
                   const ScreenScalars& c, uint64_t* idx_out) {
  size_t k = begin;
  size_t i = begin;
#if defined(__SSE2__)
  if (c.enabled) {
    for (; i + 4 <= end; i += 4) {
      int keep = ~UnchangedMask4(theta + i, m + i, v + i, c) & 0xF;
      for (; keep != 0; keep &= keep - 1)
        idx_out[k++] = i + static_cast<size_t>(__builtin_ctz(keep));
    }
  }
#endif
  for (; i < end; ++i) {
    if (!CertainlyUnchanged(theta[i], m[i], v[i], c)) idx_out[k++] = i;
  }
  return k - begin;
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
  return c;
}

size_t ScreenCandidates(const float* theta, const float* m, const float* v, size_t n,
                        const ScreenScalars& c, uint64_t* idx_out) {
  const size_t chunks = (n + kScreenChunk - 1) / kScreenChunk;
  std::vector<size_t> counts(chunks);
  kernels::ParallelFor(chunks, 1, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k) {
      counts[k] = ScreenRange(theta, m, v, k * kScreenChunk, std::min(n, (k + 1) * kScreenChunk), c,
                              idx_out);
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
