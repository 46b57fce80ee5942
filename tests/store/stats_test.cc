// The naming rules and version ranges of store/ops/stats.h (the rows themselves
// are checked end to end against checkpoints and block tables in
// tests/py/test_cli.py).
#include "store/ops/stats.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace dte {
namespace {

TEST(Stats, KindsOfHuggingFaceNames) {
  const std::map<std::string, std::string> want = {
      {"model.embed_tokens.weight", "embedding"},
      {"model.layers.3.self_attn.q_proj.weight", "q_proj"},
      {"model.layers.3.self_attn.q_proj.bias", "q_proj"},
      {"model.layers.3.self_attn.k_proj.weight", "k_proj"},
      {"model.layers.3.self_attn.v_proj.weight", "v_proj"},
      {"model.layers.3.self_attn.o_proj.weight", "o_proj"},
      {"model.layers.3.self_attn.qkv_proj.weight", "qkv_proj"},
      {"model.layers.3.self_attn.q_norm.weight", "norm"},
      {"model.layers.3.mlp.gate_proj.weight", "mlp"},
      {"model.layers.3.mlp.gate_up_proj.weight", "mlp"},
      {"model.layers.3.mlp.experts.7.down_proj.weight", "mlp"},
      {"model.layers.3.mlp.gate.weight", "mlp"},  // an MoE router
      {"model.layers.3.input_layernorm.weight", "norm"},
      {"model.norm.weight", "norm"},
      {"lm_head.weight", "lm_head"},
      {"transformer.wte.weight", "embedding"},
      {"model.rotary_emb.inv_freq", "other"},
  };
  for (const auto& [name, kind] : want) EXPECT_EQ(TensorKind(name), kind) << name;
}

TEST(Stats, LayerIndexOnlyWhereANameHasOne) {
  EXPECT_EQ(TensorLayer("model.layers.0.mlp.up_proj.weight"), 0u);
  EXPECT_EQ(TensorLayer("model.layers.117.self_attn.o_proj.weight"), 117u);
  EXPECT_EQ(TensorLayer("transformer.h.5.attn.c_attn.weight"), 5u);
  EXPECT_EQ(TensorLayer("model.norm.weight"), std::nullopt);
  EXPECT_EQ(TensorLayer("model.layers.x.mlp.weight"), std::nullopt);
  EXPECT_EQ(TensorLayer("model.layers.3a.mlp.weight"), std::nullopt);
  EXPECT_EQ(TensorLayer("model.layers.12345678901.mlp.weight"), std::nullopt);
}

TEST(Stats, VersionRanges) {
  auto r = ParseVersionRange("3..7");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first, 3u);
  EXPECT_EQ(r->last, 7u);
  r = ParseVersionRange("v00000004..");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first, 4u);
  EXPECT_FALSE(r->last);
  r = ParseVersionRange("..2");
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->first);
  EXPECT_EQ(r->last, 2u);
  r = ParseVersionRange("5");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first, 5u);
  EXPECT_EQ(r->last, 5u);
  for (const char* bad : {"", "..", "7..3", "a..b", "1...2", "-1", "1..2..3", "v"}) {
    auto b = ParseVersionRange(bad);
    EXPECT_FALSE(b.ok()) << bad;
    if (!b.ok()) {
      EXPECT_NE(b.status().message().find(std::string("\"") + bad + "\""), std::string::npos)
          << b.status().message();
    }
  }
}

TEST(Stats, SelectionNamesWhatIsMissing) {
  const std::map<uint64_t, std::string> listed = {{2, "a"}, {3, "b"}, {5, "c"}};
  auto all = SelectVersions(listed, {}, "s");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);
  auto some = SelectVersions(listed, {3, std::nullopt}, "s");
  ASSERT_TRUE(some.ok());
  ASSERT_EQ(some->size(), 2u);
  EXPECT_EQ((*some)[0].first, 3u);
  auto missing = SelectVersions(listed, {std::nullopt, 4}, "s");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(),
            "v00000004 is not a version of store s (it has v00000002 to v00000005, 3 versions)");
  auto none = SelectVersions({}, {}, "s");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().message(), "store s has no versions");
}

}  // namespace
}  // namespace dte
