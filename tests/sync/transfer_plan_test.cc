// Transfer plans against a direct sharding of the HF state: scattering the
// remapped changes of a random sparse update into the receiver shards of the
// old state must give, bit for bit, the shards of the new state.
#include "sync/transfer/transfer_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/change_detect.h"
#include "kernels/remap.h"
#include "store/dtype.h"
#include "tests/sync/transfer_test_util.h"

namespace dte {
namespace {

using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::RandomChange;
using transfer_test::RandomModel;
using transfer_test::ShardModel;
using transfer_test::State;

// The changed indices and new values of every tensor of `side`.
struct Changes {
  std::vector<uint64_t> idx;
  Bytes vals;
};

Changes Diff(const PlanTensor& t, const Bytes& old_data, const Bytes& new_data) {
  const int w = DTypeWidth(t.dtype);
  const size_t n = ShapeElements(t.shape);
  Changes c;
  c.idx.resize(n);
  c.vals.resize(n * w);
  const size_t k = kernels::DetectChangesParallel(old_data.data(), new_data.data(), n, w,
                                                  c.idx.data(), c.vals.data());
  c.idx.resize(k);
  c.vals.resize(k * w);
  return c;
}

// Applies every op of the plan: remap the sender's changed indices, gather
// their values, scatter into the receiver's tensor. With `fused`, uses the
// one-pass RemapScatter instead of RemapOpIndices + Scatter.
void Apply(const TransferPlan& plan, const std::vector<std::map<std::string, Changes>>& sent,
           std::vector<State>* receivers, bool fused) {
  for (const TransferOp& op : plan.ops) {
    const PlanTensor& st = plan.sender_tensors[op.sender][op.sender_tensor];
    const PlanTensor& rt = plan.receiver_tensors[op.receiver][op.receiver_tensor];
    const Changes& c = sent[op.sender].at(st.name);
    const int w = DTypeWidth(rt.dtype);
    Bytes& dst = (*receivers)[op.receiver].at(rt.name);
    if (fused) {
      kernels::RemapScatter(op.remap, c.idx.data(), c.vals.data(), c.idx.size(), w, dst.data());
      continue;
    }
    std::vector<uint64_t> ridx(c.idx.size()), pos(c.idx.size());
    const size_t kept = RemapOpIndices(op, c.idx.data(), c.idx.size(), ridx.data(), pos.data());
    Bytes vals(kept * w);
    for (size_t j = 0; j < kept; ++j) std::memcpy(&vals[j * w], &c.vals[pos[j] * w], w);
    kernels::ScatterParallel(dst.data(), w, ridx.data(), vals.data(), kept);
  }
}

// One full round: plan, shard old and new, diff on the sender side, apply,
// compare every receiver tensor with the direct sharding of the new state.
void CheckRoundTrip(const ModelConfig& cfg, const ShardLayout& sender, const ShardLayout& receiver,
                    double density, uint64_t seed, bool fused) {
  SCOPED_TRACE("heads " + std::to_string(cfg.heads) + " kv " + std::to_string(cfg.kv_heads) +
               " sender tp " + std::to_string(sender.tp) + " receiver tp " +
               std::to_string(receiver.tp) + " density " + std::to_string(density));
  std::mt19937_64 rng(seed);
  const auto [specs, old_state] = RandomModel(cfg, rng);
  const State new_state = RandomChange(specs, old_state, density, rng);
  Result<TransferPlan> plan = MakeTransferPlan(specs, cfg.Geometry(), sender, receiver);
  ASSERT_TRUE(plan.ok()) << plan.status().message();

  std::vector<std::map<std::string, Changes>> sent(sender.tp);
  for (int s = 0; s < sender.tp; ++s) {
    const State o = ShardModel(cfg, specs, old_state, sender, s);
    const State n = ShardModel(cfg, specs, new_state, sender, s);
    ASSERT_EQ(plan->sender_tensors[s].size(), o.size());
    for (const PlanTensor& t : plan->sender_tensors[s]) {
      ASSERT_TRUE(o.count(t.name)) << t.name;
      ASSERT_EQ(o.at(t.name).size(), ShapeElements(t.shape) * DTypeWidth(t.dtype)) << t.name;
      sent[s][t.name] = Diff(t, o.at(t.name), n.at(t.name));
    }
  }
  std::vector<State> got(receiver.tp);
  for (int r = 0; r < receiver.tp; ++r) got[r] = ShardModel(cfg, specs, old_state, receiver, r);
  Apply(*plan, sent, &got, fused);
  for (int r = 0; r < receiver.tp; ++r) {
    const State want = ShardModel(cfg, specs, new_state, receiver, r);
    ASSERT_EQ(plan->receiver_tensors[r].size(), want.size());
    for (const PlanTensor& t : plan->receiver_tensors[r]) {
      ASSERT_TRUE(want.count(t.name)) << "rank " << r << " " << t.name;
      ASSERT_EQ(want.at(t.name).size(), ShapeElements(t.shape) * DTypeWidth(t.dtype)) << t.name;
      ASSERT_TRUE(got[r].at(t.name) == want.at(t.name)) << "rank " << r << " tensor " << t.name;
    }
  }
}

struct Gqa {
  uint64_t heads, kv_heads;
};

TEST(TransferPlan, ScatteredDeltasEqualDirectShardingForEveryTpAndGqaRatio) {
  const Gqa ratios[] = {{8, 1}, {8, 2}, {8, 8}, {16, 2}, {16, 4}, {32, 4}, {32, 8}};
  uint64_t seed = 1;
  for (const Gqa& g : ratios) {
    for (int tp : {1, 2, 4, 8}) {
      ModelConfig cfg;
      cfg.heads = g.heads;
      cfg.kv_heads = g.kv_heads;
      CheckRoundTrip(cfg, ShardLayout{1}, FusedReceiverLayout(tp), 0.03, seed++, false);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(TransferPlan, EveryElementIsDeliveredWhenEverythingChanges) {
  // Density 1: an op missing from the plan leaves a stale element behind.
  for (int tp : {1, 2, 4, 8}) {
    ModelConfig cfg;
    cfg.heads = 16;
    cfg.kv_heads = 2;
    cfg.vocab = 37;  // not a multiple of tp: padded vocab shards
    CheckRoundTrip(cfg, ShardLayout{1}, FusedReceiverLayout(tp), 1.0, 100 + tp, false);
    if (HasFatalFailure()) return;
  }
}

TEST(TransferPlan, ShardedSendersAndUnfusedReceiversAlsoMatch) {
  struct Case {
    Gqa g;
    ShardLayout sender, receiver;
  };
  const Case cases[] = {
      {{8, 2}, {2}, FusedReceiverLayout(4)},  {{8, 2}, {4}, FusedReceiverLayout(2)},
      {{16, 4}, {8}, FusedReceiverLayout(8)}, {{8, 1}, {4}, {2, false, false}},
      {{32, 8}, {2}, {8, true, false}},       {{16, 2}, {2, true, true}, {4, false, true}},
      {{8, 8}, {8}, FusedReceiverLayout(1)},
  };
  uint64_t seed = 500;
  for (const Case& c : cases) {
    ModelConfig cfg;
    cfg.heads = c.g.heads;
    cfg.kv_heads = c.g.kv_heads;
    CheckRoundTrip(cfg, c.sender, c.receiver, 0.05, seed++, false);
    if (HasFatalFailure()) return;
    CheckRoundTrip(cfg, c.sender, c.receiver, 0.05, seed++, true);
    if (HasFatalFailure()) return;
  }
}

TEST(TransferPlan, ReplicatedDataIsSentOnceByOneHolder) {
  ModelConfig cfg;
  cfg.heads = 8;
  cfg.kv_heads = 2;
  std::mt19937_64 rng(3);
  const auto specs = RandomModel(cfg, rng).first;
  Result<TransferPlan> plan = MakeTransferPlan(specs, cfg.Geometry(), {4}, FusedReceiverLayout(4));
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  // Per receiver rank and canonical tensor, the ops' elements add up to
  // exactly what the rank holds of it, so nothing is sent twice.
  std::map<std::pair<int, uint32_t>, uint64_t> delivered;
  std::map<int, int> norm_senders;
  for (const TransferOp& op : plan->ops) {
    delivered[{op.receiver, op.canonical}] += op.elements;
    if (plan->canonical[op.canonical].name == "model.norm.weight") {
      ++norm_senders[op.sender];
    }
  }
  for (const auto& [key, n] : delivered) {
    const PlanTensor& t = plan->canonical[key.second];
    const uint64_t all = ShapeElements(t.shape);
    EXPECT_TRUE(n == all || n == all / 4 || n == all / 2) << t.name << " rank " << key.first;
  }
  // Four receivers of a tensor that all four senders hold: one op each, from
  // four different senders.
  EXPECT_EQ(norm_senders.size(), 4u);
}

Status PlanError(std::vector<PlanTensor> specs, AttentionGeometry g, ShardLayout receiver) {
  return MakeTransferPlan(specs, g, ShardLayout{1}, receiver).status();
}

void ExpectNamed(const Status& st, const std::string& name) {
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("'" + name + "'"), std::string::npos) << st.message();
}

TEST(TransferPlan, ValidationErrorsNameTheTensor) {
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const std::string k = "model.layers.0.self_attn.k_proj.weight";
  const std::string v = "model.layers.0.self_attn.v_proj.weight";
  const AttentionGeometry g{8, 2, 4};
  auto qkv = [&](uint64_t k_rows) {
    return std::vector<PlanTensor>{
        {q, DType::kBF16, {32, 16}}, {k, DType::kBF16, {k_rows, 16}}, {v, DType::kBF16, {8, 16}}};
  };
  ExpectNamed(PlanError(qkv(8), g, FusedReceiverLayout(3)), q);          // 8 heads over tp 3
  ExpectNamed(PlanError(qkv(12), g, FusedReceiverLayout(2)), k);         // 3 kv heads of 4
  EXPECT_TRUE(PlanError(qkv(8), g, FusedReceiverLayout(8)).ok());        // kv heads replicated
  ExpectNamed(PlanError(qkv(8), {8, 3, 4}, FusedReceiverLayout(2)), k);  // geometry vs rows

  std::vector<PlanTensor> no_v = qkv(8);
  no_v.pop_back();
  ExpectNamed(PlanError(no_v, g, FusedReceiverLayout(2)), q);
  EXPECT_TRUE(PlanError(no_v, g, ShardLayout{2}).ok());  // unfused needs no partner

  const std::string gate = "model.layers.1.mlp.gate_proj.weight";
  const std::string up = "model.layers.1.mlp.up_proj.weight";
  ExpectNamed(PlanError({{gate, DType::kBF16, {64, 16}}, {up, DType::kF32, {64, 16}}}, g,
                        FusedReceiverLayout(2)),
              up);
  ExpectNamed(PlanError({{gate, DType::kBF16, {60, 16}}, {up, DType::kBF16, {60, 16}}}, g,
                        FusedReceiverLayout(8)),
              gate);
  ExpectNamed(PlanError({{"model.layers.0.mlp.experts.3.w1", DType::kBF16, {4, 4}}}, g,
                        FusedReceiverLayout(2)),
              "model.layers.0.mlp.experts.3.w1");
  ExpectNamed(PlanError({{"model.layers.0.self_attn.o_proj.weight", DType::kBF16, {16, 30}}}, g,
                        FusedReceiverLayout(4)),
              "model.layers.0.self_attn.o_proj.weight");
  ExpectNamed(PlanError({{"model.norm.weight", DType::kBF16, {16}},
                         {"model.norm.weight", DType::kBF16, {16}}},
                        g, FusedReceiverLayout(1)),
              "model.norm.weight");
  EXPECT_FALSE(PlanError({}, g, ShardLayout{0}).ok());
}

}  // namespace
}  // namespace dte
