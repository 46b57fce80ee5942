#include "store/fp8_policy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dte {
namespace {

const std::vector<int64_t> kMatrix = {256, 128};
const std::vector<int64_t> kVector = {256};

Fp8Decision Decide(std::string_view name, DType dtype = DType::kBF16,
                   const std::vector<int64_t>& shape = kMatrix, const Fp8Policy& p = {}) {
  return DecideFp8(p, name, dtype, shape);
}

TEST(Fp8Policy, LinearWeightsOfAttentionMlpAndExpertsAreQuantized) {
  for (const char* name :
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.q_b_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.5.mlp.experts.17.gate_proj.weight",
        "model.layers.5.mlp.shared_experts.down_proj.weight",
        "model.layers.1.block_sparse_moe.experts.3.w1.weight"}) {
    EXPECT_EQ(Decide(name), Fp8Decision::kQuantize) << name;
  }
}

TEST(Fp8Policy, EmbeddingsHeadNormsBiasesAndRoutersAreNot) {
  EXPECT_EQ(Decide("model.embed_tokens.weight"), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("lm_head.weight"), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.layers.5.mlp.gate.weight"), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.layers.1.block_sparse_moe.gate.weight"), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.layers.2.mlp.shared_expert_gate.weight"), Fp8Decision::kSkippedModule);
  // A 2-D norm weight (some models store them so) is still a norm.
  EXPECT_EQ(Decide("model.layers.0.self_attn.q_a_layernorm.weight"), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.norm.weight", DType::kBF16, kVector), Fp8Decision::kNot2d);
  EXPECT_EQ(Decide("model.layers.0.self_attn.q_proj.bias", DType::kBF16, kVector),
            Fp8Decision::kNot2d);
  EXPECT_EQ(Decide("model.layers.0.self_attn.q_proj.bias"), Fp8Decision::kNotWeight);
  EXPECT_EQ(Decide("model.layers.5.mlp.gate.e_score_correction_bias", DType::kF32, kVector),
            Fp8Decision::kNotBf16);
  EXPECT_EQ(Decide("model.layers.0.mlp.up_proj.weight", DType::kF32), Fp8Decision::kNotBf16);
  EXPECT_EQ(Fp8DecisionName(Fp8Decision::kSkippedModule), "skipped module");
}

TEST(Fp8Policy, IsConfigurable) {
  Fp8Policy p;
  p.skip_modules.push_back("o_proj");
  EXPECT_EQ(Decide("model.layers.0.self_attn.o_proj.weight", DType::kBF16, kMatrix, p),
            Fp8Decision::kSkippedModule);
  p.skip_modules.clear();  // quantize the head and the routers too
  EXPECT_EQ(Decide("lm_head.weight", DType::kBF16, kMatrix, p), Fp8Decision::kQuantize);
  EXPECT_EQ(Decide("model.layers.5.mlp.gate.weight", DType::kBF16, kMatrix, p),
            Fp8Decision::kQuantize);
  EXPECT_EQ(Decide("model.embed_tokens.weight", DType::kBF16, kMatrix, p),
            Fp8Decision::kSkippedModule);
}

}  // namespace
}  // namespace dte
