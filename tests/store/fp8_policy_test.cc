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
  return DecideFp8(p, Fp8Block{}, name, dtype, shape);
}

Fp8Decision DecideShape(const std::vector<int64_t>& shape, Fp8Block block,
                        const Fp8Policy& p = {}) {
  return DecideFp8(p, block, "model.layers.0.mlp.down_proj.weight", DType::kBF16, shape);
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

// transformers' fine-grained FP8 refuses a weight that is not a whole
// number of blocks, so such weights stay BF16 by default, for each block.
TEST(Fp8Policy, ShapesThatAreNotAMultipleOfTheBlockAreNot) {
  const Fp8Block b128{128, 128}, b8x32{8, 32};
  EXPECT_EQ(DecideShape({344, 128}, b128), Fp8Decision::kNotBlockMultiple);
  EXPECT_EQ(DecideShape({128, 344}, b128), Fp8Decision::kNotBlockMultiple);
  EXPECT_EQ(DecideShape({256, 256}, b128), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideShape({1, 128}, b128), Fp8Decision::kNotBlockMultiple);
  // The same shapes under 8 x 32 blocks: 344 rows are 43 blocks of 8, 344
  // columns are not a multiple of 32, 1 row is not a multiple of 8.
  EXPECT_EQ(DecideShape({344, 128}, b8x32), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideShape({128, 344}, b8x32), Fp8Decision::kNotBlockMultiple);
  EXPECT_EQ(DecideShape({256, 256}, b8x32), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideShape({1, 128}, b8x32), Fp8Decision::kNotBlockMultiple);
  // Rows and columns are each checked against their own side.
  EXPECT_EQ(DecideShape({8, 32}, {32, 8}), Fp8Decision::kNotBlockMultiple);
  EXPECT_EQ(DecideShape({32, 8}, {32, 8}), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideShape({0, 128}, b128), Fp8Decision::kQuantize);  // no blocks at all
  EXPECT_EQ(DecideShape({128, 128}, {0, 128}), Fp8Decision::kNotBlockMultiple);
  EXPECT_FALSE(QuantizeAsFp8({}, b128, "model.layers.0.mlp.up_proj.weight", DType::kBF16,
                             std::vector<int64_t>{344, 128}));
  EXPECT_EQ(Fp8DecisionName(Fp8Decision::kNotBlockMultiple), "shape not a multiple of the block");
}

// The other reasons come first: a head, a norm or a bias off the block
// says what it is.
TEST(Fp8Policy, OtherReasonsComeBeforeTheBlock) {
  const std::vector<int64_t> odd = {300, 64};
  EXPECT_EQ(Decide("lm_head.weight", DType::kBF16, odd), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.embed_tokens.weight", DType::kBF16, odd), Fp8Decision::kSkippedModule);
  EXPECT_EQ(Decide("model.layers.0.mlp.up_proj.weight", DType::kF32, odd), Fp8Decision::kNotBf16);
  EXPECT_EQ(Decide("model.layers.0.mlp.up_proj.bias", DType::kBF16, odd), Fp8Decision::kNotWeight);
  EXPECT_EQ(Decide("model.layers.0.mlp.up_proj.weight", DType::kBF16, odd),
            Fp8Decision::kNotBlockMultiple);
  EXPECT_TRUE(ListedAsNotConverted(Fp8Decision::kSkippedModule));
  EXPECT_TRUE(ListedAsNotConverted(Fp8Decision::kNotBlockMultiple));
  EXPECT_FALSE(ListedAsNotConverted(Fp8Decision::kNot2d));
  EXPECT_FALSE(ListedAsNotConverted(Fp8Decision::kNotBf16));
  EXPECT_FALSE(ListedAsNotConverted(Fp8Decision::kQuantize));
}

// The opt-in quantizes partial edge blocks (the quantizer supports them),
// for consumers that load them; the other rules still hold.
TEST(Fp8Policy, PartialBlocksAreQuantizedWhenAskedFor) {
  Fp8Policy p;
  p.quantize_partial_blocks = true;
  EXPECT_EQ(DecideShape({344, 128}, {128, 128}, p), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideShape({1, 128}, {8, 32}, p), Fp8Decision::kQuantize);
  EXPECT_EQ(DecideFp8(p, {128, 128}, "lm_head.weight", DType::kBF16, std::vector<int64_t>{300, 64}),
            Fp8Decision::kSkippedModule);
}

}  // namespace
}  // namespace dte
