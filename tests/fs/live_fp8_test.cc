// Live apply into FP8 receivers (sync/live/live.h, docs/live.md "FP8 receivers")
// without FUSE: receivers of a small Llama in /dev/shm, in vLLM's fused
// layout at TP 1 and 2, under both scale rules, registered with their E4M3
// bytes, scales and BF16 tensors. After every apply, forward and back, along
// the chain, across dense steps and steps that move block scales, every
// buffer equals an independent construction: the target's BF16 tensors
// sliced directly per rank (tests/sync/transfer_test_util.h), the FP8 ones
// quantized from those slices. Refusals name what to fix and write nothing.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fs/filesystem.h"
#include "kernels/fp8.h"
#include "store/ops/commit.h"
#include "sync/live/live.h"
#include "sync/transfer/fp8_plan.h"
#include "tests/sync/transfer_test_util.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/shm_object.h"

namespace dte::fs {
namespace {

using kernels::Fp8ScaleRule;
using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::State;

// One layer, 128-row heads: with 128 x 128 blocks every TP 1 and 2 split of
// the fused layout is block-aligned; gate/up/down (1536) span several 256
// KiB store blocks per FP8 block row, and block rows cross store blocks.
ModelConfig Config() {
  ModelConfig c;
  c.layers = 1;
  c.hidden = 256;
  c.heads = 2;
  c.kv_heads = 2;
  c.head_dim = 128;
  c.intermediate = 1536;
  c.vocab = 256;
  return c;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

using Shm = test::ShmObject;

// A registered buffer: its name, dtype and shape as registered, its place.
struct BufferSpec {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  uint64_t offset = 0, bytes = 0;
};

// What a rank of `tp` holds of version `s` under `rule`, by buffer name:
// BF16 slices, and for FP8 tensors the quantized slice and its scales.
std::map<std::string, Bytes> Expected(const State& s, int tp, int rank, Fp8ScaleRule rule) {
  const ModelConfig c = Config();
  const State shard =
      transfer_test::ShardModel(c, transfer_test::ModelSpecs(c), s, FusedReceiverLayout(tp), rank);
  auto plan = MakeTransferPlan(transfer_test::ModelSpecs(c), c.Geometry(), {1, false, false},
                               FusedReceiverLayout(tp));
  EXPECT_TRUE(plan.ok());
  Fp8ReceiverOptions o;
  o.rule = rule;
  auto fp = MakeFp8ReceiverPlan(*plan, rank, o);
  EXPECT_TRUE(fp.ok()) << fp.status().message();
  std::map<std::string, Bytes> out;
  for (size_t i = 0; i < fp->tensors.size(); ++i) {
    const PlanTensor& t = plan->receiver_tensors[rank][i];
    if (!fp->tensors[i].fp8) {
      out[t.name] = shard.at(t.name);
      continue;
    }
    const kernels::Fp8Layout l{t.shape[0], t.shape[1], 128, 128, rule};
    Bytes q(l.num_elements()), sc(4 * l.num_blocks());
    EXPECT_EQ(kernels::Fp8Quantize(l, reinterpret_cast<const uint16_t*>(shard.at(t.name).data()),
                                   q.data(), reinterpret_cast<float*>(sc.data()), t.name),
              "");
    out[t.name] = std::move(q);
    out[fp->tensors[i].scale_name] = std::move(sc);
  }
  return out;
}

// One receiver (an owner) with every tensor of its rank in one shm object.
struct Receiver {
  uint64_t owner;
  int tp, rank;
  Fp8ScaleRule rule;
  std::vector<BufferSpec> buffers;
  std::unique_ptr<Shm> shm;
  std::string server;  // a rank of this server of tp ranks; empty: none

  // Lays the buffers out from `want` (names) and the plan (dtypes, shapes).
  void Build(const std::map<std::string, Bytes>& want, const std::string& shm_name) {
    const ModelConfig c = Config();
    auto plan = MakeTransferPlan(transfer_test::ModelSpecs(c), c.Geometry(), {1, false, false},
                                 FusedReceiverLayout(tp));
    auto fp = MakeFp8ReceiverPlan(*plan, rank, Fp8ReceiverOptions{});
    uint64_t end = 0;
    for (size_t i = 0; i < fp->tensors.size(); ++i) {
      const PlanTensor& t = plan->receiver_tensors[rank][i];
      const bool fp8 = fp->tensors[i].fp8;
      buffers.push_back(
          {t.name, fp8 ? "F8_E4M3" : DTypeName(t.dtype), t.shape, end, want.at(t.name).size()});
      end += (buffers.back().bytes + 63) / 64 * 64;
      if (!fp8) continue;
      buffers.push_back({fp->tensors[i].scale_name, "F32", fp->tensors[i].scale_shape, end, 0});
      buffers.back().bytes = want.at(buffers.back().name).size();
      end += (buffers.back().bytes + 63) / 64 * 64;
    }
    shm = std::make_unique<Shm>(shm_name, end);
    for (const BufferSpec& b : buffers) {
      std::memcpy(shm->data() + b.offset, want.at(b.name).data(), b.bytes);
    }
  }

  dte_live_register Request(const BufferSpec& b, uint64_t version) const {
    dte_live_register r = {};
    r.abi_version = DTE_LIVE_ABI_VERSION;
    r.kind = DTE_LIVE_HOST_SHM;
    r.tp = tp;
    r.rank = rank;
    r.fuse_qkv = r.fuse_gate_up = 1;
    std::snprintf(r.name, sizeof r.name, "%s", b.name.c_str());
    std::snprintf(r.dtype, sizeof r.dtype, "%s", b.dtype.c_str());
    r.ndim = static_cast<uint32_t>(b.shape.size());
    for (size_t d = 0; d < b.shape.size(); ++d) r.shape[d] = static_cast<int64_t>(b.shape[d]);
    std::snprintf(r.shm_name, sizeof r.shm_name, "%s", shm->name().c_str());
    r.offset = b.offset;
    r.version = version;
    r.fp8_scale_rule = rule == Fp8ScaleRule::kPowerOfTwo ? DTE_LIVE_FP8_POW2 : DTE_LIVE_FP8_PLAIN;
    std::snprintf(r.server, sizeof r.server, "%s", server.c_str());
    r.server_size = server.empty() ? 1 : tp;
    return r;
  }

  // Every buffer equals `want`, bit for bit.
  void ExpectHolds(const std::map<std::string, Bytes>& want, const std::string& what) const {
    for (const BufferSpec& b : buffers) {
      EXPECT_EQ(std::memcmp(shm->data() + b.offset, want.at(b.name).data(), b.bytes), 0)
          << what << ": tp " << tp << " rank " << rank << " rule " << static_cast<int>(rule)
          << " buffer " << b.name;
    }
  }
};

// The bytes an apply from `a` to `b` writes into a receiver: its differing
// elements times their width (FP8 bytes, 4 per scale, 2 per BF16 element).
uint64_t DifferingBytes(const Receiver& rx, const std::map<std::string, Bytes>& a,
                        const std::map<std::string, Bytes>& b) {
  uint64_t n = 0;
  for (const BufferSpec& buf : rx.buffers) {
    const int w = buf.dtype == "F8_E4M3" ? 1 : DTypeWidth(*ParseDType(buf.dtype));
    for (uint64_t i = 0; i < buf.bytes; i += w) {
      n += std::memcmp(a.at(buf.name).data() + i, b.at(buf.name).data() + i, w) != 0 ? w : 0;
    }
  }
  return n;
}

class LiveFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_TRUE(store_);
    std::mt19937_64 rng(5);
    states_.push_back(First(rng));
    // v1, v2: sparse AdamW-like steps, each with one jump that moves a
    // block's scale; v3: o_proj redrawn (dense records: compared blocks).
    states_.push_back(Step(states_.back(), "model.layers.0.self_attn.q_proj.weight", rng));
    states_.push_back(Step(states_.back(), "model.layers.0.mlp.down_proj.weight", rng));
    State dense = Step(states_.back(), "model.layers.0.mlp.up_proj.weight", rng);
    std::normal_distribution<float> wide(0, 0.04f);  // new values: dense records
    auto* o = reinterpret_cast<uint16_t*>(dense.at(kOProj).data());
    for (size_t i = 0; i < dense.at(kOProj).size() / 2; ++i) o[i] = Bf16(wide(rng));
    states_.push_back(std::move(dense));
    for (uint64_t v = 0; v < states_.size(); ++v) ASSERT_TRUE(Commit(states_[v], Config(), v).ok());
    fs_ = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
    fs_->SetInitialLive(0);
    ASSERT_TRUE(fs_->Refresh().ok());
  }

  static constexpr const char* kOProj = "model.layers.0.self_attn.o_proj.weight";

  static State First(std::mt19937_64& rng) { return OtherModel(Config(), rng); }

  static State OtherModel(const ModelConfig& c, std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0, 0.02f);
    State s;
    for (const PlanTensor& t : transfer_test::ModelSpecs(c)) {
      Bytes b(transfer_test::ByteSize(t));
      for (size_t i = 0; i < b.size() / DTypeWidth(t.dtype); ++i) {
        const float x = normal(rng);
        if (t.dtype == DType::kBF16) {
          const uint16_t v = Bf16(x);
          std::memcpy(&b[2 * i], &v, 2);
        } else {
          std::memcpy(&b[4 * i], &x, 4);
        }
      }
      s[t.name] = std::move(b);
    }
    return s;
  }

  // 3% of BF16 elements move by one ulp; one element of `jump` becomes 0.5.
  static State Step(const State& old, const std::string& jump, std::mt19937_64& rng) {
    State s = old;
    std::uniform_real_distribution<double> u(0, 1);
    for (auto& [name, b] : s) {
      if (name.find("norm") != std::string::npos) continue;  // F32
      auto* v = reinterpret_cast<uint16_t*>(b.data());
      for (size_t i = 0; i < b.size() / 2; ++i) {
        if (u(rng) < 0.03) v[i] ^= 1;
      }
    }
    auto* v = reinterpret_cast<uint16_t*>(s.at(jump).data());
    v[rng() % (s.at(jump).size() / 2)] = Bf16(0.5f);
    return s;
  }

  Status Commit(const State& s, const ModelConfig& c, uint64_t version) {
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

  // A receiver of rank `rank` of `tp` holding version `v`, registered.
  std::unique_ptr<Receiver> Register(int tp, int rank, Fp8ScaleRule rule, uint64_t v,
                                     const std::string& server = "") {
    auto rx = std::make_unique<Receiver>();
    *rx = Receiver{++owners_, tp, rank, rule, {}, nullptr, server};
    rx->Build(Expected(states_[v], tp, rank, rule),
              "dte-fp8-test-" + std::to_string(getpid()) + "-" + std::to_string(rx->owner));
    for (const BufferSpec& b : rx->buffers) {
      auto id = fs_->live().Register(rx->owner, getuid(), rx->Request(b, v));
      EXPECT_TRUE(id.ok()) << b.name << ": " << id.status().message();
    }
    return rx;
  }

  // Expected() of version v for rx's rank and rule, computed once.
  const std::map<std::string, Bytes>& Want(uint64_t v, const Receiver& rx) {
    auto key = std::make_tuple(v, rx.tp, rx.rank, rx.rule);
    auto it = want_.find(key);
    if (it == want_.end()) {
      it = want_.emplace(key, Expected(states_[v], rx.tp, rx.rank, rx.rule)).first;
    }
    return it->second;
  }

  test::ScopedTempDir dir_;
  std::map<std::tuple<uint64_t, int, int, Fp8ScaleRule>, std::map<std::string, Bytes>> want_;
  std::unique_ptr<Store> store_;
  std::vector<State> states_;
  std::unique_ptr<Filesystem> fs_;
  uint64_t owners_ = 0;
};

TEST_F(LiveFp8Test, ReceiversEqualTheQuantizedTargetAfterEveryApply) {
  std::vector<std::unique_ptr<Receiver>> rxs;
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo}) {
    for (int tp : {1, 2}) {
      for (int rank = 0; rank < tp; ++rank) rxs.push_back(Register(tp, rank, rule, 0));
    }
  }
  uint64_t at = 0, scales_moved = 0;
  for (uint64_t target : {1, 2, 0, 3, 1, 2}) {
    auto counts = fs_->ApplyLive(target, nullptr);
    ASSERT_TRUE(counts.ok()) << counts.status().message();
    const std::string what = "apply " + std::to_string(at) + " -> " + std::to_string(target);
    uint64_t want_bytes = 0;
    for (const auto& rx : rxs) {
      const auto& before = Want(at, *rx);
      const auto& after = Want(target, *rx);
      rx->ExpectHolds(after, what);
      want_bytes += DifferingBytes(*rx, before, after);
      for (const BufferSpec& b : rx->buffers) {
        if (b.dtype == "F32" && before.at(b.name) != after.at(b.name)) scales_moved++;
      }
    }
    EXPECT_EQ(counts->bytes, want_bytes) << what;  // only what changed is written
    EXPECT_EQ(counts->receivers, rxs.size()) << what;
    if (target == 3) {
      EXPECT_GT(counts->compared_blocks, 0u) << what;
    }
    at = target;
  }
  EXPECT_GT(scales_moved, 0u);
}

// A registration of `name` as `dtype` `shape` at offset 0 of /dev/shm/`shm`.
dte_live_register Request(const std::string& name, const std::string& dtype,
                          std::vector<int64_t> shape, int tp, int rank, const std::string& shm) {
  dte_live_register r = {};
  r.abi_version = DTE_LIVE_ABI_VERSION;
  r.tp = tp;
  r.rank = rank;
  r.fuse_qkv = r.fuse_gate_up = 1;
  std::snprintf(r.name, sizeof r.name, "%s", name.c_str());
  std::snprintf(r.dtype, sizeof r.dtype, "%s", dtype.c_str());
  r.ndim = static_cast<uint32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) r.shape[d] = shape[d];
  std::snprintf(r.shm_name, sizeof r.shm_name, "%s", shm.c_str());
  r.version = DTE_LIVE_LATEST;
  return r;
}

TEST_F(LiveFp8Test, RegistrationRefusesWhatAnFp8ReceiverCannotHold) {
  const std::string name = "dte-fp8-test-" + std::to_string(getpid()) + "-refuse";
  Shm shm(name, 1 << 20);
  live::Live& live = fs_->live();
  auto refused = [&](dte_live_register r, uint64_t owner, const std::string& want) {
    auto id = live.Register(owner, getuid(), r);
    ASSERT_FALSE(id.ok()) << want;
    EXPECT_EQ(id.status().code(), Code::kInvalidArgument) << id.status().message();
    EXPECT_NE(id.status().message().find(want), std::string::npos) << id.status().message();
  };
  const std::string down = "model.layers.0.mlp.down_proj.weight";
  refused(Request("lm_head.weight", "F8_E4M3", {256, 256}, 1, 0, name), 1,
          "\"lm_head.weight\" is not held in FP8 (skipped module)");
  refused(Request("model.norm.weight", "F8_E4M3", {256}, 1, 0, name), 1, "not held in FP8");
  refused(Request(down + "_scale_inv", "F32", {2, 13}, 1, 0, name), 1,
          "F32 [2, 13] given, the FP8 layout has F32 [2, 12]");
  refused(Request(down, "F8_E4M3", {256, 1535}, 1, 0, name), 1, "the FP8 layout has F8_E4M3");
  auto missing = live.Register(
      1, getuid(),
      Request("model.layers.9.mlp.down_proj.weight_scale_inv", "F32", {2, 12}, 1, 0, name));
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("no weight \"model.layers.9.mlp.down_proj.weight\""),
            std::string::npos)
      << missing.status().message();
  dte_live_register r = Request(down, "F8_E4M3", {256, 1536}, 1, 0, name);
  r.fp8_scale_rule = 7;
  refused(r, 1, "unknown FP8 scale rule 7");
  // 256-row blocks do not divide rank 1's q rows [128, 256) at TP 2.
  r = Request("model.layers.0.self_attn.qkv_proj.weight", "F8_E4M3", {384, 256}, 2, 1, name);
  r.fp8_block = 256;
  refused(r, 2,
          "'model.layers.0.self_attn.q_proj.weight': receiver rank 1 (tp=2) takes its rows "
          "[128, 256) of 256 (from sender rank 0), not on multiples of the FP8 block 256");
  // One receiver, one set of FP8 options.
  ASSERT_TRUE(live.Register(3, getuid(), Request(down, "F8_E4M3", {256, 1536}, 1, 0, name)).ok());
  r = Request(down + "_scale_inv", "F32", {2, 12}, 1, 0, name);
  r.fp8_scale_rule = DTE_LIVE_FP8_POW2;
  refused(r, 3, "FP8 block 128 and scale rule 1 differ from this receiver's (128, 0)");
  r.fp8_scale_rule = DTE_LIVE_FP8_PLAIN;
  EXPECT_TRUE(live.Register(3, getuid(), r).ok());
}

// A target whose quantized tensor holds a NaN cannot be given in FP8, and a
// target of another layout not at all: both applies fail before writing.
TEST_F(LiveFp8Test, AnApplyAnFp8ReceiverCannotTakeWritesNothing) {
  State bad = states_[1];
  const std::string down = "model.layers.0.mlp.down_proj.weight";
  reinterpret_cast<uint16_t*>(bad.at(down).data())[300] = 0x7FC0;  // NaN
  ASSERT_TRUE(Commit(bad, Config(), 4).ok());
  ModelConfig other = Config();
  other.intermediate = 1280;
  std::mt19937_64 rng(9);
  ASSERT_TRUE(Commit(OtherModel(other, rng), other, 5).ok());
  ASSERT_TRUE(fs_->Refresh().ok());
  auto rx = Register(2, 1, Fp8ScaleRule::kPlain, 0);
  auto r = fs_->ApplyLive(4, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("apply of v00000004 refused, live state unchanged"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(down), std::string::npos) << r.status().message();
  rx->ExpectHolds(Want(0, *rx), "after the refused apply of v4");
  r = fs_->ApplyLive(5, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("cannot apply v00000005 over live v00000000"),
            std::string::npos)
      << r.status().message();
  rx->ExpectHolds(Want(0, *rx), "after the refused apply of v5");
  EXPECT_EQ(fs_->live().View()->version->manifest.version, 0u);
  ASSERT_TRUE(fs_->ApplyLive(2, nullptr).ok());
  rx->ExpectHolds(Want(2, *rx), "apply 0 -> 2");
}

// A rank of a server that fails mid-apply (its object truncated): the rank
// written before it gets its E4M3 bytes and scales back, bit for bit
// (docs/live.md, "Servers"), across steps that move block scales.
TEST_F(LiveFp8Test, AFailedRankWritesBackTheFp8RankWrittenBeforeIt) {
  auto rank0 = Register(2, 0, Fp8ScaleRule::kPlain, 0, "s");
  auto rank1 = Register(2, 1, Fp8ScaleRule::kPlain, 0, "s");
  ASSERT_NE(Want(2, *rank0), Want(0, *rank0));
  rank1->shm->Truncate();
  auto r = fs_->ApplyLive(2, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted);
  EXPECT_NE(r.status().message().find("the 1 server ranks written before it were written back"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ(r.status().message().find("could not be written back"), std::string::npos)
      << r.status().message();
  rank0->ExpectHolds(Want(0, *rank0), "written back");
  EXPECT_EQ(fs_->live().GetStatus().live_version, 0u);
}

}  // namespace
}  // namespace dte::fs
