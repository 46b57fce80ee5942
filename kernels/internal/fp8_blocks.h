// Block geometry and the refusal message shared by the CPU FP8 kernels
// (kernels/fp8_cpu.cc, kernels/fp8_changes.cc).
//
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "kernels/fp8.h"

namespace dte::kernels::fp8_internal {

inline constexpr uint64_t kNoElement = std::numeric_limits<uint64_t>::max();

// The element rectangle of one block: rows [r0, r1), cols [c0, c1).
struct BlockRect {
  uint64_t r0, r1, c0, c1;
};

inline BlockRect RectOf(const Fp8Layout& l, uint64_t b) {
  const uint64_t r0 = (b / l.grid_cols()) * l.block_rows;
  const uint64_t c0 = (b % l.grid_cols()) * l.block_cols;
  return {r0, std::min(r0 + l.block_rows, l.rows), c0, std::min(c0 + l.block_cols, l.cols)};
}

// The row-major block index of flat element i.
inline uint64_t BlockOf(const Fp8Layout& l, uint64_t i) {
  return (i / l.cols / l.block_rows) * l.grid_cols() + (i % l.cols) / l.block_cols;
}

// The block's scale from its largest BF16 magnitude. Lowers *bad to the flat
// index of the block's first NaN or +-inf element, if it has one below *bad.
inline float BlockScale(const Fp8Layout& l, const uint16_t* x, const BlockRect& rect,
                        uint64_t* bad) {
  uint16_t amax = 0;
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    const uint16_t* row = x + r * l.cols;
    for (uint64_t c = rect.c0; c < rect.c1; ++c) amax = std::max(amax, Bf16AbsBits(row[c]));
  }
  if (Bf16AbsNonFinite(amax)) {
    for (uint64_t r = rect.r0; r < rect.r1; ++r) {
      for (uint64_t c = rect.c0; c < rect.c1; ++c) {
        const uint64_t i = r * l.cols + c;
        if (Bf16AbsNonFinite(Bf16AbsBits(x[i])) && i < *bad) *bad = i;
      }
    }
  }
  return Fp8BlockScale(Bf16BitsToFp32(amax), l.rule);
}

// BlockScale with the block's rows scanned by a vectorized maximum
// (kernels/fp8_cpu.cc); the same scale and *bad.
float FastBlockScale(const Fp8Layout& l, const uint16_t* x, const BlockRect& rect, uint64_t* bad);

// "tensor 'NAME': FP8 block (R, C) (rows .., cols ..) holds a NaN or
// infinite weight at element (r, c); ..." for flat element `bad`.
std::string Refusal(const Fp8Layout& l, std::string_view tensor, uint64_t bad);

}  // namespace dte::kernels::fp8_internal
