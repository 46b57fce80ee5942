// The Publisher's ranges (PublishRanges) in worlds of one to eight ranks:
// ranks on TCP transports (threads of this process, each with its own
// store handle) publish the versions a world of one publishes from whole
// tensors, block for block, for whole tensors,
// FSDP2 row shards, flat ranges across tensor boundaries and replicas;
// policy anchors; and every rank fails, writing nothing, when a rank
// disagrees, leaves elements uncovered or dies, after which a retry
// publishes the same version.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "kernels/cuda.h"
#include "store/materialize.h"
#include "store/ops/export.h"
#include "store/ops/verify.h"
#include "store/store.h"
#include "sync/publish/publish_metrics.h"
#include "sync/publish/publisher.h"
#include "sync/push/push_server.h"
#include "tests/testutil/adamw_state.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/metrics_text.h"
#include "tests/testutil/ranks.h"
#include "tests/testutil/same_version.h"

namespace dte {
namespace {

using State = test::AdamWTensorState;

// Both stores keep a full table of version v, or neither does.
void ExpectSameAnchor(Store& a, Store& b, uint64_t v) {
  auto va = a.GetVersion(v);
  auto vb = b.GetVersion(v);
  ASSERT_TRUE(va.ok() && vb.ok());
  EXPECT_EQ((*va)->manifest.full.has_value(), (*vb)->manifest.full.has_value()) << "v" << v;
}

kernels::AdamWParams Params(int64_t step) {
  kernels::AdamWParams p;
  p.lr = 3e-5;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  p.step = step;
  return p;
}

std::string ReadAll(const std::string& path) {
  auto r = test::ReadFileBytes(path);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : "";
}

// Which elements each rank holds: layout(rank, world, states) -> ranges.
using Layout = std::function<std::vector<RangeState>(int, int, const std::vector<State>&)>;

RangeState RangeOf(const State& s, uint64_t begin, uint64_t end) {
  RangeState r;
  r.name = s.name;
  r.begin = begin;
  r.end = end;
  r.param = s.theta.data() + begin;
  r.exp_avg = s.m.data() + begin;
  r.exp_avg_sq = s.v.data() + begin;
  return r;
}

// Every rank holds every tensor (DP replicas without a sharded optimizer).
std::vector<RangeState> Replicated(int, int, const std::vector<State>& states) {
  std::vector<RangeState> out;
  for (const auto& s : states) out.push_back(RangeOf(s, 0, s.theta.size()));
  return out;
}

// FSDP2 Shard(0): torch.chunk of dim 0, uneven and possibly empty.
std::vector<RangeState> RowShards(int rank, int world, const std::vector<State>& states) {
  std::vector<RangeState> out;
  for (const auto& s : states) {
    FlatRange rows = ChunkRows(static_cast<uint64_t>(s.shape[0]), rank, world);
    FlatRange flat = RowRange(s.shape, rows.begin, rows.end);
    out.push_back(RangeOf(s, flat.begin, flat.end));
  }
  return out;
}

// A flat buffer of every tensor, cut into `world` equal ranges across tensor
// boundaries (ZeRO / Megatron's distributed optimizer).
std::vector<RangeState> FlatBuffer(int rank, int world, const std::vector<State>& states) {
  uint64_t total = 0;
  for (const auto& s : states) total += s.theta.size();
  const uint64_t per = (total + world - 1) / world;
  const uint64_t lo = std::min(total, per * rank), hi = std::min(total, lo + per);
  std::vector<RangeState> out;
  uint64_t at = 0;
  for (const auto& s : states) {
    const uint64_t b = std::max(lo, at), e = std::min(hi, at + s.theta.size());
    if (b < e) out.push_back(RangeOf(s, b - at, e - at));
    at += s.theta.size();
  }
  return out;
}

// Two replicas of a 2-way row sharding (HSDP); world must be 4.
std::vector<RangeState> Hybrid(int rank, int world, const std::vector<State>& states) {
  EXPECT_EQ(world, 4);
  return RowShards(rank % 2, 2, states);
}

struct RankOutcome {
  Status status;
  PublishResult result;
  DistPublishStats stats;
};

class PublisherRanksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A 17-block tensor, one that ends mid-block, a small one and a frozen
    // tensor no rank names.
    states_.push_back(test::RandomAdamWState("model.embed_tokens.weight", {2200, 1000}, 1));
    states_.push_back(test::RandomAdamWState("model.layers.0.mlp.down_proj.weight", {333, 700}, 2));
    states_.push_back(test::RandomAdamWState("model.norm.weight", {300}, 3));
    for (auto& s : states_) s.theta = s.prev;
    frozen_ = test::Bf16Tensor("model.frozen.weight", {70, 50}, 4);
  }

  test::TestCheckpoint Checkpoint() const { return test::AdamWCheckpoint(states_, {frozen_}); }

  std::string WriteCheckpoint() {
    std::string dir = tmp_.path() + "/ckpt" + std::to_string(dirs_++);
    Status s = test::WriteCheckpoint(Checkpoint(), dir);
    EXPECT_TRUE(s.ok()) << s.message();
    return dir;
  }

  PublisherOptions Options(const std::string& name) const {
    PublisherOptions o;
    o.store = tmp_.path() + "/" + name;
    o.anchor_policy = policy_;
    return o;
  }

  // Imports the initial weights into `name` with the single-process publisher.
  std::unique_ptr<Publisher> ImportInto(const std::string& name) {
    auto p = Publisher::Open(Options(name));
    EXPECT_TRUE(p.ok()) << p.status().message();
    auto r = (*p)->ImportCheckpoint(WriteCheckpoint());
    EXPECT_TRUE(r.ok()) << r.status().message();
    return std::move(p).value();
  }

  void OpenRanks(const std::string& name, int world) {
    pubs_.clear();
    for (int r = 0; r < world; ++r) {
      PublisherOptions o = Options(name);
      o.group = {r, world, nullptr};  // each publish sets its exchange (test::PublishOver)
      auto p = Publisher::Open(o);
      ASSERT_TRUE(p.ok()) << p.status().message();
      pubs_.push_back(std::move(p).value());
    }
  }

  // Runs one publish on every rank, each on its own thread and transport.
  // `before(rank)` may replace a rank's step or ranges; a rank for which
  // `absent(rank)` holds connects and then leaves without publishing.
  std::vector<RankOutcome> PublishAll(
      const Layout& layout, const AdamWStep& h,
      std::function<void(int, AdamWStep*, std::vector<RangeState>*)> before = nullptr,
      std::function<bool(int)> absent = nullptr) {
    const int world = static_cast<int>(pubs_.size());
    std::vector<RankOutcome> out(world);
    test::RunRanks(world, tmp_.path(), std::chrono::milliseconds(timeout_ms_),
                   [&](int rank, Transport* t) {
                     if (t == nullptr) {
                       out[rank].status = Internal("no transport");
                       return;
                     }
                     if (absent && absent(rank)) {
                       out[rank].status = Unimplemented("absent");
                       return;  // closes its connections: the rank is gone
                     }
                     AdamWStep step = h;
                     std::vector<RangeState> ranges = layout(rank, world, states_);
                     if (before) before(rank, &step, &ranges);
                     auto r = test::PublishOver(*pubs_[rank], *t, step, ranges);
                     out[rank].status = r.status();
                     if (r.ok()) out[rank].result = *r;
                     out[rank].stats = pubs_[rank]->last_stats();
                   });
    return out;
  }

  // Steps the state, publishes it with the single-process publisher into
  // `ref` and with `world` ranks laid out by `layout` into "dist", and
  // compares; then exports the last version and checks it is the BF16 cast.
  void RunAndCompare(const Layout& layout, int world, int steps) {
    auto ref = ImportInto("ref");
    auto dist_import = ImportInto("dist");
    OpenRanks("dist", world);
    std::vector<DistPublishStats> routed(world);  // each rank's stats over the steps
    uint64_t changed = 0;
    for (int64_t step = 1; step <= steps; ++step) {
      const auto p = Params(step);
      for (size_t i = 0; i < states_.size(); ++i) {
        test::AdamWStepState(&states_[i], p, 100 * step + i);
      }
      if (on_step_) on_step_();
      std::vector<AdamWParamState> whole;
      for (const auto& s : states_) {
        AdamWParamState a;
        a.name = s.name;
        a.param = {s.theta.data(), DType::kF32, s.shape};
        a.exp_avg = {s.m.data(), DType::kF32, s.shape};
        a.exp_avg_sq = {s.v.data(), DType::kF32, s.shape};
        whole.push_back(a);
      }
      auto r = ref->PublishAdamW(test::AdamWStepOf(p), whole);
      ASSERT_TRUE(r.ok()) << r.status().message();
      auto out = PublishAll(layout, test::AdamWStepOf(p));
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_TRUE(out[rank].status.ok()) << "rank " << rank << ": " << out[rank].status.message();
        EXPECT_EQ(out[rank].result.version, r->version) << "rank " << rank;
        EXPECT_EQ(out[rank].result.changed, r->changed) << "rank " << rank;
        EXPECT_EQ(out[rank].result.full_table, r->full_table) << "rank " << rank;
        EXPECT_EQ(out[rank].result.join_table, r->join_table) << "rank " << rank;
        EXPECT_EQ(out[rank].result.join_error, "") << "rank " << rank;
        // Entries travel as 6 bytes (plus a 16-byte header per chunk).
        EXPECT_LE(out[rank].stats.bytes_sent,
                  out[rank].stats.entries_sent * 6 + 4096 + world * 64 * 1024)
            << "rank " << rank;
        routed[rank].entries_sent += out[rank].stats.entries_sent;
        routed[rank].bytes_received += out[rank].stats.bytes_received;
        routed[rank].tensors_owned += out[rank].stats.tensors_owned;
      }
      changed += r->changed;
      EXPECT_GT(r->changed, 0u);
      test::ExpectSameVersion(ref->store(), pubs_[0]->store(), r->version);
      ExpectSameAnchor(ref->store(), pubs_[0]->store(), r->version);
    }
    // Every rank's metrics: the versions' figures, and its own routing.
    for (int rank = 0; rank < world; ++rank) {
      const std::string text = pubs_[rank]->metrics().Text();
      EXPECT_EQ(test::MetricValue(text, "dte_publish_versions_total"), steps) << rank;
      EXPECT_EQ(test::MetricValue(text, "dte_publish_changed_elements_total"), changed) << rank;
      EXPECT_EQ(test::MetricValue(text, "dte_publish_last_version"), steps) << rank;
      EXPECT_EQ(test::MetricValue(text, "dte_publish_dist_entries_sent_total"),
                routed[rank].entries_sent)
          << rank;
      EXPECT_EQ(test::MetricValue(text, "dte_publish_dist_received_bytes_total"),
                routed[rank].bytes_received)
          << rank;
      EXPECT_EQ(test::MetricValue(text, "dte_publish_dist_owned_tensors_total"),
                routed[rank].tensors_owned)
          << rank;
    }
    auto report = VerifyStore(pubs_[0]->store(), std::nullopt, nullptr);
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_TRUE(report->ok()) << report->problems.front();
    std::string out = tmp_.path() + "/export";
    ASSERT_TRUE(ExportVersion(pubs_[0]->store(), steps, out, nullptr).ok());
    std::string expected = tmp_.path() + "/expected";
    ASSERT_TRUE(test::WriteCheckpoint(Checkpoint(), expected).ok());
    EXPECT_EQ(ReadAll(out + "/model.safetensors"), ReadAll(expected + "/model.safetensors"));
  }

  size_t Versions(const std::string& name) {
    StoreOptions o;
    o.uri = tmp_.path() + "/" + name;
    auto s = Store::Open(o);
    EXPECT_TRUE(s.ok());
    auto v = (*s)->ListVersions(true);
    EXPECT_TRUE(v.ok());
    return v.ok() ? v->size() : 0;
  }

  test::ScopedTempDir tmp_;
  int dirs_ = 0;
  int timeout_ms_ = 20000;
  AnchorPolicy policy_;
  std::vector<State> states_;
  test::TestTensor frozen_;
  std::vector<std::unique_ptr<Publisher>> pubs_;
  std::function<void()> on_step_;  // after RunAndCompare steps the state
};

TEST_F(PublisherRanksTest, OneRankEqualsTheSingleProcessPublisher) {
  RunAndCompare(Replicated, 1, 2);
}

// The one Publisher in a world of one, with no exchange, publishing the
// ranges one rank holds (every tensor in three row pieces), and in a world
// of three ranks publishing their row shards: the same versions as the
// world of one publishing whole tensors, and nothing sent by the one rank.
TEST_F(PublisherRanksTest, AWorldOfOneAndThreeRanksPublishTheSameVersions) {
  auto whole = ImportInto("whole");
  auto one = ImportInto("one");
  ImportInto("three");
  OpenRanks("three", 3);
  EXPECT_EQ(one->group().world, 1);
  EXPECT_EQ(one->group().exchange, nullptr);
  for (int64_t step = 1; step <= 2; ++step) {
    const auto p = Params(step);
    for (size_t i = 0; i < states_.size(); ++i) {
      test::AdamWStepState(&states_[i], p, 100 * step + i);
    }
    std::vector<AdamWParamState> tensors;
    std::vector<RangeState> pieces;
    for (const auto& s : states_) {
      tensors.push_back({s.name,
                         {s.theta.data(), DType::kF32, s.shape},
                         {s.m.data(), DType::kF32, s.shape},
                         {s.v.data(), DType::kF32, s.shape},
                         std::nullopt,
                         std::nullopt,
                         std::nullopt});
    }
    for (int r = 0; r < 3; ++r) {
      for (RangeState& x : RowShards(r, 3, states_)) pieces.push_back(x);
    }
    auto w = whole->PublishAdamW(test::AdamWStepOf(p), tensors);
    ASSERT_TRUE(w.ok()) << w.status().message();
    auto o = one->PublishRanges(test::AdamWStepOf(p), pieces);
    ASSERT_TRUE(o.ok()) << o.status().message();
    EXPECT_EQ(o->version, w->version);
    EXPECT_EQ(o->changed, w->changed);
    EXPECT_EQ(one->last_stats().bytes_sent, 0u);
    EXPECT_EQ(one->last_stats().messages_sent, 0u);
    EXPECT_GE(one->last_stats().tensors_owned, states_.size());  // every tensor, for a full table
    auto out = PublishAll(RowShards, test::AdamWStepOf(p));
    for (int rank = 0; rank < 3; ++rank) {
      ASSERT_TRUE(out[rank].status.ok()) << "rank " << rank << ": " << out[rank].status.message();
      EXPECT_EQ(out[rank].result.version, w->version);
    }
    test::ExpectSameVersion(whole->store(), one->store(), w->version);
    test::ExpectSameVersion(one->store(), pubs_[0]->store(), w->version);
  }
}

// PublishAdamW of whole tensors on every rank of two: each rank's copy is a
// replica, published once; the version is the world of one's.
TEST_F(PublisherRanksTest, WholeTensorsOnEveryRankPublishAsReplicas) {
  auto ref = ImportInto("ref");
  ImportInto("two");
  OpenRanks("two", 2);
  const auto p = Params(1);
  for (size_t i = 0; i < states_.size(); ++i) test::AdamWStepState(&states_[i], p, 100 + i);
  std::vector<AdamWParamState> tensors;
  for (const auto& s : states_) {
    tensors.push_back({s.name,
                       {s.theta.data(), DType::kF32, s.shape},
                       {s.m.data(), DType::kF32, s.shape},
                       {s.v.data(), DType::kF32, s.shape},
                       std::nullopt,
                       std::nullopt,
                       std::nullopt});
  }
  auto r = ref->PublishAdamW(test::AdamWStepOf(p), tensors);
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::vector<Result<PublishResult>> out(2, Internal("not run"));
  test::RunRanks(2, tmp_.path(), std::chrono::milliseconds(timeout_ms_),
                 [&](int rank, Transport* t) {
                   ASSERT_NE(t, nullptr);
                   ASSERT_TRUE(pubs_[rank]->SetGroup({rank, 2, t}).ok());
                   out[rank] = pubs_[rank]->PublishAdamW(test::AdamWStepOf(p), tensors);
                   ASSERT_TRUE(pubs_[rank]->SetGroup({rank, 2, nullptr}).ok());
                 });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(out[rank].ok()) << "rank " << rank << ": " << out[rank].status().message();
    EXPECT_EQ(out[rank]->version, r->version);
    EXPECT_EQ(out[rank]->changed, r->changed);
  }
  test::ExpectSameVersion(ref->store(), pubs_[0]->store(), r->version);
}

// What only a world of one does, or a rank of several cannot do alone, is
// refused naming the rank; a bad group is refused at Open and SetGroup.
TEST_F(PublisherRanksTest, CallsForAWorldOfOneAreRefusedOnARankOfSeveral) {
  ImportInto("two");
  OpenRanks("two", 2);
  Publisher& rank1 = *pubs_[1];
  auto imported = rank1.ImportCheckpoint(WriteCheckpoint());
  ASSERT_FALSE(imported.ok());
  EXPECT_NE(imported.status().message().find("is for a world of one, and this publisher is rank 1 "
                                             "of 2"),
            std::string::npos)
      << imported.status().message();
  Status begun = rank1.BeginWeights(1);
  EXPECT_EQ(begun.code(), Code::kInvalidArgument);
  EXPECT_NE(begun.message().find("publishing weights is for a world of one"), std::string::npos)
      << begun.message();
  auto ranged = rank1.PublishRanges(test::AdamWStepOf(Params(1)), {});
  ASSERT_FALSE(ranged.ok());
  EXPECT_NE(ranged.status().message().find("rank 1 of 2 has no exchange"), std::string::npos)
      << ranged.status().message();
  EXPECT_FALSE(rank1.SetGroup({2, 2, nullptr}).ok());
  PublisherOptions o = Options("two");
  o.group = {1, 2, nullptr};
  o.screen = false;
  auto unscreened = Publisher::Open(o);
  ASSERT_FALSE(unscreened.ok());
  EXPECT_NE(unscreened.status().message().find("screen"), std::string::npos)
      << unscreened.status().message();
  EXPECT_EQ(Versions("two"), 1u);
}

// Rank 0 holds its shards in GPU memory (found there), rank 1 in host
// memory (the screen): the same versions as the single-process publisher.
TEST_F(PublisherRanksTest, StateOnTheGpuPublishesTheSameVersion) {
  if (!kernels::CudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device: the runtime reports none (or dte was built without CUDA); "
                    "the CPU tests cover the shared element math (AdamW.FindChanges*)";
  }
  std::vector<std::array<kernels::CudaBuffer, 3>> dev(states_.size());
  on_step_ = [&] {
    for (size_t i = 0; i < states_.size(); ++i) {
      const State& s = states_[i];
      const std::vector<float>* host[3] = {&s.theta, &s.m, &s.v};
      for (int a = 0; a < 3; ++a) {
        const size_t bytes = host[a]->size() * sizeof(float);
        if (dev[i][a].size() != bytes) {
          ASSERT_TRUE(dev[i][a].Allocate(bytes).ok());
        }
        const kernels::CudaStatus st =
            kernels::CudaCopyToDevice(dev[i][a].data(), host[a]->data(), bytes);
        ASSERT_TRUE(st.ok()) << st.message;
      }
    }
  };
  auto layout = [&](int rank, int world, const std::vector<State>& states) {
    std::vector<RangeState> out = RowShards(rank, world, states);
    if (rank == 0) {
      for (size_t i = 0; i < out.size(); ++i) {
        RangeState& r = out[i];
        r.device = 0;
        r.param = static_cast<const float*>(dev[i][0].data()) + r.begin;
        r.exp_avg = static_cast<const float*>(dev[i][1].data()) + r.begin;
        r.exp_avg_sq = static_cast<const float*>(dev[i][2].data()) + r.begin;
      }
    }
    return out;
  };
  RunAndCompare(layout, 2, 3);
}

TEST_F(PublisherRanksTest, ReplicasPublishOnce) { RunAndCompare(Replicated, 2, 2); }

TEST_F(PublisherRanksTest, Fsdp2RowShardsOverTwoRanks) { RunAndCompare(RowShards, 2, 3); }

TEST_F(PublisherRanksTest, UnevenRowShardsOverThreeRanks) { RunAndCompare(RowShards, 3, 2); }

TEST_F(PublisherRanksTest, FlatRangesAcrossTensorBoundariesOverFourRanks) {
  RunAndCompare(FlatBuffer, 4, 2);
}

TEST_F(PublisherRanksTest, HybridShardedReplicasOverFourRanks) { RunAndCompare(Hybrid, 4, 2); }

TEST_F(PublisherRanksTest, FlatRangesOverEightRanks) { RunAndCompare(FlatBuffer, 8, 2); }

TEST_F(PublisherRanksTest, PolicyAnchorsCarryTheSameFullTable) {
  policy_.every = 2;  // v2 and v4 carry full tables
  RunAndCompare(FlatBuffer, 3, 4);
  auto v = pubs_[0]->store().GetVersion(4);
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE((*v)->manifest.full.has_value());
  // An empty cache starts at the full table: export v4 from a fresh handle.
  StoreOptions o;
  o.uri = tmp_.path() + "/dist";
  auto fresh = Store::Open(o);
  ASSERT_TRUE(fresh.ok());
  std::string out = tmp_.path() + "/export-fresh";
  ASSERT_TRUE(ExportVersion(**fresh, 4, out, nullptr).ok());
  EXPECT_EQ(ReadAll(out + "/model.safetensors"),
            ReadAll(tmp_.path() + "/export/model.safetensors"));
}

TEST_F(PublisherRanksTest, JoinTablesAreBuiltFromEveryRanksPart) {
  policy_ = {0, 0, 1e-9};  // a join table whenever the parent has none: v2 and v4
  RunAndCompare(FlatBuffer, 3, 4);
  StoreOptions o;
  o.uri = tmp_.path() + "/dist";
  auto fresh = Store::Open(o);
  ASSERT_TRUE(fresh.ok());
  auto joins = (*fresh)->ListJoins();
  ASSERT_TRUE(joins.ok());
  ASSERT_EQ(joins->size(), 2u);
  EXPECT_EQ(joins->begin()->first, 2u);
  EXPECT_EQ(joins->rbegin()->first, 4u);
  // An empty cache reads v4 from its join table alone (a payload blob per
  // rank), to the bytes of the export.
  auto v4 = (*fresh)->GetVersion(4);
  ASSERT_TRUE(v4.ok());
  EXPECT_FALSE((*v4)->manifest.full.has_value());
  auto join = (*fresh)->JoinOf(**v4);
  ASSERT_NE(join, nullptr);
  EXPECT_EQ(join->join.table.blobs.size(), 3u);
  for (const auto& r : join->records) EXPECT_EQ(r.kind, BlockKind::kDenseRaw);
  Materializer reader(fresh->get());
  const FileEntry* file = nullptr;
  for (const auto& e : (*v4)->manifest.files) {
    if (e.safetensors) file = &e;
  }
  ASSERT_NE(file, nullptr);
  const FileEntry& f = *file;
  std::string got(f.size, '\0');
  ASSERT_TRUE(reader.ReadFile(*v4, f, 0, f.size, reinterpret_cast<uint8_t*>(got.data())).ok());
  EXPECT_EQ(got, ReadAll(tmp_.path() + "/export/" + f.name));
  EXPECT_EQ(reader.counters().join_blocks.load(), (*v4)->records.size());
}

TEST_F(PublisherRanksTest, DisagreementsFailEveryRankAndWriteNothing) {
  ImportInto("dist");
  OpenRanks("dist", 3);
  const auto p = Params(1);
  for (auto& s : states_) test::AdamWStepState(&s, p, 7);
  auto expect_all_fail = [&](const std::vector<RankOutcome>& out, const std::string& needle) {
    for (size_t rank = 0; rank < out.size(); ++rank) {
      EXPECT_FALSE(out[rank].status.ok()) << "rank " << rank;
      EXPECT_NE(out[rank].status.message().find(needle), std::string::npos)
          << "rank " << rank << ": " << out[rank].status.message();
    }
    EXPECT_EQ(Versions("dist"), 1u);
  };
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep* h, std::vector<RangeState>*) {
                               if (rank == 2) h->lr *= 2;
                             }),
                  "step 1: rank 2 disagrees with rank 0 on lr");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep* h, std::vector<RangeState>*) {
                               if (rank == 1) h->step = 2;
                             }),
                  "rank 1 disagrees with rank 0 on step");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 1) r->pop_back();  // model.norm.weight's middle
                             }),
                  "tensor model.norm.weight: elements [100, 200) are held by no rank");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 0) r->push_back(r->front());
                             }),
                  "rank 0 gives some of elements [0, 734000) twice");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 2) (*r)[0].name = "model.missing.weight";
                             }),
                  "rank 2: tensor model.missing.weight is not in v00000000");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 1) (*r)[1].end = 1u << 30;
                             }),
                  "are not a range of its 233100 elements");
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 2) (*r)[2].lr = 1e-3;
                             }),
                  "give it different param-group lr or weight_decay");
  // State said to be on a GPU the rank does not have (999: no machine has
  // it): every rank fails before anything is routed.
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p),
                             [](int rank, AdamWStep*, std::vector<RangeState>* r) {
                               if (rank == 1) (*r)[0].device = 999;
                             }),
                  "rank 1: tensor model.embed_tokens.weight (state on the GPU): CUDA device 999");
  // Push groups on some ranks but not all, or not on rank 0: refused on
  // every rank, naming the rank, before anything is written.
  std::vector<std::unique_ptr<PushServer>> servers;
  for (int r = 0; r < 3; ++r) {
    auto s = PushServer::Start({});
    ASSERT_TRUE(s.ok()) << s.status().message();
    servers.push_back(std::move(s).value());
  }
  // (This store's config.json names only its model type: the servers plan
  // receivers with LlamaConfig's defaults, as transformers would load it,
  // and no receiver connects here.)
  for (int r = 0; r < 2; ++r) {
    Status set = pubs_[r]->SetPush(servers[r].get());
    EXPECT_TRUE(set.ok()) << set.message();
  }
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p)),
                  "step 1: rank 2 has no push group and other ranks have one");
  ASSERT_TRUE(pubs_[0]->SetPush(nullptr).ok());
  expect_all_fail(PublishAll(RowShards, test::AdamWStepOf(p)),
                  "step 1: rank 1 has a push group and rank 0 has none");
  ASSERT_TRUE(pubs_[1]->SetPush(nullptr).ok());
  // Agreed again, the same ranks publish v1.
  auto out = PublishAll(RowShards, test::AdamWStepOf(p));
  for (const auto& o : out) {
    ASSERT_TRUE(o.status.ok()) << o.status.message();
    EXPECT_EQ(o.result.version, 1u);
  }
}

TEST_F(PublisherRanksTest, ARankThatDiesFailsTheOthersAndARetrySucceeds) {
  ImportInto("dist");
  OpenRanks("dist", 3);
  timeout_ms_ = 3000;
  const auto p = Params(1);
  for (auto& s : states_) test::AdamWStepState(&s, p, 7);
  auto out = PublishAll(RowShards, test::AdamWStepOf(p), nullptr, [](int r) { return r == 1; });
  for (int rank : {0, 2}) {
    EXPECT_FALSE(out[rank].status.ok()) << "rank " << rank;
    EXPECT_NE(out[rank].status.message().find("step 1"), std::string::npos)
        << out[rank].status.message();
    EXPECT_NE(out[rank].status.message().find("rank 1"), std::string::npos)
        << out[rank].status.message();
  }
  EXPECT_EQ(Versions("dist"), 1u);
  // Retried on fresh transports, the step publishes v1.
  out = PublishAll(RowShards, test::AdamWStepOf(p));
  for (const auto& o : out) {
    ASSERT_TRUE(o.status.ok()) << o.status.message();
    EXPECT_EQ(o.result.version, 1u);
  }
  auto report = VerifyStore(pubs_[0]->store(), std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->problems.front();
}

// A transport that dies at its `fail_at`-th exchange, as a killed rank
// does: its connections close and its peers' exchanges fail.
class DyingTransport : public Transport {
 public:
  DyingTransport(Transport* inner, int fail_at) : inner_(inner), fail_at_(fail_at) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) override {
    if (calls_++ == fail_at_) {
      died = true;
      return IOError("killed");
    }
    return inner_->Exchange(sends, recvs);
  }
  bool died = false;

 private:
  Transport* inner_;
  int rank_ = inner_->rank(), size_ = inner_->size();
  int fail_at_;
  int calls_ = 0;
};

// Rank 1 (or rank 0) dies at each of the ten exchanges of a publish: the
// others fail naming it; no version appears unless rank 0 had committed it
// (only while the outcome is sent), and the retried step then publishes or
// returns version 1 on every rank, equal to the single-process publisher's.
TEST_F(PublisherRanksTest, ARankDyingAtEveryExchangeLeavesNoHalfVersion) {
  timeout_ms_ = 3000;
  for (int victim : {1, 0}) {
    for (int fail_at = 0; fail_at < 10; ++fail_at) {
      SCOPED_TRACE("rank " + std::to_string(victim) + " dies at exchange " +
                   std::to_string(fail_at));
      const std::string name = "dist-" + std::to_string(victim) + "-" + std::to_string(fail_at);
      states_.clear();
      SetUp();
      ImportInto(name);
      OpenRanks(name, 3);
      const auto p = Params(1);
      for (size_t i = 0; i < states_.size(); ++i) test::AdamWStepState(&states_[i], p, 100 + i);
      std::vector<Status> first(3);
      test::RunRanks(3, tmp_.path(), std::chrono::milliseconds(timeout_ms_),
                     [&](int rank, Transport* t) {
                       ASSERT_NE(t, nullptr);
                       if (rank == victim) {
                         auto dying = std::make_unique<DyingTransport>(t, fail_at);
                         first[rank] = test::PublishOver(*pubs_[rank], *dying, test::AdamWStepOf(p),
                                                         RowShards(rank, 3, states_))
                                           .status();
                         return;  // the transport closes: the rank is gone
                       }
                       first[rank] = test::PublishOver(*pubs_[rank], *t, test::AdamWStepOf(p),
                                                       RowShards(rank, 3, states_))
                                         .status();
                     });
      // Exchanges 8 and 9 send the outcome: rank 0 has committed by then.
      const size_t versions = Versions(name);
      EXPECT_EQ(versions, fail_at >= 8 ? 2u : 1u);
      for (int rank = 0; rank < 3; ++rank) {
        if (rank == victim) continue;
        if (versions == 2 && first[rank].ok()) continue;  // it learned the outcome
        EXPECT_FALSE(first[rank].ok()) << "rank " << rank;
        EXPECT_NE(first[rank].message().find("step 1"), std::string::npos) << first[rank].message();
        EXPECT_NE(first[rank].message().find("rank " + std::to_string(victim)), std::string::npos)
            << first[rank].message();
      }
      auto out = PublishAll(RowShards, test::AdamWStepOf(p));
      for (int rank = 0; rank < 3; ++rank) {
        ASSERT_TRUE(out[rank].status.ok()) << "rank " << rank << ": " << out[rank].status.message();
        EXPECT_EQ(out[rank].result.version, 1u);
      }
      EXPECT_EQ(Versions(name), 2u);
      auto report = VerifyStore(pubs_[0]->store(), std::nullopt, nullptr);
      ASSERT_TRUE(report.ok());
      EXPECT_TRUE(report->ok()) << report->problems.front();
    }
  }
}

// Ranks that share only the store: the messages are objects of the store,
// read and deleted; a rank that fails leaves its reason for the others.
TEST_F(PublisherRanksTest, RanksThatShareOnlyTheStorePublishThroughIt) {
  auto ref = ImportInto("ref");
  ImportInto("dist");
  OpenRanks("dist", 3);
  auto publish_all = [&](const AdamWStep& h, const std::string& job, int failing) {
    std::vector<Result<PublishResult>> out(3, Internal("not run"));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 3; ++rank) {
      threads.emplace_back([&, rank] {
        StoreTransportOptions o;
        o.base.rank = rank;
        o.base.size = 3;
        o.base.timeout = std::chrono::milliseconds(5000);
        o.prefix = "exchange/" + job + "/";
        auto t = ConnectStoreTransport(&pubs_[rank]->store().objects(), o);
        ASSERT_TRUE(t.ok()) << t.status().message();
        auto ranges = RowShards(rank, 3, states_);
        if (rank == failing) ranges[0].name = "model.missing.weight";
        out[rank] = test::PublishOver(*pubs_[rank], **t, h, ranges);
      });
    }
    for (auto& th : threads) th.join();
    return out;
  };
  for (int64_t step = 1; step <= 2; ++step) {
    const auto p = Params(step);
    for (size_t i = 0; i < states_.size(); ++i)
      test::AdamWStepState(&states_[i], p, 100 * step + i);
    std::vector<AdamWParamState> whole;
    for (const auto& s : states_) {
      whole.push_back({s.name,
                       {s.theta.data(), DType::kF32, s.shape},
                       {s.m.data(), DType::kF32, s.shape},
                       {s.v.data(), DType::kF32, s.shape},
                       std::nullopt,
                       std::nullopt,
                       std::nullopt});
    }
    auto r = ref->PublishAdamW(test::AdamWStepOf(p), whole);
    ASSERT_TRUE(r.ok()) << r.status().message();
    auto out = publish_all(test::AdamWStepOf(p), "job-" + std::to_string(step), -1);
    for (int rank = 0; rank < 3; ++rank) {
      ASSERT_TRUE(out[rank].ok()) << "rank " << rank << ": " << out[rank].status().message();
      EXPECT_EQ(out[rank]->version, r->version);
    }
    test::ExpectSameVersion(ref->store(), pubs_[0]->store(), r->version);
    ExpectSameAnchor(ref->store(), pubs_[0]->store(), r->version);
  }
  // Every message was read and deleted.
  auto left = pubs_[0]->store().objects().List("exchange/");
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->empty()) << left->front();
  // A rank that fails (here: naming a tensor the store does not have) fails
  // them all, and nothing is written.
  const auto p = Params(3);
  for (size_t i = 0; i < states_.size(); ++i) test::AdamWStepState(&states_[i], p, 300 + i);
  auto out = publish_all(test::AdamWStepOf(p), "job-3", 2);
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_FALSE(out[rank].ok());
    EXPECT_NE(out[rank].status().message().find("rank 2: tensor model.missing.weight"),
              std::string::npos)
        << out[rank].status().message();
  }
  EXPECT_EQ(Versions("dist"), 3u);
}

TEST(StoreTransport, AFailedRankIsNamedAndASilentOneTimesOut) {
  test::MemoryStore objects;
  auto connect = [&](int rank, const std::string& prefix) {
    StoreTransportOptions o;
    o.base.rank = rank;
    o.base.size = 2;
    o.base.timeout = std::chrono::milliseconds(500);
    o.prefix = prefix;
    return std::move(ConnectStoreTransport(&objects, o)).value();
  };
  // Messages arrive in order, to the peer and to oneself.
  {
    auto a = connect(0, "exchange/ok/"), b = connect(1, "exchange/ok/");
    uint64_t x = 7, y = 0, z = 0, w = 0;
    std::vector<SendBuffer> sends{{1, &x, 8}, {0, &x, 8}};
    std::vector<RecvBuffer> recvs{{0, &z, 8}};
    const uint64_t puts = objects.Calls(test::StoreOp::kPut);
    ASSERT_TRUE(a->Exchange(sends, recvs).ok());
    // A message to oneself is copied, never stored: one object, to rank 1.
    EXPECT_EQ(objects.Calls(test::StoreOp::kPut) - puts, 1u);
    std::vector<RecvBuffer> brecv{{0, &y, 8}};
    ASSERT_TRUE(b->Exchange({}, brecv).ok());
    EXPECT_EQ(y, 7u);
    EXPECT_EQ(z, 7u);
    std::vector<RecvBuffer> wrong{{0, &w, 4}};
    ASSERT_TRUE(a->Exchange(std::vector<SendBuffer>{{1, &x, 8}}, {}).ok());
    Status s = b->Exchange({}, wrong);
    EXPECT_EQ(s.code(), Code::kCorruption) << s.message();
  }
  auto a = connect(0, "exchange/bad/"), b = connect(1, "exchange/bad/");
  uint64_t x = 0;
  std::vector<SendBuffer> bad{{5, &x, 8}};
  EXPECT_FALSE(b->Exchange(bad, {}).ok());
  std::vector<RecvBuffer> from_b{{1, &x, 8}};
  Status s = a->Exchange({}, from_b);
  EXPECT_NE(s.message().find("rank 1 aborted the exchange"), std::string::npos) << s.message();
  auto c = connect(0, "exchange/silent/");
  s = c->Exchange({}, from_b);
  EXPECT_NE(s.message().find("timed out after 500 ms waiting for rank 1"), std::string::npos)
      << s.message();
  // Once failed, a transport stays failed.
  EXPECT_FALSE(c->Exchange({}, {}).ok());
}

TEST(PublisherRanges, RowAndChunkRanges) {
  FlatRange r = RowRange({10, 3, 4}, 2, 5);
  EXPECT_EQ(r.begin, 24u);
  EXPECT_EQ(r.end, 60u);
  // torch.chunk(10, 4): 3, 3, 3, 1; torch.chunk(3, 4): 1, 1, 1, 0.
  EXPECT_EQ(ChunkRows(10, 3, 4).begin, 9u);
  EXPECT_EQ(ChunkRows(10, 3, 4).end, 10u);
  EXPECT_EQ(ChunkRows(3, 3, 4).begin, 3u);
  EXPECT_EQ(ChunkRows(3, 3, 4).end, 3u);
  EXPECT_EQ(ChunkRows(2, 3, 4).begin, 2u);
  EXPECT_EQ(ChunkRows(2, 3, 4).end, 2u);
}

}  // namespace
}  // namespace dte
