// FP8 receivers of the push (docs/push.md "FP8 receivers"): a PushServer
// and receivers holding block-scaled E4M3 weights and their scales, over
// real loopback TCP. After every push and catch-up an FP8 receiver must
// equal the FP8 quantization of the version (kernels::Fp8Quantize per
// canonical tensor, split by plain row and column slicing:
// tests/sync/push_fp8_fixture.h), bit for bit; bad layouts and malformed
// pushes are refused with nothing written.
#include "sync/push/internal/push_fp8.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda.h"
#include "sync/push/changes.h"
#include "sync/push/internal/push_wire.h"
#include "sync/transport/socket.h"
#include "tests/sync/push_fp8_fixture.h"

namespace dte::push_fp8_test {
namespace {

using kernels::Fp8ScaleRule;

class PushFp8Rules : public PushFp8Test, public ::testing::WithParamInterface<Fp8ScaleRule> {};

// The fp8 options of a receiver's hello, as the server parses them: block
// sides outside [1, 2^32) are refused naming the block, before a plan.
TEST(PushFp8Hello, BlockSidesOutOfRangeAreRefusedNamingTheBlock) {
  auto parse = [](uint64_t rows, uint64_t cols) {  // as the hello's JSON text has them
    return push_internal::ParseFp8Options(
        nlohmann::json::parse("{\"block\": [" + std::to_string(rows) + ", " + std::to_string(cols) +
                              "], \"scale_rule\": \"plain\"}"));
  };
  ASSERT_TRUE(parse(128, 64).ok()) << parse(128, 64).status().message();
  EXPECT_EQ(parse(128, 64)->block_cols, 64u);
  for (const uint64_t bad : {uint64_t{0}, uint64_t{1} << 32, ~uint64_t{0}}) {
    auto o = parse(bad, 128);
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument);
    EXPECT_NE(o.status().message().find("block " + std::to_string(bad) + " x 128"),
              std::string::npos)
        << o.status().message();
  }
  // Keys missing or of the wrong type: refused, never looked up blindly.
  for (const char* text : {R"({"scale_rule": "plain"})", R"({"block": [128, 128]})", R"({})",
                           R"({"block": [128, 128], "scale_rule": 1})", R"([])"}) {
    auto o = push_internal::ParseFp8Options(nlohmann::json::parse(text));
    ASSERT_FALSE(o.ok()) << text;
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument) << text;
  }
}

// Hellos whose tensor entries or fp8 options lack keys are refused in the
// welcome, naming what is wrong (the server looks up no missing key).
TEST_F(PushFp8Test, HelloWithMissingKeysIsRefusedInTheWelcome) {
  using push_internal::Msg;
  auto server = StartServer();
  ASSERT_TRUE(server);
  const nlohmann::json tensor = {{"name", "w"}, {"dtype", "BF16"}, {"shape", {2, 2}}};
  struct Case {
    nlohmann::json tensors, fp8;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{nlohmann::json::object()}, nullptr, "a tensor entry is not {name, dtype, shape}"},
      {{{{"name", "w"}, {"dtype", "BF16"}}}, nullptr, "a tensor entry is not {name, dtype, shape}"},
      {{tensor}, {{"scale_rule", "plain"}}, "fp8 options are not {block: [rows, cols]"},
      {{tensor}, nlohmann::json::object(), "fp8 options are not {block: [rows, cols]"},
  };
  for (const Case& c : cases) {
    transport_internal::Deadline d(10s);
    auto fd =
        transport_internal::ConnectTcp("127.0.0.1:" + std::to_string(server->port()), d, "server");
    ASSERT_TRUE(fd.ok()) << fd.status().message();
    const nlohmann::json hello = {
        {"rank", 0}, {"tp", 1}, {"version", 0}, {"tensors", c.tensors}, {"fp8", c.fp8}};
    const std::string f = push_internal::Frame(Msg::kHello, hello.dump());
    ASSERT_TRUE(transport_internal::SendAll(fd->get(), f.data(), f.size(), d, "server").ok());
    auto welcome = push_internal::RecvFrame(fd->get(), 1 << 20, d, "server");
    ASSERT_TRUE(welcome.ok()) << welcome.status().message();
    EXPECT_EQ(welcome->type, Msg::kWelcome);
    EXPECT_NE(welcome->body.find(c.error), std::string::npos) << welcome->body;
  }
}

// A BF16 receiver and FP8 receivers of three layouts on one server: TP 1
// unfused with blocks of 5 x 7 (partial blocks at every edge, quantized by
// the opt-in), TP 1 and TP 2 fused (vLLM's qkv_proj and gate_up_proj) with
// blocks of 4 x 4. Step 3 makes one block of every quantized tensor 4x
// larger: its scale changes and every byte of it that changes is pushed.
TEST_P(PushFp8Rules, ReceiversEqualTheQuantizedVersionAfterEveryPush) {
  const Fp8ScaleRule rule = GetParam();
  auto server = StartServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 0, std::nullopt, state_, 0));
  rxs.push_back(Receiver(*server, {1, false, false}, 0, PartialFp8Options(5, 7, rule), state_, 0));
  rxs.push_back(Receiver(*server, FusedReceiverLayout(1), 0, Fp8Options(4, 4, rule), state_, 0));
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(
        Receiver(*server, FusedReceiverLayout(2), r, Fp8Options(4, 4, rule), state_, 0, r == 0));
  }
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(5);
  State state = state_;
  for (int step = 1; step <= 4; ++step) {
    const bool grow = step == 3;
    State next = Step(state, 0.05, grow, rng);
    const uint64_t v = Commit(next);
    ASSERT_EQ(v, static_cast<uint64_t>(step));
    auto report = server->Push(*store_, V(v), Diff(state, next));
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    EXPECT_TRUE(report->dropped.empty()) << report->dropped[0];
    for (auto& r : rxs) {
      Status s = r->rx->WaitFor(v, 10s);
      ASSERT_TRUE(s.ok()) << LayoutText(r->layout, r->rank) << ": " << s.message();
      ExpectHolds(*r, next);
      EXPECT_EQ(r->rx->GetStatus().version, v);
    }
    if (grow) {  // the step did change scales of the TP 2 receivers
      const auto o = Fp8Options(4, 4, rule);
      const State a = Expected(state, FusedReceiverLayout(2), 0, o);
      const State b = Expected(next, FusedReceiverLayout(2), 0, o);
      const std::string scale = "model.layers.1.mlp.down_proj.weight_scale_inv";
      EXPECT_NE(a.at(scale), b.at(scale));
    }
    state = std::move(next);
  }
  // Bytes written over the four steps, scales included: the FP8 receiver
  // of TP 2 rank 0 against the BF16 one.
  const PushReceiverStatus bf16 = rxs[0]->rx->GetStatus(), fp8 = rxs[3]->rx->GetStatus();
  EXPECT_GT(fp8.bytes, 0u);
  EXPECT_LT(fp8.bytes, bf16.bytes) << "FP8 " << fp8.bytes << " BF16 " << bf16.bytes;
}

INSTANTIATE_TEST_SUITE_P(Rules, PushFp8Rules,
                         ::testing::Values(Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo),
                         [](const ::testing::TestParamInfo<Fp8ScaleRule>& i) {
                           return std::string(i.param == Fp8ScaleRule::kPlain ? "Plain" : "Pow2");
                         });

// One receiver at v0 while the server is at v1, one that holds nothing
// (version unknown): both are told, catch up from the store (the version
// quantized and split) and take the next push.
TEST_F(PushFp8Test, ReceiversThatMissedPushesCatchUpToTheQuantizedVersion) {
  std::mt19937_64 rng(6);
  State v1 = Step(state_, 0.05, true, rng);
  ASSERT_EQ(Commit(v1), 1u);
  auto server = StartServer();  // latest: v1
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 1, Fp8Options(4, 4, Fp8ScaleRule::kPlain),
                         state_, 0, false));
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 0,
                         Fp8Options(4, 4, Fp8ScaleRule::kPowerOfTwo), state_, std::nullopt, false));
  rxs.push_back(Receiver(*server, {1, false, false}, 0,
                         PartialFp8Options(5, 7, Fp8ScaleRule::kPlain), state_, std::nullopt,
                         false));
  for (auto& r : rxs) {
    Status s = r->rx->WaitFor(1, 10s);
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.message();
    ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
    ExpectHolds(*r, v1);
    EXPECT_EQ(r->rx->GetStatus().version, 1u);
  }
  AwaitReceiversAt(*server, rxs.size(), 1);
  State v2 = Step(v1, 0.05, false, rng);
  ASSERT_EQ(Commit(v2), 2u);
  auto report = server->Push(*store_, V(2), Diff(v1, v2));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->pushed, rxs.size());
  for (auto& r : rxs) {
    ASSERT_TRUE(r->rx->WaitFor(2, 10s).ok());
    ExpectHolds(*r, v2);
  }
}

// FP8 receivers moved forward two versions, back to v0 and forward to v1
// by the store's deltas: each move writes only the E4M3 bytes and scales
// that differ, and every one ends equal to that version quantized (scales
// that grow included).
TEST_F(PushFp8Test, Fp8ReceiversMoveBackAndForwardToTheQuantizedVersion) {
  std::mt19937_64 rng(9);
  State v1 = Step(state_, 0.05, true, rng);
  ASSERT_EQ(Commit(v1), 1u);
  State v2 = Step(v1, 0.05, true, rng);
  ASSERT_EQ(Commit(v2), 2u);
  auto server = StartServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  for (int rank : {0, 1}) {
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), rank,
                           Fp8Options(4, 4, Fp8ScaleRule::kPowerOfTwo), state_, 0, false));
  }
  rxs.push_back(Receiver(*server, {1, false, false}, 0,
                         PartialFp8Options(5, 7, Fp8ScaleRule::kPlain), state_, 0, false));
  for (auto& r : rxs) {
    for (uint64_t target : {2u, 0u, 1u}) {
      ASSERT_TRUE(r->rx->MoveTo(*store_, target).ok());
      auto n = r->rx->ApplyPending();
      ASSERT_TRUE(n.ok()) << n.status().message();
      EXPECT_EQ(*n, target == 2 ? 2u : target == 0 ? 2u : 1u);
      ExpectHolds(*r, target == 2 ? v2 : target == 0 ? state_ : v1);
      EXPECT_EQ(r->rx->GetStatus().version, target);
    }
  }
}

// A version pushed from its records in the store (a distributed
// publisher's rank 0: differences over unknown old values, dense blocks
// compared), with no cache and one tensor per batch, so every tensor is
// read, its FP8 change set computed, and its data packed twice: the FP8
// receivers still equal the version.
TEST_F(PushFp8Test, ChangesReadBackFromTheStoreInTwoPassesPushTheQuantizedVersion) {
  auto server = StartTwoPassServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r,
                           Fp8Options(4, 4, Fp8ScaleRule::kPowerOfTwo), state_, 0));
  }
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 0, std::nullopt, state_, 0));
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(12);
  State state = state_;
  for (double density : {0.05, 0.7}) {
    State next = Step(state, density, density > 0.5, rng);
    const uint64_t v = Commit(next);
    auto source = StoreChanges(*store_, V(v));
    ASSERT_TRUE(source.ok()) << source.status().message();
    auto report = server->Push(*store_, V(v), **source);
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok());
      ExpectHolds(*r, next);
    }
    state = std::move(next);
  }
}

// A push in parts from two senders (a distributed publisher's ranks, each
// pushing the tensors it owns; each computes the FP8 change sets of its
// own): the FP8 receivers join the parts into one version equal to the
// quantized version. The senders swap their tensors at step 2 and back at
// step 3: a sender's summaries of a tensor another sender pushed since no
// longer describe it (its hash differs), and the tensor is read whole.
TEST_F(PushFp8Test, PartsFromTwoSendersMakeOneQuantizedVersion) {
  std::vector<std::unique_ptr<PushServer>> servers;
  std::vector<std::string> senders;
  for (int p = 0; p < 2; ++p) {
    servers.push_back(StartServer());
    ASSERT_TRUE(servers.back());
    ASSERT_TRUE(servers.back()->SetGroup(p, 2).ok());
    senders.push_back(servers.back()->address());
  }
  for (auto& s : servers) ASSERT_TRUE(s->SetSenders(senders).ok());
  std::vector<std::unique_ptr<Rx>> rxs;
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(Receiver(*servers[0], FusedReceiverLayout(2), r,
                           Fp8Options(4, 4, Fp8ScaleRule::kPlain), state_, 0));
  }
  for (auto& s : servers) AwaitReceivers(*s, rxs.size());
  std::mt19937_64 rng(14);
  State state = state_;
  for (int step = 1; step <= 3; ++step) {
    State next = Step(state, 0.05, step == 2, rng);
    const uint64_t v = Commit(next);
    std::vector<std::vector<TensorChanges>> mine(2);
    for (TensorChanges& c : Diff(state, next)) {
      const size_t k = std::find_if(specs_.begin(), specs_.end(),
                                    [&](const PlanTensor& t) { return t.name == c.name; }) -
                       specs_.begin();
      mine[(k + (step == 2)) % 2].push_back(std::move(c));
    }
    std::vector<Result<PushReport>> reports(2, Internal("not run"));
    std::vector<std::thread> threads;
    for (int p = 0; p < 2; ++p) {
      threads.emplace_back([&, p] { reports[p] = servers[p]->Push(*store_, V(v), mine[p]); });
    }
    for (auto& t : threads) t.join();
    for (auto& rep : reports) {
      ASSERT_TRUE(rep.ok()) << rep.status().message();
      EXPECT_EQ(rep->pushed, rxs.size());
    }
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok());
      ExpectHolds(*r, next);
    }
    state = std::move(next);
  }
}

// The tensors an FP8 receiver of `layout`/`rank` declares with blocks of
// `block`: every projection weight F8_E4M3 with its scales, the rest as the
// plan has them; `keep` owns the memory.
std::vector<PushTensor> Fp8Tensors(const TransferPlan& plan, int rank, uint64_t block,
                                   std::vector<Bytes>* keep) {
  std::vector<PushTensor> out;
  keep->reserve(2 * plan.receiver_tensors[rank].size());
  for (const PlanTensor& t : plan.receiver_tensors[rank]) {
    const bool fp8 = transfer_test::EndsWith(t.name, "proj.weight");
    const DType dtype = fp8 ? DType::kF8E4M3 : t.dtype;
    keep->emplace_back(ShapeElements(t.shape) * DTypeWidth(dtype));
    out.push_back({t.name, dtype, t.shape, keep->back().data()});
    if (!fp8) continue;
    const std::vector<uint64_t> grid = {(t.shape[0] + block - 1) / block,
                                        (t.shape[1] + block - 1) / block};
    keep->emplace_back(ShapeElements(grid) * 4);
    out.push_back({Fp8ScaleName(t.name), DType::kF32, grid, keep->back().data()});
  }
  return out;
}

// Blocks of 8 x 8 against TP 2, whose ranks take 4 rows of each k_proj:
// the hello is refused naming the tensor, the split and the block.
TEST_F(PushFp8Test, SplitsOffTheBlockBoundariesAreRefusedNamingTensorSplitAndBlock) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto plan = MakeTransferPlan(specs_, config_.Geometry(), ShardLayout{1, false, false},
                               FusedReceiverLayout(2));
  ASSERT_TRUE(plan.ok());
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(server->port());
  o.rank = 1;
  o.layout = FusedReceiverLayout(2);
  o.version = 0;
  o.fp8 = Fp8Options(8, 8, Fp8ScaleRule::kPlain);
  std::vector<Bytes> keep;
  o.tensors = Fp8Tensors(*plan, 1, 8, &keep);
  auto rx = PushReceiver::Open(o);
  ASSERT_TRUE(rx.ok()) << rx.status().message();
  Status s = (*rx)->WaitFor(1, 10s);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  for (const char* part : {"refused", "model.layers.0.self_attn.k_proj.weight", "tp=2",
                           "rows [4, 8) of 8", "FP8 block 8"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
  }
  EXPECT_TRUE(server->Receivers().empty());
  // A receiver that lists an FP8 tensor without its scales is refused at
  // once, naming it.
  o.tensors.erase(o.tensors.begin() + 3);  // qkv_proj.weight_scale_inv of layer 0
  auto bad = PushReceiver::Open(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("qkv_proj.weight_scale_inv"), std::string::npos)
      << bad.status().message();
}

// A version whose shapes no longer split on block boundaries (a new
// model with an intermediate size of 20: TP 2 ranks take 10 rows of
// gate_proj): the FP8 receiver's catch-up is refused naming the tensor and
// the block, keeping the version it had, and the server, told of the
// version, drops it and refuses its next hello the same way.
TEST_F(PushFp8Test, AVersionWhoseLayoutChangedUnderAReceiverIsRefused) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  auto r = Receiver(*server, FusedReceiverLayout(2), 0, Fp8Options(4, 4, Fp8ScaleRule::kPlain),
                    state_, 0);
  AwaitReceivers(*server, 1);
  config_.intermediate = 20;
  specs_ = transfer_test::ModelSpecs(config_);
  std::mt19937_64 rng(8);
  ASSERT_EQ(Commit(RandomState(rng)), 1u);
  Status caught = r->rx->CatchUp(*store_, 1);
  EXPECT_EQ(caught.code(), Code::kInvalidArgument) << caught.message();
  EXPECT_NE(caught.message().find("mlp.gate_proj.weight"), std::string::npos) << caught.message();
  EXPECT_EQ(r->rx->GetStatus().version, 0u);
  EXPECT_FALSE(r->rx->GetStatus().inconsistent);
  ASSERT_TRUE(server->SetLatest(*store_, V(1)).ok());
  Status s = r->rx->WaitFor(1, 10s);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  for (const char* part : {"refused", "mlp.gate_proj.weight", "FP8 block 4"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in: " << s.message();
  }
  EXPECT_TRUE(server->Receivers().empty());
  EXPECT_EQ(r->rx->GetStatus().version, 0u);
}

// A server that sends an FP8 receiver entries of the wrong kind or out of
// bounds: each push is refused whole, naming the tensor, and nothing is
// written. The receiver reconnects after each refusal.
TEST_F(PushFp8Test, MalformedFp8PushIsRefusedBeforeAnyByteIsWritten) {
  using push_internal::EntryKind;
  using push_internal::Msg;
  int port = 0;
  auto listen = transport_internal::ListenTcp("127.0.0.1:0", 4, &port);
  ASSERT_TRUE(listen.ok());
  std::vector<uint8_t> w(32, 0x11);       // m.weight: F8_E4M3 4 x 8
  std::vector<float> scale(2, 1.0f);      // m.weight_scale_inv: blocks of 4 x 4
  std::vector<uint16_t> bias(8, 0x3F80);  // b.bias: BF16
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.version = 4;
  o.reconnect = 10ms;
  o.fp8 = Fp8Options(4, 4, Fp8ScaleRule::kPlain);
  o.tensors = {{"m.weight", DType::kF8E4M3, {4, 8}, w.data()},
               {"m.weight_scale_inv", DType::kF32, {1, 2}, scale.data()},
               {"b.bias", DType::kBF16, {8}, bias.data()}};
  auto rx = PushReceiver::Open(o);
  ASSERT_TRUE(rx.ok()) << rx.status().message();
  const uint64_t pos[] = {0, 1};
  const uint8_t bytes[] = {0x20, 0x21};
  const float scales[] = {2.0f};
  auto seg = [&](const uint64_t* dst, size_t n, int width, const void* vals) {
    std::string out;
    push_internal::AppendOpSegments(dst, pos, n, width, static_cast<const uint8_t*>(vals), nullptr,
                                    nullptr, &out);
    return out;
  };
  const uint64_t at3_9[] = {3, 9}, at2[] = {2};
  struct Case {
    Msg type;
    push_internal::CountsMsg counts;
    std::string data, error;
  };
  const std::vector<Case> cases = {
      {Msg::kCountsFp8,
       {5, 4, 0, 1, {0, 1}, {0, 2}, {2, 1}, {EntryKind::kFp8Bytes, EntryKind::kFp8Bytes}},
       seg(at3_9, 2, 1, bytes) + seg(at3_9, 1, 1, bytes),
       "writes FP8 bytes into tensor b.bias (BF16), which holds elements"},
      {Msg::kCounts,
       {5, 4, 0, 1, {0}, {0}, {2}, {}},
       seg(at3_9, 2, 1, bytes),
       "writes elements into tensor m.weight (F8_E4M3), which holds FP8 bytes"},
      {Msg::kCountsFp8,
       {5, 4, 0, 1, {0, 0}, {0, 1}, {2, 1}, {EntryKind::kFp8Bytes, EntryKind::kFp8Scales}},
       seg(at3_9, 2, 1, bytes) + seg(at2, 1, 4, scales),
       "tensor m.weight_scale_inv: segment at element 2 spanning 1 with 1 entries does not fit "
       "the tensor of 2 elements"},
  };
  for (const Case& c : cases) {
    transport_internal::Deadline d(10s);
    auto conn = transport_internal::AcceptOne(listen->get(), d, "the receiver");
    ASSERT_TRUE(conn.ok()) << conn.status().message();
    auto hello = push_internal::RecvFrame(conn->get(), 1 << 20, d, "receiver");
    ASSERT_TRUE(hello.ok() && hello->type == Msg::kHello);
    auto j = nlohmann::json::parse(hello->body);
    EXPECT_EQ(j["fp8"]["block"], nlohmann::json({4, 4}));
    EXPECT_EQ(j["fp8"]["scale_rule"], "plain");
    const std::string frames = push_internal::Frame(Msg::kWelcome, "{\"latest\": 4}") +
                               push_internal::Frame(c.type, push_internal::EncodeCounts(c.counts)) +
                               push_internal::Frame(Msg::kData, c.data) +
                               push_internal::Frame(Msg::kDataEnd, "");
    ASSERT_TRUE(
        transport_internal::SendAll(conn->get(), frames.data(), frames.size(), d, "rx").ok());
    auto answer = push_internal::RecvFrame(conn->get(), 1 << 20, d, "receiver");
    ASSERT_TRUE(answer.ok()) << answer.status().message();
    EXPECT_EQ(answer->type, Msg::kError);
    EXPECT_NE(answer->body.find(c.error), std::string::npos) << answer->body;
    for (uint8_t x : w) ASSERT_EQ(x, 0x11);
    for (float x : scale) ASSERT_EQ(x, 1.0f);
    for (uint16_t x : bias) ASSERT_EQ(x, 0x3F80);
    EXPECT_EQ((*rx)->GetStatus().version, 4u);
  }
}

// FP8 receivers in GPU memory: a catch-up into them and pushes written
// there by the CUDA kernel (1-byte E4M3 and 4-byte scale entries), read
// back after every version.
TEST_F(PushFp8Test, CudaFp8ReceiversEqualTheQuantizedVersion) {
  if (!kernels::CudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device here: FP8 pushes into GPU memory need one "
                    "(tools/gpu_check.sh runs this test on a GPU host)";
  }
  auto server = StartServer();
  ASSERT_TRUE(server);
  const auto fp8 = Fp8Options(4, 4, Fp8ScaleRule::kPowerOfTwo);
  std::vector<kernels::CudaBuffer> buffers;
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(server->port());
  o.rank = 1;
  o.layout = FusedReceiverLayout(2);
  o.timeout = 10s;
  o.fp8 = fp8;
  auto plan = MakeTransferPlan(specs_, config_.Geometry(), ShardLayout{1, false, false},
                               FusedReceiverLayout(2));
  ASSERT_TRUE(plan.ok());
  std::vector<Bytes> keep;
  std::vector<PushTensor> tensors = Fp8Tensors(*plan, 1, 4, &keep);
  for (PushTensor& t : tensors) {
    const size_t bytes = ShapeElements(t.shape) * DTypeWidth(t.dtype);
    buffers.emplace_back();
    ASSERT_TRUE(buffers.back().Allocate(bytes).ok());
    std::vector<uint8_t> zeros(bytes, 0);
    ASSERT_TRUE(kernels::CudaCopyToDevice(buffers.back().data(), zeros.data(), bytes).ok());
    t.data = buffers.back().data();
    t.device = 0;
  }
  o.tensors = tensors;
  auto rx = PushReceiver::Open(o);
  ASSERT_TRUE(rx.ok()) << rx.status().message();
  auto expect = [&](const State& state) {
    const State want = Expected(state, FusedReceiverLayout(2), 1, fp8);
    for (size_t i = 0; i < tensors.size(); ++i) {
      Bytes got(want.at(tensors[i].name).size());
      ASSERT_TRUE(kernels::CudaCopyToHost(got.data(), buffers[i].data(), got.size()).ok());
      ASSERT_TRUE(got == want.at(tensors[i].name)) << tensors[i].name << " differs";
    }
  };
  ASSERT_EQ((*rx)->WaitFor(0, 10s).code(), Code::kFailedPrecondition);
  ASSERT_TRUE((*rx)->CatchUp(*store_, std::nullopt).ok());
  expect(state_);
  ASSERT_TRUE(test::WaitFor([&] {
    auto infos = server->Receivers();
    return infos.size() == 1 && infos[0].version == 0u;
  }));
  std::mt19937_64 rng(9);
  State state = state_;
  for (int step = 1; step <= 2; ++step) {
    State next = Step(state, 0.05, step == 2, rng);
    const uint64_t v = Commit(next);
    auto report = server->Push(*store_, V(v), Diff(state, next));
    ASSERT_TRUE(report.ok());
    ASSERT_TRUE((*rx)->WaitFor(v, 10s).ok());
    expect(next);
    state = std::move(next);
  }
}

}  // namespace
}  // namespace dte::push_fp8_test

namespace dte {
namespace {

// The FP8 counts message round-trips its kinds; an unknown kind or kinds
// out of order are refused.
TEST(PushWire, Fp8CountsCarryTheirKinds) {
  using push_internal::EntryKind;
  using push_internal::Msg;
  push_internal::CountsMsg m{
      7,          6,
      1,          2,
      {3, 3, 5},  {0, 9, 1},
      {10, 2, 4}, {EntryKind::kFp8Bytes, EntryKind::kFp8Scales, EntryKind::kElements}};
  const std::string body = push_internal::EncodeCounts(m);
  EXPECT_EQ(body.size(), 32u + 3 * 24);
  auto back = push_internal::DecodeCounts(Msg::kCountsFp8, body, "server");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->op, m.op);
  EXPECT_EQ(back->tensor, m.tensor);
  EXPECT_EQ(back->count, m.count);
  EXPECT_EQ(back->kind, m.kind);
  std::string bad = body;
  bad[32 + 16] = 7;  // entry 0's kind
  EXPECT_EQ(push_internal::DecodeCounts(Msg::kCountsFp8, bad, "server").status().code(),
            Code::kCorruption);
  std::swap(m.kind[0], m.kind[1]);  // scales before bytes of op 3
  EXPECT_EQ(push_internal::DecodeCounts(Msg::kCountsFp8, push_internal::EncodeCounts(m), "server")
                .status()
                .code(),
            Code::kCorruption);
  // A receiver of the first wire reads a plain counts message as before.
  m.kind.clear();
  m.op = {1, 2, 3};
  auto plain = push_internal::DecodeCounts(Msg::kCounts, push_internal::EncodeCounts(m), "server");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->kind.empty());
}

}  // namespace
}  // namespace dte
