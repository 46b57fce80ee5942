// The fixture of tests/sync/push_fp8_test.cc: a small Llama-shaped model
// of finite BF16 weights committed version by version, a push server, and
// FP8 and BF16 receivers whose buffers are compared with what they must
// hold, computed independently of the push and of the FP8 receiver plan:
// every quantized canonical tensor through kernels::Fp8Quantize, then split
// with the plain row and column slicing of tests/sync/transfer_test_util.h
// (the block grids split the same way, in block rows and columns).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "store/fp8_policy.h"
#include "store/ops/commit.h"
#include "store/store.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"
#include "tests/sync/push_test_util.h"
#include "tests/sync/transfer_test_util.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/wait.h"

namespace dte::push_fp8_test {

using namespace std::chrono_literals;
using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::State;

inline Fp8ReceiverOptions Fp8Options(uint64_t rows, uint64_t cols, kernels::Fp8ScaleRule rule) {
  Fp8ReceiverOptions o;
  o.block_rows = rows;
  o.block_cols = cols;
  o.rule = rule;
  return o;
}

// The same with Fp8Policy::quantize_partial_blocks: every 2-D weight of the
// policy is quantized, its last block row and column partial where the
// block does not divide it. No dimension of the model is a multiple of 5
// or 7, so the 5 x 7 receivers of these tests hold FP8 only through it;
// they keep the partial blocks of summaries, bands and catch-up tested.
inline Fp8ReceiverOptions PartialFp8Options(uint64_t rows, uint64_t cols,
                                            kernels::Fp8ScaleRule rule) {
  Fp8ReceiverOptions o = Fp8Options(rows, cols, rule);
  o.policy.quantize_partial_blocks = true;
  return o;
}

// Whether a receiver of options `o` holds canonical tensor t in FP8 (its
// policy with its block); by default whether any block shape would (the
// policy's other rules alone).
inline bool Quantized(const PlanTensor& t, const Fp8ReceiverOptions& o = PartialFp8Options(
                                               1, 1, kernels::Fp8ScaleRule::kPlain)) {
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  return QuantizeAsFp8(o.policy, {o.block_rows, o.block_cols}, t.name, t.dtype, shape);
}

// One receiver: layout, rank, FP8 options (none: BF16), buffers by name.
struct Rx {
  ShardLayout layout;
  int rank = 0;
  std::optional<Fp8ReceiverOptions> fp8;
  State buffers;
  std::unique_ptr<PushReceiver> rx;
};

class PushFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(11);
    specs_ = transfer_test::ModelSpecs(config_);
    state_ = RandomState(rng);
    store_ = test::OpenTestStore(tmp_.path() + "/store");
    ASSERT_TRUE(store_);
    ASSERT_EQ(Commit(state_), 0u);
  }

  static bool IsBf16(const PlanTensor& t) { return t.dtype == DType::kBF16; }

  // Random finite BF16 weights (normal, sigma 0.05); F32 tensors random bits.
  State RandomState(std::mt19937_64& rng) const {
    std::normal_distribution<float> normal(0.0f, 0.05f);
    State s;
    for (const PlanTensor& t : specs_) {
      Bytes b(transfer_test::ByteSize(t));
      if (!IsBf16(t)) {
        for (auto& x : b) x = static_cast<uint8_t>(rng());
      } else {
        for (size_t i = 0; i < b.size(); i += 2) {
          const float f = normal(rng);
          uint32_t u;
          std::memcpy(&u, &f, 4);
          const uint16_t h = static_cast<uint16_t>(u >> 16);
          std::memcpy(&b[i], &h, 2);
        }
      }
      s[t.name] = std::move(b);
    }
    return s;
  }

  // Changes each element with probability `density` by flipping some of
  // its two lowest mantissa bits (BF16 stays finite); with grow, the first
  // element of every quantized tensor becomes 4x its block's largest
  // magnitude, so that block's scale changes under both rules.
  State Step(const State& s, double density, bool grow, std::mt19937_64& rng) const {
    std::uniform_real_distribution<double> u(0, 1);
    State out = s;
    for (const PlanTensor& t : specs_) {
      Bytes& b = out[t.name];
      const int w = DTypeWidth(t.dtype);
      for (size_t i = 0; i < b.size() / w; ++i) {
        if (u(rng) < density) b[i * w] ^= static_cast<uint8_t>(1 + rng() % 3);
      }
      if (!grow || !Quantized(t)) continue;
      uint16_t amax = 0;  // over the whole tensor: at least its first block's
      for (size_t i = 0; i < b.size(); i += 2) {
        uint16_t h;
        std::memcpy(&h, &b[i], 2);
        amax = std::max<uint16_t>(amax, h & 0x7FFF);
      }
      const uint16_t big = static_cast<uint16_t>(amax + (2 << 7));  // exponent + 2: 4x
      std::memcpy(&b[0], &big, 2);
    }
    return out;
  }

  uint64_t Commit(const State& state) {
    const std::string dir = tmp_.path() + "/ckpt" + std::to_string(dirs_++);
    return push_test::CommitState(*store_, config_, specs_, state, dir);
  }

  std::shared_ptr<const Version> V(uint64_t version) {
    return push_test::GetVersion(*store_, version);
  }

  // Per tensor, the elements that differ, with their old values.
  std::vector<TensorChanges> Diff(const State& a, const State& b) const {
    return push_test::Diff(specs_, a, b, /*with_old=*/true);
  }

  std::unique_ptr<PushServer> StartServer(PushServerOptions o = {}) {
    o.timeout = 10s;
    return push_test::StartServer(*store_, o);
  }

  // A server with no cache and one tensor per batch: every tensor is read,
  // its FP8 change sets computed and its data packed twice.
  std::unique_ptr<PushServer> StartTwoPassServer() {
    PushServerOptions o;
    o.cache_bytes = 0;
    o.batch_entries = 1;
    return StartServer(o);
  }

  // What a receiver of `layout`/`rank` with `fp8` options holds at `state`:
  // the BF16 shard, its FP8 tensors replaced by the shards of the quantized
  // canonical tensors and their block grids (split like the elements, in
  // blocks: this needs block_rows to divide head_dim, or TP 1 unfused).
  State Expected(const State& state, const ShardLayout& layout, int rank,
                 const std::optional<Fp8ReceiverOptions>& fp8) const {
    State out = transfer_test::ShardModel(config_, specs_, state, layout, rank);
    if (!fp8) return out;
    std::vector<PlanTensor> qspecs, sspecs;
    State q, s;
    for (const PlanTensor& t : specs_) {
      if (!Quantized(t, *fp8)) continue;
      const kernels::Fp8Layout l{t.shape[0], t.shape[1], fp8->block_rows, fp8->block_cols,
                                 fp8->rule};
      Bytes qb(l.num_elements()), sb(l.num_blocks() * 4);
      const std::string bad =
          kernels::Fp8Quantize(l, reinterpret_cast<const uint16_t*>(state.at(t.name).data()),
                               qb.data(), reinterpret_cast<float*>(sb.data()), t.name);
      EXPECT_EQ(bad, "");
      qspecs.push_back({t.name, DType::kF8E4M3, t.shape});
      sspecs.push_back({t.name, DType::kF32, {l.grid_rows(), l.grid_cols()}});
      q[t.name] = std::move(qb);
      s[t.name] = std::move(sb);
    }
    const bool whole = layout.tp == 1 && !layout.fuse_qkv && !layout.fuse_gate_up;
    ModelConfig grid = config_;
    EXPECT_TRUE(whole || config_.head_dim % fp8->block_rows == 0);
    grid.head_dim = config_.head_dim / fp8->block_rows;
    for (auto& [name, bytes] : transfer_test::ShardModel(config_, qspecs, q, layout, rank)) {
      out[name] = std::move(bytes);
    }
    State scales = whole ? s : transfer_test::ShardModel(grid, sspecs, s, layout, rank);
    for (auto& [name, bytes] : scales) out[Fp8ScaleName(name)] = std::move(bytes);
    return out;
  }

  // A receiver whose buffers hold `state` as `version` (nullopt: zeros,
  // version unknown). Its tensors' shapes from the transfer plan, as a
  // server's model has them; FP8 ones are those Expected gives 1-byte
  // elements, scales the "weight_scale_inv" ones.
  std::unique_ptr<Rx> Receiver(const PushServer& server, ShardLayout layout, int rank,
                               std::optional<Fp8ReceiverOptions> fp8, const State& state,
                               std::optional<uint64_t> version, bool auto_apply = true) {
    auto r = std::make_unique<Rx>();
    r->layout = layout;
    r->rank = rank;
    r->fp8 = fp8;
    r->buffers = Expected(state, layout, rank, fp8);
    if (!version) {
      for (auto& [name, b] : r->buffers) std::fill(b.begin(), b.end(), 0);
    }
    PushReceiverOptions o = push_test::ReceiverOptions(server, layout, rank, version, auto_apply);
    o.fp8 = fp8;
    o.catch_up_band_bytes = band_bytes_;
    for (const PlanTensor& t : push_test::ReceiverTensors(config_, specs_, layout, rank)) {
      Bytes& b = r->buffers.at(t.name);
      const bool is_fp8 = b.size() == ShapeElements(t.shape);
      o.tensors.push_back({t.name, is_fp8 ? DType::kF8E4M3 : t.dtype, t.shape, b.data()});
      if (!is_fp8) continue;
      const std::vector<uint64_t> grid = {(t.shape[0] + fp8->block_rows - 1) / fp8->block_rows,
                                          (t.shape[1] + fp8->block_cols - 1) / fp8->block_cols};
      const std::string sname = Fp8ScaleName(t.name);
      o.tensors.push_back({sname, DType::kF32, grid, r->buffers.at(sname).data()});
    }
    r->rx = push_test::OpenReceiver(o);
    return r;
  }

  void ExpectHolds(const Rx& r, const State& state) const {
    const State want = Expected(state, r.layout, r.rank, r.fp8);
    ASSERT_EQ(want.size(), r.buffers.size());
    for (const auto& [name, bytes] : want) {
      const Bytes& got = r.buffers.at(name);
      size_t differ = 0;
      for (size_t i = 0; i < bytes.size(); ++i) differ += got[i] != bytes[i];
      ASSERT_EQ(differ, 0u) << LayoutText(r.layout, r.rank) << (r.fp8 ? " FP8" : " BF16")
                            << ": tensor " << name << " differs in " << differ << " of "
                            << bytes.size() << " bytes";
    }
  }

  // The usual pair of receivers of state_ at v0, listed by the server: an
  // FP8 one (TP 1 unfused, 5 x 7 plain blocks, partial ones quantized) and
  // a BF16 one (TP 2 fused, rank 0).
  std::vector<std::unique_ptr<Rx>> Fp8AndBf16Receivers(const PushServer& server) {
    std::vector<std::unique_ptr<Rx>> rxs;
    rxs.push_back(Receiver(server, {1, false, false}, 0,
                           PartialFp8Options(5, 7, kernels::Fp8ScaleRule::kPlain), state_, 0));
    rxs.push_back(Receiver(server, FusedReceiverLayout(2), 0, std::nullopt, state_, 0));
    AwaitReceivers(server, rxs.size());
    return rxs;
  }

  void AwaitReceivers(const PushServer& s, size_t n) {
    ASSERT_TRUE(test::WaitFor([&] { return s.Receivers().size() >= n; }))
        << s.Receivers().size() << " receivers listed, not " << n;
  }

  // Until the server lists n receivers, each at `version` and not behind.
  void AwaitReceiversAt(PushServer& s, size_t n, uint64_t version) {
    ASSERT_TRUE(test::WaitFor([&] {
      const std::vector<PushReceiverInfo> infos = s.Receivers();
      return infos.size() == n && std::all_of(infos.begin(), infos.end(), [&](const auto& i) {
               return i.version == version && !i.behind;
             });
    })) << s.StatusJson();
  }

  ModelConfig config_;
  std::vector<PlanTensor> specs_;
  State state_;
  test::ScopedTempDir tmp_;
  int dirs_ = 0;
  std::unique_ptr<Store> store_;
  uint64_t band_bytes_ = PushReceiverOptions{}.catch_up_band_bytes;  // of receivers opened
};

}  // namespace dte::push_fp8_test
