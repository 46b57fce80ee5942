// A push receiver's catch-up a band of rows at a time
// (sync/push/internal/push_catchup.h): with bands far smaller than the
// tensors (one row or FP8 block row, and a few), receivers of every layout
// still equal the version (BF16) or its whole-tensor quantization split by
// plain slicing (FP8: tests/sync/push_fp8_fixture.h), a NaN is refused
// naming the tensor and block, and a TP-2 rank reads only its half of a
// row-split tensor from the store.
#include "sync/push/internal/push_catchup.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "store/materialize.h"
#include "sync/push/internal/push_fp8.h"
#include "sync/transfer/plan_inputs.h"
#include "tests/sync/push_fp8_fixture.h"

namespace dte::push_fp8_test {
namespace {

using kernels::Fp8ScaleRule;

class PushCatchUpBands : public PushFp8Test, public ::testing::WithParamInterface<Fp8ScaleRule> {
 protected:
  PushCatchUpBands() { config_.vocab = 41; }  // TP 2 pads the last vocabulary shard
};

// Receivers that hold nothing catch up to v1 with bands of 1 byte (one row,
// one FP8 block row), 200 and 700 bytes (several rows and block rows,
// cutting tensors part way, partial edge blocks of 5 x 7, quantized by the
// opt-in, in the last band):
// TP 1 unfused and fused, TP 2 unfused (column splits of o_proj and
// down_proj) and fused (qkv_proj, gate_up_proj), BF16 and FP8.
TEST_P(PushCatchUpBands, ReceiversOfEveryLayoutEqualTheWholeTensorResult) {
  const Fp8ScaleRule rule = GetParam();
  std::mt19937_64 rng(21);
  const State v1 = Step(state_, 0.05, true, rng);
  ASSERT_EQ(Commit(v1), 1u);
  auto server = StartServer();
  ASSERT_TRUE(server);
  for (uint64_t band : {1, 200, 700}) {
    band_bytes_ = band;
    std::vector<std::unique_ptr<Rx>> rxs;
    const State& none = state_;
    rxs.push_back(Receiver(*server, {1, false, false}, 0, PartialFp8Options(5, 7, rule), none,
                           std::nullopt, false));
    rxs.push_back(
        Receiver(*server, FusedReceiverLayout(1), 0, Fp8Options(4, 4, rule), none, std::nullopt));
    for (int r = 0; r < 2; ++r) {
      rxs.push_back(Receiver(*server, {2, false, false}, r, Fp8Options(4, 4, rule), none,
                             std::nullopt, false));
      rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r, Fp8Options(4, 4, rule), none,
                             std::nullopt, false));
      rxs.push_back(
          Receiver(*server, FusedReceiverLayout(2), r, std::nullopt, none, std::nullopt, false));
      rxs.push_back(
          Receiver(*server, {2, false, false}, r, std::nullopt, none, std::nullopt, false));
    }
    for (auto& r : rxs) {
      SCOPED_TRACE("bands of " + std::to_string(band) + " bytes");
      Status s = r->rx->CatchUp(*store_, 1);
      ASSERT_TRUE(s.ok()) << s.message();
      ExpectHolds(*r, v1);
      EXPECT_EQ(r->rx->GetStatus().version, 1u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, PushCatchUpBands,
                         ::testing::Values(Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo),
                         [](const auto& info) {
                           return std::string(push_internal::Fp8RuleName(info.param));
                         });

// A NaN in down_proj (16 x 24, split by columns at 12 under TP 2) at
// element (9, 14), in block (2, 3) of 4 x 4 blocks: the rank whose columns
// hold it refuses the catch-up naming the tensor, block and element, in
// bands of one block row, and is inconsistent; the other rank quantizes
// only its own columns and holds the version (compared with the version
// whose NaN is 0: the same in that rank's blocks).
TEST_F(PushFp8Test, ACatchUpRefusesANanInItsOwnColumnsNamingTensorAndBlock) {
  band_bytes_ = 1;
  State v1 = state_;
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  const uint16_t nan = 0x7FC0;
  std::memcpy(&v1.at(name)[(9 * 24 + 14) * 2], &nan, 2);
  ASSERT_EQ(Commit(v1), 1u);
  auto server = StartServer();
  ASSERT_TRUE(server);
  const auto fp8 = Fp8Options(4, 4, Fp8ScaleRule::kPlain);
  auto r1 = Receiver(*server, {2, false, false}, 1, fp8, state_, 0, false);
  Status s = r1->rx->CatchUp(*store_, 1);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "catch-up to v00000001 of receiver tp=2 rank 1: tensor '" + name +
                "': FP8 block (2, 3) (rows 8..11, cols 12..15) holds a NaN or infinite weight at "
                "element (9, 14); FP8 quantization refuses non-finite weights");
  EXPECT_TRUE(r1->rx->GetStatus().inconsistent);
  auto r0 = Receiver(*server, {2, false, false}, 0, fp8, state_, 0, false);
  ASSERT_TRUE(r0->rx->CatchUp(*store_, 1).ok());
  State clean = v1;  // the same in rank 0's blocks, and quantizable whole
  std::memset(&clean.at(name)[(9 * 24 + 14) * 2], 0, 2);
  ExpectHolds(*r0, clean);
}

class PushCatchUpReads : public PushFp8Test {
 protected:
  // embed_tokens of 16384 x 64 BF16: 2 MiB, 8 store blocks of 256 KiB.
  PushCatchUpReads() {
    config_.vocab = 16384;
    config_.hidden = 64;
  }

  // The store blocks that catching up embed_tokens as `rank` of `layout`
  // materializes, in bands of `band` bytes; the shard it copies checked.
  uint64_t BlocksRead(const ShardLayout& layout, int rank, uint64_t band) {
    const std::string name = "model.embed_tokens.weight";
    auto v = V(0);
    auto in = PlanInputsOf(*store_, *v);
    EXPECT_TRUE(in.ok()) << in.status().message();
    auto plan = MakeTransferPlan(in->canonical, in->geometry, {1, false, false}, layout);
    EXPECT_TRUE(plan.ok()) << plan.status().message();
    const Bytes want = transfer_test::ShardModel(config_, specs_, state_, layout, rank).at(name);
    Bytes got(want.size());
    Materializer reader(store_.get());
    push_internal::BandCopier copier(reader, v, *plan, band, "catch-up");
    const auto& own = plan->receiver_tensors[rank];
    for (const TransferOp& op : plan->ops) {
      if (op.receiver != rank || own[op.receiver_tensor].name != name) continue;
      Status s = copier.CopyOp(op, got.data());
      EXPECT_TRUE(s.ok()) << s.message();
    }
    EXPECT_TRUE(got == want) << LayoutText(layout, rank) << ": embed_tokens differs";
    return reader.counters().blocks;
  }
};

TEST_F(PushCatchUpReads, ATp2RankReadsHalfOfARowSplitTensor) {
  EXPECT_EQ(BlocksRead({1, false, false}, 0, 16 << 20), 8u);
  EXPECT_EQ(BlocksRead({2, false, false}, 0, 16 << 20), 4u);
  EXPECT_EQ(BlocksRead({2, false, false}, 1, 16 << 20), 4u);
  // Bands of one store block each, and of 100 KiB: a block that two bands
  // cut is read by each (4 blocks in 11 bands).
  EXPECT_EQ(BlocksRead({2, false, false}, 1, 256 << 10), 4u);
  EXPECT_LE(BlocksRead({2, false, false}, 1, 100 << 10), 4u + 10u);
}

}  // namespace
}  // namespace dte::push_fp8_test
