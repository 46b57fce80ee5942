// What the push tests (tests/sync/push_test.cc, push_fp8_test.cc) share:
// a model state committed as a version of a test store, the element
// changes between two states, and a push server started at the store's
// latest version.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/ops/commit.h"
#include "store/store.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"
#include "tests/sync/transfer_test_util.h"
#include "tests/testutil/checkpoint.h"

namespace dte::push_test {

// The config.json of a Llama model of `c`'s shape.
inline std::string ConfigJson(const transfer_test::ModelConfig& c) {
  return "{\"model_type\": \"llama\", \"num_hidden_layers\": " + std::to_string(c.layers) +
         ", \"hidden_size\": " + std::to_string(c.hidden) +
         ", \"num_attention_heads\": " + std::to_string(c.heads) +
         ", \"num_key_value_heads\": " + std::to_string(c.kv_heads) +
         ", \"head_dim\": " + std::to_string(c.head_dim) +
         ", \"intermediate_size\": " + std::to_string(c.intermediate) +
         ", \"vocab_size\": " + std::to_string(c.vocab) + "}\n";
}

// Writes `state` (tensors `specs` of a model of `config`) as a checkpoint
// in `dir` and commits it to `store`; the new version (0 on failure, which
// the test reports).
inline uint64_t CommitState(Store& store, const transfer_test::ModelConfig& config,
                            const std::vector<PlanTensor>& specs, const transfer_test::State& state,
                            const std::string& dir) {
  test::TestCheckpoint c;
  c.raw_files["config.json"] = ConfigJson(config);
  test::TestSafetensors f{"model.safetensors", {}, {{"format", "pt"}}};
  for (const PlanTensor& t : specs) {
    const transfer_test::Bytes& b = state.at(t.name);
    std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
    f.tensors.push_back({t.name, t.dtype, shape, std::string(b.begin(), b.end())});
  }
  c.safetensors.push_back(f);
  EXPECT_TRUE(test::WriteCheckpoint(c, dir).ok());
  auto r = CommitDirectory(store, dir, CommitOptions{});
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? r->version : 0;
}

inline std::shared_ptr<const Version> GetVersion(Store& store, uint64_t version) {
  auto v = store.GetVersion(version);
  EXPECT_TRUE(v.ok()) << v.status().message();
  return v.ok() ? *v : nullptr;
}

// The elements that differ between two states, per tensor; with_old:
// also the old elements (then a push sends differences, else whole values).
inline std::vector<TensorChanges> Diff(const std::vector<PlanTensor>& specs,
                                       const transfer_test::State& a, const transfer_test::State& b,
                                       bool with_old) {
  std::vector<TensorChanges> out;
  for (const PlanTensor& t : specs) {
    const int w = DTypeWidth(t.dtype);
    const transfer_test::Bytes &x = a.at(t.name), &y = b.at(t.name);
    TensorChanges c;
    c.name = t.name;
    c.old_exact = with_old;
    for (size_t i = 0; i < x.size() / w; ++i) {
      if (std::memcmp(&x[i * w], &y[i * w], w) == 0) continue;
      c.indices.push_back(i);
      c.values.insert(c.values.end(), y.begin() + i * w, y.begin() + (i + 1) * w);
      if (with_old)
        c.old_values.insert(c.old_values.end(), x.begin() + i * w, x.begin() + (i + 1) * w);
    }
    if (!c.indices.empty()) out.push_back(std::move(c));
  }
  return out;
}

// A push server of options `o` holding `store`'s latest version.
inline std::unique_ptr<PushServer> StartServer(Store& store, const PushServerOptions& o) {
  auto s = PushServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  if (!s.ok()) return nullptr;
  Status latest = (*s)->SetLatest(store, GetVersion(store, *store.Latest().value()));
  EXPECT_TRUE(latest.ok()) << latest.message();
  return std::move(s).value();
}

// The options of a receiver of `server` on loopback (10 s timeout), before
// its tensors.
inline PushReceiverOptions ReceiverOptions(const PushServer& server, const ShardLayout& layout,
                                           int rank, std::optional<uint64_t> version,
                                           bool auto_apply) {
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(server.port());
  o.rank = rank;
  o.layout = layout;
  o.version = version;
  o.auto_apply = auto_apply;
  o.timeout = std::chrono::seconds(10);
  return o;
}

// The receiver tensors of `layout` and `rank` for a model of `config`,
// with the shapes a server's model gives them (from a transfer plan).
inline std::vector<PlanTensor> ReceiverTensors(const transfer_test::ModelConfig& config,
                                               const std::vector<PlanTensor>& specs,
                                               const ShardLayout& layout, int rank) {
  auto plan = MakeTransferPlan(specs, config.Geometry(), ShardLayout{1, false, false}, layout);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? plan->receiver_tensors[rank] : std::vector<PlanTensor>{};
}

// Opens a receiver of options `o` (null on failure, which the test reports).
inline std::unique_ptr<PushReceiver> OpenReceiver(const PushReceiverOptions& o) {
  auto rx = PushReceiver::Open(o);
  EXPECT_TRUE(rx.ok()) << rx.status().message();
  return rx.ok() ? std::move(rx).value() : nullptr;
}

}  // namespace dte::push_test
