// Megatron-Core -> HF conversion: round trips through sharded MCore state,
// the fused layouts checked element by element against their definitions,
// and errors that name the tensor and rank.
#include "sync/convert/convert.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/testutil/convert_fixtures.h"

namespace dte {
namespace {

using test::RandomHfState;

// Converts `state` back to HF, collecting every unit's tensors in order.
Result<std::vector<HfTensor>> ConvertAll(const std::vector<ConvertUnit>& plan,
                                         const McoreState& state, ConvertStats* stats = nullptr) {
  McoreStateSource source(&state);
  std::vector<HfTensor> out;
  Status st = ConvertToHf(
      plan, source,
      [&](const ConvertUnit&, std::vector<HfTensor>& tensors) {
        for (HfTensor& t : tensors) out.push_back(std::move(t));
        return Status::Ok();
      },
      stats);
  if (!st.ok()) return st;
  return out;
}

struct RoundTripCase {
  const char* name;
  ModelSpec spec;
  int tp;
  int ep;
  DType dtype;
};

std::vector<RoundTripCase> RoundTripCases() {
  std::vector<RoundTripCase> cases;
  const std::vector<std::tuple<const char*, ModelSpec>> specs = {
      {"LlamaMha", test::TinyLlama(4, 4)},   {"LlamaGqa2", test::TinyLlama(8, 4)},
      {"Qwen3Gqa4", test::TinyQwen3(16, 4)}, {"Qwen3Gqa8", test::TinyQwen3(32, 4)},
      {"MoeGqa2", test::TinyQwen3Moe(8, 4)}, {"MoeGqa4", test::TinyQwen3Moe(16, 4)},
      {"LlamaKv2", test::TinyLlama(8, 2)},
  };
  for (const auto& [name, spec] : specs) {
    for (int tp : {1, 2, 4}) {
      if (spec.num_kv_heads % tp != 0) continue;
      for (int ep : {1, 2}) {
        if (ep > 1 && spec.num_experts == 0) continue;
        for (DType dtype : {DType::kBF16, DType::kF32}) {
          cases.push_back({name, spec, tp, ep, dtype});
        }
      }
    }
  }
  return cases;
}

class ConvertRoundTrip : public testing::TestWithParam<RoundTripCase> {};

TEST_P(ConvertRoundTrip, ReproducesHfStateBitForBit) {
  const RoundTripCase& c = GetParam();
  ParallelLayout layout;
  layout.tp = c.tp;
  layout.ep = c.ep;
  layout.vocab_divisible_by = 8;  // 50 rows pad to 56 or 64: padding is exercised
  auto plan = PlanConversion(c.spec, layout);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const auto hf = RandomHfState(*plan, c.dtype, 7);
  auto state = ShardHfState(*plan, hf);
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  // Every tensor-parallel tensor really is split: some shard is smaller.
  if (c.tp > 1) {
    const TensorData& qkv =
        state->at({"decoder.layers.0.self_attention.linear_qkv.weight", c.tp - 1, 0});
    EXPECT_EQ(qkv.shape[0] * c.tp,
              (c.spec.num_attention_heads + 2 * c.spec.num_kv_heads) * c.spec.head_dim);
  }
  auto out = ConvertAll(*plan, *state);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), hf.size());
  for (const HfTensor& t : *out) {
    auto it = hf.find(t.name);
    ASSERT_NE(it, hf.end()) << t.name;
    EXPECT_EQ(t.tensor.dtype, c.dtype) << t.name;
    EXPECT_EQ(t.tensor.shape, it->second.shape) << t.name;
    EXPECT_TRUE(t.tensor.data == it->second.data) << t.name << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(ConvertSpecs, ConvertRoundTrip, testing::ValuesIn(RoundTripCases()),
                         [](const testing::TestParamInfo<RoundTripCase>& info) {
                           const RoundTripCase& c = info.param;
                           return std::string(c.name) + "Tp" + std::to_string(c.tp) + "Ep" +
                                  std::to_string(c.ep) + DTypeName(c.dtype);
                         });

// FP32 tensors whose element (r, c) of tensor `tag` holds tag * 1e5 + r * 100 + c (exact in FP32).
TensorData Tagged(int tag, int64_t rows, int64_t cols) {
  TensorData t{DType::kF32, {rows, cols}, std::string(rows * cols * 4, '\0')};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = static_cast<float>(tag * 100000 + r * 100 + c);
      std::memcpy(&t.data[(r * cols + c) * 4], &v, 4);
    }
  }
  return t;
}

float At(const TensorData& t, int64_t r, int64_t c) {
  float v;
  std::memcpy(&v, &t.data[(r * t.shape[1] + c) * 4], 4);
  return v;
}

// A layout's conversion plan, an HF state whose tensors are Tagged values
// (tags in plan order) and that state sharded for the layout.
struct TaggedShards {
  std::vector<ConvertUnit> plan;
  std::map<std::string, TensorData> hf;
  McoreState state;
};

Result<TaggedShards> ShardTaggedState(const ModelSpec& spec, const ParallelLayout& layout) {
  TaggedShards out;
  ASSIGN_OR_RETURN(out.plan, PlanConversion(spec, layout));
  int tag = 1;
  for (const ConvertUnit& u : out.plan) {
    for (const PlannedTensor& t : u.tensors) {
      TensorData d = Tagged(tag++, t.shape[0], t.shape.size() > 1 ? t.shape[1] : 1);
      d.shape = t.shape;
      out.hf[t.name] = std::move(d);
    }
  }
  ASSIGN_OR_RETURN(out.state, ShardHfState(out.plan, out.hf));
  return out;
}

TEST(ConvertLayout, FusedQkvHoldsGqaGroupsPerRank) {
  // 8 query heads in 4 KV groups (g = 2), TP 2: each rank holds 2 groups.
  ModelSpec spec = test::TinyLlama(8, 4);
  ParallelLayout layout;
  layout.tp = 2;
  auto tagged = ShardTaggedState(spec, layout);
  ASSERT_TRUE(tagged.ok()) << tagged.status().ToString();
  const auto& hf = tagged->hf;
  const McoreState* state = &tagged->state;
  const int64_t d = spec.head_dim, g = 2;
  const std::string prefix = "model.layers.1.self_attn.";
  for (int r = 0; r < 2; ++r) {
    const TensorData& shard =
        state->at({"decoder.layers.1.self_attention.linear_qkv.weight", r, 0});
    ASSERT_EQ(shard.shape, (std::vector<int64_t>{2 * (g + 2) * d, spec.hidden}));
    int64_t row = 0;
    for (int64_t j = 2 * r; j < 2 * r + 2; ++j) {
      // [q_(j*g) .. q_((j+1)*g-1), k_j, v_j], head_dim rows each.
      std::vector<std::pair<std::string, int64_t>> heads;
      for (int64_t h = j * g; h < (j + 1) * g; ++h) heads.push_back({"q_proj.weight", h});
      heads.push_back({"k_proj.weight", j});
      heads.push_back({"v_proj.weight", j});
      for (const auto& [tensor, head] : heads) {
        const TensorData& src = hf.at(prefix + tensor);
        for (int64_t i = 0; i < d; ++i, ++row) {
          for (int64_t c = 0; c < spec.hidden; ++c) {
            ASSERT_EQ(At(shard, row, c), At(src, head * d + i, c))
                << "rank " << r << " row " << row << " (" << tensor << " head " << head << ")";
          }
        }
      }
    }
  }
}

TEST(ConvertLayout, Fc1IsGateShardThenUpShardAndFc2SplitsColumns) {
  ModelSpec spec = test::TinyLlama(4, 4);
  ParallelLayout layout;
  layout.tp = 4;
  auto tagged = ShardTaggedState(spec, layout);
  ASSERT_TRUE(tagged.ok()) << tagged.status().ToString();
  const auto& hf = tagged->hf;
  const McoreState* state = &tagged->state;
  const int64_t part = spec.ffn_hidden / 4;
  const TensorData& gate = hf.at("model.layers.0.mlp.gate_proj.weight");
  const TensorData& up = hf.at("model.layers.0.mlp.up_proj.weight");
  const TensorData& down = hf.at("model.layers.0.mlp.down_proj.weight");
  for (int r = 0; r < 4; ++r) {
    const TensorData& fc1 = state->at({"decoder.layers.0.mlp.linear_fc1.weight", r, 0});
    const TensorData& fc2 = state->at({"decoder.layers.0.mlp.linear_fc2.weight", r, 0});
    ASSERT_EQ(fc1.shape, (std::vector<int64_t>{2 * part, spec.hidden}));
    ASSERT_EQ(fc2.shape, (std::vector<int64_t>{spec.hidden, part}));
    for (int64_t i = 0; i < part; ++i) {
      EXPECT_EQ(At(fc1, i, 3), At(gate, r * part + i, 3));
      EXPECT_EQ(At(fc1, part + i, 5), At(up, r * part + i, 5));
    }
    for (int64_t row = 0; row < spec.hidden; ++row) {
      EXPECT_EQ(At(fc2, row, 1), At(down, row, r * part + 1));
    }
  }
}

TEST(ConvertLayout, ExpertsLiveOnTheirEpRankAsLocalExperts) {
  ModelSpec spec = test::TinyQwen3Moe(8, 4);
  ParallelLayout layout;
  layout.tp = 2;
  layout.ep = 2;
  auto tagged = ShardTaggedState(spec, layout);
  ASSERT_TRUE(tagged.ok()) << tagged.status().ToString();
  const auto& hf = tagged->hf;
  const McoreState* state = &tagged->state;
  // Global expert 3 of 4 with EP 2: EP rank 1, local expert 1.
  const TensorData& fc2 =
      state->at({"decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight", 1, 1});
  const TensorData& down = hf.at("model.layers.2.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(At(fc2, 2, 0), At(down, 2, spec.moe_ffn_hidden / 2));
  EXPECT_EQ(state->count({"decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight", 0, 0}),
            0u);
  // Layer 1 is in mlp_only_layers: a dense MLP, no router.
  EXPECT_EQ(state->count({"decoder.layers.1.mlp.linear_fc1.weight", 0, 0}), 1u);
  EXPECT_EQ(state->count({"decoder.layers.1.mlp.router.weight", 0, 0}), 0u);
  const TensorData& router = state->at({"decoder.layers.0.mlp.router.weight", 0, 0});
  EXPECT_TRUE(router.data == hf.at("model.layers.0.mlp.gate.weight").data);
}

TEST(ConvertLayout, ExpertTensorParallelSizeCanDifferFromTp) {
  for (auto [tp, etp] : {std::pair{2, 1}, std::pair{1, 2}, std::pair{4, 2}}) {
    ParallelLayout layout;
    layout.tp = tp;
    layout.etp = etp;
    layout.ep = 2;
    auto plan = PlanConversion(test::TinyQwen3Moe(8, 4), layout);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const auto hf = RandomHfState(*plan, DType::kBF16, 8);
    auto state = ShardHfState(*plan, hf);
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    const std::string fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight";
    EXPECT_EQ(state->count({fc1, etp - 1, 1}), 1u) << "tp " << tp << " etp " << etp;
    EXPECT_EQ(state->count({fc1, etp, 1}), 0u) << "tp " << tp << " etp " << etp;
    EXPECT_EQ(state->at({fc1, 0, 1}).shape[0], 2 * 8 / etp);
    auto out = ConvertAll(*plan, *state);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    for (const HfTensor& t : *out) EXPECT_TRUE(t.tensor.data == hf.at(t.name).data) << t.name;
  }
}

TEST(ConvertLayout, GroupedExpertNamesAndLocalNorms) {
  ModelSpec spec = test::TinyQwen3Moe(8, 4);
  ParallelLayout layout;
  layout.ep = 2;
  layout.experts = McoreExperts::kGrouped;
  layout.norms = McoreNorms::kLocal;
  auto plan = PlanConversion(spec, layout);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  auto state = ShardHfState(*plan, RandomHfState(*plan, DType::kBF16, 3));
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  for (const char* name :
       {"decoder.layers.0.input_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.0.pre_mlp_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.final_layernorm.weight",
        "output_layer.weight"}) {
    EXPECT_EQ(state->count({name, 0, 0}), 1u) << name;
  }
  EXPECT_EQ(state->count({"decoder.layers.2.mlp.experts.linear_fc1.weight1", 0, 1}), 1u);
  EXPECT_EQ(state->count({"decoder.layers.2.mlp.experts.linear_fc2.weight0", 0, 1}), 1u);
}

TEST(ConvertLayout, VocabPaddingRowsAreZeroAndIgnored) {
  ModelSpec spec = test::TinyLlama(4, 4);  // vocab 50
  ParallelLayout layout;
  layout.tp = 4;
  layout.vocab_divisible_by = 16;  // padded to 64: rank 3 holds rows 48..63
  auto plan = PlanConversion(spec, layout);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  auto hf = RandomHfState(*plan, DType::kBF16, 11);
  auto state = ShardHfState(*plan, hf);
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  TensorData& last = state->at({"embedding.word_embeddings.weight", 3, 0});
  ASSERT_EQ(last.shape, (std::vector<int64_t>{16, spec.hidden}));
  const size_t row_bytes = spec.hidden * 2;
  EXPECT_EQ(last.data.substr(2 * row_bytes), std::string(14 * row_bytes, '\0'));
  last.data.replace(2 * row_bytes, 14 * row_bytes, std::string(14 * row_bytes, 'x'));
  auto out = ConvertAll(*plan, *state);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->front().name, "model.embed_tokens.weight");
  EXPECT_TRUE(out->front().tensor.data == hf.at("model.embed_tokens.weight").data);
}

TEST(ConvertLayout, TiedEmbeddingsHaveNoLmHead) {
  auto plan = PlanConversion(test::TinyQwen3(8, 4), ParallelLayout{});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  auto state = ShardHfState(*plan, RandomHfState(*plan, DType::kBF16, 1));
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  EXPECT_EQ(plan->back().label, "final norm");
  EXPECT_EQ(state->count({"output_layer.weight", 0, 0}), 0u);
}

// A converted plan and state to break in the error tests.
struct Sharded {
  std::vector<ConvertUnit> plan;
  McoreState state;
};

Sharded MakeSharded(int tp) {
  ParallelLayout layout;
  layout.tp = tp;
  auto plan = PlanConversion(test::TinyLlama(8, 4), layout);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  auto state = ShardHfState(*plan, RandomHfState(*plan, DType::kBF16, 5));
  EXPECT_TRUE(state.ok()) << state.status().ToString();
  return {*plan, *state};
}

void ExpectMentions(const Status& st, const std::vector<std::string>& words) {
  ASSERT_FALSE(st.ok());
  for (const std::string& w : words) {
    EXPECT_NE(st.message().find(w), std::string::npos) << "'" << w << "' not in: " << st.message();
  }
}

TEST(ConvertErrors, MissingShardNamesTensorAndRank) {
  Sharded s = MakeSharded(2);
  s.state.erase({"decoder.layers.1.self_attention.linear_proj.weight", 1, 0});
  auto out = ConvertAll(s.plan, s.state);
  EXPECT_EQ(out.status().code(), Code::kNotFound);
  ExpectMentions(out.status(), {"layer 1 attention", "decoder.layers.1.self_attention.linear_proj",
                                "tp rank 1", "ep rank 0"});
}

TEST(ConvertErrors, WrongShardShapeNamesTensorRankAndShapes) {
  Sharded s = MakeSharded(2);
  TensorData& fc1 = s.state.at({"decoder.layers.0.mlp.linear_fc1.weight", 1, 0});
  fc1.shape = {12, 32};  // same bytes, transposed-looking shape
  auto out = ConvertAll(s.plan, s.state);
  EXPECT_EQ(out.status().code(), Code::kInvalidArgument);
  ExpectMentions(out.status(),
                 {"decoder.layers.0.mlp.linear_fc1.weight", "tp rank 1", "[12, 32]", "[24, 16]"});
}

TEST(ConvertErrors, ShardByteCountAndDtypeAreChecked) {
  Sharded s = MakeSharded(1);
  s.state.at({"decoder.final_layernorm.weight", 0, 0}).data.pop_back();
  ExpectMentions(ConvertAll(s.plan, s.state).status(),
                 {"decoder.final_layernorm.weight", "31 bytes"});
  s = MakeSharded(1);
  TensorData& norm = s.state.at({"decoder.final_layernorm.weight", 0, 0});
  norm.dtype = DType::kU8;
  norm.data.resize(16);
  ExpectMentions(ConvertAll(s.plan, s.state).status(), {"decoder.final_layernorm.weight", "U8"});
}

TEST(ConvertErrors, ShardsOfOneTensorMustShareADtype) {
  Sharded s = MakeSharded(2);
  TensorData& o = s.state.at({"decoder.layers.0.self_attention.linear_proj.weight", 1, 0});
  o.dtype = DType::kF16;  // same width, different type
  ExpectMentions(ConvertAll(s.plan, s.state).status(),
                 {"linear_proj.weight (tp rank 1", "F16", "o_proj.weight", "BF16"});
}

TEST(ConvertErrors, InconsistentSpecsNameTheFields) {
  ParallelLayout tp4;
  tp4.tp = 4;
  ExpectMentions(PlanConversion(test::TinyLlama(8, 2), tp4).status(),
                 {"num_kv_heads 2", "tensor parallel size 4"});
  ExpectMentions(PlanConversion(test::TinyLlama(6, 4), ParallelLayout{}).status(),
                 {"num_attention_heads 6", "num_kv_heads 4"});
  ParallelLayout ep3;
  ep3.ep = 3;
  ExpectMentions(PlanConversion(test::TinyQwen3Moe(8, 4), ep3).status(),
                 {"num_experts 4", "expert parallel size 3"});
  ExpectMentions(PlanConversion(test::TinyLlama(8, 4), ep3).status(), {"without MoE"});
  ModelSpec odd_ffn = test::TinyLlama(8, 4);
  odd_ffn.ffn_hidden = 26;
  ExpectMentions(PlanConversion(odd_ffn, tp4).status(), {"ffn_hidden 26"});
}

TEST(ConvertErrors, InverseNamesMissingWrongAndExtraHfTensors) {
  auto plan = PlanConversion(test::TinyLlama(8, 4), ParallelLayout{});
  ASSERT_TRUE(plan.ok());
  auto hf = RandomHfState(*plan, DType::kF32, 2);
  auto missing = hf;
  missing.erase("model.layers.1.self_attn.k_proj.weight");
  ExpectMentions(ShardHfState(*plan, missing).status(), {"model.layers.1.self_attn.k_proj.weight"});
  auto wrong = hf;
  wrong.at("model.norm.weight").shape = {8, 2};
  ExpectMentions(ShardHfState(*plan, wrong).status(), {"model.norm.weight", "[8, 2]", "[16]"});
  auto extra = hf;
  extra["model.layers.9.mlp.up_proj.weight"] = hf.at("model.norm.weight");
  ExpectMentions(ShardHfState(*plan, extra).status(), {"model.layers.9.mlp.up_proj.weight"});
  auto mixed = hf;
  TensorData& k = mixed.at("model.layers.0.self_attn.k_proj.weight");
  k.dtype = DType::kBF16;
  k.data.resize(k.data.size() / 2);
  ExpectMentions(ShardHfState(*plan, mixed).status(), {"k_proj.weight", "linear_qkv.weight"});
}

}  // namespace
}  // namespace dte
