// The E4M3 element conversion and the block scale rules (kernels/fp8_math.h)
// against references written from the format's definition in exact double
// arithmetic, independent of the bit manipulation under test.
#include "kernels/fp8_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace dte::kernels {
namespace {

// The value of a finite E4M3 byte from the format's definition.
double E4m3Value(uint8_t b) {
  const double sign = (b & 0x80) != 0 ? -1.0 : 1.0;
  const int exp = (b >> 3) & 0xF, mant = b & 7;
  if (exp == 0) return sign * std::ldexp(mant, -9);
  return sign * std::ldexp(8 + mant, exp - 7 - 3);
}

// Saturating round-to-nearest-even by comparing distances to every finite
// E4M3 magnitude (0x00..0x7E); the result keeps x's sign.
uint8_t ReferenceE4m3(float x) {
  if (std::isnan(x)) return kE4m3CanonicalNan;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7E;
  uint8_t best = 0;
  for (uint8_t m = 1; m <= 0x7E; ++m) {
    const double dm = std::fabs(E4m3Value(m) - a), db = std::fabs(E4m3Value(best) - a);
    if (dm < db || (dm == db && (m & 1) == 0)) best = m;
  }
  return sign | best;
}

TEST(Fp8Math, DecodeMatchesFormatDefinition) {
  for (int b = 0; b < 256; ++b) {
    const float got = E4m3BitsToFp32(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(got)) << b;
      EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << b;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), E4m3Value(static_cast<uint8_t>(b))) << b;
    EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << b;  // -0 decodes as -0.0
  }
}

TEST(Fp8Math, EveryFiniteByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    EXPECT_EQ(Fp32ToE4m3Bits(E4m3BitsToFp32(static_cast<uint8_t>(b))), b) << b;
  }
}

TEST(Fp8Math, EveryBf16ValueRoundsToNearestEven) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = Bf16BitsToFp32(static_cast<uint16_t>(b));
    ASSERT_EQ(Bf16ToE4m3Bits(static_cast<uint16_t>(b)), ReferenceE4m3(x)) << std::hex << b;
  }
}

TEST(Fp8Math, RandomFp32RoundsToNearestEven) {
  std::mt19937 rng(29);
  // Exponents from FP32 subnormals to far above 448, every mantissa.
  std::uniform_int_distribution<uint32_t> bits(0, 0x44FFFFFFu);
  for (int k = 0; k < 200000; ++k) {
    const uint32_t u = bits(rng) | ((k & 1) ? 0x80000000u : 0u);
    const float x = BitsToFloat(u);
    ASSERT_EQ(Fp32ToE4m3Bits(x), ReferenceE4m3(x)) << std::hex << u;
  }
}

TEST(Fp8Math, TiesSaturationZerosAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(Fp32ToE4m3Bits(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal
  EXPECT_EQ(Fp32ToE4m3Bits(-std::ldexp(1.0f, -10)), 0x80);
  EXPECT_EQ(Fp32ToE4m3Bits(std::ldexp(3.0f, -10)), 0x02);   // 1.5 units: tie to even 2
  EXPECT_EQ(Fp32ToE4m3Bits(std::ldexp(15.0f, -10)), 0x08);  // 7.5 units: the smallest normal
  EXPECT_EQ(Fp32ToE4m3Bits(1.0625f), 0x38);                 // 1 + 2^-4: tie to even 1.0
  EXPECT_EQ(Fp32ToE4m3Bits(1.1875f), 0x3A);                 // 1 + 3 * 2^-4: tie to 1.25
  EXPECT_EQ(Fp32ToE4m3Bits(440.0f), 0x7E);                  // rounds up to 448
  EXPECT_EQ(Fp32ToE4m3Bits(464.0f), 0x7E);                  // would be 480: saturates
  EXPECT_EQ(Fp32ToE4m3Bits(1e30f), 0x7E);
  EXPECT_EQ(Fp32ToE4m3Bits(-1e30f), 0xFE);
  EXPECT_EQ(Fp32ToE4m3Bits(inf), 0x7E);
  EXPECT_EQ(Fp32ToE4m3Bits(-inf), 0xFE);
  EXPECT_EQ(Fp32ToE4m3Bits(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(Fp32ToE4m3Bits(BitsToFloat(0xFFC00001u)), 0x7F);  // negative NaN, payload
  EXPECT_EQ(Fp32ToE4m3Bits(0.0f), 0x00);
  EXPECT_EQ(Fp32ToE4m3Bits(-0.0f), 0x80);
  EXPECT_EQ(Fp32ToE4m3Bits(BitsToFloat(1u)), 0x00);  // FP32 subnormal
}

TEST(Fp8Math, PlainScaleIsAmaxOver448) {
  EXPECT_EQ(Fp8BlockScale(448.0f, Fp8ScaleRule::kPlain), 1.0f);
  EXPECT_EQ(Fp8BlockScale(1.0f, Fp8ScaleRule::kPlain), 1.0f / 448.0f);
  EXPECT_EQ(Fp8BlockScale(-2.0f, Fp8ScaleRule::kPlain), 2.0f / 448.0f);  // magnitude
  EXPECT_EQ(Fp8BlockScale(0.0f, Fp8ScaleRule::kPlain), 1.0f);
  EXPECT_EQ(Fp8BlockScale(-0.0f, Fp8ScaleRule::kPlain), 1.0f);
  // The smallest BF16 subnormal still gives a positive (subnormal) scale.
  const float tiny = Bf16BitsToFp32(0x0001);
  EXPECT_GT(Fp8BlockScale(tiny, Fp8ScaleRule::kPlain), 0.0f);
  EXPECT_EQ(Fp8BlockScale(BitsToFloat(1u), Fp8ScaleRule::kPlain), BitsToFloat(1u));
  EXPECT_TRUE(
      std::isnan(Fp8BlockScale(std::numeric_limits<float>::infinity(), Fp8ScaleRule::kPlain)));
  EXPECT_TRUE(std::isnan(Fp8BlockScale(std::nanf(""), Fp8ScaleRule::kPowerOfTwo)));
}

TEST(Fp8Math, PowerOfTwoScaleRoundsUp) {
  const auto p2 = [](float amax) { return Fp8BlockScale(amax, Fp8ScaleRule::kPowerOfTwo); };
  EXPECT_EQ(p2(448.0f), 1.0f);
  EXPECT_EQ(p2(224.0f), 0.5f);
  EXPECT_EQ(p2(449.0f), 2.0f);
  EXPECT_EQ(p2(1.0f), std::ldexp(1.0f, -8));  // 1/448 lies in (2^-9, 2^-8]
  EXPECT_EQ(p2(0.0f), 1.0f);
  EXPECT_EQ(p2(Bf16BitsToFp32(0x0001)), std::ldexp(1.0f, -126));  // clamped: stays normal
  EXPECT_EQ(p2(std::numeric_limits<float>::max()), std::ldexp(1.0f, 120));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-60.0f, 60.0f);
  for (int k = 0; k < 10000; ++k) {
    const float amax = std::exp2(e(rng));
    const float s = p2(amax);
    int exp = 0;
    ASSERT_EQ(std::frexp(s, &exp), 0.5f) << amax;  // a power of two
    ASSERT_GE(s, Fp8BlockScale(amax, Fp8ScaleRule::kPlain)) << amax;
    ASSERT_LT(s / 2, Fp8BlockScale(amax, Fp8ScaleRule::kPlain)) << amax;
    // Division by a power of two is exact, so both expressions agree.
    ASSERT_EQ(QuantizeE4m3(amax, s), Fp32ToE4m3Bits(amax * (1.0f / s))) << amax;
  }
}

TEST(Fp8Math, BlockMaximumQuantizesTo448UnderPlainScale) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits(0x0001, 0x7F7F);  // finite positive BF16
  for (int k = 0; k < 100000; ++k) {
    const float amax = Bf16BitsToFp32(static_cast<uint16_t>(bits(rng)));
    const float s = Fp8BlockScale(amax, Fp8ScaleRule::kPlain);
    ASSERT_EQ(QuantizeE4m3(amax, s), 0x7E) << amax;
    ASSERT_EQ(QuantizeE4m3(-amax, s), 0xFE) << amax;
  }
}

TEST(Fp8Math, DequantizeMultipliesByTheScale) {
  EXPECT_EQ(DequantizeE4m3(0x7E, 0.5f), 224.0f);
  EXPECT_EQ(DequantizeE4m3(0x01, 1.0f), std::ldexp(1.0f, -9));
  EXPECT_EQ(DequantizeE4m3(0x80, 3.0f), -0.0f);
  EXPECT_TRUE(std::signbit(DequantizeE4m3(0x80, 3.0f)));
  EXPECT_TRUE(std::isnan(DequantizeE4m3(0x7F, 1.0f)));
}

}  // namespace
}  // namespace dte::kernels
