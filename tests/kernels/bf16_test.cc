#include "kernels/bf16.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

// Value of BF16 bits as a double, with the infinity pattern standing for
// 2^128: IEEE rounding treats overflow as if the exponent range continued.
double Bf16ValueUnbounded(uint32_t b) {
  const double sign = (b & 0x8000u) != 0 ? -1.0 : 1.0;
  if ((b & 0x7FFFu) == 0x7F80u) return sign * std::ldexp(1.0, 128);
  return static_cast<double>(BitsToFloat(b << 16));
}

// Round-to-nearest-even by comparing distances to both neighbours in exact
// double arithmetic: an implementation independent of the bias trick.
uint16_t ReferenceBf16(uint32_t u) {
  const float f = BitsToFloat(u);
  if (std::isnan(f)) return 0x7FC0;
  if (std::isinf(f)) return static_cast<uint16_t>(u >> 16);
  const uint32_t lo = u >> 16;  // truncation: same sign, magnitude rounded down
  if ((u & 0xFFFFu) == 0) return static_cast<uint16_t>(lo);
  const uint32_t hi = lo + 1;  // next magnitude up (may be the inf pattern)
  const double x = static_cast<double>(f);
  const double dlo = std::fabs(x - Bf16ValueUnbounded(lo));
  const double dhi = std::fabs(Bf16ValueUnbounded(hi) - x);
  if (dlo < dhi) return static_cast<uint16_t>(lo);
  if (dhi < dlo) return static_cast<uint16_t>(hi);
  return static_cast<uint16_t>((lo & 1u) == 0 ? lo : hi);
}

// Checks every pattern in [first, last] in parallel; returns mismatches and
// records the first one.
size_t CountMismatches(uint64_t first, uint64_t last, uint32_t* example) {
  std::atomic<size_t> bad{0};
  std::atomic<uint32_t> ex{0};
  ParallelFor(last - first + 1, 1 << 16, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const uint32_t u = static_cast<uint32_t>(first + i);
      if (Fp32ToBf16Bits(BitsToFloat(u)) != ReferenceBf16(u)) {
        if (bad.fetch_add(1) == 0) ex.store(u);
      }
    }
  });
  *example = ex.load();
  return bad.load();
}

TEST(Bf16, KnownValuesRoundToNearestEven) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: tie, stays even
      {0x3F818000u, 0x3F82},  // 1 + 3 * 2^-8: tie, rounds up to even
      {0x3F808001u, 0x3F81},  // just above the tie
      {0x3F817FFFu, 0x3F81},  // just below the next tie
      {0x7F7F7FFFu, 0x7F7F},  // below the overflow threshold
      {0x7F7F8000u, 0x7F80},  // tie between max finite and inf: inf is even
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX rounds up into inf
      {0xFF7FFFFFu, 0xFF80},  // -FLT_MAX into -inf
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0 keeps its sign
      {0x00000001u, 0x0000},  // smallest subnormal rounds to +0
      {0x80000001u, 0x8000},  // ... and its negative to -0
      {0x00008000u, 0x0000},  // subnormal tie, even
      {0x00018000u, 0x0002},  // subnormal tie, up to even
      {0x00008001u, 0x0001},  // above the tie
      {0x007FFFFFu, 0x0080},  // largest subnormal rounds up to the smallest normal
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0x7F800001u, 0x7FC0},  // signalling NaN
      {0xFFFFFFFFu, 0x7FC0},  // negative NaN, full payload
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Fp32ToBf16Bits(BitsToFloat(c.in)), c.out) << std::hex << c.in;
    EXPECT_EQ(ReferenceBf16(c.in), c.out) << "reference disagrees on " << std::hex << c.in;
  }
}

TEST(Bf16, EverySubnormalAndZeroOfBothSignsMatchesReference) {
  uint32_t ex;
  EXPECT_EQ(CountMismatches(0x00000000u, 0x007FFFFFu, &ex), 0u) << std::hex << ex;
  EXPECT_EQ(CountMismatches(0x80000000u, 0x807FFFFFu, &ex), 0u) << std::hex << ex;
}

TEST(Bf16, EveryNanPayloadOfBothSignsBecomesCanonical) {
  std::atomic<size_t> bad{0};
  for (uint32_t sign : {0u, 0x80000000u}) {
    ParallelFor(0x7FFFFF, 1 << 16, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const uint32_t u = sign | 0x7F800000u | static_cast<uint32_t>(i + 1);
        if (Fp32ToBf16Bits(BitsToFloat(u)) != kBf16CanonicalNan) bad.fetch_add(1);
      }
    });
  }
  EXPECT_EQ(bad.load(), 0u);
}

TEST(Bf16, TiesAndTheirNeighboursForEveryBf16ValueMatchReference) {
  // For each of the 65536 upper halves, the low halves where rounding
  // decisions happen: exact, tie, one ulp either side, extremes.
  const uint32_t lows[] = {0x0000, 0x0001, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF};
  size_t bad = 0;
  uint32_t example = 0;
  for (uint32_t hi = 0; hi <= 0xFFFF; ++hi) {
    for (uint32_t low : lows) {
      const uint32_t u = hi << 16 | low;
      if (Fp32ToBf16Bits(BitsToFloat(u)) != ReferenceBf16(u) && bad++ == 0) example = u;
    }
  }
  EXPECT_EQ(bad, 0u) << "first mismatch " << std::hex << example;
}

TEST(Bf16, EveryPatternNearOverflowMatchesReference) {
  // All finite values whose upper half is the largest finite BF16 (both
  // signs): the ones above the tie must round into infinity.
  uint32_t ex;
  EXPECT_EQ(CountMismatches(0x7F7F0000u, 0x7F7FFFFFu, &ex), 0u) << std::hex << ex;
  EXPECT_EQ(CountMismatches(0xFF7F0000u, 0xFF7FFFFFu, &ex), 0u) << std::hex << ex;
}

TEST(Bf16, RandomPatternsAndOneWholeBinadeMatchReference) {
  uint32_t ex;
  EXPECT_EQ(CountMismatches(0x3F800000u, 0x3FFFFFFFu, &ex), 0u) << std::hex << ex;  // [1, 2)
  std::mt19937 rng(42);
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t u = static_cast<uint32_t>(rng());
    ASSERT_EQ(Fp32ToBf16Bits(BitsToFloat(u)), ReferenceBf16(u)) << std::hex << u;
  }
}

TEST(Bf16, WideningIsExactAndRoundTripsEveryNonNanValue) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float f = Bf16BitsToFp32(static_cast<uint16_t>(b));
    ASSERT_EQ(FloatBits(f), b << 16);
    const bool nan = (b & 0x7FFFu) > 0x7F80u;
    ASSERT_EQ(Fp32ToBf16Bits(f), nan ? kBf16CanonicalNan : b) << std::hex << b;
  }
}

TEST(Bf16, ArrayCastsMatchElementFunctionsAtSeveralSizes) {
  std::mt19937 rng(7);
  for (size_t n : {0, 1, 17, 65536, 65536 * 3 + 5, 1000003}) {
    std::vector<uint32_t> bits(n);
    for (auto& u : bits) u = static_cast<uint32_t>(rng());
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) in[i] = BitsToFloat(bits[i]);
    std::vector<uint16_t> out(n);
    CastFp32ToBf16(in.data(), out.data(), n);
    std::vector<float> back(n);
    CastBf16ToFp32(out.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out[i], Fp32ToBf16Bits(in[i])) << "n=" << n << " i=" << i;
      ASSERT_EQ(FloatBits(back[i]), static_cast<uint32_t>(out[i]) << 16);
    }
  }
}

}  // namespace
}  // namespace dte::kernels
