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

// GCC vectorizes loops with a remainder only from -O3 (the build is -O2);
// clang does at -O2 and has no such attribute. On x86-64 the loops are also
// built for AVX2 (8 floats per division instead of SSE2's 4), chosen at load
// time; the results are the same bytes (IEEE division either way).
#if defined(__GNUC__) && !defined(__clang__)
#define DTE_VECTORIZE_OPT __attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#else
#define DTE_VECTORIZE_OPT
#endif
// Not under the sanitizers: the clones' ifunc resolvers run before their
// runtime is set up (a ThreadSanitizer build crashed at start).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define DTE_NO_TARGET_CLONES 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define DTE_NO_TARGET_CLONES 1
#endif
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(DTE_NO_TARGET_CLONES)
#define DTE_VECTORIZE DTE_VECTORIZE_OPT __attribute__((target_clones("avx2", "default")))
#else
#define DTE_VECTORIZE DTE_VECTORIZE_OPT
#endif

// The largest BF16 magnitude bits of x[0 .. n).
DTE_VECTORIZE uint16_t AbsMax(const uint16_t* x, size_t n) {
  uint16_t m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max<uint16_t>(m, x[i] & 0x7FFFu);
  return m;
}

// QuantizeE4m3 over n elements that share a finite scale, written without
// branches so that the compiler vectorizes it; the same bytes as the
// element function for every finite FP32 y (checked exhaustively when it was
// written; tests/py/test_fp8_reference.py quantizes every BF16 value through
// Fp8Quantize against numpy). A finite scale is at least amax / 448 of its block, so y is never
// NaN here. Normal results round as Fp32ToE4m3Bits does; below 2^-6 the
// result is round(|y| * 2^9) to nearest even, which one FP32 addition of
// 2^14 (whose ulp is 2^-9) computes exactly: its low bits are the E4M3
// subnormal code, 8 being the smallest normal.
DTE_VECTORIZE void QuantizeRun(const uint16_t* x, uint8_t* q, size_t n, float scale) {
  constexpr uint32_t kMaxBits = 0x43E00000u;        // 448
  constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  constexpr float kSubnormalShift = 16384.0f;       // 2^14
  constexpr uint32_t kSubnormalShiftBits = 0x46800000u;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = FloatBits(rn::Div(Bf16BitsToFp32(x[i]), scale));
    const uint32_t a = u & 0x7FFFFFFFu;
    const uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    const uint32_t sub = FloatBits(rn::Add(BitsToFloat(a), kSubnormalShift)) - kSubnormalShiftBits;
    // Selected with masks: GCC does not if-convert the ternaries.
    const uint32_t is_normal = 0u - static_cast<uint32_t>(a >= kMinNormalBits);
    const uint32_t is_max = 0u - static_cast<uint32_t>(a >= kMaxBits);
    const uint32_t finite = (normal & is_normal) | (sub & ~is_normal);
    const uint32_t mag = (kE4m3MaxBits & is_max) | (finite & ~is_max);
    q[i] = static_cast<uint8_t>(((u >> 24) & 0x80u) | mag);
  }
}

}  // namespace

// BlockScale for a block whose rows are scanned by AbsMax; a block holding
// NaN or +-inf goes through BlockScale, which finds the element to refuse.
float fp8_internal::FastBlockScale(const Fp8Layout& l, const uint16_t* x, const BlockRect& rect,
                                   uint64_t* bad) {
  uint16_t amax = 0;
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    amax = std::max(amax, AbsMax(x + r * l.cols + rect.c0, rect.c1 - rect.c0));
  }
  if (Bf16AbsNonFinite(amax)) return fp8_internal::BlockScale(l, x, rect, bad);
  return Fp8BlockScale(Bf16BitsToFp32(amax), l.rule);
}

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
  // ceil(n / block) as (n + block - 1) / block must not wrap.
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  if (l.block_rows - 1 > kMax - l.rows || l.block_cols - 1 > kMax - l.cols) {
    return "FP8 block size " + std::to_string(l.block_rows) + " x " + std::to_string(l.block_cols) +
           " for " + std::to_string(l.rows) + " x " + std::to_string(l.cols) +
           " elements: the block grid overflows 64 bits";
  }
  if (l.cols != 0 && l.rows > std::numeric_limits<uint64_t>::max() / l.cols) {
    return "FP8 tensor of " + std::to_string(l.rows) + " x " + std::to_string(l.cols) +
           " elements: the element count overflows 64 bits";
  }
  return {};
}

namespace {

// Quantizes block `rect` of x (a tensor of l) by `scale` into q, whose rows
// hold q_cols bytes from column q_col0 of the tensor; `finite`: the block
// holds no NaN or inf.
void QuantizeBlock(const Fp8Layout& l, const uint16_t* x, const BlockRect& rect, float scale,
                   bool finite, uint8_t* q, uint64_t q_cols, uint64_t q_col0) {
  const uint64_t n = rect.c1 - rect.c0;
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    const uint16_t* in = x + r * l.cols + rect.c0;
    uint8_t* out = q + r * q_cols + (rect.c0 - q_col0);
    if (finite) {
      QuantizeRun(in, out, n, scale);
      continue;
    }
    for (uint64_t i = 0; i < n; ++i) out[i] = QuantizeE4m3(Bf16BitsToFp32(in[i]), scale);
  }
}

}  // namespace

std::string Fp8Quantize(const Fp8Layout& l, const uint16_t* bf16, uint8_t* q_out, float* scale_out,
                        std::string_view tensor) {
  std::vector<uint64_t> bad(l.num_blocks(), kNoElement);
  ParallelFor(l.num_blocks(), BlockGrain(l), [&](size_t begin, size_t end) {
    for (size_t b = begin; b < end; ++b) {
      const BlockRect rect = RectOf(l, b);
      const float scale = fp8_internal::FastBlockScale(l, bf16, rect, &bad[b]);
      scale_out[b] = scale;
      QuantizeBlock(l, bf16, rect, scale, bad[b] == kNoElement, q_out, l.cols, 0);
    }
  });
  return FirstRefusal(l, tensor, bad);
}

std::string Fp8QuantizeRegion(const Fp8Layout& l, const uint16_t* bf16, uint64_t row0,
                              uint64_t rows, uint64_t col0, uint64_t col1, uint8_t* q_out,
                              float* scale_out, std::string_view tensor) {
  // The rows held, as a tensor of their own: row0 is on a block boundary,
  // so its blocks are the whole tensor's, partial edge blocks included.
  const Fp8Layout band{rows, l.cols, l.block_rows, l.block_cols, l.rule};
  const uint64_t first_col = col0 / l.block_cols;
  const uint64_t grid_cols = (col1 - col0 + l.block_cols - 1) / l.block_cols;
  const uint64_t n = band.grid_rows() * grid_cols;
  std::vector<uint64_t> bad(n, kNoElement);
  ParallelFor(n, BlockGrain(band), [&](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      const uint64_t b = (k / grid_cols) * band.grid_cols() + first_col + k % grid_cols;
      const BlockRect rect = RectOf(band, b);
      const float scale = fp8_internal::FastBlockScale(band, bf16, rect, &bad[k]);
      scale_out[k] = scale;
      QuantizeBlock(band, bf16, rect, scale, bad[k] == kNoElement, q_out, col1 - col0, col0);
    }
  });
  for (uint64_t i : bad) {
    if (i != kNoElement) return fp8_internal::Refusal(l, tensor, row0 * l.cols + i);
  }
  return {};
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
