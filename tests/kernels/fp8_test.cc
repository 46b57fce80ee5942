// Block-scaled FP8 quantization of tensors (kernels/fp8.h) against a serial
// reference over the shared element math, and the FP8 change set against
// quantizing both versions and comparing every byte and scale.
#include "kernels/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scale;
  std::string error;
};

Quantized Quantize(const Fp8Layout& l, const std::vector<uint16_t>& x) {
  Quantized out{std::vector<uint8_t>(l.num_elements()), std::vector<float>(l.num_blocks()), ""};
  out.error = Fp8Quantize(l, x.data(), out.q.data(), out.scale.data(), "layers.0.mlp.up_proj");
  return out;
}

// Serial reference: each block's amax as the largest std::fabs over floats.
Quantized Reference(const Fp8Layout& l, const std::vector<uint16_t>& x) {
  Quantized out{std::vector<uint8_t>(l.num_elements()), std::vector<float>(l.num_blocks()), ""};
  for (uint64_t b = 0; b < l.num_blocks(); ++b) {
    const uint64_t r0 = b / l.grid_cols() * l.block_rows, c0 = b % l.grid_cols() * l.block_cols;
    float amax = 0.0f;
    for (uint64_t r = r0; r < std::min(r0 + l.block_rows, l.rows); ++r) {
      for (uint64_t c = c0; c < std::min(c0 + l.block_cols, l.cols); ++c) {
        amax = std::max(amax, std::fabs(Bf16BitsToFp32(x[r * l.cols + c])));
      }
    }
    out.scale[b] = Fp8BlockScale(amax, l.rule);
  }
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    const uint64_t b = i / l.cols / l.block_rows * l.grid_cols() + i % l.cols / l.block_cols;
    out.q[i] = QuantizeE4m3(Bf16BitsToFp32(x[i]), out.scale[b]);
  }
  return out;
}

// Weights like a linear layer's: normal with a few outliers, as BF16 bits.
std::vector<uint16_t> Weights(uint64_t n, uint32_t seed, float sigma = 0.02f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<uint16_t> x(n);
  for (uint64_t i = 0; i < n; ++i) x[i] = Fp32ToBf16Bits(i % 997 == 0 ? 40 * d(rng) : d(rng));
  return x;
}

std::vector<uint32_t> ScaleBits(const std::vector<float>& s) {
  std::vector<uint32_t> out;
  for (float f : s) out.push_back(FloatBits(f));
  return out;
}

void ExpectSame(const Quantized& got, const Quantized& want) {
  EXPECT_EQ(got.error, want.error);
  EXPECT_EQ(ScaleBits(got.scale), ScaleBits(want.scale));
  EXPECT_EQ(got.q, want.q);
}

TEST(Fp8Quantize, PartialEdgeBlocksMatchReferenceUnderBothRules) {
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo}) {
    const Fp8Layout l{.rows = 300, .cols = 200, .rule = rule};
    ASSERT_EQ(l.grid_rows(), 3u);
    ASSERT_EQ(l.grid_cols(), 2u);
    const std::vector<uint16_t> x = Weights(l.num_elements(), 1);
    ExpectSame(Quantize(l, x), Reference(l, x));
  }
}

TEST(Fp8Quantize, OtherBlockSizesMatchReference) {
  for (auto [br, bc] : {std::pair<uint64_t, uint64_t>{1, 1}, {1, 128}, {64, 32}, {7, 300}}) {
    const Fp8Layout l{.rows = 130, .cols = 257, .block_rows = br, .block_cols = bc};
    const std::vector<uint16_t> x = Weights(l.num_elements(), 2);
    ExpectSame(Quantize(l, x), Reference(l, x));
  }
}

TEST(Fp8Quantize, ResultDoesNotDependOnThreadCount) {
  const Fp8Layout l{.rows = 1000, .cols = 700, .rule = Fp8ScaleRule::kPowerOfTwo};
  const std::vector<uint16_t> x = Weights(l.num_elements(), 3);
  SetNumThreads(1);
  const Quantized one = Quantize(l, x);
  SetNumThreads(4);
  const Quantized four = Quantize(l, x);
  SetNumThreads(0);
  ExpectSame(four, one);
}

TEST(Fp8Quantize, ZeroBlocksKeepSignedZerosAndScaleOne) {
  const Fp8Layout l{.rows = 4, .cols = 4, .block_rows = 2, .block_cols = 2};
  std::vector<uint16_t> x(16, 0x0000);
  for (uint64_t i = 0; i < 16; i += 2) x[i] = 0x8000;  // -0.0
  const Quantized got = Quantize(l, x);
  EXPECT_EQ(got.error, "");
  EXPECT_EQ(got.scale, std::vector<float>(4, 1.0f));
  for (uint64_t i = 0; i < 16; ++i) EXPECT_EQ(got.q[i], i % 2 == 0 ? 0x80 : 0x00) << i;
}

TEST(Fp8Quantize, AllEqualBlockQuantizesToFullRange) {
  const Fp8Layout l{.rows = 128, .cols = 256};
  std::vector<uint16_t> x(l.num_elements(), Fp32ToBf16Bits(3.0f));
  for (uint64_t r = 0; r < 128; ++r) {
    for (uint64_t c = 128; c < 256; ++c) x[r * 256 + c] = Fp32ToBf16Bits(-0.1f);
  }
  const Quantized got = Quantize(l, x);
  EXPECT_EQ(got.scale[0], 3.0f / 448.0f);
  EXPECT_EQ(got.scale[1], Bf16BitsToFp32(Fp32ToBf16Bits(0.1f)) / 448.0f);
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    ASSERT_EQ(got.q[i], i % 256 < 128 ? 0x7E : 0xFE) << i;
  }
}

TEST(Fp8Quantize, SubnormalsAndTinyValuesBesideAnOutlier) {
  // One outlier of 448 makes the scale 1, so the others map directly into
  // E4M3's subnormal range, including BF16 subnormals that round to +-0.
  const Fp8Layout l{.rows = 1, .cols = 8};
  const std::vector<uint16_t> x = {Fp32ToBf16Bits(448.0f),
                                   Fp32ToBf16Bits(std::ldexp(1.0f, -9)),
                                   Fp32ToBf16Bits(std::ldexp(1.0f, -10)),
                                   Fp32ToBf16Bits(std::ldexp(3.0f, -10)),
                                   0x0001,
                                   0x8001,
                                   Fp32ToBf16Bits(-std::ldexp(5.0f, -9)),
                                   Fp32ToBf16Bits(std::ldexp(15.0f, -10))};
  const Quantized got = Quantize(l, x);
  EXPECT_EQ(got.scale[0], 1.0f);
  EXPECT_EQ(got.q, (std::vector<uint8_t>{0x7E, 0x01, 0x00, 0x02, 0x00, 0x80, 0x85, 0x08}));
}

TEST(Fp8Quantize, RefusesNanAndInfNamingTensorBlockAndElement) {
  const Fp8Layout l{.rows = 300, .cols = 200};
  for (uint16_t bad : {uint16_t{0x7FC0}, uint16_t{0x7F80}, uint16_t{0xFF80}}) {
    std::vector<uint16_t> x = Weights(l.num_elements(), 4);
    x[131 * 200 + 5] = bad;
    x[260 * 200 + 150] = bad;  // a later block: the first one is reported
    const Quantized got = Quantize(l, x);
    EXPECT_EQ(got.error,
              "tensor 'layers.0.mlp.up_proj': FP8 block (1, 0) (rows 128..255, cols 0..127) holds "
              "a NaN or infinite weight at element (131, 5); FP8 quantization refuses non-finite "
              "weights");
    // Every output is still written, as the CUDA backend writes it.
    EXPECT_TRUE(std::isnan(got.scale[2]));
    EXPECT_TRUE(std::isnan(got.scale[5]));
    EXPECT_FALSE(std::isnan(got.scale[0]));
    const Quantized want = Reference(l, x);
    for (int b : {0, 1, 3, 4}) EXPECT_EQ(FloatBits(got.scale[b]), FloatBits(want.scale[b])) << b;
    EXPECT_EQ(got.q[131 * 200 + 6], 0x7F);  // anything over a NaN scale is NaN
    EXPECT_EQ(got.q[0], want.q[0]);
  }
}

// Rows [row0, row0 + rows) of x, columns [col0, col1) quantized as a region
// (from those rows alone) equal the whole tensor's bytes and scales there.
void ExpectRegionOfWhole(const Fp8Layout& l, const std::vector<uint16_t>& x, const Quantized& whole,
                         uint64_t row0, uint64_t rows, uint64_t col0, uint64_t col1) {
  SCOPED_TRACE("rows " + std::to_string(row0) + "+" + std::to_string(rows) + ", cols " +
               std::to_string(col0) + ".." + std::to_string(col1));
  const uint64_t cols = col1 - col0;
  const uint64_t grid_rows = (rows + l.block_rows - 1) / l.block_rows;
  const uint64_t grid_cols = (cols + l.block_cols - 1) / l.block_cols;
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scale(grid_rows * grid_cols);
  const std::vector<uint16_t> band(x.begin() + row0 * l.cols, x.begin() + (row0 + rows) * l.cols);
  ASSERT_EQ(Fp8QuantizeRegion(l, band.data(), row0, rows, col0, col1, q.data(), scale.data(), "t"),
            "");
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(q[r * cols + c], whole.q[(row0 + r) * l.cols + col0 + c]) << r << ", " << c;
    }
  }
  for (uint64_t br = 0; br < grid_rows; ++br) {
    for (uint64_t bc = 0; bc < grid_cols; ++bc) {
      const uint64_t b = (row0 / l.block_rows + br) * l.grid_cols() + col0 / l.block_cols + bc;
      ASSERT_EQ(FloatBits(scale[br * grid_cols + bc]), FloatBits(whole.scale[b]))
          << br << ", " << bc;
    }
  }
}

TEST(Fp8QuantizeRegion, BandsAndColumnRangesEqualTheWholeTensorWithPartialEdgeBlocks) {
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo}) {
    const Fp8Layout l{.rows = 12, .cols = 20, .block_rows = 5, .block_cols = 7, .rule = rule};
    const std::vector<uint16_t> x = Weights(l.num_elements(), 7, 1.0f);
    const Quantized whole = Reference(l, x);
    for (auto [row0, rows] :
         {std::pair<uint64_t, uint64_t>{0, 12}, {0, 5}, {5, 5}, {10, 2}, {5, 7}, {0, 10}}) {
      for (auto [col0, col1] :
           {std::pair<uint64_t, uint64_t>{0, 20}, {0, 7}, {7, 14}, {14, 20}, {7, 20}}) {
        ExpectRegionOfWhole(l, x, whole, row0, rows, col0, col1);
      }
    }
  }
  const Fp8Layout big{.rows = 300, .cols = 200};
  const std::vector<uint16_t> x = Weights(big.num_elements(), 8);
  const Quantized whole = Reference(big, x);
  ExpectRegionOfWhole(big, x, whole, 128, 172, 128, 200);
  ExpectRegionOfWhole(big, x, whole, 0, 256, 0, 128);
}

TEST(Fp8QuantizeRegion, RefusalNamesTheBlockAndElementOfTheWholeTensor) {
  const Fp8Layout l{.rows = 300, .cols = 200};
  std::vector<uint16_t> x = Weights(l.num_elements(), 9);
  x[260 * 200 + 150] = 0x7FC0;
  x[270 * 200 + 5] = 0x7F80;  // outside the columns below: not looked at
  const uint64_t rows = 44, cols = 72;
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scale(1);
  EXPECT_EQ(Fp8QuantizeRegion(l, x.data() + 256 * 200, 256, rows, 128, 200, q.data(), scale.data(),
                              "layers.0.mlp.up_proj"),
            "tensor 'layers.0.mlp.up_proj': FP8 block (2, 1) (rows 256..299, cols 128..199) holds "
            "a NaN or infinite weight at element (260, 150); FP8 quantization refuses non-finite "
            "weights");
  x[260 * 200 + 150] = 0;
  EXPECT_EQ(Fp8QuantizeRegion(l, x.data() + 256 * 200, 256, rows, 128, 200, q.data(), scale.data(),
                              "layers.0.mlp.up_proj"),
            "");
}

TEST(Fp8Quantize, LayoutErrors) {
  EXPECT_NE(Fp8LayoutError({.rows = 4, .cols = 4, .block_rows = 0}).find("at least 1"),
            std::string::npos);
  EXPECT_NE(Fp8LayoutError({.rows = uint64_t{1} << 40, .cols = uint64_t{1} << 40}).find("overflow"),
            std::string::npos);
  EXPECT_EQ(Fp8LayoutError({.rows = 0, .cols = 5}), "");
  // A block side whose grid would wrap (rows + block - 1 past 2^64; dtectl
  // stats --fp8-block takes any 64-bit count) is refused, naming the block.
  const uint64_t huge = ~uint64_t{0};
  EXPECT_NE(Fp8LayoutError({.rows = 4, .cols = 4, .block_rows = huge})
                .find("block size " + std::to_string(huge) + " x 128"),
            std::string::npos);
  EXPECT_NE(Fp8LayoutError({.rows = 4, .cols = 4, .block_cols = huge - 2}).find("overflow"),
            std::string::npos);
  EXPECT_EQ(Fp8LayoutError({.rows = 4, .cols = 4, .block_rows = huge - 3}), "");
  const Fp8Layout empty{.rows = 0, .cols = 5};
  EXPECT_EQ(Quantize(empty, {}).error, "");
}

TEST(Fp8Dequantize, MultipliesEachByteByItsBlockScale) {
  const Fp8Layout l{.rows = 200, .cols = 130, .block_rows = 64, .block_cols = 64};
  const std::vector<uint16_t> x = Weights(l.num_elements(), 5);
  const Quantized got = Quantize(l, x);
  std::vector<float> out(l.num_elements());
  Fp8Dequantize(l, got.q.data(), got.scale.data(), out.data());
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    const uint64_t b = i / l.cols / 64 * l.grid_cols() + i % l.cols / 64;
    ASSERT_EQ(out[i], E4m3BitsToFp32(got.q[i]) * got.scale[b]) << i;
    // Within half an E4M3 step of 2^-3 relative (normal range) or of the
    // subnormal step 2^-9 * scale.
    const float xv = Bf16BitsToFp32(x[i]);
    ASSERT_LE(std::fabs(out[i] - xv),
              std::max(std::fabs(xv) / 16, std::ldexp(got.scale[b], -10)) * 1.0001f)
        << i;
  }
}

}  // namespace
}  // namespace dte::kernels
