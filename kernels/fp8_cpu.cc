// CPU backend of block-scaled FP8 quantization (kernels/fp8.h).
#include <algorithm>
#include <limits>

#include "kernels/fp8.h"
#include "kernels/internal/fp8_blocks.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

using fp8_internal::BlockRect;
using fp8_internal::kNoElement;
using fp8_internal::RectOf;

// Blocks per ParallelFor task: about 64 Ki elements, enough to hide hand-off.
constexpr size_t kElementsPerTask = size_t{1} << 16;

size_t BlockGrain(const Fp8Layout& l) {
  const uint64_t elems = std::min(l.block_rows, l.rows) * std::min(l.block_cols, l.cols);
  return std::max<size_t>(1, kElementsPerTask / std::max<uint64_t>(1, elems));
}

// The first recorded bad element in block order, as a refusal, or "".
std::string FirstRefusal(const Fp8Layout& l, std::string_view tensor,
                         const std::vector<uint64_t>& bad) {
  for (uint64_t b : bad) {
    if (b != kNoElement) return fp8_internal::Refusal(l, tensor, b);
  }
  return {};
}

}  // namespace

std::string fp8_internal::Refusal(const Fp8Layout& l, std::string_view tensor, uint64_t bad) {
  const uint64_t b = BlockOf(l, bad);
  const BlockRect rect = RectOf(l, b);
  return "tensor '" + std::string(tensor) + "': FP8 block (" + std::to_string(b / l.grid_cols()) +
         ", " + std::to_string(b % l.grid_cols()) + ") (rows " + std::to_string(rect.r0) + ".." +
         std::to_string(rect.r1 - 1) + ", cols " + std::to_string(rect.c0) + ".." +
         std::to_string(rect.c1 - 1) + ") holds a NaN or infinite weight at element (" +
         std::to_string(bad / l.cols) + ", " + std::to_string(bad % l.cols) +
         "); FP8 quantization refuses non-finite weights";
}

std::string Fp8LayoutError(const Fp8Layout& l) {
  if (l.block_rows == 0 || l.block_cols == 0) {
    return "FP8 block size " + std::to_string(l.block_rows) + " x " + std::to_string(l.block_cols) +
           ": both sides must be at least 1";
  }
  if (l.cols != 0 && l.rows > std::numeric_limits<uint64_t>::max() / l.cols) {
    return "FP8 tensor of " + std::to_string(l.rows) + " x " + std::to_string(l.cols) +
           " elements: the element count overflows 64 bits";
  }
  return {};
}

std::string Fp8Quantize(const Fp8Layout& l, const uint16_t* bf16, uint8_t* q_out, float* scale_out,
                        std::string_view tensor) {
  std::vector<uint64_t> bad(l.num_blocks(), kNoElement);
  ParallelFor(l.num_blocks(), BlockGrain(l), [&](size_t begin, size_t end) {
    for (size_t b = begin; b < end; ++b) {
      const BlockRect rect = RectOf(l, b);
      const float scale = fp8_internal::BlockScale(l, bf16, rect, &bad[b]);
      scale_out[b] = scale;
      for (uint64_t r = rect.r0; r < rect.r1; ++r) {
        for (uint64_t c = rect.c0; c < rect.c1; ++c) {
          const uint64_t i = r * l.cols + c;
          q_out[i] = QuantizeE4m3(Bf16BitsToFp32(bf16[i]), scale);
        }
      }
    }
  });
  return FirstRefusal(l, tensor, bad);
}

void Fp8Dequantize(const Fp8Layout& l, const uint8_t* q, const float* scale, float* out) {
  const size_t grain = std::max<size_t>(1, kElementsPerTask / std::max<uint64_t>(1, l.cols));
  ParallelFor(l.rows, grain, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const float* scale_row = scale + (r / l.block_rows) * l.grid_cols();
      for (uint64_t c = 0; c < l.cols; ++c) {
        const uint64_t i = r * l.cols + c;
        out[i] = DequantizeE4m3(q[i], scale_row[c / l.block_cols]);
      }
    }
  });
}

}  // namespace dte::kernels
