// FP8 receiver plans against an independent construction: quantizing each
// receiver's BF16 shard (sliced directly, tests/sync/transfer_test_util.h)
// must give, bit for bit, what the plan scatters from the canonical
// quantization, whole or as change sets of a sequence of versions.
#include "sync/transfer/fp8_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "tests/sync/transfer_test_util.h"

namespace dte {
namespace {

using kernels::Fp8ChangeSet;
using kernels::Fp8Layout;
using kernels::Fp8ScaleRule;
using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::ShardModel;
using transfer_test::State;

using Scales = std::map<std::string, std::vector<float>>;

// A receiver rank's FP8 tensors: bytes by weight name, scales by scale name.
struct Fp8State {
  State q;
  Scales scales;
};

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// Finite BF16 weights of about unit size (random bytes would hold NaN).
State FiniteModel(const std::vector<PlanTensor>& specs, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0, 0.05f);
  State s;
  for (const PlanTensor& t : specs) {
    Bytes b(transfer_test::ByteSize(t));
    if (t.dtype == DType::kBF16) {
      for (size_t i = 0; i < b.size() / 2; ++i) {
        const uint16_t v = Bf16(normal(rng));
        std::memcpy(&b[2 * i], &v, 2);
      }
    }
    s[t.name] = std::move(b);
  }
  return s;
}

// An AdamW-like step: a fraction of BF16 elements move by a few ulps, and
// one element of every third quantized tensor jumps (so some scales move).
State Step(const std::vector<PlanTensor>& specs, const State& old, double density,
           std::mt19937_64& rng) {
  State out = old;
  std::uniform_real_distribution<double> u(0, 1);
  int k = 0;
  for (const PlanTensor& t : specs) {
    if (t.dtype != DType::kBF16) continue;
    Bytes& b = out[t.name];
    auto* v = reinterpret_cast<uint16_t*>(b.data());
    for (size_t i = 0; i < b.size() / 2; ++i) {
      if (u(rng) < density) v[i] ^= 1;  // one ulp, stays finite
    }
    if (t.shape.size() == 2 && k++ % 3 == 0) v[rng() % (b.size() / 2)] = Bf16(0.9f);
  }
  return out;
}

Fp8Layout LayoutOf(const std::vector<uint64_t>& shape, const Fp8ReceiverOptions& o) {
  return {shape[0], shape[1], o.block_rows, o.block_cols, o.rule};
}

struct Quantized {
  Bytes q;
  std::vector<float> scales;
};

Quantized Quantize(const Fp8Layout& l, const Bytes& bf16, const std::string& name) {
  Quantized out{Bytes(l.num_elements()), std::vector<float>(l.num_blocks())};
  const std::string err = kernels::Fp8Quantize(l, reinterpret_cast<const uint16_t*>(bf16.data()),
                                               out.q.data(), out.scales.data(), name);
  EXPECT_EQ(err, "");
  return out;
}

// The reference: slice the BF16 model for the rank, quantize each FP8 tensor.
Fp8State Reference(const ModelConfig& c, const std::vector<PlanTensor>& specs, const State& s,
                   const ShardLayout& layout, int rank, const TransferPlan& plan,
                   const Fp8ReceiverPlan& fp) {
  const State shard = ShardModel(c, specs, s, layout, rank);
  Fp8State out;
  for (size_t i = 0; i < fp.tensors.size(); ++i) {
    if (!fp.tensors[i].fp8) continue;
    const PlanTensor& t = plan.receiver_tensors[rank][i];
    Quantized q = Quantize(LayoutOf(t.shape, fp.options), shard.at(t.name), t.name);
    out.q[t.name] = std::move(q.q);
    out.scales[fp.tensors[i].scale_name] = std::move(q.scales);
  }
  return out;
}

// Writes canonical change sets through the plan into a receiver.
void Scatter(const TransferPlan& plan, const Fp8ReceiverPlan& fp,
             const std::map<uint32_t, Fp8ChangeSet>& changes, Fp8State* r) {
  Fp8OpIndices idx;
  for (const Fp8ReceiverOp& op : fp.ops) {
    auto it = changes.find(op.canonical);
    if (it == changes.end()) continue;
    const Fp8ChangeSet& cs = it->second;
    RemapFp8Changes(op, cs, &idx);
    const PlanTensor& t = plan.receiver_tensors[fp.rank][op.receiver_tensor];
    Bytes& q = r->q[t.name];
    std::vector<float>& sc = r->scales[fp.tensors[op.receiver_tensor].scale_name];
    q.resize(ShapeElements(t.shape));
    sc.resize(ShapeElements(fp.tensors[op.receiver_tensor].scale_shape));
    for (size_t j = 0; j < idx.byte_index.size(); ++j) {
      q.at(idx.byte_index[j]) = cs.byte_value[idx.byte_pos[j]];
    }
    for (size_t j = 0; j < idx.scale_index.size(); ++j) {
      sc.at(idx.scale_index[j]) = cs.scale_value[idx.scale_pos[j]];
    }
  }
}

void ExpectSame(const Fp8State& got, const Fp8State& want, const std::string& what) {
  ASSERT_EQ(got.q.size(), want.q.size()) << what;
  for (const auto& [name, bytes] : want.q) EXPECT_EQ(got.q.at(name), bytes) << what << " " << name;
  ASSERT_EQ(got.scales.size(), want.scales.size()) << what;
  for (const auto& [name, s] : want.scales) {
    const std::vector<float>& g = got.scales.at(name);
    ASSERT_EQ(g.size(), s.size()) << what << " " << name;
    EXPECT_EQ(std::memcmp(g.data(), s.data(), 4 * s.size()), 0) << what << " " << name;
  }
}

class Fp8PlanTest : public ::testing::TestWithParam<std::tuple<int, Fp8ScaleRule>> {};

// Fills receivers from version 0, then walks 0 -> 1 -> 2 -> 1 -> 0 by change
// sets; after each step every rank equals the quantization of its shard.
TEST_P(Fp8PlanTest, ReceiversEqualQuantizedShardsAcrossSteps) {
  const auto [tp, rule] = GetParam();
  const ModelConfig c;
  const std::vector<PlanTensor> specs = transfer_test::ModelSpecs(c);
  std::mt19937_64 rng(7 + tp);
  std::vector<State> versions = {FiniteModel(specs, rng)};
  for (int v = 1; v < 3; ++v) versions.push_back(Step(specs, versions.back(), 0.3, rng));
  const ShardLayout layout = FusedReceiverLayout(tp);
  auto plan = MakeTransferPlan(specs, c.Geometry(), ShardLayout{1, false, false}, layout);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  Fp8ReceiverOptions o;
  o.block_rows = o.block_cols = 4;
  o.rule = rule;
  uint64_t scale_changes = 0;
  for (int rank = 0; rank < tp; ++rank) {
    auto fp = MakeFp8ReceiverPlan(*plan, rank, o);
    ASSERT_TRUE(fp.ok()) << fp.status().ToString();
    ASSERT_FALSE(fp->ops.empty());
    std::map<uint32_t, Fp8ChangeSet> whole;
    for (uint32_t i = 0; i < specs.size(); ++i) {
      if (!fp->canonical_fp8[i]) continue;
      const Fp8Layout l = fp->canonical_layout[i];
      Quantized q = Quantize(l, versions[0].at(specs[i].name), specs[i].name);
      whole[i] = WholeFp8ChangeSet(l, q.q.data(), q.scales.data());
    }
    Fp8State r;
    Scatter(*plan, *fp, whole, &r);
    ExpectSame(r, Reference(c, specs, versions[0], layout, rank, *plan, *fp), "version 0");
    int at = 0;
    for (int next : {1, 2, 1, 0}) {
      std::map<uint32_t, Fp8ChangeSet> changes;
      for (uint32_t i = 0; i < specs.size(); ++i) {
        if (!fp->canonical_fp8[i]) continue;
        const auto* a = reinterpret_cast<const uint16_t*>(versions[at].at(specs[i].name).data());
        const auto* b = reinterpret_cast<const uint16_t*>(versions[next].at(specs[i].name).data());
        ASSERT_EQ(kernels::Fp8Changes(fp->canonical_layout[i], a, b, specs[i].name, &changes[i]),
                  "");
        scale_changes += changes[i].scale_index.size();
      }
      Scatter(*plan, *fp, changes, &r);
      ExpectSame(r, Reference(c, specs, versions[next], layout, rank, *plan, *fp),
                 "step to version " + std::to_string(next) + " rank " + std::to_string(rank));
      at = next;
    }
  }
  EXPECT_GT(scale_changes, 0u);  // the steps exercised moved scales
}

INSTANTIATE_TEST_SUITE_P(TpAndRule, Fp8PlanTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Fp8ScaleRule::kPlain,
                                                              Fp8ScaleRule::kPowerOfTwo)));

Result<TransferPlan> Plan(const ShardLayout& layout) {
  const ModelConfig c;
  return MakeTransferPlan(transfer_test::ModelSpecs(c), c.Geometry(), ShardLayout{1, false, false},
                          layout);
}

TEST(Fp8Plan, DecidesTensorsByPolicyAndNamesScales) {
  auto plan = Plan(FusedReceiverLayout(2));
  ASSERT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.block_rows = o.block_cols = 4;
  auto fp = MakeFp8ReceiverPlan(*plan, 1, o);
  ASSERT_TRUE(fp.ok()) << fp.status().ToString();
  std::map<std::string, Fp8ReceiverTensor> by_name;
  for (size_t i = 0; i < fp->tensors.size(); ++i) {
    by_name[plan->receiver_tensors[1][i].name] = fp->tensors[i];
  }
  const Fp8ReceiverTensor& qkv = by_name.at("model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_TRUE(qkv.fp8);
  EXPECT_EQ(qkv.scale_name, "model.layers.0.self_attn.qkv_proj.weight_scale_inv");
  EXPECT_EQ(qkv.scale_shape, (std::vector<uint64_t>{6, 4}));  // 24 x 16 rows on rank 1
  EXPECT_EQ(by_name.at("model.layers.1.mlp.down_proj.weight").scale_shape,
            (std::vector<uint64_t>{4, 3}));  // 16 x 12
  EXPECT_FALSE(by_name.at("lm_head.weight").fp8);
  EXPECT_EQ(by_name.at("lm_head.weight").decision, Fp8Decision::kSkippedModule);
  EXPECT_FALSE(by_name.at("model.embed_tokens.weight").fp8);
  EXPECT_EQ(by_name.at("model.layers.0.self_attn.qkv_proj.bias").decision, Fp8Decision::kNot2d);
  EXPECT_EQ(by_name.at("model.norm.weight").decision, Fp8Decision::kNotBf16);
}

TEST(Fp8Plan, FusedTensorIsBf16UnlessEveryPartIsQuantized) {
  auto plan = Plan(FusedReceiverLayout(1));
  ASSERT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.block_rows = o.block_cols = 4;
  o.policy.skip_modules.push_back("k_proj");
  auto fp = MakeFp8ReceiverPlan(*plan, 0, o);
  ASSERT_TRUE(fp.ok()) << fp.status().ToString();
  for (size_t i = 0; i < fp->tensors.size(); ++i) {
    const std::string& name = plan->receiver_tensors[0][i].name;
    if (name.find("qkv_proj.weight") != std::string::npos) {
      EXPECT_FALSE(fp->tensors[i].fp8) << name;
      EXPECT_EQ(fp->tensors[i].decision, Fp8Decision::kSkippedModule) << name;
    }
    if (name.find("gate_up_proj.weight") != std::string::npos) {
      EXPECT_TRUE(fp->tensors[i].fp8) << name;
    }
  }
  for (const Fp8ReceiverOp& op : fp->ops) EXPECT_TRUE(fp->tensors[op.receiver_tensor].fp8);
}

TEST(Fp8Plan, RefusesASplitOffBlockBoundariesNamingTensorSplitAndBlock) {
  auto plan = Plan(ShardLayout{2, false, false});
  ASSERT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.block_rows = 4;
  o.block_cols = 8;  // down_proj's 24 columns split at 12
  auto fp = MakeFp8ReceiverPlan(*plan, 1, o);
  ASSERT_FALSE(fp.ok());
  EXPECT_EQ(fp.status().code(), Code::kInvalidArgument);
  const std::string m = fp.status().message();
  EXPECT_NE(m.find("'model.layers.0.mlp.down_proj.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("tp=2"), std::string::npos) << m;
  EXPECT_NE(m.find("columns [12, 24) of 24"), std::string::npos) << m;
  EXPECT_NE(m.find("FP8 block 8"), std::string::npos) << m;
  // Unsplit, the same blocks are fine.
  auto whole = Plan(ShardLayout{1, false, false});
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(MakeFp8ReceiverPlan(*whole, 0, o).ok());
}

// Only with partial blocks can a fused part be quantized and yet land off
// the blocks: every part is then whole blocks, and so is every offset.
TEST(Fp8Plan, RefusesAFusedPartOffBlockBoundariesInTheReceiverTensor) {
  // Fused on one rank: q (32 rows) then k at rows [32, 40): a block of 16
  // rows would mix k and v.
  auto plan = Plan(FusedReceiverLayout(1));
  ASSERT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.block_rows = 16;
  o.block_cols = 4;
  o.policy.quantize_partial_blocks = true;
  auto fp = MakeFp8ReceiverPlan(*plan, 0, o);
  ASSERT_FALSE(fp.ok());
  const std::string m = fp.status().message();
  EXPECT_NE(m.find("'model.layers.0.self_attn.k_proj.weight' lands in rows [32, 40) of 48 of "
                   "'model.layers.0.self_attn.qkv_proj.weight'"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("FP8 block 16"), std::string::npos) << m;
}

// A receiver decides with its own block, on the canonical tensors: under
// 16 x 16 blocks k_proj and v_proj (8 rows), gate_proj and up_proj (24
// rows) and down_proj (24 columns) are not whole blocks, so they and the
// fused tensors holding them stay BF16, while q_proj (32 x 16) and o_proj
// (16 x 32) are FP8; under 8 x 8 blocks every projection is FP8.
TEST(Fp8Plan, TensorsOffTheReceiversBlockStayBf16) {
  struct Case {
    ShardLayout layout;
    uint64_t block;
    std::map<std::string, bool> fp8;
  };
  const std::string p = "model.layers.0.";
  const std::vector<Case> cases = {
      {ShardLayout{1, false, false},
       16,
       {{p + "self_attn.q_proj.weight", true},
        {p + "self_attn.k_proj.weight", false},
        {p + "self_attn.v_proj.weight", false},
        {p + "self_attn.o_proj.weight", true},
        {p + "mlp.gate_proj.weight", false},
        {p + "mlp.up_proj.weight", false},
        {p + "mlp.down_proj.weight", false}}},
      {FusedReceiverLayout(1),
       16,
       {{p + "self_attn.qkv_proj.weight", false},
        {p + "self_attn.o_proj.weight", true},
        {p + "mlp.gate_up_proj.weight", false},
        {p + "mlp.down_proj.weight", false}}},
      {FusedReceiverLayout(1),
       8,
       {{p + "self_attn.qkv_proj.weight", true},
        {p + "self_attn.o_proj.weight", true},
        {p + "mlp.gate_up_proj.weight", true},
        {p + "mlp.down_proj.weight", true}}},
  };
  for (const Case& c : cases) {
    auto plan = Plan(c.layout);
    ASSERT_TRUE(plan.ok());
    Fp8ReceiverOptions o;
    o.block_rows = o.block_cols = c.block;
    auto fp = MakeFp8ReceiverPlan(*plan, 0, o);
    ASSERT_TRUE(fp.ok()) << fp.status().ToString();
    const std::string what = LayoutText(c.layout, 0) + " block " + std::to_string(c.block);
    for (const auto& [name, want] : c.fp8) {
      const auto& tensors = plan->receiver_tensors[0];
      auto it = std::find_if(tensors.begin(), tensors.end(),
                             [&](const PlanTensor& t) { return t.name == name; });
      ASSERT_NE(it, tensors.end()) << what << " " << name;
      const Fp8ReceiverTensor& t = fp->tensors[it - tensors.begin()];
      EXPECT_EQ(t.fp8, want) << what << " " << name;
      EXPECT_EQ(t.decision, want ? Fp8Decision::kQuantize : Fp8Decision::kNotBlockMultiple)
          << what << " " << name;
    }
    for (const Fp8ReceiverOp& op : fp->ops) EXPECT_TRUE(fp->tensors[op.receiver_tensor].fp8);
  }
}

TEST(Fp8Plan, RefusesZeroBlocksAndRanksOutOfRange) {
  auto plan = Plan(FusedReceiverLayout(2));
  ASSERT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.block_cols = 0;
  EXPECT_EQ(MakeFp8ReceiverPlan(*plan, 0, o).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(MakeFp8ReceiverPlan(*plan, 2, Fp8ReceiverOptions{}).status().code(),
            Code::kInvalidArgument);
}

// A block side of 2^32 or more (the live ABI's fp8_block is 32-bit) is
// refused before any grid is computed: ceil(rows / block) would wrap.
TEST(Fp8Plan, RefusesBlockSidesOf2To32OrMoreNamingTheBlock) {
  auto plan = Plan(ShardLayout{1, false, false});  // whole tensors: every block aligned
  ASSERT_TRUE(plan.ok());
  for (const uint64_t huge : {uint64_t{1} << 32, ~uint64_t{0}}) {
    Fp8ReceiverOptions o;
    o.block_rows = huge;
    const Status s = MakeFp8ReceiverPlan(*plan, 0, o).status();
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << huge;
    EXPECT_NE(s.message().find(std::to_string(huge) + " x 128"), std::string::npos) << s.message();
  }
}

TEST(Fp8Plan, ScaleNameReplacesTheWeightSuffix) {
  EXPECT_EQ(Fp8ScaleName("model.layers.3.mlp.down_proj.weight"),
            "model.layers.3.mlp.down_proj.weight_scale_inv");
}

}  // namespace
}  // namespace dte
