// FP8 receivers of the push whose block does not divide every weight
// (docs/fp8.md "Which tensors"): a weight that is not whole blocks of the
// receiver's own block is held in BF16, as the FP8 view of that block
// keeps it, and the push and the catch-up write it the version's BF16
// elements, while a receiver of a block that divides it holds it in FP8.
// The model (tests/sync/transfer_test_util.h) has k_proj and v_proj of 8
// rows, gate_proj and up_proj of 24 rows, down_proj of 24 columns, q_proj
// of 32 x 16 and o_proj of 16 x 32.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "sync/push/internal/push_fp8.h"
#include "tests/sync/push_fp8_fixture.h"

namespace dte::push_fp8_test {
namespace {

using kernels::Fp8ScaleRule;

const std::string kLayer = "model.layers.1.";

// The layer-1 projections a TP 1 unfused receiver of each block holds in
// FP8 (the others in BF16).
const std::vector<std::string> kProjections = {"self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                               "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                                               "mlp.down_proj.weight"};

// Checks, independently of the policy, which of r's projections are BF16:
// two bytes per element, no scales, equal to the version's bytes (TP 1
// unfused: the canonical tensor itself).
void ExpectBf16Where(const Rx& r, const State& state, const std::vector<std::string>& fp8) {
  for (const std::string& p : kProjections) {
    const std::string name = kLayer + p;
    const bool want_fp8 = std::find(fp8.begin(), fp8.end(), p) != fp8.end();
    EXPECT_EQ(r.buffers.count(Fp8ScaleName(name)), want_fp8 ? 1u : 0u) << name;
    const Bytes& got = r.buffers.at(name);
    EXPECT_EQ(got.size() == state.at(name).size(), !want_fp8) << name;
    if (!want_fp8) {
      EXPECT_EQ(got, state.at(name)) << name << " is not the version's BF16";
    }
  }
}

// 16 x 16 blocks divide q_proj and o_proj only; 8 x 32 blocks o_proj only;
// 4 x 4 blocks every projection (the same canonical tensors are FP8 for
// one variant and BF16 elements for the others in each push). Receivers
// that hold nothing catch up from the store the same way.
TEST_F(PushFp8Test, WeightsOffAReceiversBlockArriveAsBf16) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  const ShardLayout whole{1, false, false};
  rxs.push_back(Receiver(*server, whole, 0, Fp8Options(16, 16, Fp8ScaleRule::kPlain), state_, 0));
  rxs.push_back(
      Receiver(*server, whole, 0, Fp8Options(8, 32, Fp8ScaleRule::kPowerOfTwo), state_, 0));
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r,
                           Fp8Options(4, 4, Fp8ScaleRule::kPlain), state_, 0));
  }
  AwaitReceivers(*server, rxs.size());
  const std::vector<std::vector<std::string>> fp8 = {
      {"self_attn.q_proj.weight", "self_attn.o_proj.weight"}, {"self_attn.o_proj.weight"}};
  std::mt19937_64 rng(17);
  State state = state_;
  for (int step = 1; step <= 3; ++step) {
    State next = Step(state, 0.05, step == 2, rng);
    const uint64_t v = Commit(next);
    auto report = server->Push(*store_, V(v), Diff(state, next));
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok()) << LayoutText(r->layout, r->rank);
      ExpectHolds(*r, next);
    }
    for (size_t k = 0; k < fp8.size(); ++k) ExpectBf16Where(*rxs[k], next, fp8[k]);
    state = std::move(next);
  }
  // Late receivers of the same blocks hold nothing: they catch up.
  for (size_t k = 0; k < fp8.size(); ++k) {
    auto late = Receiver(*server, whole, 0, rxs[k]->fp8, state_, std::nullopt, false);
    EXPECT_EQ(late->rx->WaitFor(3, 10s).code(), Code::kFailedPrecondition);
    ASSERT_TRUE(late->rx->CatchUp(*store_, std::nullopt).ok());
    ExpectHolds(*late, state);
    ExpectBf16Where(*late, state, fp8[k]);
  }
}

// A receiver that gives a weight as F8_E4M3 where its block keeps it BF16
// is told why, and what to give instead.
TEST(PushFp8Match, AWeightGivenAsFp8ThatThePlanHoldsInBf16IsRefusedSayingWhy) {
  const ModelConfig c;
  auto plan = MakeTransferPlan(transfer_test::ModelSpecs(c), c.Geometry(), {1, false, false},
                               {1, false, false});
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  auto fp8 = MakeFp8ReceiverPlan(*plan, 0, Fp8Options(16, 16, Fp8ScaleRule::kPlain));
  ASSERT_TRUE(fp8.ok()) << fp8.status().message();
  std::vector<PlanTensor> have;
  for (const PlanTensor& t : push_internal::Fp8ReceiverTensors(*plan, *fp8)) {
    if (!t.name.empty()) have.push_back(t);
  }
  ASSERT_TRUE(push_internal::MatchFp8ReceiverTensors(*plan, *fp8, have, "rx").ok());
  const std::string k = kLayer + "self_attn.k_proj.weight";
  for (PlanTensor& t : have) {
    if (t.name == k) t.dtype = DType::kF8E4M3;
  }
  auto m = push_internal::MatchFp8ReceiverTensors(*plan, *fp8, have, "rx");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "rx: tensor " + k +
                " is given as F8_E4M3 but is not held in FP8 (shape not a multiple of the block, "
                "FP8 block 16 x 16); give it as BF16");
}

// The hello carries the policy's partial-blocks opt-in; anything but a
// boolean is refused, and an absent key is the default (off).
TEST(PushFp8Hello, PartialBlocksTravelInTheHello) {
  Fp8ReceiverOptions o = PartialFp8Options(5, 7, Fp8ScaleRule::kPlain);
  const nlohmann::json j = push_internal::Fp8OptionsJson(o);
  EXPECT_EQ(j.at("partial_blocks"), true);
  auto back = push_internal::ParseFp8Options(j);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_TRUE(back->policy.quantize_partial_blocks);
  auto plain = push_internal::ParseFp8Options(
      nlohmann::json::parse(R"({"block": [128, 128], "scale_rule": "plain"})"));
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->policy.quantize_partial_blocks);
  auto bad = push_internal::ParseFp8Options(nlohmann::json::parse(
      R"({"block": [128, 128], "scale_rule": "plain", "partial_blocks": "yes"})"));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("partial_blocks"), std::string::npos);
}

}  // namespace
}  // namespace dte::push_fp8_test
