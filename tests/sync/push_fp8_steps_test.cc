// The push server's FP8 work after its first push (docs/push.md "FP8
// receivers", "Costs"): changes that hold the parent's elements step the
// block summaries the server kept (sync/push/internal/push_fp8_summary.h)
// and read no parent tensor whole, over real loopback TCP, while every FP8
// receiver still equals the quantized version (tests/sync/push_fp8_fixture.h).
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "sync/push/changes.h"
#include "tests/sync/push_fp8_fixture.h"

namespace dte::push_fp8_test {
namespace {

using kernels::Fp8ScaleRule;

// Two passes (no cache, a tensor per batch), two block shapes and rules
// over the same tensors: the first push reads the changed tensors' parents
// whole; the next ones none, reading only block rows of the parents (more
// of them at the step whose scales grow); changes read back from the store
// (differences over unknown old values) read the parents whole again, and
// the push after them steps again.
TEST_F(PushFp8Test, PushesAfterTheFirstReadNoParentTensorWhole) {
  PushServerOptions two_passes;
  two_passes.cache_bytes = 0;
  two_passes.batch_entries = 1;
  auto server = StartServer(two_passes);
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(
      Receiver(*server, {1, false, false}, 0, Fp8Options(5, 7, Fp8ScaleRule::kPlain), state_, 0));
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

}  // namespace
}  // namespace dte::push_fp8_test
