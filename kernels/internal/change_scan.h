// Bitwise difference masks over blocks of 64 elements, the core of the CPU
// change detector.
//
// A block of 64 elements becomes one 64-bit mask, bit j set when element j
// differs in any bit; callers then skip all-zero masks and walk the set bits.
// On x86-64 the mask comes from SSE2 compares, packs and movemask (two to
// three times the throughput of the plain element loop, see docs/kernels.md);
// elsewhere from 64-bit XORs reduced per lane without branches. Loads are
// unaligned, so buffers need no particular alignment.
//
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/width.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dte::kernels::internal {

static_assert(std::endian::native == std::endian::little,
              "lane extraction assumes little-endian element order in a word");

inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Bit j set iff element j of the 64-element blocks at a and b (elements of
// W bytes) differ in any bit. Portable form: one 64-bit XOR per word, reduced
// to one bit per lane without branches.
template <int W>
uint64_t DiffMask64Portable(const uint8_t* a, const uint8_t* b) {
  constexpr int kLanes = 8 / W;
  constexpr int kLaneBits = 8 * W;
  constexpr uint64_t kLaneMask = W == 8 ? ~uint64_t{0} : (uint64_t{1} << kLaneBits) - 1;
  uint64_t mask = 0;
  for (int w = 0; w < 8 * W; ++w) {
    const uint64_t x = Load64(a + 8 * w) ^ Load64(b + 8 * w);
    for (int lane = 0; lane < kLanes; ++lane) {
      const uint64_t differs = ((x >> (lane * kLaneBits)) & kLaneMask) != 0;
      mask |= differs << (w * kLanes + lane);
    }
  }
  return mask;
}

#if defined(__SSE2__)
// SSE2 (every x86-64 CPU): compare 16 bytes at a time and collect one bit per
// element with packs + movemask, several times faster than the portable form.

// Lane-wise equality (all-ones lanes where equal) of the i-th 16-byte
// vectors at a and b, with lanes of E bytes (1, 2 or 4).
template <int E>
__m128i EqAt(const uint8_t* a, const uint8_t* b, int i) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * i));
  const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
  if constexpr (E == 1) {
    return _mm_cmpeq_epi8(x, y);
  } else if constexpr (E == 2) {
    return _mm_cmpeq_epi16(x, y);
  } else {
    return _mm_cmpeq_epi32(x, y);
  }
}

// Equality bits of the 16 elements (W = 1, 2 or 4 bytes) starting at 16-byte
// vector v.
template <int W>
uint64_t EqBits16(const uint8_t* a, const uint8_t* b, int v) {
  __m128i bytes;  // one all-ones or all-zeros byte per element
  if constexpr (W == 1) {
    bytes = EqAt<1>(a, b, v);
  } else if constexpr (W == 2) {
    bytes = _mm_packs_epi16(EqAt<2>(a, b, v), EqAt<2>(a, b, v + 1));
  } else {
    const __m128i lo = _mm_packs_epi32(EqAt<4>(a, b, v), EqAt<4>(a, b, v + 1));
    const __m128i hi = _mm_packs_epi32(EqAt<4>(a, b, v + 2), EqAt<4>(a, b, v + 3));
    bytes = _mm_packs_epi16(lo, hi);
  }
  return static_cast<uint32_t>(_mm_movemask_epi8(bytes));
}

template <int W>
uint64_t DiffMask64(const uint8_t* a, const uint8_t* b) {
  if constexpr (W == 8) {
    return DiffMask64Portable<8>(a, b);  // one XOR per element is already cheap
  } else {
    uint64_t eq = 0;
    for (int q = 0; q < 4; ++q) eq |= EqBits16<W>(a, b, q * W) << (16 * q);
    return ~eq;
  }
}
#else
template <int W>
uint64_t DiffMask64(const uint8_t* a, const uint8_t* b) {
  return DiffMask64Portable<W>(a, b);
}
#endif

// Same for a partial block of `count` < 64 elements.
template <int W>
uint64_t DiffMaskTail(const uint8_t* a, const uint8_t* b, size_t count) {
  uint64_t mask = 0;
  for (size_t j = 0; j < count; ++j) {
    const uint64_t differs = std::memcmp(a + j * W, b + j * W, W) != 0;
    mask |= differs << j;
  }
  return mask;
}

// Calls on_block(first_element, mask) for each 64-element block of [0, n)
// whose mask is non-zero, in increasing order.
template <int W, typename OnBlock>
void ForEachDiffBlock(const uint8_t* a, const uint8_t* b, size_t n, const OnBlock& on_block) {
  const size_t full = n / 64 * 64;
  for (size_t i = 0; i < full; i += 64) {
    const uint64_t m = DiffMask64<W>(a + i * W, b + i * W);
    if (m != 0) on_block(i, m);
  }
  if (full < n) {
    const uint64_t m = DiffMaskTail<W>(a + full * W, b + full * W, n - full);
    if (m != 0) on_block(full, m);
  }
}

// Number of differing elements in [0, n).
template <int W>
size_t CountDiffs(const uint8_t* a, const uint8_t* b, size_t n) {
  size_t count = 0;
  ForEachDiffBlock<W>(a, b, n,
                      [&](size_t, uint64_t m) { count += static_cast<size_t>(std::popcount(m)); });
  return count;
}

// For each differing element i of [0, n), in order, writes first_index + i
// to idx[k] and the new element to vals (W bytes at k * W); returns k.
template <int W, typename Index>
size_t DetectDiffs(const uint8_t* a, const uint8_t* b, size_t n, size_t first_index, Index* idx,
                   uint8_t* vals) {
  size_t k = 0;
  ForEachDiffBlock<W>(a, b, n, [&](size_t base, uint64_t m) {
    for (; m != 0; m &= m - 1) {
      const size_t i = base + static_cast<size_t>(std::countr_zero(m));
      idx[k] = static_cast<Index>(first_index + i);
      std::memcpy(vals + k * W, b + i * W, W);  // constant size: one load and store
      ++k;
    }
  });
  return k;
}

}  // namespace dte::kernels::internal
