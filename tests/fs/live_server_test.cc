// Live apply into the ranks of an inference server (sync/live/live.h,
// docs/live.md "Servers") without FUSE: a small Llama's BF16 receivers in
// /dev/shm at TP 2, both ranks of one server. A write into rank 1 that
// fails (its object truncated under the mapping: SIGBUS) fails the apply
// after rank 0 was written, and rank 0 is written back to the live version,
// bit for bit, both for differences (sparse steps) and for values set whole
// (a dense step: compared blocks). Refusals of an incomplete server write
// nothing. A server over two mounts (two Filesystems of copies of the store,
// as on two hosts) moves by the two phases: prepared on both, nothing is
// written until each commits; an abort, the preparing control file's close,
// or a rank that left since the prepare leave every buffer as it was.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "fs/filesystem.h"
#include "store/ops/commit.h"
#include "sync/live/live.h"
#include "tests/sync/transfer_test_util.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/shm_object.h"

namespace dte::fs {
namespace {

using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::State;

constexpr int kTp = 2;
constexpr const char* kOProj = "model.layers.0.self_attn.o_proj.weight";

ModelConfig Config() {
  ModelConfig c;
  c.layers = 1;
  c.hidden = 256;
  c.heads = 2;
  c.kv_heads = 2;
  c.head_dim = 128;
  c.intermediate = 512;
  c.vocab = 256;
  return c;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// One rank's tensors, each in a /dev/shm object of its own, mapped here too.
class Rank {
 public:
  Rank(int rank, const State& want, const std::string& prefix) : rank_(rank) {
    for (const auto& [name, bytes] : want) {
      auto o = std::make_unique<test::ShmObject>(prefix + "-" + std::to_string(objects_.size()),
                                                 bytes.size());
      std::memcpy(o->data(), bytes.data(), bytes.size());
      objects_[name] = std::move(o);
    }
  }

  // Registers every tensor as rank `rank_` of server "s" of kTp ranks.
  void Register(live::Live& live, uint64_t owner, uint64_t version) const {
    for (const auto& [name, o] : objects_) {
      dte_live_register r = {};
      r.abi_version = DTE_LIVE_ABI_VERSION;
      r.kind = DTE_LIVE_HOST_SHM;
      r.tp = kTp;
      r.rank = rank_;
      r.fuse_qkv = r.fuse_gate_up = 1;
      std::snprintf(r.name, sizeof r.name, "%s", name.c_str());
      std::snprintf(r.dtype, sizeof r.dtype, "%s", dtypes.at(name).c_str());
      const std::vector<uint64_t>& shape = shapes.at(name);
      r.ndim = static_cast<uint32_t>(shape.size());
      for (size_t d = 0; d < shape.size(); ++d) r.shape[d] = static_cast<int64_t>(shape[d]);
      std::snprintf(r.shm_name, sizeof r.shm_name, "%s", o->name().c_str());
      r.version = version;
      std::snprintf(r.server, sizeof r.server, "s");
      r.server_size = kTp;
      auto id = live.Register(owner, getuid(), r);
      EXPECT_TRUE(id.ok()) << name << ": " << id.status().message();
    }
  }

  // Its memory goes away under every mapping: the next write SIGBUSes.
  void Truncate() {
    for (auto& [name, o] : objects_) o->Truncate();
  }

  void ExpectHolds(const State& want, const std::string& what) const {
    for (const auto& [name, o] : objects_) {
      EXPECT_EQ(std::memcmp(o->data(), want.at(name).data(), o->size()), 0)
          << what << ": rank " << rank_ << " tensor " << name;
    }
  }

  std::map<std::string, std::vector<uint64_t>> shapes;  // rank-local, by name
  std::map<std::string, std::string> dtypes;

 private:
  int rank_;
  std::map<std::string, std::unique_ptr<test::ShmObject>> objects_;
};

class LiveServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_TRUE(store_);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0, 0.02f);
    State s;
    for (const PlanTensor& t : transfer_test::ModelSpecs(Config())) {
      Bytes b(transfer_test::ByteSize(t));
      for (size_t i = 0; i < b.size() / DTypeWidth(t.dtype); ++i) {
        const float x = normal(rng);
        const uint16_t v = Bf16(x);
        if (t.dtype == DType::kBF16) std::memcpy(&b[2 * i], &v, 2);
        if (t.dtype != DType::kBF16) std::memcpy(&b[4 * i], &x, 4);
      }
      s[t.name] = std::move(b);
    }
    states_.push_back(s);
    // v1: 3% of the BF16 elements move by one ulp (sparse records:
    // differences); v2: o_proj redrawn (dense records: compared blocks,
    // whose entries set values whole).
    std::uniform_real_distribution<double> u(0, 1);
    for (auto& [name, b] : s) {
      if (name.find("norm") != std::string::npos) continue;
      auto* v = reinterpret_cast<uint16_t*>(b.data());
      for (size_t i = 0; i < b.size() / 2; ++i) v[i] ^= u(rng) < 0.03 ? 1 : 0;
    }
    states_.push_back(s);
    auto* o = reinterpret_cast<uint16_t*>(s.at(kOProj).data());
    for (size_t i = 0; i < s.at(kOProj).size() / 2; ++i) o[i] = Bf16(normal(rng) * 2);
    states_.push_back(s);
    for (uint64_t v = 0; v < states_.size(); ++v) ASSERT_TRUE(Commit(states_[v], v).ok());
    fs_ = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
    fs_->SetInitialLive(0);
    ASSERT_TRUE(fs_->Refresh().ok());
    // The second "host": its own Filesystem (mount) of the same versions.
    fs2_ = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
    fs2_->SetInitialLive(0);
    ASSERT_TRUE(fs2_->Refresh().ok());
  }

  Status Commit(const State& s, uint64_t version) {
    const ModelConfig c = Config();
    test::TestCheckpoint ckpt;
    ckpt.raw_files["config.json"] =
        "{\"model_type\": \"llama\", \"hidden_size\": " + std::to_string(c.hidden) +
        ", \"num_attention_heads\": " + std::to_string(c.heads) +
        ", \"num_key_value_heads\": " + std::to_string(c.kv_heads) +
        ", \"head_dim\": " + std::to_string(c.head_dim) + "}\n";
    test::TestSafetensors file{"model.safetensors", {}, {}};
    for (const PlanTensor& t : transfer_test::ModelSpecs(c)) {
      const Bytes& b = s.at(t.name);
      file.tensors.push_back({t.name, t.dtype, std::vector<int64_t>(t.shape.begin(), t.shape.end()),
                              std::string(b.begin(), b.end())});
    }
    ckpt.safetensors.push_back(std::move(file));
    const std::string dir = dir_.path() + "/in" + std::to_string(version);
    RETURN_IF_ERROR(test::WriteCheckpoint(ckpt, dir));
    CommitOptions o;
    o.version = version;
    auto r = CommitDirectory(*store_, dir, o);
    return r.ok() ? Status::Ok() : r.status();
  }

  // What rank `rank` holds of version v, by receiver tensor name.
  State Want(uint64_t v, int rank) const {
    const ModelConfig c = Config();
    return transfer_test::ShardModel(c, transfer_test::ModelSpecs(c), states_[v],
                                     FusedReceiverLayout(kTp), rank);
  }

  // Rank `rank` holding version v, registered as owner `owner` (on fs, by
  // default the first mount).
  std::unique_ptr<Rank> Start(int rank, uint64_t v, uint64_t owner, Filesystem* fs = nullptr) {
    auto r = std::make_unique<Rank>(
        rank, Want(v, rank),
        "dte-server-test-" + std::to_string(getpid()) + "-" + std::to_string(owner));
    const ModelConfig c = Config();
    auto plan = MakeTransferPlan(transfer_test::ModelSpecs(c), c.Geometry(), {1, false, false},
                                 FusedReceiverLayout(kTp));
    EXPECT_TRUE(plan.ok());
    for (const PlanTensor& t : plan->receiver_tensors[rank]) {
      r->shapes[t.name] = t.shape;
      r->dtypes[t.name] = DTypeName(t.dtype);
    }
    r->Register((fs ? fs : fs_.get())->live(), owner, v);
    return r;
  }

  test::ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  std::vector<State> states_;
  std::unique_ptr<Filesystem> fs_, fs2_;
};

TEST_F(LiveServerTest, AnIncompleteServerRefusesTheApplyAndNothingIsWritten) {
  auto rank0 = Start(0, 0, 1);
  auto r = fs_->ApplyLive(2, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(r.status().message().find(
                "server \"s\" is incomplete on this mount: ranks [0] of its 2 registered"),
            std::string::npos)
      << r.status().message();
  rank0->ExpectHolds(Want(0, 0), "refused");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
}

TEST_F(LiveServerTest, AFailedRankWritesBackTheRanksWrittenBeforeIt) {
  auto rank0 = Start(0, 0, 1);
  auto rank1 = Start(1, 0, 2);
  ASSERT_NE(Want(2, 0), Want(0, 0));
  rank1->Truncate();
  // Ranks are written in order, so rank 0 is written before rank 1 fails.
  auto r = fs_->ApplyLive(2, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("writing the buffers of rank 1 of server \"s\""), std::string::npos) << m;
  EXPECT_NE(m.find("the 1 server ranks written before it were written back"), std::string::npos)
      << m;
  rank0->ExpectHolds(Want(0, 0), "written back");
  const dte_live_status st = fs_->live().GetStatus();
  EXPECT_EQ(st.live_version, 0u);
  EXPECT_EQ(st.failed_applies, 1u);
  EXPECT_EQ(st.receivers, 1u);  // rank 1 was dropped
  const std::vector<live::Live::Server> servers = fs_->live().Servers();
  ASSERT_EQ(servers.size(), 1u);
  EXPECT_EQ(servers[0].ranks, std::vector<int>{0});
  EXPECT_FALSE(servers[0].complete);

  // Rank 1 loads again and registers: the server moves whole, both ways.
  rank1 = Start(1, 0, 3);
  for (uint64_t target : {2, 1, 0, 2}) {
    auto ok = fs_->ApplyLive(target, nullptr);
    ASSERT_TRUE(ok.ok()) << ok.status().message();
    EXPECT_EQ(ok->receivers, 2u);
    // The failed apply's changed set was this one's: set values too.
    if (target == 2) {
      EXPECT_GT(ok->compared_blocks, 0u);
    }
    rank0->ExpectHolds(Want(target, 0), "apply to " + std::to_string(target));
    rank1->ExpectHolds(Want(target, 1), "apply to " + std::to_string(target));
  }
}

TEST_F(LiveServerTest, AFailedRankAfterDifferencesOnlyWritesBackExactly) {
  auto rank0 = Start(0, 0, 1);
  auto rank1 = Start(1, 0, 2);
  rank1->Truncate();
  auto r = fs_->ApplyLive(1, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted) << r.status().message();
  rank0->ExpectHolds(Want(0, 0), "written back");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
}

constexpr uint64_t kCoordinator = 100;  // the coordinator's control file, on each mount

TEST_F(LiveServerTest, AServerOverTwoMountsMovesByPrepareThenCommit) {
  auto rank0 = Start(0, 0, 1);
  auto rank1 = Start(1, 0, 2, fs2_.get());
  // Neither mount sees the whole server: a one-phase apply is refused.
  EXPECT_EQ(fs_->ApplyLive(2, nullptr).status().code(), Code::kFailedPrecondition);
  for (uint64_t target : {2, 1, 0, 2}) {
    uint32_t id0 = 0, id1 = 0;
    auto p0 = fs_->PrepareLive(kCoordinator, target, &id0);
    ASSERT_TRUE(p0.ok()) << p0.status().message();
    auto p1 = fs2_->PrepareLive(kCoordinator, target, &id1);
    ASSERT_TRUE(p1.ok()) << p1.status().message();
    EXPECT_NE(id0, 0u);
    EXPECT_EQ(p0->to_version, target);
    EXPECT_GT(p0->entries + p0->compared_blocks, 0u);
    // Prepared: what the coordinator checks, and nothing written.
    std::optional<live::Live::PreparedInfo> info = fs_->live().Prepared();
    ASSERT_TRUE(info);
    EXPECT_EQ(info->id, id0);
    ASSERT_EQ(info->servers.size(), 1u);
    EXPECT_EQ(info->servers[0].ranks, std::vector<int>{0});
    EXPECT_EQ(fs_->live().GetStatus().prepared, id0);
    const uint64_t held = fs_->live().GetStatus().live_version;
    rank0->ExpectHolds(Want(held, 0), "prepared");
    rank1->ExpectHolds(Want(held, 1), "prepared");
    // No other apply and no registration while it is prepared.
    auto busy = fs_->ApplyLive(1, nullptr);
    EXPECT_EQ(busy.status().code(), Code::kUnavailable);
    EXPECT_NE(busy.status().message().find("apply " + std::to_string(id0) + " of " +
                                           VersionName(target) + " is prepared"),
              std::string::npos)
        << busy.status().message();
    uint32_t other = 0;
    EXPECT_EQ(fs_->PrepareLive(kCoordinator + 1, 1, &other).status().code(), Code::kUnavailable);
    // Only its control file commits it.
    EXPECT_EQ(fs_->CommitLive(kCoordinator + 1, id0, nullptr).status().code(),
              Code::kFailedPrecondition);
    auto c0 = fs_->CommitLive(kCoordinator, id0, nullptr);
    ASSERT_TRUE(c0.ok()) << c0.status().message();
    auto c1 = fs2_->CommitLive(kCoordinator, id1, nullptr);
    ASSERT_TRUE(c1.ok()) << c1.status().message();
    EXPECT_EQ(c0->receivers, 1u);
    rank0->ExpectHolds(Want(target, 0), "committed " + std::to_string(target));
    rank1->ExpectHolds(Want(target, 1), "committed " + std::to_string(target));
    EXPECT_EQ(fs_->live().GetStatus().live_version, target);
    EXPECT_EQ(fs2_->live().GetStatus().live_version, target);
    EXPECT_EQ(fs_->live().GetStatus().prepared, 0u);
    EXPECT_FALSE(fs_->live().Prepared());
  }
}

TEST_F(LiveServerTest, AnAbortedOrDroppedPreparedApplyWritesNothing) {
  auto rank0 = Start(0, 0, 1);
  uint32_t id = 0;
  ASSERT_TRUE(fs_->PrepareLive(kCoordinator, 2, &id).ok());
  EXPECT_EQ(fs_->live().Abort(kCoordinator, id + 1).code(), Code::kFailedPrecondition);
  ASSERT_TRUE(fs_->live().Abort(kCoordinator, id).ok());
  EXPECT_EQ(fs_->CommitLive(kCoordinator, id, nullptr).status().code(), Code::kFailedPrecondition);
  rank0->ExpectHolds(Want(0, 0), "aborted");
  // The coordinator's control file closes (it exited): the apply is dropped.
  ASSERT_TRUE(fs_->PrepareLive(kCoordinator, 2, &id).ok());
  fs_->live().Drop(kCoordinator);
  EXPECT_FALSE(fs_->live().Prepared());
  rank0->ExpectHolds(Want(0, 0), "dropped");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
  // The mount takes the next one.
  ASSERT_TRUE(fs_->PrepareLive(kCoordinator + 1, 1, &id).ok());
  ASSERT_TRUE(fs_->CommitLive(kCoordinator + 1, id, nullptr).ok());
  rank0->ExpectHolds(Want(1, 0), "the next apply");
}

TEST_F(LiveServerTest, ACommitRefusesWhenARankLeftSinceThePrepare) {
  auto rank0 = Start(0, 0, 1);
  auto rank1 = Start(1, 0, 2);
  uint32_t id = 0;
  ASSERT_TRUE(fs_->PrepareLive(kCoordinator, 2, &id).ok());
  fs_->live().Drop(2);  // rank 1's process exited
  auto c = fs_->CommitLive(kCoordinator, id, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kAborted);
  EXPECT_NE(c.status().message().find("server \"s\" changed on this mount since the apply was "
                                      "prepared (ranks [0, 1] of 2 then, ranks [0] of 2 now)"),
            std::string::npos)
      << c.status().message();
  rank0->ExpectHolds(Want(0, 0), "refused commit");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
  EXPECT_FALSE(fs_->live().Prepared());
  EXPECT_EQ(fs_->live().GetStatus().applying, 0u);
}

TEST_F(LiveServerTest, AFailedRankInACommitWritesBackAndKeepsTheVersion) {
  auto rank0 = Start(0, 0, 1);
  auto rank1 = Start(1, 0, 2);
  rank1->Truncate();
  uint32_t id = 0;
  ASSERT_TRUE(fs_->PrepareLive(kCoordinator, 2, &id).ok());
  auto c = fs_->CommitLive(kCoordinator, id, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kAborted) << c.status().message();
  rank0->ExpectHolds(Want(0, 0), "written back");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
  EXPECT_FALSE(fs_->live().Prepared());
}

}  // namespace
}  // namespace dte::fs
