// The FP8 change set (kernels/fp8.h, Fp8Changes and Fp8ChangesAt) against
// quantizing both versions whole and comparing every byte and scale.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8.h"

namespace dte::kernels {
namespace {

constexpr char kTensor[] = "layers.3.self_attn.q_proj.weight";

// The change set by brute force.
Fp8ChangeSet BruteForce(const Fp8Layout& l, const std::vector<uint16_t>& parent,
                        const std::vector<uint16_t>& child) {
  std::vector<uint8_t> qp(l.num_elements()), qc(l.num_elements());
  std::vector<float> sp(l.num_blocks()), sc(l.num_blocks());
  EXPECT_EQ(Fp8Quantize(l, parent.data(), qp.data(), sp.data(), kTensor), "");
  EXPECT_EQ(Fp8Quantize(l, child.data(), qc.data(), sc.data(), kTensor), "");
  Fp8ChangeSet want;
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    if (qp[i] == qc[i]) continue;
    want.byte_index.push_back(i);
    want.byte_value.push_back(qc[i]);
  }
  for (uint64_t b = 0; b < l.num_blocks(); ++b) {
    if (FloatBits(sp[b]) == FloatBits(sc[b])) continue;
    want.scale_index.push_back(b);
    want.scale_value.push_back(sc[b]);
  }
  return want;
}

void ExpectEqual(const Fp8ChangeSet& got, const Fp8ChangeSet& want) {
  EXPECT_EQ(got.byte_index, want.byte_index);
  EXPECT_EQ(got.byte_value, want.byte_value);
  EXPECT_EQ(got.scale_index, want.scale_index);
  EXPECT_EQ(got.scale_value, want.scale_value);
}

std::vector<uint16_t> Weights(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<uint16_t> x(n);
  for (uint16_t& v : x) v = Fp32ToBf16Bits(d(rng));
  return x;
}

// A training step's footprint: a fraction of elements move by one BF16 ulp.
std::vector<uint16_t> Step(std::vector<uint16_t> x, double fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(fraction);
  for (uint16_t& v : x) {
    if (pick(rng)) v = static_cast<uint16_t>(rng() % 2 ? v + 1 : v - 1);
  }
  return x;
}

TEST(Fp8Changes, SparseStepMatchesBruteForceUnderBothRules) {
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo}) {
    const Fp8Layout l{.rows = 300, .cols = 260, .rule = rule};
    const std::vector<uint16_t> parent = Weights(l.num_elements(), 1);
    const std::vector<uint16_t> child = Step(parent, 0.05, 2);
    Fp8ChangeSet got;
    ASSERT_EQ(Fp8Changes(l, parent.data(), child.data(), kTensor, &got), "");
    const Fp8ChangeSet want = BruteForce(l, parent, child);
    ExpectEqual(got, want);
    EXPECT_EQ(got.blocks_touched, l.num_blocks());
    // One-ulp BF16 moves rarely change the 3-bit mantissa.
    EXPECT_GT(got.byte_index.size(), 0u);
    EXPECT_LT(got.byte_index.size(), l.num_elements() * 0.05 / 3);
  }
}

TEST(Fp8Changes, ScaleChangeReportsEveryChangedByteOfTheBlock) {
  const Fp8Layout l{.rows = 256, .cols = 256};
  const std::vector<uint16_t> parent = Weights(l.num_elements(), 3);
  std::vector<uint16_t> child = parent;
  child[5 * 256 + 200] = Fp32ToBf16Bits(0.5f);  // a new maximum in block (0, 1)
  Fp8ChangeSet got;
  ASSERT_EQ(Fp8Changes(l, parent.data(), child.data(), kTensor, &got), "");
  ExpectEqual(got, BruteForce(l, parent, child));
  EXPECT_EQ(got.scale_index, std::vector<uint64_t>{1});
  EXPECT_EQ(got.scale_value, std::vector<float>{0.5f / 448.0f});
  EXPECT_GT(got.byte_index.size(), 1000u);  // nearly every byte of the block
  EXPECT_EQ(got.blocks_touched, 1u);
}

TEST(Fp8Changes, GivenIndicesOnlyReadsTheirBlocks) {
  const Fp8Layout l{.rows = 200,
                    .cols = 300,
                    .block_rows = 64,
                    .block_cols = 64,
                    .rule = Fp8ScaleRule::kPowerOfTwo};
  const std::vector<uint16_t> parent = Weights(l.num_elements(), 5);
  const std::vector<uint16_t> child = Step(parent, 0.001, 6);
  std::vector<uint64_t> changed;
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    if (parent[i] != child[i]) changed.push_back(i);
  }
  Fp8ChangeSet got;
  ASSERT_EQ(
      Fp8ChangesAt(l, parent.data(), child.data(), changed.data(), changed.size(), kTensor, &got),
      "");
  ExpectEqual(got, BruteForce(l, parent, child));
  EXPECT_LE(got.blocks_touched, changed.size());
}

TEST(Fp8Changes, GivenIndicesMayRepeatOrIncludeUnchangedAndOutOfBounds) {
  const Fp8Layout l{.rows = 130, .cols = 140};
  const std::vector<uint16_t> parent = Weights(l.num_elements(), 9);
  const std::vector<uint16_t> child = Step(parent, 0.01, 10);
  std::vector<uint64_t> changed;
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    if (parent[i] != child[i]) changed.push_back(i);
  }
  std::vector<uint64_t> noisy = changed;
  noisy.insert(noisy.end(), changed.begin(), changed.begin() + 10);  // repeats
  noisy.push_back(3);                                                // unchanged
  noisy.push_back(l.num_elements() + 5);                             // out of bounds
  Fp8ChangeSet got;
  ASSERT_EQ(Fp8ChangesAt(l, parent.data(), child.data(), noisy.data(), noisy.size(), kTensor, &got),
            "");
  ExpectEqual(got, BruteForce(l, parent, child));
}

// Ascending indices (grouped by block without sorting) with adjacent
// repeats, unchanged ones and ones past the end.
TEST(Fp8Changes, GivenAscendingIndicesMayRepeatOrIncludeUnchangedAndOutOfBounds) {
  const Fp8Layout l{.rows = 130, .cols = 140};
  const std::vector<uint16_t> parent = Weights(l.num_elements(), 11);
  const std::vector<uint16_t> child = Step(parent, 0.01, 12);
  std::vector<uint64_t> noisy;
  for (uint64_t i = 0; i < l.num_elements(); ++i) {
    if (parent[i] != child[i]) noisy.insert(noisy.end(), i % 3 ? 1 : 2, i);
    if (i % 97 == 0 && parent[i] == child[i]) noisy.push_back(i);
  }
  noisy.insert(noisy.end(), {l.num_elements(), l.num_elements(), l.num_elements() + 5});
  Fp8ChangeSet got;
  ASSERT_EQ(Fp8ChangesAt(l, parent.data(), child.data(), noisy.data(), noisy.size(), kTensor, &got),
            "");
  ExpectEqual(got, BruteForce(l, parent, child));
  EXPECT_GT(got.byte_index.size(), 0u);
}

TEST(Fp8Changes, NoChangeIsEmpty) {
  const Fp8Layout l{.rows = 10, .cols = 10};
  const std::vector<uint16_t> x = Weights(100, 7);
  Fp8ChangeSet got;
  got.byte_index = {1, 2};  // overwritten
  ASSERT_EQ(Fp8Changes(l, x.data(), x.data(), kTensor, &got), "");
  EXPECT_TRUE(got.byte_index.empty());
  EXPECT_TRUE(got.scale_index.empty());
  EXPECT_EQ(got.blocks_touched, 0u);
}

TEST(Fp8Changes, RefusesNonFiniteNamingTheVersion) {
  const Fp8Layout l{.rows = 130, .cols = 130};
  const std::vector<uint16_t> parent = Weights(l.num_elements(), 8);
  std::vector<uint16_t> child = parent;
  child[129 * 130 + 129] = 0x7F80;  // +inf in block (1, 1)
  Fp8ChangeSet got;
  EXPECT_EQ(Fp8Changes(l, parent.data(), child.data(), kTensor, &got),
            std::string("tensor '") + kTensor +
                "': FP8 block (1, 1) (rows 128..129, cols 128..129) holds a NaN or infinite "
                "weight at element (129, 129); FP8 quantization refuses non-finite weights (in "
                "the new version)");
  EXPECT_NE(Fp8Changes(l, child.data(), parent.data(), kTensor, &got).find("(in the parent"),
            std::string::npos);
}

}  // namespace
}  // namespace dte::kernels
