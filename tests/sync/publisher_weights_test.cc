// Publisher::PublishWeights, the path for any optimizer: a version from new
// weights compared with the parent's equals a commit of the same weights,
// with and without this host's snapshots, from FP32 and BF16 weights, one
// tensor at a time or all at once; rejections name the tensor and write
// nothing; the changes a push sends carry the parent's exact old bits.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kernels/bf16.h"
#include "store/ops/commit.h"
#include "store/ops/export.h"
#include "store/ops/verify.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "sync/publish/publish_metrics.h"
#include "sync/publish/publisher.h"
#include "tests/sync/publisher_fixture.h"
#include "tests/testutil/adamw_state.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/metrics_text.h"
#include "tests/testutil/same_version.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::TestCheckpoint;
using test::TestTensor;

kernels::AdamWParams Params(int64_t step) {
  kernels::AdamWParams p;
  p.lr = 1e-4;
  p.beta2 = 0.95;
  p.weight_decay = 0.1;
  p.step = step;
  return p;
}

// The publisher model (tests/sync/publisher_fixture.h), published from its
// FP32 masters or their BF16 casts.
class PublisherWeightsTest : public test::PublisherModelTest {
 protected:
  std::unique_ptr<Publisher> Open(const std::string& name, bool cache) {
    PublisherOptions o;
    o.store = tmp_.path() + "/" + name;
    if (cache) o.cache_dir = tmp_.path() + "/cache-" + name;
    // Plain deltas only: a version stored whole (a full or join table)
    // would also get a snapshot, which the snapshot test counts.
    o.anchor_policy.budget = 0;
    o.anchor_policy.join_budget = 0;
    auto p = Publisher::Open(o);
    EXPECT_TRUE(p.ok()) << p.status().message();
    return p.ok() ? std::move(p).value() : nullptr;
  }

  // The weights of every trained tensor: FP32 masters, or their BF16 casts.
  std::vector<WeightsTensor> Weights(bool bf16) {
    bf16_.assign(states_.size(), {});
    std::vector<WeightsTensor> w;
    for (size_t i = 0; i < states_.size(); ++i) {
      const auto& s = states_[i];
      if (bf16) {
        bf16_[i].resize(s.theta.size());
        kernels::CastFp32ToBf16(s.theta.data(), bf16_[i].data(), s.theta.size());
        w.push_back({s.name, {bf16_[i].data(), DType::kBF16, s.shape}});
      } else {
        w.push_back({s.name, {s.theta.data(), DType::kF32, s.shape}});
      }
    }
    return w;
  }

  void Step(int64_t step) {
    for (size_t i = 0; i < states_.size(); ++i) {
      test::AdamWStepState(&states_[i], Params(step), 100 * step + i);
    }
  }

  std::vector<std::vector<uint16_t>> bf16_;
};

// (snapshots on this host, BF16 weights given)
class PublisherWeightsModeTest : public PublisherWeightsTest,
                                 public ::testing::WithParamInterface<std::tuple<bool, bool>> {};

TEST_P(PublisherWeightsModeTest, PublishEqualsCommitOfTheSameWeights) {
  const auto [cache, bf16] = GetParam();
  auto pub = Open("weights", cache);
  auto committed = Open("commit", false);
  ASSERT_TRUE(pub && committed);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  ASSERT_TRUE(committed->ImportCheckpoint(WriteCheckpoint()).ok());
  uint64_t total_changed = 0;
  constexpr int64_t kSteps = 10;  // past a snapshot every 8 versions
  for (int64_t step = 1; step <= kSteps; ++step) {
    Step(step);
    auto r = pub->PublishWeights(step, Weights(bf16));
    ASSERT_TRUE(r.ok()) << r.status().message();
    auto c = CommitDirectory(committed->store(), WriteCheckpoint(), CommitOptions{});
    ASSERT_TRUE(c.ok()) << c.status().message();
    EXPECT_EQ(r->version, static_cast<uint64_t>(step));
    EXPECT_TRUE(r->from_weights);
    EXPECT_EQ(r->changed, c->changed_elements);
    EXPECT_GT(r->changed, 0u);
    EXPECT_EQ(r->tensors, states_.size());
    EXPECT_EQ(r->parent_bytes, r->elements * 2);  // every named tensor's parent, once
    EXPECT_EQ(r->state_bytes, r->elements * (bf16 ? 2 : 4));
    EXPECT_EQ(r->flagged, 0u);
    EXPECT_EQ(r->uncertain, 0u);
    test::ExpectSameVersion(pub->store(), committed->store(), r->version);
    total_changed += r->changed;
  }
  auto report = VerifyStore(pub->store(), std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->problems.front();
  const std::string out_a = tmp_.path() + "/export-a", out_b = tmp_.path() + "/export-b";
  ASSERT_TRUE(ExportVersion(pub->store(), kSteps, out_a, nullptr).ok());
  ASSERT_TRUE(ExportVersion(committed->store(), kSteps, out_b, nullptr).ok());
  EXPECT_EQ(test::ReadFileBytes(out_a + "/model.safetensors").value(),
            test::ReadFileBytes(out_b + "/model.safetensors").value());
  // With a cache directory the publisher leaves snapshots to read its
  // parents from: the import left one of version 0, and one is due once
  // none of the last 7 versions has one (version 8).
  auto snapshots = OpenStoreSnapshots(pub->store());
  if (cache) {
    ASSERT_TRUE(snapshots);
    EXPECT_EQ(snapshots->Stats().versions, (std::vector<uint64_t>{0, 8}));
  } else {
    EXPECT_FALSE(snapshots);
  }
  const std::string text = pub->metrics().Text();
  EXPECT_EQ(test::MetricValue(text, "dte_publish_weights_versions_total"), kSteps);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_changed_elements_total"), total_changed);
}

INSTANTIATE_TEST_SUITE_P(CacheAndDtype, PublisherWeightsModeTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

TEST_F(PublisherWeightsTest, OneTensorAtATimeEqualsAllAtOnce) {
  auto a = Open("a", true);
  auto b = Open("b", false);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->ImportCheckpoint(WriteCheckpoint()).ok());
  ASSERT_TRUE(b->ImportCheckpoint(WriteCheckpoint()).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    Step(step);
    auto all = a->PublishWeights(std::nullopt, Weights(false));
    ASSERT_TRUE(all.ok()) << all.status().message();
    ASSERT_TRUE(b->BeginWeights(std::nullopt).ok());
    for (const WeightsTensor& w : Weights(true)) ASSERT_TRUE(b->AddWeights(w).ok());
    auto one = b->CommitWeights();
    ASSERT_TRUE(one.ok()) << one.status().message();
    EXPECT_EQ(one->changed, all->changed);
    test::ExpectSameVersion(a->store(), b->store(), all->version);
  }
  // A tensor that fails drops the version being built: the commit after it
  // has nothing to commit, and the store keeps its latest version.
  Step(4);
  ASSERT_TRUE(b->BeginWeights(std::nullopt).ok());
  auto w = Weights(false);
  w[1].weights.shape = {301};
  ASSERT_TRUE(b->AddWeights(w[0]).ok());
  EXPECT_FALSE(b->AddWeights(w[1]).ok());
  auto after = b->CommitWeights();
  ASSERT_FALSE(after.ok());
  EXPECT_NE(after.status().message().find("before BeginWeights"), std::string::npos);
  EXPECT_EQ(b->store().Latest().value(), std::optional<uint64_t>(3));
}

TEST_F(PublisherWeightsTest, RejectionsNameTheTensorAndWriteNothing) {
  auto pub = Open("weights", true);
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  const size_t files = StoreFiles("weights");
  Step(1);
  auto expect_rejected = [&](std::vector<WeightsTensor> w, const std::string& needle) {
    auto r = pub->PublishWeights(1, w);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().message();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  auto w = Weights(false);
  w[1].weights.dtype = DType::kF16;
  expect_rejected(w, "tensor model.norm.weight: weights are F16");
  w = Weights(false);
  w[0].weights.shape = {1000, 2200};
  expect_rejected(w, "tensor model.embed_tokens.weight: weights have shape [1000, 2200]");
  w = Weights(false);
  w.push_back(w[0]);
  expect_rejected(w, "model.embed_tokens.weight is given twice");
  w = Weights(false);
  w[0].name = "model.missing.weight";
  expect_rejected(w, "model.missing.weight is not in v00000000");
  w = Weights(false);
  w.push_back({inv_freq_.name, {inv_freq_.data.data(), DType::kF32, {16}}});
  expect_rejected(w, "model.rotary.inv_freq is F32 in the store");
  w = Weights(false);
  w[1].weights.data = nullptr;
  expect_rejected(w, "tensor model.norm.weight: weights have no data");
  EXPECT_EQ(StoreFiles("weights"), files);
  EXPECT_EQ(pub->store().Latest().value(), std::optional<uint64_t>(0));

  auto ok = pub->PublishWeights(1, Weights(false));
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  auto late = pub->PublishWeights(3, Weights(false));
  ASSERT_FALSE(late.ok());
  EXPECT_NE(late.status().message().find("step 3 does not follow step 1"), std::string::npos);
  // Every rejection counts as a failed publish, the commit alone as a version.
  const std::string text = pub->metrics().Text();
  EXPECT_EQ(test::MetricValue(text, "dte_publish_failures_total"), 7);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_versions_total"), 1);
}

}  // namespace
}  // namespace dte
