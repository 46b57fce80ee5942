// The FP8 change counts of `dtectl stats --fp8` (store/ops/fp8_stats.h):
// counted from the changed elements, they equal what kernels::Fp8Changes
// finds comparing whole tensors, under both scale rules; over a store, per
// quantized tensor of a version read back from its records.
#include "store/ops/fp8_stats.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using kernels::Fp8ScaleRule;

constexpr uint64_t kRows = 200, kCols = 300;  // a 2 x 3 grid of 128 x 128, partial edges

uint16_t Bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);  // the values below are exact in BF16
}

// Deterministic nonzero weights in [0.25, 0.5) with alternating signs, so
// every element of a block has a normal E4M3 byte that halving changes.
std::vector<uint16_t> Weights() {
  std::vector<uint16_t> w(kRows * kCols);
  for (uint64_t i = 0; i < w.size(); ++i) {
    const float mag = 0.25f + 0.25f * static_cast<float>(i * 37 % 128) / 128.0f;
    w[i] = Bf16(i % 2 ? -mag : mag);
  }
  return w;
}

uint64_t At(uint64_t r, uint64_t c) { return r * kCols + c; }

// Where Weights() puts the magnitude 0.25 + 0.25 * k / 128.
uint64_t Level(uint64_t i) { return i * 37 % 128; }

// The set kernels::Fp8Changes finds comparing every element.
kernels::Fp8ChangeSet BruteForce(const std::vector<uint16_t>& parent,
                                 const std::vector<uint16_t>& child, Fp8ScaleRule rule) {
  kernels::Fp8Layout l;
  l.rows = kRows;
  l.cols = kCols;
  l.rule = rule;
  kernels::Fp8ChangeSet set;
  EXPECT_EQ(kernels::Fp8Changes(l, parent.data(), child.data(), "w", &set), "");
  return set;
}

uint64_t BytesInBlock(const kernels::Fp8ChangeSet& set, uint64_t br, uint64_t bc) {
  uint64_t n = 0;
  for (uint64_t i : set.byte_index) n += (i / kCols / 128 == br && i % kCols / 128 == bc) ? 1 : 0;
  return n;
}

TEST(Fp8Stats, CountsEqualTheWholeTensorChangeSetUnderBothRules) {
  const std::vector<uint16_t> parent = Weights();
  std::vector<uint16_t> child = parent;
  std::vector<uint64_t> changed;
  auto bump = [&](uint64_t i, int ulps) {
    child[i] = static_cast<uint16_t>(child[i] + ulps);
    changed.push_back(i);
  };
  // Block (0, 0): one-ulp moves of elements below the block's maximum
  // (the scale stays); most keep their byte.
  for (uint64_t r = 0; r < 128; r += 9) {
    if (Level(At(r, r % 100)) < 120) bump(At(r, r % 100), 1);
  }
  ASSERT_GE(changed.size(), 10u);
  // Block (0, 1): its largest magnitude doubled, so the scale doubles under
  // both rules and every byte of the block changes, not only the one moved.
  child[At(3, 130)] = Bf16(-1.0f);
  changed.push_back(At(3, 130));
  // Block (1, 0), a partial one: its largest element up by one ulp moves the
  // plain scale, not the power-of-two one (still the same power of two).
  uint64_t amax_at = At(128, 0);
  while (Level(amax_at) != 127) ++amax_at;  // 255 / 512, the block's maximum
  ASSERT_LT(amax_at % kCols, 128u);
  bump(amax_at, 1);  // to 0.5: plain scales 255 / 512 / 448 -> 0.5 / 448, both in 2^-9
  // Block (1, 2), partial in both directions: an element below the maximum
  // moved down far.
  ASSERT_LT(Level(At(199, 299)), 127u);
  bump(At(199, 299), -40);
  std::sort(changed.begin(), changed.end());

  // Candidates may hold unchanged and out-of-range indices as well.
  std::vector<uint64_t> candidates = changed;
  candidates.insert(candidates.begin(), {0, 1});
  candidates.push_back(kRows * kCols + 5);
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());

  auto c = CountFp8Changes({}, "model.layers.0.mlp.up_proj.weight", kRows, kCols, parent.data(),
                           child.data(), candidates);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->elements, kRows * kCols);
  EXPECT_EQ(c->blocks, 6u);
  EXPECT_EQ(c->bf16_changed, changed.size());
  EXPECT_EQ(c->bf16_step_bytes(), 2 * changed.size());
  const kernels::Fp8ChangeSet plain = BruteForce(parent, child, Fp8ScaleRule::kPlain);
  const kernels::Fp8ChangeSet pow2 = BruteForce(parent, child, Fp8ScaleRule::kPowerOfTwo);
  EXPECT_EQ(c->plain.bytes_changed, plain.byte_index.size());
  EXPECT_EQ(c->plain.scales_changed, plain.scale_index.size());
  EXPECT_EQ(c->pow2.bytes_changed, pow2.byte_index.size());
  EXPECT_EQ(c->pow2.scales_changed, pow2.scale_index.size());
  EXPECT_EQ(c->plain.step_bytes(), plain.byte_index.size() + 4 * plain.scale_index.size());
  // The scales: blocks (0, 1) and (1, 0) under the plain rule, only (0, 1)
  // under the power-of-two rule.
  EXPECT_EQ(plain.scale_index, (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(pow2.scale_index, (std::vector<uint64_t>{1}));
  // Every byte of block (0, 1) changed under both rules.
  EXPECT_EQ(BytesInBlock(plain, 0, 1), 128u * 128u);
  EXPECT_EQ(BytesInBlock(pow2, 0, 1), 128u * 128u);
  // Fewer FP8 bytes than BF16 elements changed in block (0, 0).
  EXPECT_LT(BytesInBlock(plain, 0, 0), 15u);
}

TEST(Fp8Stats, NothingChangedCountsNothingAndReadsNoElements) {
  const std::vector<uint16_t> w = Weights();
  auto c = CountFp8Changes({}, "w", kRows, kCols, w.data(), w.data(), std::vector<uint64_t>{4, 9});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bf16_changed, 0u);
  EXPECT_EQ(c->plain.step_bytes() + c->pow2.step_bytes(), 0u);
  // No element is read when no index is given.
  c = CountFp8Changes({}, "w", kRows, kCols, nullptr, nullptr, {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->blocks, 6u);
}

TEST(Fp8Stats, ANonFiniteWeightInAChangedBlockNamesTensorAndBlock) {
  const std::vector<uint16_t> parent = Weights();
  std::vector<uint16_t> child = parent;
  child[At(140, 260)] = 0x7FC0;  // NaN, in block (1, 2)
  const std::vector<uint64_t> changed = {At(140, 260)};
  auto c = CountFp8Changes({}, "model.layers.1.self_attn.q_proj.weight", kRows, kCols,
                           parent.data(), child.data(), changed);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("model.layers.1.self_attn.q_proj.weight"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("block (1, 2)"), std::string::npos) << c.status().message();
  // Block sizes of 0 are refused, naming the tensor.
  Fp8StatsOptions zero;
  zero.block_rows = 0;
  c = CountFp8Changes(zero, "w", kRows, kCols, parent.data(), child.data(), changed);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("'w'"), std::string::npos) << c.status().message();
}

std::vector<uint16_t> Elements(const test::TestTensor& t) {
  std::vector<uint16_t> out(t.data.size() / 2);
  std::memcpy(out.data(), t.data.data(), t.data.size());
  return out;
}

// A version's counts read back from the store equal those of the tensors
// it was written from: sparse records (v1) and dense ones (v2), tensors
// the policy skips left out: the head, the embeddings, the norm and, unless
// partial blocks are asked for, o_proj (300 x 200, not whole 128 x 128
// blocks), as the FP8 view of the same block leaves them.
TEST(Fp8Stats, AVersionsQuantizedTensorsReadBackFromTheStore) {
  test::ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path() + "/store");
  ASSERT_NE(store, nullptr);
  test::VersionWriter writer(&store->objects());
  std::vector<test::TestTensor> t = {
      test::Bf16Tensor("model.embed_tokens.weight", {64, 256}, 1),
      test::Bf16Tensor("model.layers.0.mlp.up_proj.weight", {512, 384}, 2),
      test::Bf16Tensor("model.layers.0.input_layernorm.weight", {384}, 3),
      test::Bf16Tensor("model.layers.0.self_attn.o_proj.weight", {300, 200}, 4),
      test::Bf16Tensor("lm_head.weight", {64, 256}, 5)};
  ASSERT_TRUE(writer.Write(0, t, true).ok());
  std::vector<std::vector<test::TestTensor>> versions = {t};
  for (uint64_t v = 1; v <= 2; ++v) {
    for (size_t i = 0; i < t.size(); ++i) {
      // v1: 2% of the elements move a little; v2: new weights, stored dense.
      if (v == 1) test::PerturbElements(&t[i].data, 2, t[i].elements() / 50, 10 + i);
      if (v == 2) t[i].data = test::RandomBf16(t[i].elements(), 20 + i);
    }
    ASSERT_TRUE(writer.Write(v, t, false).ok());
    versions.push_back(t);
  }
  ASSERT_EQ(writer.records(1)[1].kind, BlockKind::kSparse);
  ASSERT_NE(writer.records(2)[1].kind, BlockKind::kSparse);
  auto v0 = store->GetVersion(0);
  ASSERT_TRUE(v0.ok());
  Status anchor = Fp8StatsReader(*store, {}).CountVersion(*v0, [](const Fp8TensorCounts&) {
    return Status::Ok();
  });
  EXPECT_EQ(anchor.code(), Code::kInvalidArgument) << anchor.message();
  for (uint64_t pass = 0; pass < 4; ++pass) {  // versions 1 and 2, then with partial blocks
    const bool partial = pass >= 2;
    const uint64_t at = pass % 2 + 1;
    Fp8StatsOptions options;
    options.policy.quantize_partial_blocks = partial;
    Fp8StatsReader reader(*store, options);
    // The projections: up_proj, and o_proj with partial blocks.
    const std::vector<size_t> counted =
        partial ? std::vector<size_t>{1, 3} : std::vector<size_t>{1};
    auto version = store->GetVersion(at);
    ASSERT_TRUE(version.ok());
    std::vector<Fp8TensorCounts> got;
    Status s = reader.CountVersion(*version, [&](const Fp8TensorCounts& c) {
      got.push_back(c);
      return Status::Ok();
    });
    ASSERT_TRUE(s.ok()) << s.message();
    ASSERT_EQ(got.size(), counted.size()) << "v" << at;
    for (size_t k = 0; k < counted.size(); ++k) {
      const size_t i = counted[k];
      const auto parent = Elements(versions[at - 1][i]), child = Elements(versions[at][i]);
      EXPECT_EQ(got[k].name, t[i].name);
      const auto rows = static_cast<uint64_t>(t[i].shape[0]);
      const auto cols = static_cast<uint64_t>(t[i].shape[1]);
      EXPECT_EQ(got[k].bf16_changed,
                test::CountDifferingElements(versions[at - 1][i].data, versions[at][i].data, 2));
      for (auto [rule, counts] : {std::pair{Fp8ScaleRule::kPlain, got[k].plain},
                                  std::pair{Fp8ScaleRule::kPowerOfTwo, got[k].pow2}}) {
        kernels::Fp8Layout l{rows, cols, 128, 128, rule};
        kernels::Fp8ChangeSet set;
        ASSERT_EQ(kernels::Fp8Changes(l, parent.data(), child.data(), t[i].name, &set), "");
        EXPECT_EQ(counts.bytes_changed, set.byte_index.size()) << t[i].name << " v" << at;
        EXPECT_EQ(counts.scales_changed, set.scale_index.size()) << t[i].name << " v" << at;
        EXPECT_GT(counts.bytes_changed, 0u);
      }
    }
  }
}

}  // namespace
}  // namespace dte
