// The AdamW-inverting publisher: a publish equals a commit of the same BF16
// weights, rejections name the tensor and leave the store untouched, races,
// false-positive counting, and the codec's set elements it relies on.
#include "sync/publish/publisher.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "store/delta_codec.h"
#include "store/materialize.h"
#include "store/ops/commit.h"
#include "store/ops/export.h"
#include "store/ops/verify.h"
#include "store/store.h"
#include "sync/publish/internal/engine_screen.h"
#include "sync/publish/publish_metrics.h"
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

using State = test::AdamWTensorState;

kernels::AdamWParams Params(int64_t step, double lr = 3e-5, double wd = 0.1) {
  kernels::AdamWParams p;
  p.lr = lr;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = wd;
  p.step = step;
  return p;
}

AdamWParamState StateRef(const State& s) {
  AdamWParamState p;
  p.name = s.name;
  p.param = {s.theta.data(), DType::kF32, s.shape};
  p.exp_avg = {s.m.data(), DType::kF32, s.shape};
  p.exp_avg_sq = {s.v.data(), DType::kF32, s.shape};
  return p;
}

class PublisherTest : public test::PublisherModelTest {
 protected:
  std::unique_ptr<Publisher> OpenPublisher(const std::string& name = "engine", bool screen = true) {
    PublisherOptions o;
    o.store = tmp_.path() + "/" + name;
    o.screen = screen;
    auto p = Publisher::Open(o);
    EXPECT_TRUE(p.ok()) << p.status().message();
    return p.ok() ? std::move(p).value() : nullptr;
  }

  std::vector<AdamWParamState> Refs() const {
    std::vector<AdamWParamState> r;
    for (const auto& s : states_) r.push_back(StateRef(s));
    return r;
  }

  size_t StoreFiles(const std::string& name = "engine") const {
    return PublisherModelTest::StoreFiles(name);
  }
};

std::string ReadAll(const std::string& path) {
  auto r = test::ReadFileBytes(path);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : "";
}

class PublisherModeTest : public PublisherTest, public ::testing::WithParamInterface<bool> {};

TEST_P(PublisherModeTest, PublishEqualsCommitOfTheSameWeights) {
  auto pub = OpenPublisher("engine", GetParam());
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  PublisherOptions co;
  co.store = tmp_.path() + "/commit";
  auto committed = Publisher::Open(co);  // a second store, fed by CommitDirectory
  ASSERT_TRUE(committed.ok());
  ASSERT_TRUE((*committed)->ImportCheckpoint(WriteCheckpoint()).ok());
  for (int64_t step = 1; step <= 3; ++step) {
    const auto p = Params(step);
    for (size_t i = 0; i < states_.size(); ++i)
      test::AdamWStepState(&states_[i], p, 100 * step + i);
    auto r = pub->PublishAdamW(test::AdamWStepOf(p), Refs());
    ASSERT_TRUE(r.ok()) << r.status().message();
    auto c = CommitDirectory((*committed)->store(), WriteCheckpoint(), CommitOptions{});
    ASSERT_TRUE(c.ok()) << c.status().message();
    EXPECT_EQ(r->version, static_cast<uint64_t>(step));
    EXPECT_EQ(c->version, r->version);
    // Exact old bits leave no false positives on this data; the delta holds
    // exactly the changed elements.
    EXPECT_EQ(r->changed, c->changed_elements);
    EXPECT_GT(r->changed, r->elements / 100);
    EXPECT_LE(r->changed, r->flagged);
    EXPECT_EQ(r->flagged - r->false_positives, r->changed);

    test::ExpectSameVersion(pub->store(), r->version, (*committed)->store(), c->version);
    // ... down to the same file blobs.
    auto a = pub->store().GetVersion(r->version);
    auto b = (*committed)->store().GetVersion(c->version);
    ASSERT_TRUE(a.ok() && b.ok());
    const auto& fa = (*a)->manifest.files;
    const auto& fb = (*b)->manifest.files;
    for (size_t f = 0; f < fa.size() && f < fb.size(); ++f) {
      EXPECT_EQ(fa[f].blob, fb[f].blob) << fa[f].name;
      EXPECT_EQ(fa[f].header_blob, fb[f].header_blob) << fa[f].name;
    }
  }
  auto report = VerifyStore(pub->store(), std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->problems.front();
  std::string out_a = tmp_.path() + "/export-engine", out_b = tmp_.path() + "/export-commit";
  ASSERT_TRUE(ExportVersion(pub->store(), 3, out_a, nullptr).ok());
  ASSERT_TRUE(ExportVersion((*committed)->store(), 3, out_b, nullptr).ok());
  for (const char* f : {"model.safetensors", "config.json"}) {
    EXPECT_EQ(ReadAll(out_a + "/" + f), ReadAll(out_b + "/" + f)) << f;
  }
  std::string dir = tmp_.path() + "/expected";
  ASSERT_TRUE(test::WriteCheckpoint(Checkpoint(), dir).ok());
  EXPECT_EQ(ReadAll(out_a + "/model.safetensors"), ReadAll(dir + "/model.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(ScreenOrFusedDetector, PublisherModeTest, ::testing::Bool());

TEST_F(PublisherTest, RejectionsNameTheTensorAndWriteNothing) {
  auto pub = OpenPublisher();
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  const size_t files = StoreFiles();
  const auto p = Params(1);
  for (size_t i = 0; i < states_.size(); ++i) test::AdamWStepState(&states_[i], p, 7 + i);
  int rejected = 0;
  auto expect_rejected = [&](AdamWStep h, std::vector<AdamWParamState> refs,
                             const std::string& needle) {
    ++rejected;
    auto r = pub->PublishAdamW(h, refs);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().message();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  AdamWStep h = test::AdamWStepOf(p);
  h.amsgrad = true;
  expect_rejected(h, Refs(), "amsgrad");
  h = test::AdamWStepOf(p);
  h.maximize = true;
  expect_rejected(h, Refs(), "maximize");
  h = test::AdamWStepOf(p);
  h.beta2 = 1.0;
  expect_rejected(h, Refs(), "beta2");

  auto refs = Refs();
  refs[1].exp_avg.dtype = DType::kBF16;
  expect_rejected(test::AdamWStepOf(p), refs, "tensor model.norm.weight: exp_avg is BF16");
  refs = Refs();
  refs[0].exp_avg_sq.shape = {1000, 2200};
  expect_rejected(test::AdamWStepOf(p), refs,
                  "tensor model.embed_tokens.weight: exp_avg_sq has shape");
  refs = Refs();
  refs[1].state_step = 2;
  expect_rejected(test::AdamWStepOf(p), refs, "tensor model.norm.weight: optimizer state step 2");
  refs = Refs();
  refs[1].weight_decay = 1e9;
  expect_rejected(test::AdamWStepOf(p), refs, "tensor model.norm.weight: ");
  refs = Refs();
  refs.push_back(refs[0]);
  expect_rejected(test::AdamWStepOf(p), refs, "model.embed_tokens.weight is given twice");
  refs = Refs();
  refs[0].name = "model.missing.weight";
  expect_rejected(test::AdamWStepOf(p), refs, "model.missing.weight is not in v00000000");
  refs = Refs();
  refs.push_back(refs[1]);
  refs.back().name = inv_freq_.name;
  refs.back().param.shape = refs.back().exp_avg.shape = refs.back().exp_avg_sq.shape = {16};
  expect_rejected(test::AdamWStepOf(p), refs, "model.rotary.inv_freq is F32 in the store");

  // Nothing reached the store.
  EXPECT_EQ(StoreFiles(), files);
  auto latest = pub->store().Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, std::optional<uint64_t>(0));

  // A valid publish still works, and the next step must follow it.
  auto ok = pub->PublishAdamW(test::AdamWStepOf(p), Refs());
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  expect_rejected(test::AdamWStepOf(Params(3)), Refs(), "step 3 does not follow step 1");

  // The metrics count every rejection as a failure and only the commit's figures.
  const std::string text = pub->metrics().Text();
  EXPECT_EQ(test::MetricValue(text, "dte_publish_failures_total"), rejected);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_versions_total"), 1);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_changed_elements_total"), ok->changed);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_stored_bytes_total"), ok->stored_bytes);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_last_version"), 1);
  EXPECT_EQ(test::MetricValue(text, "dte_publish_duration_seconds_count"), rejected + 1);
}

TEST_F(PublisherTest, AnotherWriterMakesTheNextPublishFailCleanly) {
  auto pub = OpenPublisher();
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  for (size_t i = 0; i < states_.size(); ++i) test::AdamWStepState(&states_[i], Params(1), 20 + i);
  // Someone else commits v1 first; its weights are not this trainer's
  // step t-1, so a delta against it would be wrong.
  ASSERT_TRUE(CommitDirectory(pub->store(), WriteCheckpoint(), CommitOptions{}).ok());
  auto r = pub->PublishAdamW(test::AdamWStepOf(Params(1)), Refs());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("v00000001, not v00000000"), std::string::npos)
      << r.status().message();
  auto latest = pub->store().Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, std::optional<uint64_t>(1));
}

TEST_F(PublisherTest, FalsePositivesNearBoundariesAreCountedAndDropped) {
  // Weights sitting 1-3 FP32 ulps from a BF16 rounding boundary and no
  // update at all: the detector must report them (its margin), and the exact
  // check must prove each unchanged.
  State& s = states_[1];
  for (size_t i = 0; i < s.prev.size(); ++i) {
    uint32_t bits = 0x3C238000u + (static_cast<uint32_t>(i) << 16);
    bits += (i % 2 ? 1u : -1u) * static_cast<uint32_t>(1 + i % 3);
    std::memcpy(&s.prev[i], &bits, 4);
  }
  s.theta = s.prev;
  std::fill(s.m.begin(), s.m.end(), 0.0f);
  std::fill(s.v.begin(), s.v.end(), 1.0f);
  const auto p = Params(1, 1e-5, 0.0);
  for (bool screen : {false, true}) {
    SCOPED_TRACE(screen ? "screen" : "fused detector");
    auto pub = OpenPublisher(screen ? "screen" : "fused", screen);
    ASSERT_TRUE(pub);
    ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
    auto r = pub->PublishAdamW(test::AdamWStepOf(p), {StateRef(s)});
    ASSERT_TRUE(r.ok()) << r.status().message();
    // The fused detector's margin reports all; the screen's bound (2 to 4
    // ulps here, by the mantissa) reports those 1 and 2 ulps away, and some
    // of those 3 ulps away.
    if (screen) {
      EXPECT_GE(r->flagged, 2 * s.prev.size() / 3);
      EXPECT_LT(r->flagged, s.prev.size());
    } else {
      EXPECT_EQ(r->flagged, s.prev.size());
    }
    EXPECT_EQ(r->false_positives, r->flagged);
    EXPECT_EQ(r->changed, 0u);
    EXPECT_EQ(r->stored_bytes, pub->store().GetVersion(1).value()->manifest.block_table.size);
  }
}

TEST_F(PublisherTest, UpdatesThatDwarfTheWeightAreStoredWhole) {
  // Zero-initialized weights under a large update: a whole interval of old
  // values maps to each new one, so the old BF16 bits are not provable and
  // the values are stored as set elements; the version is still exact.
  State& s = states_[1];
  std::fill(s.prev.begin(), s.prev.end(), 0.0f);
  for (size_t i = 0; i < s.prev.size(); ++i) s.prev[i] = i % 2 ? 1e-30f : 0.0f;
  s.theta = s.prev;
  auto pub = OpenPublisher();
  ASSERT_TRUE(pub);
  ASSERT_TRUE(pub->ImportCheckpoint(WriteCheckpoint()).ok());
  const auto p = Params(1, 1e-3, 0.0);
  test::AdamWStepState(&s, p, 5);
  auto r = pub->PublishAdamW(test::AdamWStepOf(p), {StateRef(s)});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_GT(r->uncertain, s.prev.size() / 2);
  Materializer reader(&pub->store());
  auto v = pub->store().GetVersion(1);
  ASSERT_TRUE(v.ok());
  const FileEntry& f = (*v)->manifest.files[1];  // model.safetensors after config.json
  ASSERT_EQ(f.name, "model.safetensors");
  const TensorEntry* t = nullptr;
  for (const auto& e : f.tensors) t = e.name == s.name ? &e : t;
  ASSERT_NE(t, nullptr);
  std::string got(t->bytes(), '\0');
  ASSERT_TRUE(reader
                  .ReadFile(*v, f, f.header_size + t->begin, t->bytes(),
                            reinterpret_cast<uint8_t*>(got.data()))
                  .ok());
  EXPECT_EQ(got, test::Bf16TensorOf(s.name, s.shape, s.theta).data);
}

// Every element the screen rules out kept its BF16 bits, and every old value
// its signed estimate proves is the true one, across orders, learning rates,
// weight decays and weights from 0 to 1e3 (checked against the true previous
// weights of a forward step).
TEST(EngineScreen, NeverRulesOutAChange) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  constexpr size_t kN = 1 << 18;
  std::vector<float> prev(kN), m(kN), v(kN), theta(kN);
  std::vector<uint64_t> idx(kN + internal::kScreenSlack);
  std::vector<uint32_t> old(kN + internal::kScreenSlack);
  size_t screened_out = 0, slow_screened_out = 0, flagged = 0, decided = 0, changes_proven = 0;
  constexpr int kOrders = 5;  // every kernels::AdamWOrder
  for (int order = 0; order < kOrders; ++order) {
    for (double lr : {1e-7, 1e-5, 1e-3, 1e-1}) {
      for (double wd : {0.0, 0.1, 3.0}) {
        for (size_t i = 0; i < kN; ++i) {
          const float scale = std::pow(10.0f, static_cast<float>(i % 8) - 5.0f);
          prev[i] = i % 61 == 0 ? 0.0f : scale * g(rng);
          m[i] = 1e-3f * g(rng);
          v[i] = m[i] * m[i] * (0.1f + std::abs(g(rng))) + (i % 7 == 0 ? 0.0f : 1e-12f);
        }
        kernels::AdamWParams p = Params(1 + static_cast<int64_t>(lr * 1e6) % 50, lr, wd);
        p.order = static_cast<kernels::AdamWOrder>(order);
        kernels::AdamWForward(prev.data(), m.data(), v.data(), kN, p, theta.data());
        const auto sc = internal::MakeScreenScalars(kernels::MakeAdamWScalars(p));
        const internal::ScreenCounts count = internal::ScreenCandidates(
            theta.data(), m.data(), v.data(), kN, sc, idx.data(), old.data());
        std::vector<uint32_t> verdict(kN, 0x20000);  // not kept
        for (size_t k = 0; k < count.kept; ++k) verdict[idx[k]] = old[k];
        size_t want_flagged = 0;
        for (size_t i = 0; i < kN; ++i) {
          const uint16_t was = kernels::Fp32ToBf16Bits(prev[i]);
          const uint16_t now = kernels::Fp32ToBf16Bits(theta[i]);
          const std::string where = "order " + std::to_string(order) + " lr " + std::to_string(lr) +
                                    " wd " + std::to_string(wd) + " element " + std::to_string(i);
          const bool candidate = !internal::CertainlyUnchanged(theta[i], m[i], v[i], sc);
          want_flagged += candidate;
          if (!candidate) {
            ++screened_out;
            slow_screened_out += lr == 1e-7;
            ASSERT_EQ(verdict[i], 0x20000u) << where;
            ASSERT_EQ(was, now) << where;
            continue;
          }
          const uint32_t proven = internal::ScreenOldBits(theta[i], m[i], v[i], sc);
          decided += proven != internal::kScreenUndecided;
          if (proven == internal::kScreenUndecided) {
            ASSERT_EQ(verdict[i], internal::kScreenUndecided) << where;
            continue;
          }
          ASSERT_EQ(proven, was) << where;  // the signed estimate never errs
          ASSERT_EQ(verdict[i], proven == now ? 0x20000u : proven) << where;
          changes_proven += proven != now;
        }
        ASSERT_EQ(count.flagged, want_flagged);
        flagged += want_flagged;
      }
    }
  }
  // The screen does its job: at the smallest learning rate it rules out most
  // elements (72% here, where an eighth of the weights are 1e-5 or smaller
  // and change anyway), and the signed estimate decides most candidates.
  EXPECT_GT(slow_screened_out, kN * kOrders * 3 * 6 / 10);
  EXPECT_GT(screened_out, kN * kOrders * 12 / 4);
  EXPECT_GT(decided, flagged * 8 / 10);
  EXPECT_GT(changes_proven, flagged / 4);
  std::printf("flagged %zu, decided %zu, changes proven %zu\n", flagged, decided, changes_proven);
}

TEST(EngineCodec, SetElementsRoundTripWithDifferences) {
  constexpr size_t kElems = 4096;
  std::vector<uint16_t> parent(kElems), expect;
  std::mt19937 rng(9);
  for (auto& x : parent) x = static_cast<uint16_t>(rng());
  expect = parent;
  std::vector<uint32_t> idx;
  std::vector<uint16_t> nv, ov;
  std::vector<uint8_t> known;
  for (uint32_t i = 0; i < kElems; i += 1 + rng() % 40) {
    const bool k = rng() % 3 != 0;
    const uint16_t now = static_cast<uint16_t>(parent[i] + 1 + rng() % 700);
    idx.push_back(i);
    nv.push_back(now);
    ov.push_back(k ? parent[i] : 0xDEAD);  // unknown entries' old value is never used
    known.push_back(k);
    expect[i] = now;
  }
  const auto count = static_cast<uint32_t>(idx.size());
  std::string payload =
      EncodeSparseEntries(idx.data(), reinterpret_cast<uint8_t*>(nv.data()),
                          reinterpret_cast<uint8_t*>(ov.data()), known.data(), count, 2, nullptr);
  std::vector<uint16_t> block = parent;
  uint32_t changed = 0;
  ASSERT_TRUE(DecodeBlock(BlockKind::kSparse, payload, 2, reinterpret_cast<uint8_t*>(block.data()),
                          kElems * 2, nullptr, "test block", &changed)
                  .ok());
  EXPECT_EQ(changed, count);
  EXPECT_EQ(block, expect);
  std::vector<uint32_t> decoded;
  std::vector<uint8_t> vals, sets;
  ASSERT_TRUE(
      DecodeSparseEntries(payload, kElems * 2, 2, &decoded, &vals, &sets, nullptr, "test block")
          .ok());
  EXPECT_EQ(decoded, idx);
  // A truncated payload is corruption, never a wrong block.
  payload.pop_back();
  std::vector<uint16_t> again = parent;
  EXPECT_FALSE(DecodeBlock(BlockKind::kSparse, payload, 2, reinterpret_cast<uint8_t*>(again.data()),
                           kElems * 2, nullptr, "test block")
                   .ok());
  EXPECT_EQ(again, parent);
}

}  // namespace
}  // namespace dte
