// Conversion plans: config.json parsing, unit order, exact coverage of every
// element, and the streaming bound (one unit held at a time, flat in depth).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "sync/convert/convert.h"
#include "tests/testutil/convert_fixtures.h"

namespace dte {
namespace {

// Shaped like Qwen/Qwen3-30B-A3B's config.json (fields the converter ignores trimmed).
constexpr char kQwen3MoeConfig[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "attention_bias": false, "decoder_sparse_step": 1, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
  "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": true,
  "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 151936})";

// Shaped like Qwen/Qwen3-0.6B.
constexpr char kQwen3Config[] = R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": false,
  "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 151936})";

// Shaped like meta-llama/Llama-3.2-1B (no head_dim: hidden / heads).
constexpr char kLlamaConfig[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": false,
  "mlp_bias": false, "hidden_size": 2048, "intermediate_size": 8192,
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "tie_word_embeddings": true, "vocab_size": 128256})";

TEST(ConvertSpec, ParsesQwen3MoeConfigAndPlansItsUnits) {
  auto spec = ParseHfConfig(kQwen3MoeConfig, "config.json");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->num_layers, 48);
  EXPECT_EQ(spec->num_kv_heads, 4);
  EXPECT_EQ(spec->head_dim, 128);
  EXPECT_EQ(spec->num_experts, 128);
  EXPECT_EQ(spec->moe_ffn_hidden, 768);
  EXPECT_TRUE(spec->qk_norm);
  EXPECT_FALSE(spec->tied_embeddings);
  ParallelLayout layout;
  layout.tp = 4;
  layout.ep = 8;
  auto plan = PlanConversion(*spec, layout);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  // embeddings + 48 x (attention, router, 128 experts) + final norm + lm_head
  EXPECT_EQ(plan->size(), 1u + 48 * 130 + 2);
  EXPECT_EQ(MaxUnitElements(*plan), 151936ull * 2048);
  const ConvertUnit& attn = (*plan)[1];
  EXPECT_EQ(attn.label, "layer 0 attention");
  // norm + q, k, v + o + q_norm, k_norm
  EXPECT_EQ(attn.elements(), 2048ull + (4096 + 512 + 512) * 2048ull + 2048ull * 4096 + 256);
  const ConvertUnit& expert = (*plan)[3 + 127];
  EXPECT_EQ(expert.label, "layer 0 expert 127");
  EXPECT_EQ(expert.elements(), 3ull * 768 * 2048);
  // Expert 127 of 128 on EP 8: EP rank 7, local expert 15, TP 4 shards each.
  ASSERT_EQ(expert.shards.size(), 8u);
  EXPECT_EQ(expert.shards[0].key.ToString(),
            "decoder.layers.0.mlp.experts.local_experts.15.linear_fc1.weight (tp rank 0, ep rank "
            "7)");
  EXPECT_EQ(expert.shards[0].shape, (std::vector<int64_t>{2 * 768 / 4, 2048}));
}

TEST(ConvertSpec, ParsesDenseConfigs) {
  auto qwen = ParseHfConfig(kQwen3Config, "qwen3/config.json");
  ASSERT_TRUE(qwen.ok()) << qwen.status().ToString();
  EXPECT_TRUE(qwen->tied_embeddings);
  EXPECT_EQ(qwen->head_dim, 128);  // not hidden / heads = 64
  EXPECT_EQ(qwen->num_experts, 0);
  auto llama = ParseHfConfig(kLlamaConfig, "llama/config.json");
  ASSERT_TRUE(llama.ok()) << llama.status().ToString();
  EXPECT_EQ(llama->head_dim, 64);
  EXPECT_FALSE(llama->qk_norm);
  ParallelLayout tp8;
  tp8.tp = 8;
  auto plan = PlanConversion(*llama, tp8);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->size(), 1u + 16 * 2 + 1);  // tied: no lm_head unit
  // The padded vocab: 128256 rounded up to a multiple of 128 * 8.
  EXPECT_EQ(plan->front().shards.front().shape, (std::vector<int64_t>{129024 / 8, 2048}));
}

TEST(ConvertSpec, ConfigErrorsNameFileAndField) {
  // No model type, so no defaults: every missing key is named at once.
  auto missing = ParseHfConfig(R"({"hidden_size": 8})", "a/config.json");
  EXPECT_EQ(missing.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "a/config.json: missing \"model_type\" (or \"architectures\"), "
            "\"num_hidden_layers\", \"intermediate_size\", \"vocab_size\", "
            "\"num_attention_heads\"");
  auto type = ParseHfConfig(R"({"model_type": "gpt2"})", "b.json");
  EXPECT_EQ(type.status().code(), Code::kUnimplemented);
  EXPECT_NE(type.status().message().find("gpt2"), std::string::npos);
  std::string biased = kQwen3Config;
  biased.replace(biased.find("\"attention_bias\": false"), 23, "\"attention_bias\": true ");
  auto bias = ParseHfConfig(biased, "c.json");
  EXPECT_EQ(bias.status().code(), Code::kUnimplemented);
  EXPECT_NE(bias.status().message().find("attention_bias"), std::string::npos);
  auto wrong_type =
      ParseHfConfig(R"({"model_type": "llama", "num_hidden_layers": "2", "vocab_size": 1.5})", "d");
  EXPECT_EQ(wrong_type.status().message(),
            "d: \"num_hidden_layers\" is not an integer; \"vocab_size\" is not an integer");
  EXPECT_FALSE(ParseHfConfig("{not json", "e").ok());
  auto arch = ParseHfConfig(R"({"architectures": ["MistralForCausalLM"]})", "f");
  EXPECT_EQ(arch.status().code(), Code::kUnimplemented);
  EXPECT_NE(arch.status().message().find("MistralForCausalLM"), std::string::npos);
}

TEST(ConvertSpec, ModelTypeFromArchitecturesAndTransformersDefaults) {
  // As transformers loads it: LlamaForCausalLM is LlamaConfig, whose
  // defaults fill what the file leaves out.
  auto llama = ParseHfConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
                                 "num_attention_heads": 16})",
                             "llama/config.json");
  ASSERT_TRUE(llama.ok()) << llama.status().ToString();
  EXPECT_EQ(llama->model_type, "llama");
  EXPECT_EQ(llama->num_kv_heads, 16);  // num_key_value_heads: num_attention_heads
  EXPECT_EQ(llama->head_dim, 128);     // hidden_size / num_attention_heads
  EXPECT_EQ(llama->ffn_hidden, 11008);
  EXPECT_EQ(llama->num_layers, 32);
  EXPECT_EQ(llama->vocab, 32000);
  EXPECT_FALSE(llama->tied_embeddings);
  // Qwen3Config's head_dim is 128 whatever hidden_size / heads is.
  auto qwen = ParseHfConfig(R"({"model_type": "qwen3", "hidden_size": 1024,
                                "num_attention_heads": 16, "num_key_value_heads": 8})",
                            "qwen3/config.json");
  ASSERT_TRUE(qwen.ok()) << qwen.status().ToString();
  EXPECT_EQ(qwen->head_dim, 128);
  EXPECT_TRUE(qwen->qk_norm);
  auto moe = ParseHfConfig(R"({"architectures": ["Qwen3MoeForCausalLM"]})", "moe/config.json");
  ASSERT_TRUE(moe.ok()) << moe.status().ToString();
  EXPECT_EQ(moe->model_type, "qwen3_moe");
  EXPECT_EQ(moe->num_experts, 128);
  EXPECT_EQ(moe->moe_ffn_hidden, 768);
  EXPECT_EQ(moe->num_kv_heads, 4);
  EXPECT_EQ(moe->head_dim, 2048 / 32);
  // "model_type" wins over "architectures".
  auto both = ParseHfConfig(R"({"model_type": "qwen3", "architectures": ["LlamaForCausalLM"]})",
                            "both.json");
  ASSERT_TRUE(both.ok()) << both.status().ToString();
  EXPECT_EQ(both->model_type, "qwen3");
}

TEST(ConvertSpec, AttentionOfAnyModelTypeNeedsOnlyItsOwnKeys) {
  // What a push plans with: no model type, no intermediate_size.
  auto plain = ParseHfAttention(
      R"({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2})", "a.json");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ((std::vector<int64_t>{plain->heads, plain->kv_heads, plain->head_dim}),
            (std::vector<int64_t>{4, 2, 16}));
  auto mistral = ParseHfAttention(R"({"architectures": ["MistralForCausalLM"], "head_dim": 8,
                                      "num_attention_heads": 4})",
                                  "m.json");
  ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
  EXPECT_EQ((std::vector<int64_t>{mistral->heads, mistral->kv_heads, mistral->head_dim}),
            (std::vector<int64_t>{4, 4, 8}));
  auto qwen = ParseHfAttention(R"({"architectures": ["Qwen3ForCausalLM"]})", "q.json");
  ASSERT_TRUE(qwen.ok()) << qwen.status().ToString();
  EXPECT_EQ((std::vector<int64_t>{qwen->heads, qwen->kv_heads, qwen->head_dim}),
            (std::vector<int64_t>{32, 32, 128}));
  auto none = ParseHfAttention(R"({"num_key_value_heads": 2})", "v1/config.json");
  EXPECT_EQ(none.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(none.status().message(),
            "v1/config.json: missing \"hidden_size\", \"num_attention_heads\"");
  auto zero = ParseHfAttention(R"({"num_attention_heads": 0, "head_dim": 8})", "z.json");
  EXPECT_EQ(zero.status().message(), "z.json: num_attention_heads must be positive, got 0");
}

// Counts, for every element, how many copies write it (HF side) or read it
// (shard side): exactly one and at most one.
void ExpectExactCoverage(const std::vector<ConvertUnit>& plan) {
  for (const ConvertUnit& u : plan) {
    std::vector<std::vector<int>> hf(u.tensors.size()), shard(u.shards.size());
    for (size_t i = 0; i < u.tensors.size(); ++i) hf[i].assign(u.tensors[i].elements(), 0);
    for (size_t i = 0; i < u.shards.size(); ++i) shard[i].assign(u.shards[i].elements(), 0);
    for (const BlockCopy& c : u.copies) {
      const auto& ts = u.tensors[c.tensor].shape;
      const auto& ss = u.shards[c.shard].shape;
      const int64_t tcols = ts.size() > 1 ? ts[1] : 1, scols = ss.size() > 1 ? ss[1] : 1;
      ASSERT_LE(c.tensor_row + c.rows, ts[0]) << u.label;
      ASSERT_LE(c.shard_row + c.rows, ss[0]) << u.label;
      ASSERT_LE(c.tensor_col + c.cols, tcols) << u.label;
      ASSERT_LE(c.shard_col + c.cols, scols) << u.label;
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int64_t k = 0; k < c.cols; ++k) {
          hf[c.tensor][(c.tensor_row + r) * tcols + c.tensor_col + k]++;
          shard[c.shard][(c.shard_row + r) * scols + c.shard_col + k]++;
        }
      }
    }
    for (size_t i = 0; i < hf.size(); ++i) {
      for (int n : hf[i]) ASSERT_EQ(n, 1) << u.tensors[i].name;
    }
    for (size_t i = 0; i < shard.size(); ++i) {
      for (int n : shard[i]) ASSERT_LE(n, 1) << u.shards[i].key.ToString();
    }
  }
}

TEST(ConvertPlan, EveryElementIsCopiedExactlyOnce) {
  for (const ModelSpec& spec : {test::TinyLlama(8, 8), test::TinyLlama(8, 2),
                                test::TinyQwen3(16, 4), test::TinyQwen3Moe(8, 4)}) {
    for (int tp : {1, 2, 4}) {
      for (int ep : {1, 2, 4}) {
        ParallelLayout layout;
        layout.tp = tp;
        layout.ep = ep;
        layout.vocab_divisible_by = 4;
        auto plan = PlanConversion(spec, layout);
        if (!plan.ok()) continue;  // kv % tp or a dense model with ep > 1
        SCOPED_TRACE(spec.model_type + " tp " + std::to_string(tp) + " ep " + std::to_string(ep));
        ExpectExactCoverage(*plan);
      }
    }
  }
}

TEST(ConvertPlan, UnitsComeInHfOrder) {
  auto plan = PlanConversion(test::TinyQwen3Moe(8, 4), ParallelLayout{});
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<std::string> labels;
  for (const ConvertUnit& u : *plan) labels.push_back(u.label);
  const std::vector<std::string> want = {
      "embeddings",       "layer 0 attention", "layer 0 router",   "layer 0 expert 0",
      "layer 0 expert 1", "layer 0 expert 2",  "layer 0 expert 3", "layer 1 attention",
      "layer 1 mlp",      "layer 2 attention", "layer 2 router",   "layer 2 expert 0",
      "layer 2 expert 1", "layer 2 expert 2",  "layer 2 expert 3", "final norm",
      "lm_head"};
  EXPECT_EQ(labels, want);
  const std::vector<std::string> attention = {
      "model.layers.0.input_layernorm.weight",  "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_norm.weight",
      "model.layers.0.self_attn.k_norm.weight"};
  std::vector<std::string> names;
  for (const PlannedTensor& t : (*plan)[1].tensors) names.push_back(t.name);
  EXPECT_EQ(names, attention);
}

// A source that copies each shard into memory it owns and tracks how many
// of those bytes are alive, as a file-backed source would.
class CopyingSource : public ShardSource {
 public:
  explicit CopyingSource(const McoreState* state) : inner_(state) {}
  Result<ShardView> Get(const ShardKey& key) override {
    ASSIGN_OR_RETURN(ShardView view, inner_.Get(key));
    auto copy = std::make_shared<std::string>(view.bytes);
    live_ += copy->size();
    peak_ = std::max(peak_, live_);
    const uint64_t size = copy->size();
    view.bytes = *copy;
    view.owner = std::shared_ptr<const void>(copy.get(), [this, copy, size](const void*) mutable {
      live_ -= size;
      copy.reset();
    });
    return view;
  }
  uint64_t live() const { return live_; }
  uint64_t peak() const { return peak_; }

 private:
  McoreStateSource inner_;
  uint64_t live_ = 0;
  uint64_t peak_ = 0;
};

TEST(ConvertPlan, PeakMemoryIsTheLargestUnitAndFlatInDepth) {
  uint64_t peaks[2] = {0, 0};
  int i = 0;
  for (int64_t layers : {2, 24}) {
    ModelSpec spec = test::TinyQwen3Moe(8, 4);
    spec.num_layers = layers;
    spec.vocab = 8;  // small, so a layer unit is the largest
    ParallelLayout layout;
    layout.tp = 2;
    layout.ep = 2;
    layout.vocab_divisible_by = 4;
    auto plan = PlanConversion(spec, layout);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    auto state = ShardHfState(*plan, test::RandomHfState(*plan, DType::kF32, 1));
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    uint64_t max_shard_bytes = 0;
    for (const ConvertUnit& u : *plan) {
      uint64_t n = 0;
      for (const PlannedShard& s : u.shards) n += s.elements() * 4;
      max_shard_bytes = std::max(max_shard_bytes, n);
    }
    CopyingSource source(&*state);
    ConvertStats stats;
    Status st = ConvertToHf(
        *plan, source,
        [&](const ConvertUnit& unit, std::vector<HfTensor>& tensors) {
          uint64_t bytes = 0;
          for (const HfTensor& t : tensors) bytes += t.tensor.data.size();
          EXPECT_EQ(bytes, unit.elements() * 4) << unit.label;
          return Status::Ok();
        },
        &stats);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(stats.units, plan->size());
    EXPECT_EQ(stats.peak_bytes, MaxUnitElements(*plan) * 4);
    EXPECT_LE(source.peak(), max_shard_bytes);  // shards released after each unit
    EXPECT_EQ(source.live(), 0u);
    peaks[i++] = stats.peak_bytes;
  }
  EXPECT_EQ(peaks[0], peaks[1]);
}

TEST(ConvertPlan, SinkErrorStopsConversion) {
  auto plan = PlanConversion(test::TinyLlama(8, 4), ParallelLayout{});
  ASSERT_TRUE(plan.ok());
  auto state = ShardHfState(*plan, test::RandomHfState(*plan, DType::kBF16, 4));
  ASSERT_TRUE(state.ok());
  McoreStateSource source(&*state);
  int calls = 0;
  Status st = ConvertToHf(*plan, source, [&](const ConvertUnit&, std::vector<HfTensor>&) {
    return ++calls == 3 ? IOError("disk full") : Status::Ok();
  });
  EXPECT_EQ(st.code(), Code::kIOError);
  EXPECT_EQ(calls, 3);
}

}  // namespace
}  // namespace dte
