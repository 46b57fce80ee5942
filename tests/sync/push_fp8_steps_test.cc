// The push server's FP8 work after its first push (docs/push.md "FP8
// receivers", "Costs"): changes that hold the parent's elements step the
// block summaries the server kept (sync/push/internal/push_fp8_summary.h)
// and read no parent tensor whole, over real loopback TCP, while every FP8
// receiver still equals the quantized version (tests/sync/push_fp8_fixture.h).
// Summaries are kept only from a push that completed with no FP8 variant
// dropped: after any other, the next push reads the parents whole again.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sync/push/changes.h"
#include "tests/sync/push_fp8_fixture.h"

namespace dte::push_fp8_test {
namespace {

using kernels::Fp8ScaleRule;

// Changes held in memory, read like the store's (twice when the push packs
// twice), whose `fail_at`-th read of tensor `fail` fails: a push that stops
// mid-way.
class FailingChanges : public ChangesSource {
 public:
  FailingChanges(std::vector<TensorChanges> changes, std::string fail, int fail_at)
      : fail_(std::move(fail)), fail_at_(fail_at) {
    for (TensorChanges& c : changes) by_name_[c.name] = std::move(c);
  }
  bool MayChange(const std::string& name) const override { return by_name_.count(name) > 0; }
  Result<const TensorChanges*> Read(const std::string& name) override {
    if (name == fail_ && ++reads_ == fail_at_) return IOError("reading " + name + " failed");
    auto it = by_name_.find(name);
    return it == by_name_.end() ? &empty_ : &it->second;
  }

 private:
  std::map<std::string, TensorChanges> by_name_;
  std::string fail_;
  int fail_at_, reads_ = 0;
  TensorChanges empty_;
};

// The tensors some receiver of these tests quantizes (the default policy,
// or `skip` kept in BF16, at any block: the 5 x 7 receivers quantize
// partial blocks, the 4 x 4 ones divide every dimension) that differ
// between a and b.
uint64_t ChangedQuantized(const std::vector<PlanTensor>& specs, const State& a, const State& b,
                          const std::string& skip = "") {
  Fp8ReceiverOptions o = PartialFp8Options(1, 1, Fp8ScaleRule::kPlain);
  if (!skip.empty()) o.policy.skip_modules.push_back(skip);
  uint64_t n = 0;
  for (const PlanTensor& t : specs) n += Quantized(t, o) && a.at(t.name) != b.at(t.name);
  return n;
}

// Two passes (no cache, a tensor per batch), two block shapes and rules
// over the same tensors: the first push reads the changed tensors' parents
// whole; the next ones none, reading only block rows of the parents (more
// of them at the step whose scales grow); changes read back from the store
// (differences over unknown old values) read the parents whole again, and
// the push after them steps again.
TEST_F(PushFp8Test, PushesAfterTheFirstReadNoParentTensorWhole) {
  auto server = StartTwoPassServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, {1, false, false}, 0,
                         PartialFp8Options(5, 7, Fp8ScaleRule::kPlain), state_, 0));
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r,
                           Fp8Options(4, 4, Fp8ScaleRule::kPowerOfTwo), state_, 0));
  }
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 0, std::nullopt, state_, 0));
  AwaitReceivers(*server, rxs.size());
  uint64_t quantized_bytes = 0;
  for (const PlanTensor& t : specs_) quantized_bytes += Quantized(t) ? state_.at(t.name).size() : 0;
  std::mt19937_64 rng(21);
  State state = state_;
  for (int step = 1; step <= 5; ++step) {
    State next = Step(state, 0.02, step == 3, rng);
    const uint64_t v = Commit(next);
    const bool from_store = step == 4;
    auto source = StoreChanges(*store_, V(v));
    ASSERT_TRUE(source.ok()) << source.status().message();
    auto report = from_store ? server->Push(*store_, V(v), **source)
                             : server->Push(*store_, V(v), Diff(state, next));
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok());
      ExpectHolds(*r, next);
    }
    if (step == 1 || from_store) {
      EXPECT_GT(report->fp8_parent_reads, 0u) << "step " << step;
      EXPECT_GE(report->fp8_parent_bytes, quantized_bytes) << "step " << step;  // two passes
    } else {
      EXPECT_EQ(report->fp8_parent_reads, 0u) << "step " << step;
      EXPECT_LT(report->fp8_parent_bytes, quantized_bytes) << "step " << step;
      if (step == 3) {
        EXPECT_GT(report->fp8_parent_bytes, 0u) << "grown blocks are read";
      }
    }
    state = std::move(next);
  }
}

// Summaries describe only the version the server pushed: after v2 is
// published without a push (the server told of it, the receivers caught
// up to it), v3 reads every changed quantized tensor's parent whole, even
// those v2 left as v1 had them, and the receivers equal v3.
TEST_F(PushFp8Test, AVersionPublishedWithoutAPushLeavesTheSummariesUnused) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs = Fp8AndBf16Receivers(*server);
  std::mt19937_64 rng(34);
  const State v1 = Step(state_, 0.05, false, rng);
  ASSERT_EQ(Commit(v1), 1u);
  ASSERT_TRUE(server->Push(*store_, V(1), Diff(state_, v1)).ok());
  State v2 = v1;  // one element of one quantized tensor changed
  v2.at("model.layers.0.mlp.up_proj.weight")[0] ^= 1;
  ASSERT_EQ(Commit(v2), 2u);
  ASSERT_TRUE(server->SetLatest(*store_, V(2)).ok());
  for (auto& r : rxs) {
    ASSERT_TRUE(r->rx->WaitFor(1, 10s).ok());
    ASSERT_TRUE(r->rx->WaitFor(2, 10s).code() == Code::kFailedPrecondition);
    ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
  }
  AwaitReceiversAt(*server, rxs.size(), 2);
  const State v3 = Step(v2, 0.05, false, rng);
  ASSERT_EQ(Commit(v3), 3u);
  auto report = server->Push(*store_, V(3), Diff(v2, v3));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->pushed, rxs.size());
  EXPECT_EQ(report->fp8_parent_reads, ChangedQuantized(specs_, v2, v3));
  for (auto& r : rxs) {
    ASSERT_TRUE(r->rx->WaitFor(3, 10s).ok());
    ExpectHolds(*r, v3);
  }
}

// The server holds at most PushServerOptions::fp8_summary_bytes of block
// summaries (a receiver of tiny blocks must not make it hold many times the
// model): with room for about half of them (7920 bytes: 99 blocks of 5 x 7
// per layer), the first push keeps some, the second steps those and reads
// the other changed tensors whole, and every receiver equals the version.
TEST_F(PushFp8Test, SummariesBeyondTheirBudgetAreNotKept) {
  PushServerOptions small;
  small.fp8_summary_bytes = 4096;
  auto server = StartServer(small);
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs = Fp8AndBf16Receivers(*server);
  std::mt19937_64 rng(33);
  State state = state_;
  for (uint64_t v = 1; v <= 3; ++v) {
    State next = Step(state, 0.05, false, rng);
    ASSERT_EQ(Commit(next), v);
    auto report = server->Push(*store_, V(v), Diff(state, next));
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    const uint64_t changed = ChangedQuantized(specs_, state, next);
    if (v == 2) {
      EXPECT_GT(report->fp8_parent_reads, 0u) << "summaries over the budget were kept";
      EXPECT_LT(report->fp8_parent_reads, changed) << "no summary was kept";
    }
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok()) << "v" << v;
      ExpectHolds(*r, next);
    }
    state = std::move(next);
  }
}

// Summaries are kept only from a push that completed with no FP8 variant
// dropped. Variant A quantizes every linear weight, variant K keeps
// down_proj in BF16 (same blocks: they share change sets). v2 puts a NaN in
// a block of layer 1's down_proj: A's receiver is dropped, K's and the
// BF16 one take v2. v3 then reads every changed tensor K quantizes whole
// (summaries of v2 kept for K's tensors would let it read none); A's
// receiver catches up to v3 and takes v4, equal to the quantized version.
TEST_F(PushFp8Test, AVersionThatDropsAnFp8VariantLeavesNoSummaries) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  Fp8ReceiverOptions keep = PartialFp8Options(5, 7, Fp8ScaleRule::kPlain);
  keep.policy.skip_modules.push_back("down_proj");
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, {1, false, false}, 0,
                         PartialFp8Options(5, 7, Fp8ScaleRule::kPlain), state_, 0));
  rxs.push_back(Receiver(*server, {1, false, false}, 0, keep, state_, 0));
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 0, std::nullopt, state_, 0));
  AwaitReceivers(*server, rxs.size());
  const std::string nan_tensor = "model.layers.1.mlp.down_proj.weight";
  std::mt19937_64 rng(31);
  std::vector<State> states = {state_};
  for (uint64_t v = 1; v <= 4; ++v) {
    State next = Step(states.back(), 0.05, false, rng);
    const uint16_t nan = 0x7FC0;
    if (v == 2) std::memcpy(next.at(nan_tensor).data() + 2 * 37, &nan, 2);
    if (v == 3) {  // v2's NaN back to v1's value
      std::memcpy(next.at(nan_tensor).data() + 2 * 37, states[1].at(nan_tensor).data() + 2 * 37, 2);
    }
    ASSERT_EQ(Commit(next), v);
    auto report = server->Push(*store_, V(v), Diff(states.back(), next));
    ASSERT_TRUE(report.ok()) << report.status().message();
    states.push_back(next);
    if (v == 2) {
      EXPECT_EQ(report->pushed, 2u);
      ASSERT_EQ(report->dropped.size(), 1u);
      EXPECT_NE(report->dropped[0].find(nan_tensor), std::string::npos) << report->dropped[0];
      ExpectHolds(*rxs[0], states[1]);  // untouched: still v1
      Status s = rxs[0]->rx->WaitFor(2, 10s);
      EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.message();
    } else {
      EXPECT_EQ(report->pushed, v == 3 ? 2u : 3u);
      EXPECT_TRUE(report->dropped.empty()) << report->dropped[0];
    }
    if (v == 3) {
      EXPECT_GE(report->fp8_parent_reads, ChangedQuantized(specs_, states[2], next, "down_proj"));
      ASSERT_TRUE(rxs[0]->rx->WaitFor(3, 10s).code() == Code::kFailedPrecondition);
      ASSERT_TRUE(rxs[0]->rx->CatchUp(*store_, std::nullopt).ok());
      AwaitReceiversAt(*server, rxs.size(), 3);
    }
    if (v == 4) {
      EXPECT_GT(report->fp8_parent_reads, 0u) << "down_proj has no summary";
    }
    for (size_t k = 0; k < rxs.size(); ++k) {
      if (v == 2 && k == 0) continue;
      ASSERT_TRUE(rxs[k]->rx->WaitFor(v, 10s).ok()) << "receiver " << k << " v" << v;
      ExpectHolds(*rxs[k], next);
    }
  }
}

// A push that fails mid-way (its changes' second read of a tensor fails,
// with no cache) keeps no summaries: its receivers, dropped, catch up to
// it, and the next push reads every changed quantized tensor whole
// (summaries of the failed push, staged in its first pass, would let it
// read none), its FP8 receivers equal to the quantized version.
TEST_F(PushFp8Test, APushThatFailsMidWayLeavesNoSummaries) {
  auto server = StartTwoPassServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs = Fp8AndBf16Receivers(*server);
  std::mt19937_64 rng(32);
  std::vector<State> states = {state_};
  for (uint64_t v = 1; v <= 3; ++v) {
    State next = Step(states.back(), 0.05, false, rng);
    ASSERT_EQ(Commit(next), v);
    const std::string last = specs_.back().name;
    if (v == 2) {
      FailingChanges failing(Diff(states.back(), next), last, 2);
      auto report = server->Push(*store_, V(v), failing);
      ASSERT_FALSE(report.ok());
      EXPECT_NE(report.status().message().find(last), std::string::npos)
          << report.status().message();
      for (auto& r : rxs) {
        ExpectHolds(*r, states.back());
        ASSERT_TRUE(r->rx->WaitFor(2, 10s).code() == Code::kFailedPrecondition);
        ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
      }
      AwaitReceiversAt(*server, rxs.size(), 2);
    } else {
      auto report = server->Push(*store_, V(v), Diff(states.back(), next));
      ASSERT_TRUE(report.ok()) << report.status().message();
      EXPECT_EQ(report->pushed, rxs.size());
      if (v == 3) {
        EXPECT_GE(report->fp8_parent_reads, ChangedQuantized(specs_, states.back(), next));
      }
    }
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok()) << "v" << v;
      ExpectHolds(*r, next);
    }
    states.push_back(std::move(next));
  }
}

}  // namespace
}  // namespace dte::push_fp8_test
