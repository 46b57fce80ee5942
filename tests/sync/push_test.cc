// Same-cluster push (sync/push/push_server.h): a PushServer and PushReceivers of several
// layouts in one process, over real loopback TCP. Receivers' buffers are
// compared with a sharding of each committed version written with plain
// row and column slicing (tests/sync/transfer_test_util.h), not with the
// plan's box math. Faults use raw sockets that speak the wire format
// (sync/push/internal/push_wire.h) wrongly or not at all.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/cuda.h"
#include "store/ops/commit.h"
#include "store/store.h"
#include "sync/publish/publisher.h"
#include "sync/push/changes.h"
#include "sync/push/internal/push_wire.h"
#include "sync/push/push_receiver.h"
#include "sync/push/push_server.h"
#include "sync/transport/socket.h"
#include "tests/sync/push_test_util.h"
#include "tests/sync/transfer_test_util.h"
#include "tests/testutil/adamw_state.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/wait.h"

namespace dte {
namespace {

using namespace std::chrono_literals;
using transfer_test::Bytes;
using transfer_test::ModelConfig;
using transfer_test::State;

// One receiver: its layout, rank, buffers (by local name) and the receiver.
struct Rx {
  ShardLayout layout;
  int rank = 0;
  State buffers;
  std::unique_ptr<PushReceiver> rx;
};

class PushTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(11);
    std::tie(specs_, state_) = transfer_test::RandomModel(config_, rng);
    store_ = test::OpenTestStore(tmp_.path() + "/store");
    ASSERT_TRUE(store_);
    Commit(state_);
  }

  // Commits `state` as the next version.
  uint64_t Commit(const State& state) {
    const std::string dir = tmp_.path() + "/ckpt" + std::to_string(dirs_++);
    return push_test::CommitState(*store_, config_, specs_, state, dir);
  }

  std::shared_ptr<const Version> V(uint64_t version) {
    return push_test::GetVersion(*store_, version);
  }

  std::vector<TensorChanges> Diff(const State& a, const State& b, bool with_old = true) {
    return push_test::Diff(specs_, a, b, with_old);
  }

  std::unique_ptr<PushServer> StartServer(std::chrono::milliseconds timeout = 10s,
                                          PushServerOptions o = {}) {
    o.timeout = timeout;
    if (o.secret.empty()) o.secret = secret_;
    return push_test::StartServer(*store_, o);
  }

  // A receiver of `layout`/`rank` whose buffers hold `state` as `version`.
  // With `server`: a rank of that server of layout.tp ranks.
  std::unique_ptr<Rx> Receiver(const PushServer& server, ShardLayout layout, int rank,
                               const State& state, uint64_t version, bool auto_apply,
                               const std::string& in_server = "") {
    auto r = std::make_unique<Rx>();
    r->layout = layout;
    r->rank = rank;
    r->buffers = transfer_test::ShardModel(config_, specs_, state, layout, rank);
    PushReceiverOptions o = push_test::ReceiverOptions(server, layout, rank, version, auto_apply);
    o.secret = secret_;
    o.server = in_server;
    o.server_size = in_server.empty() ? 1 : layout.tp;
    for (const PlanTensor& t : push_test::ReceiverTensors(config_, specs_, layout, rank)) {
      o.tensors.push_back({t.name, t.dtype, t.shape, r->buffers.at(t.name).data()});
    }
    r->rx = push_test::OpenReceiver(o);
    return r;
  }

  void ExpectHolds(const Rx& r, const State& state) {
    const State want = transfer_test::ShardModel(config_, specs_, state, r.layout, r.rank);
    for (const auto& [name, bytes] : want) {
      ASSERT_TRUE(r.buffers.at(name) == bytes)
          << LayoutText(r.layout, r.rank) << ": tensor " << name << " differs";
    }
  }

  // Waits until the server lists `n` receivers past their hello.
  void AwaitReceivers(const PushServer& s, size_t n) {
    ASSERT_TRUE(test::WaitFor([&] { return s.Receivers().size() >= n; }))
        << s.Receivers().size() << " receivers listed, not " << n;
    ASSERT_EQ(s.Receivers().size(), n);
  }

  std::string secret_;  // the job secret of servers and receivers (empty: none)
  ModelConfig config_;
  std::vector<PlanTensor> specs_;
  State state_;
  test::ScopedTempDir tmp_;
  int dirs_ = 0;
  std::unique_ptr<Store> store_;
};

// A ChangesSource over another that records the tensors read; with
// drop_on_second_read, a tensor's second read loses its last entry.
struct Recording : ChangesSource {
  explicit Recording(ChangesSource& inner) : inner(inner) {}
  bool MayChange(const std::string& name) const override { return inner.MayChange(name); }
  Result<const TensorChanges*> Read(const std::string& name) override {
    const bool again = std::count(reads.begin(), reads.end(), name) > 0;
    reads.push_back(name);
    ASSIGN_OR_RETURN(const TensorChanges* c, inner.Read(name));
    if (!again || !drop_on_second_read || c->indices.empty()) return c;
    copy = *c;
    const size_t w = copy.values.size() / copy.indices.size();
    copy.indices.pop_back();
    copy.values.resize(copy.values.size() - w);
    if (!copy.old_values.empty()) copy.old_values.resize(copy.old_values.size() - w);
    if (!copy.known.empty()) copy.known.pop_back();
    return &copy;
  }
  ChangesSource& inner;
  std::vector<std::string> reads;
  bool drop_on_second_read = false;
  TensorChanges copy;
};

TEST_F(PushTest, ReceiversOfEveryLayoutHoldEachVersionBitForBit) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, {1, false, false}, 0, state_, 0, true));
  for (int r = 0; r < 2; ++r)
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r, state_, 0, false));
  // tp 4 > 2 kv heads: each rank holds one replicated kv head.
  for (int r = 0; r < 4; ++r)
    rxs.push_back(Receiver(*server, FusedReceiverLayout(4), r, state_, 0, r % 2 == 0));
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(5);
  State state = state_;
  for (int step = 1; step <= 3; ++step) {
    State next = transfer_test::RandomChange(specs_, state, 0.05, rng);
    const uint64_t v = Commit(next);
    ASSERT_EQ(v, static_cast<uint64_t>(step));
    // Step 2 sends whole values, as for elements whose old bits the
    // publisher could not prove.
    auto report = server->Push(*store_, V(v), Diff(state, next, /*with_old=*/step != 2));
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    EXPECT_TRUE(report->dropped.empty()) << report->dropped[0];
    EXPECT_GT(report->elements, 0u);
    for (auto& r : rxs) {
      Status s = r->rx->WaitFor(v, 10s);
      ASSERT_TRUE(s.ok()) << LayoutText(r->layout, r->rank) << ": " << s.message();
      ExpectHolds(*r, next);
      EXPECT_EQ(r->rx->GetStatus().version, v);
    }
    state = std::move(next);
  }
  for (const PushReceiverInfo& info : server->Receivers()) EXPECT_EQ(info.version, 3u);
}

// With a job secret every connection authenticates first; the pushes are
// the same (strangers: tests/sync/auth_test.cc).
TEST_F(PushTest, ReceiversWithTheJobSecretHoldEachVersionFromAServerOnEveryInterface) {
  secret_ = "push-test-job-secret-0123456789";
  PushServerOptions o;
  o.address = "0.0.0.0:0";
  auto server = StartServer(10s, o);
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  for (int r = 0; r < 2; ++r)
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r, state_, 0, r == 0));
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(9);
  State next = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  const uint64_t v = Commit(next);
  auto report = server->Push(*store_, V(v), Diff(state_, next));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->pushed, rxs.size());
  for (auto& r : rxs) {
    ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok());
    ExpectHolds(*r, next);
  }
  EXPECT_EQ(server->refused(), 0u);
}

TEST_F(PushTest, ReceiverThatMissedAPushIsToldAndCatchesUpFromTheStore) {
  std::mt19937_64 rng(6);
  State v1 = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  ASSERT_EQ(Commit(v1), 1u);
  auto server = StartServer();  // latest: v1
  ASSERT_TRUE(server);
  auto r = Receiver(*server, FusedReceiverLayout(2), 1, state_, /*version=*/0, false);
  Status s = r->rx->WaitFor(1, 10s);
  EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.message();
  EXPECT_NE(s.message().find("catch up"), std::string::npos) << s.message();
  EXPECT_EQ(r->rx->GetStatus().behind, 1u);
  ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
  ExpectHolds(*r, v1);
  EXPECT_EQ(r->rx->GetStatus().version, 1u);
  // The server hears of it and pushes the next version.
  ASSERT_TRUE(test::WaitFor([&] {
    auto rs = server->Receivers();
    return rs.size() == 1 && rs[0].version == 1u && !rs[0].behind;
  })) << server->StatusJson();
  State v2 = transfer_test::RandomChange(specs_, v1, 0.05, rng);
  ASSERT_EQ(Commit(v2), 2u);
  auto report = server->Push(*store_, V(2), Diff(v1, v2));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->pushed, 1u);
  ASSERT_TRUE(r->rx->WaitFor(2, 10s).ok());
  ExpectHolds(*r, v2);
}

TEST_F(PushTest, StalledReceiverIsDroppedAndThePushCompletes) {
  auto server = StartServer(/*timeout=*/500ms);
  ASSERT_TRUE(server);
  auto good = Receiver(*server, {1, false, false}, 0, state_, 0, true);
  // A receiver that says hello and then reads nothing and confirms nothing.
  transport_internal::Deadline d(5s);
  auto fd =
      transport_internal::ConnectTcp("127.0.0.1:" + std::to_string(server->port()), d, "server");
  ASSERT_TRUE(fd.ok()) << fd.status().message();
  nlohmann::json hello = {
      {"rank", 0}, {"tp", 1}, {"version", 0}, {"tensors", nlohmann::json::array()}};
  auto plan = MakeTransferPlan(specs_, config_.Geometry(), ShardLayout{1, false, false},
                               ShardLayout{1, false, false});
  for (const PlanTensor& t : plan->receiver_tensors[0]) {
    hello["tensors"].push_back(
        {{"name", t.name}, {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}});
  }
  const std::string f = push_internal::Frame(push_internal::Msg::kHello, hello.dump());
  ASSERT_TRUE(transport_internal::SendAll(fd->get(), f.data(), f.size(), d, "server").ok());
  AwaitReceivers(*server, 2);
  std::mt19937_64 rng(7);
  State next = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  ASSERT_EQ(Commit(next), 1u);
  auto report = server->Push(*store_, V(1), Diff(state_, next));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->pushed, 1u);
  ASSERT_EQ(report->dropped.size(), 1u);
  EXPECT_NE(report->dropped[0].find("did not confirm v00000001"), std::string::npos)
      << report->dropped[0];
  EXPECT_LT(report->seconds, 5.0);
  ASSERT_TRUE(good->rx->WaitFor(1, 10s).ok());
  ExpectHolds(*good, next);
  EXPECT_EQ(server->Receivers().size(), 1u);
}

// Each of `servers` (the senders of one push in parts) pushes the tensors it
// owns (tensor k of `specs`: part k % servers), all at once; `skip` sends
// nothing. Returns each part's report.
std::vector<Result<PushReport>> PushParts(const std::vector<std::unique_ptr<PushServer>>& servers,
                                          Store& store, const std::shared_ptr<const Version>& v,
                                          const std::vector<PlanTensor>& specs,
                                          const std::vector<TensorChanges>& all, int skip) {
  const int parts = static_cast<int>(servers.size());
  std::vector<std::vector<TensorChanges>> mine(parts);
  for (const TensorChanges& c : all) {
    const size_t k = std::find_if(specs.begin(), specs.end(),
                                  [&](const PlanTensor& t) { return t.name == c.name; }) -
                     specs.begin();
    mine[k % parts].push_back(c);
  }
  std::vector<Result<PushReport>> reports(parts, Internal("not run"));
  std::vector<std::thread> threads;
  for (int p = 0; p < parts; ++p) {
    if (p == skip) continue;
    threads.emplace_back([&, p] { reports[p] = servers[p]->Push(store, v, mine[p]); });
  }
  for (auto& t : threads) t.join();
  return reports;
}

// A push in parts from three senders (the ranks of a distributed
// publisher, each sending the tensors it owns): receivers connect to part
// 0's server, are told of the others, and hold each version whole once every
// part is in. A sender that never sends its part (a dead rank) leaves them
// at the version they had, whole; they catch up from the store and the next
// push in three parts lands.
TEST_F(PushTest, PartsFromEverySenderMakeOneVersionAndAMissingPartChangesNothing) {
  constexpr int kParts = 3;
  std::vector<std::unique_ptr<PushServer>> servers;
  std::vector<std::string> senders;
  PushServerOptions options;
  options.receivers = 3;  // the three receivers below
  for (int p = 0; p < kParts; ++p) {
    servers.push_back(StartServer(/*timeout=*/1500ms, options));
    ASSERT_TRUE(servers.back());
    ASSERT_TRUE(servers.back()->SetGroup(p, kParts).ok());
    senders.push_back(servers.back()->address());
  }
  EXPECT_EQ(senders[1], "127.0.0.1:" + std::to_string(servers[1]->port()));
  EXPECT_EQ(servers[0]->SetSenders({senders[0]}).code(), Code::kInvalidArgument);
  std::vector<std::unique_ptr<Rx>> rxs;
  // Connected before part 0 knows the senders: its hello waits for them.
  // The server's event for the held hello proves it read the hello; from
  // then on an answer would already list the receiver.
  rxs.push_back(Receiver(*servers[0], {1, false, false}, 0, state_, 0, true));
  std::string events;
  ASSERT_TRUE(test::WaitFor([&] {
    for (const std::string& e : servers[0]->TakeEvents()) events += e + "\n";
    return events.find("waits for the push senders") != std::string::npos;
  })) << "no held hello; events:\n"
      << events;
  EXPECT_TRUE(servers[0]->Receivers().empty());
  EXPECT_FALSE(rxs[0]->rx->GetStatus().connected);
  ASSERT_TRUE(servers[0]->SetSenders(senders).ok());
  for (int r = 0; r < 2; ++r)
    rxs.push_back(Receiver(*servers[0], FusedReceiverLayout(2), r, state_, 0, r == 0));
  for (auto& s : servers) AwaitReceivers(*s, rxs.size());
  for (auto& r : rxs) {
    EXPECT_TRUE(test::WaitFor([&] { return r->rx->GetStatus().connected; }))
        << LayoutText(r->layout, r->rank) << ": not connected";
  }

  auto push_parts = [&](uint64_t v, const std::vector<TensorChanges>& all, int skip) {
    return PushParts(servers, *store_, V(v), specs_, all, skip);
  };

  std::mt19937_64 rng(21);
  State state = state_;
  uint64_t written_before = 0;
  for (int step = 1; step <= 2; ++step) {
    uint64_t written = 0;
    State next = transfer_test::RandomChange(specs_, state, 0.05, rng);
    const uint64_t v = Commit(next);
    auto reports = push_parts(v, Diff(state, next), /*skip=*/-1);
    uint64_t elements = 0;
    for (int p = 0; p < kParts; ++p) {
      ASSERT_TRUE(reports[p].ok()) << reports[p].status().message();
      EXPECT_EQ(reports[p]->pushed, rxs.size()) << "part " << p;
      EXPECT_TRUE(reports[p]->dropped.empty()) << reports[p]->dropped[0];
      EXPECT_GT(reports[p]->elements, 0u) << "part " << p;
      EXPECT_EQ(reports[p]->missing, 0u) << "part " << p;
      elements += reports[p]->elements;
    }
    for (auto& r : rxs) {
      Status s = r->rx->WaitFor(v, 10s);
      ASSERT_TRUE(s.ok()) << LayoutText(r->layout, r->rank) << ": " << s.message();
      ExpectHolds(*r, next);
      written += r->rx->GetStatus().elements;
    }
    // What the parts sent is what the receivers wrote, each element once.
    EXPECT_EQ(written - written_before, elements);
    written_before = written;
    state = std::move(next);
  }

  // Part 2's sender is gone: parts 0 and 1 are never confirmed, and every
  // receiver keeps v2 whole.
  State v3 = transfer_test::RandomChange(specs_, state, 0.05, rng);
  ASSERT_EQ(Commit(v3), 3u);
  auto reports = push_parts(3, Diff(state, v3), /*skip=*/2);
  for (int p = 0; p < 2; ++p) {
    ASSERT_TRUE(reports[p].ok()) << reports[p].status().message();
    EXPECT_EQ(reports[p]->pushed, 0u);
    EXPECT_EQ(reports[p]->missing, 3u);
    EXPECT_EQ(reports[p]->dropped.size(), rxs.size());
  }
  for (auto& r : rxs) {
    Status s = r->rx->WaitFor(3, 10s);
    EXPECT_EQ(s.code(), Code::kFailedPrecondition) << s.message();
    EXPECT_EQ(r->rx->GetStatus().version, 2u);
    EXPECT_FALSE(r->rx->GetStatus().inconsistent);
    ExpectHolds(*r, state);
    ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
    ExpectHolds(*r, v3);
  }
  // Every sender hears of v3 (part 2's sender restarted at v3, say).
  ASSERT_TRUE(servers[2]->SetLatest(*store_, V(3)).ok());
  for (auto& s : servers) {
    ASSERT_TRUE(test::WaitFor([&] {
      auto infos = s->Receivers();
      return infos.size() == rxs.size() &&
             std::all_of(infos.begin(), infos.end(),
                         [](const PushReceiverInfo& x) { return x.version == 3u && !x.behind; });
    })) << s->StatusJson();
  }
  State v4 = transfer_test::RandomChange(specs_, v3, 0.05, rng);
  ASSERT_EQ(Commit(v4), 4u);
  reports = push_parts(4, Diff(v3, v4), /*skip=*/-1);
  for (int p = 0; p < kParts; ++p) {
    ASSERT_TRUE(reports[p].ok()) << reports[p].status().message();
    EXPECT_EQ(reports[p]->pushed, rxs.size())
        << "part " << p << ": " << PushReportJson(*reports[p]) << " " << servers[p]->StatusJson();
  }
  for (auto& r : rxs) {
    ASSERT_TRUE(r->rx->WaitFor(4, 10s).ok());
    ExpectHolds(*r, v4);
  }
}

TEST_F(PushTest, ReceiverWhoseTensorsDoNotFitThePlanIsRefusedNamingTheTensor) {
  auto server = StartServer();
  ASSERT_TRUE(server);
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(server->port());
  o.layout = FusedReceiverLayout(2);
  std::vector<uint8_t> buf(1 << 16);
  o.tensors.push_back(
      {"model.layers.0.self_attn.qkv_proj.weight", DType::kBF16, {7, 16}, buf.data()});
  auto rx = PushReceiver::Open(o);
  ASSERT_TRUE(rx.ok());
  Status s = (*rx)->WaitFor(1, 10s);
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find("refused"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("qkv_proj"), std::string::npos) << s.message();
  EXPECT_TRUE(server->Receivers().empty());
}

// Receivers whose tensors live in GPU memory: a catch-up into them and
// pushes applied there by the CUDA kernel, read back after every version.
TEST_F(PushTest, CudaReceiversHoldEachVersionBitForBit) {
  if (!kernels::CudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device here: pushes into GPU memory need one (tools/gpu_check.sh "
                    "runs this test on a GPU host)";
  }
  auto server = StartServer();
  ASSERT_TRUE(server);
  const ShardLayout layout = FusedReceiverLayout(2);
  auto plan = MakeTransferPlan(specs_, config_.Geometry(), ShardLayout{1, false, false}, layout);
  ASSERT_TRUE(plan.ok());
  struct DeviceRx {
    std::vector<kernels::CudaBuffer> buffers;
    std::unique_ptr<PushReceiver> rx;
  };
  std::vector<DeviceRx> rxs(2);
  for (int r = 0; r < 2; ++r) {
    PushReceiverOptions o;
    o.address = "127.0.0.1:" + std::to_string(server->port());
    o.rank = r;
    o.layout = layout;
    o.timeout = 10s;
    for (const PlanTensor& t : plan->receiver_tensors[r]) {
      kernels::CudaBuffer b;
      const size_t bytes = ShapeElements(t.shape) * DTypeWidth(t.dtype);
      ASSERT_TRUE(b.Allocate(bytes).ok());
      std::vector<uint8_t> zeros(bytes, 0);  // padding rows stay zero, as in ShardModel
      ASSERT_TRUE(kernels::CudaCopyToDevice(b.data(), zeros.data(), bytes).ok());
      o.tensors.push_back({t.name, t.dtype, t.shape, b.data(), 0});
      rxs[r].buffers.push_back(std::move(b));
    }
    auto rx = PushReceiver::Open(o);  // no version: it catches up to v0
    ASSERT_TRUE(rx.ok()) << rx.status().message();
    rxs[r].rx = std::move(rx).value();
  }
  auto expect = [&](int r, const State& state, uint64_t v) {
    const State want = transfer_test::ShardModel(config_, specs_, state, layout, r);
    const auto& tensors = plan->receiver_tensors[r];
    for (size_t i = 0; i < tensors.size(); ++i) {
      Bytes got(want.at(tensors[i].name).size());
      ASSERT_TRUE(kernels::CudaCopyToHost(got.data(), rxs[r].buffers[i].data(), got.size()).ok());
      ASSERT_TRUE(got == want.at(tensors[i].name))
          << "rank " << r << " tensor " << tensors[i].name << " differs at " << VersionName(v);
    }
  };
  for (int r = 0; r < 2; ++r) {
    Status s = rxs[r].rx->WaitFor(0, 10s);
    ASSERT_EQ(s.code(), Code::kFailedPrecondition) << s.message();
    ASSERT_TRUE(rxs[r].rx->CatchUp(*store_, std::nullopt).ok());
    expect(r, state_, 0);
  }
  ASSERT_TRUE(test::WaitFor([&] {
    auto infos = server->Receivers();
    return infos.size() == 2 && infos[0].version == 0u && infos[1].version == 0u;
  })) << server->StatusJson();
  std::mt19937_64 rng(9);
  State state = state_;
  for (int step = 1; step <= 2; ++step) {
    State next = transfer_test::RandomChange(specs_, state, 0.05, rng);
    const uint64_t v = Commit(next);
    auto report = server->Push(*store_, V(v), Diff(state, next, /*with_old=*/step == 1));
    ASSERT_TRUE(report.ok());
    EXPECT_EQ(report->pushed, 2u) << (report->dropped.empty() ? "" : report->dropped[0]);
    for (int r = 0; r < 2; ++r) {
      Status s = rxs[r].rx->WaitFor(v, 10s);
      ASSERT_TRUE(s.ok()) << s.message();
      expect(r, next, v);
    }
    state = std::move(next);
  }
}

// A distributed publisher's rank 0 pushes a version from its stored
// records: sparse blocks as recorded, dense ones (a step that changed most
// of a block) compared with the parent. Receivers end up at the version.
TEST_F(PushTest, ChangesReadBackFromTheStorePushTheVersionWhole) {
  // No cache: every tensor read twice (counts, then data); one tensor per
  // batch: round 2 in many data frames.
  PushServerOptions no_cache;
  no_cache.cache_bytes = 0;
  no_cache.batch_entries = 1;
  auto server = StartServer(10s, no_cache);
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, {1, false, false}, 0, state_, 0, true));
  for (int r = 0; r < 2; ++r) {
    rxs.push_back(Receiver(*server, FusedReceiverLayout(2), r, state_, 0, true));
  }
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(12);
  State state = state_;
  for (double density : {0.05, 0.7}) {
    State next = transfer_test::RandomChange(specs_, state, density, rng);
    const uint64_t v = Commit(next);
    auto changes = ChangesFromStore(*store_, V(v));
    ASSERT_TRUE(changes.ok()) << changes.status().message();
    // The same elements as the difference of the two states.
    const auto diff = Diff(state, next);
    ASSERT_EQ(changes->size(), diff.size());
    for (size_t i = 0; i < diff.size(); ++i) {
      EXPECT_EQ((*changes)[i].name, diff[i].name);
      EXPECT_EQ((*changes)[i].indices, diff[i].indices) << diff[i].name;
    }
    // Pushed from the store a tensor at a time: each changed tensor read
    // twice, in the version's order.
    auto source = StoreChanges(*store_, V(v));
    ASSERT_TRUE(source.ok()) << source.status().message();
    Recording recording(**source);
    auto report = server->Push(*store_, V(v), recording);
    ASSERT_TRUE(report.ok()) << report.status().message();
    EXPECT_EQ(report->pushed, rxs.size());
    std::vector<std::string> once;
    for (const auto& c : diff) once.push_back(c.name);
    std::vector<std::string> twice = once;
    twice.insert(twice.end(), once.begin(), once.end());
    EXPECT_EQ(recording.reads, twice);
    for (auto& r : rxs) {
      ASSERT_TRUE(r->rx->WaitFor(v, 10s).ok());
      ExpectHolds(*r, next);
    }
    state = std::move(next);
  }
}

// A source whose second read of a tensor differs from its first (a store
// changed under the push): the push fails naming the tensor, every receiver
// is closed holding its version whole, and catches up from the store.
TEST_F(PushTest, AChangeSourceThatReadsDifferentlyAbortsThePushWhole) {
  PushServerOptions no_cache;
  no_cache.cache_bytes = 0;
  auto server = StartServer(10s, no_cache);
  ASSERT_TRUE(server);
  std::vector<std::unique_ptr<Rx>> rxs;
  rxs.push_back(Receiver(*server, {1, false, false}, 0, state_, 0, true));
  rxs.push_back(Receiver(*server, FusedReceiverLayout(2), 1, state_, 0, true));
  AwaitReceivers(*server, rxs.size());
  std::mt19937_64 rng(13);
  State next = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  const uint64_t v = Commit(next);
  auto source = StoreChanges(*store_, V(v));
  ASSERT_TRUE(source.ok());
  Recording shrinking(**source);
  shrinking.drop_on_second_read = true;
  auto report = server->Push(*store_, V(v), shrinking);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("read differently in the second pass"),
            std::string::npos)
      << report.status().message();
  for (auto& r : rxs) {
    EXPECT_FALSE(r->rx->WaitFor(v, 2s).ok());
    EXPECT_EQ(r->rx->GetStatus().version, std::optional<uint64_t>(0));
    ExpectHolds(*r, state_);
    ASSERT_TRUE(r->rx->CatchUp(*store_, std::nullopt).ok());
    ExpectHolds(*r, next);
  }
}

// A server that sends a push with an index past its tensor: the receiver
// refuses it whole and its buffers keep the version they had.
TEST_F(PushTest, MalformedPushIsRefusedBeforeAnyByteIsWritten) {
  int port = 0;
  auto listen = transport_internal::ListenTcp("127.0.0.1:0", 4, &port);
  ASSERT_TRUE(listen.ok());
  std::vector<uint16_t> tensor(64, 7);
  PushReceiverOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.version = 4;
  o.tensors.push_back({"t", DType::kBF16, {64}, tensor.data()});
  auto rx = PushReceiver::Open(o);
  ASSERT_TRUE(rx.ok());
  transport_internal::Deadline d(10s);
  auto conn = transport_internal::AcceptOne(listen->get(), d, "the receiver");
  ASSERT_TRUE(conn.ok()) << conn.status().message();
  auto hello = push_internal::RecvFrame(conn->get(), 1 << 20, d, "receiver");
  ASSERT_TRUE(hello.ok() && hello->type == push_internal::Msg::kHello);
  // Two ops on tensor t, in two data frames (as a push sends a tensor at a
  // time): a valid one, then one whose segment runs past the end.
  push_internal::CountsMsg counts{5, 4, 0, 1, {0, 1}, {0, 0}, {2, 1}, {}};
  std::string ok_data, bad_data;
  const uint64_t ok_dst[] = {3, 9}, bad_dst[] = {70}, pos[] = {0, 1};
  const uint16_t vals[] = {1, 2};
  push_internal::AppendOpSegments(ok_dst, pos, 2, 2, reinterpret_cast<const uint8_t*>(vals),
                                  nullptr, nullptr, &ok_data);
  push_internal::AppendOpSegments(bad_dst, pos, 1, 2, reinterpret_cast<const uint8_t*>(vals),
                                  nullptr, nullptr, &bad_data);
  std::string frames =
      push_internal::Frame(push_internal::Msg::kWelcome, "{\"latest\": 4}") +
      push_internal::Frame(push_internal::Msg::kCounts, push_internal::EncodeCounts(counts)) +
      push_internal::Frame(push_internal::Msg::kData, ok_data) +
      push_internal::Frame(push_internal::Msg::kData, bad_data) +
      push_internal::Frame(push_internal::Msg::kDataEnd, "");
  ASSERT_TRUE(transport_internal::SendAll(conn->get(), frames.data(), frames.size(), d, "rx").ok());
  auto answer = push_internal::RecvFrame(conn->get(), 1 << 20, d, "receiver");
  ASSERT_TRUE(answer.ok()) << answer.status().message();
  EXPECT_EQ(answer->type, push_internal::Msg::kError);
  EXPECT_NE(answer->body.find("tensor t: segment at element 70 spanning 1 with 1 entries does "
                              "not fit the tensor of 64 elements"),
            std::string::npos)
      << answer->body;
  for (uint16_t x : tensor) ASSERT_EQ(x, 7);
  PushReceiverStatus st = (*rx)->GetStatus();
  EXPECT_EQ(st.version, 4u);
  EXPECT_EQ(st.pending, 0u);
}

// The AdamW publisher pushes what it commits: receivers equal the store's
// version after every publish.
TEST_F(PushTest, PublisherPushesEachVersionItCommits) {
  // A store of AdamW-trained BF16 tensors: the model's BF16 tensors from
  // FP32 state; F32 norms stay as committed.
  std::vector<test::AdamWTensorState> states;
  State state = state_;
  for (const PlanTensor& t : specs_) {
    if (t.dtype != DType::kBF16) continue;
    std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
    states.push_back(test::RandomAdamWState(t.name, shape, states.size() + 1));
    states.back().theta = states.back().prev;
    test::TestTensor bf = test::Bf16TensorOf(t.name, shape, states.back().theta);
    state[t.name] = Bytes(bf.data.begin(), bf.data.end());
  }
  ASSERT_EQ(Commit(state), 1u);
  PublisherOptions po;
  po.store = tmp_.path() + "/store";
  auto pub = Publisher::Open(po);
  ASSERT_TRUE(pub.ok()) << pub.status().message();
  auto server = StartServer();
  ASSERT_TRUE(server);
  ASSERT_TRUE((*pub)->SetPush(server.get()).ok());
  auto r = Receiver(*server, FusedReceiverLayout(2), 0, state, 1, true);
  AwaitReceivers(*server, 1);
  kernels::AdamWParams p;
  p.lr = 3e-3;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  for (int64_t step = 1; step <= 2; ++step) {
    p.step = step;
    std::vector<AdamWParamState> params;
    for (size_t i = 0; i < states.size(); ++i) {
      test::AdamWStepState(&states[i], p, 40 * step + i);
      auto& s = states[i];
      params.push_back({s.name,
                        {s.theta.data(), DType::kF32, s.shape},
                        {s.m.data(), DType::kF32, s.shape},
                        {s.v.data(), DType::kF32, s.shape},
                        std::nullopt,
                        std::nullopt,
                        std::nullopt});
    }
    auto res = (*pub)->PublishAdamW(test::AdamWStepOf(p), params);
    ASSERT_TRUE(res.ok()) << res.status().message();
    ASSERT_TRUE(res->push.has_value()) << res->push_error;
    EXPECT_EQ(res->push->pushed, 1u);
    EXPECT_GT(res->push->elements, 0u);
    ASSERT_TRUE(r->rx->WaitFor(res->version, 10s).ok());
    for (const auto& s : states) {
      test::TestTensor bf = test::Bf16TensorOf(s.name, s.shape, s.theta);
      state[s.name] = Bytes(bf.data.begin(), bf.data.end());
    }
    ExpectHolds(*r, state);
  }
}

}  // namespace
}  // namespace dte

namespace dte {
namespace {

// The round-2 encoding alone: entries spread over more than one segment,
// with and without old values, decode and apply to the new bits.
TEST(PushServers, AgreedVersionIsTheFurthestOnEveryPath) {
  using Paths = std::vector<std::vector<uint64_t>>;
  EXPECT_EQ(AgreedVersion(Paths{{1, 2, 3}, {1, 2}}), 2u);
  EXPECT_EQ(AgreedVersion(Paths{{1, 2}, {1, 2, 3}}), 2u);
  EXPECT_EQ(AgreedVersion(Paths{{2}, {1, 2}, {1, 2, 3}}), 2u);
  EXPECT_EQ(AgreedVersion(Paths{{5, 4, 3}, {5, 6}}), 5u);  // one moves back, one forward
  EXPECT_EQ(AgreedVersion(Paths{{5, 4, 3}, {5, 4, 3}}), 3u);
  EXPECT_EQ(AgreedVersion(Paths{{1, 2}, {3}}), std::nullopt);
  EXPECT_EQ(AgreedVersion(Paths{{1}, {}}), std::nullopt);  // a rank holds an unknown version
  EXPECT_EQ(AgreedVersion(Paths{}), std::nullopt);
}

// A server of two ranks (TP 2, fused): a push that reaches only rank 0 is
// staged there and applied by neither; rank 1's catch-up is staged, not
// written; then both apply it together, and move back and forward again
// by the store's deltas, every time holding one version bit for bit.
TEST_F(PushTest, RanksOfAServerApplyOnlyWhatEveryRankStagedAndMoveBackTogether) {
  auto server = StartServer(/*timeout=*/2s);
  ASSERT_TRUE(server);
  const ShardLayout tp2 = FusedReceiverLayout(2);
  auto r0 = Receiver(*server, tp2, 0, state_, 0, false, "rollout-0");
  auto r1 = Receiver(*server, tp2, 1, state_, 0, false, "rollout-0");
  AwaitReceivers(*server, 2);
  EXPECT_EQ(r0->rx->ApplyPending().status().code(), Code::kFailedPrecondition);
  // Rank 1 goes away (its buffers keep v0); v1 reaches rank 0 only.
  r1->rx.reset();
  ASSERT_TRUE(test::WaitFor([&] { return server->Receivers().size() == 1; }));
  std::mt19937_64 rng(21);
  State v1 = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  ASSERT_EQ(Commit(v1), 1u);
  auto report = server->Push(*store_, V(1), Diff(state_, v1));
  ASSERT_TRUE(report.ok()) << report.status().message();
  EXPECT_EQ(report->pushed, 1u);
  ASSERT_TRUE(r0->rx->WaitFor(1, 10s).ok());  // staged
  EXPECT_EQ(r0->rx->Path(), (std::vector<uint64_t>{0, 1}));
  ExpectHolds(*r0, state_);
  // Rank 1 is back at v0: the ranks agree on v0 and write nothing.
  PushReceiverOptions o1 = push_test::ReceiverOptions(*server, tp2, 1, 0, false);
  o1.server = "rollout-0";
  o1.server_size = 2;
  for (const PlanTensor& t : push_test::ReceiverTensors(config_, specs_, tp2, 1)) {
    o1.tensors.push_back({t.name, t.dtype, t.shape, r1->buffers.at(t.name).data()});
  }
  r1->rx = push_test::OpenReceiver(o1);
  ASSERT_TRUE(r1->rx);
  AwaitReceivers(*server, 2);
  auto paths = [&] { return std::vector<std::vector<uint64_t>>{r0->rx->Path(), r1->rx->Path()}; };
  for (Rx* r : {r0.get(), r1.get()}) {
    auto n = r->rx->ApplyAgreed(paths());
    ASSERT_TRUE(n.ok()) << n.status().message();
    EXPECT_EQ(*n, 0u);
    EXPECT_EQ(r->rx->GetStatus().server_version, 0u);
  }
  ExpectHolds(*r0, state_);
  ExpectHolds(*r1, state_);
  // Its catch-up is staged (v1's changed elements for rank 1), not written.
  ASSERT_TRUE(test::WaitFor([&] { return r1->rx->GetStatus().behind == 1u; }));
  ASSERT_TRUE(r1->rx->CatchUp(*store_, std::nullopt).ok());
  EXPECT_EQ(r1->rx->Path(), (std::vector<uint64_t>{0, 1}));
  EXPECT_GT(r1->rx->GetStatus().staged_bytes, 0u);
  ExpectHolds(*r1, state_);
  const auto both = paths();
  for (Rx* r : {r0.get(), r1.get()}) {
    auto n = r->rx->ApplyAgreed(both);
    ASSERT_TRUE(n.ok()) << n.status().message();
    EXPECT_EQ(*n, 1u);
    EXPECT_EQ(r->rx->GetStatus().version, 1u);
    EXPECT_EQ(r->rx->GetStatus().server_version, 1u);
    EXPECT_EQ(r->rx->GetStatus().staged_bytes, 0u);
  }
  ExpectHolds(*r0, v1);
  ExpectHolds(*r1, v1);
  ASSERT_TRUE(test::WaitFor([&] {
    auto ss = server->Servers();
    return ss.size() == 1 && ss[0].version == 1u && ss[0].complete;
  })) << server->StatusJson(false);
  EXPECT_EQ(server->Servers()[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(server->Servers()[0].staleness, 0u);
  // Rolled back to v0 in place, then forward to v1, by the store's deltas.
  for (uint64_t target : {0u, 1u}) {
    for (Rx* r : {r0.get(), r1.get()}) ASSERT_TRUE(r->rx->MoveTo(*store_, target).ok());
    const auto moved = paths();
    for (Rx* r : {r0.get(), r1.get()}) {
      auto n = r->rx->ApplyAgreed(moved);
      ASSERT_TRUE(n.ok()) << n.status().message();
      EXPECT_EQ(*n, 1u);
    }
    ExpectHolds(*r0, target == 0 ? state_ : v1);
    ExpectHolds(*r1, target == 0 ? state_ : v1);
  }
}

// Ranks that hold different versions with nothing staged to join them: the
// server is inconsistent and writes nothing, until a push and a staged
// catch-up bring both to one version.
TEST_F(PushTest, AServerWhoseRanksDisagreeIsInconsistentUntilMadeWhole) {
  std::mt19937_64 rng(22);
  State v1 = transfer_test::RandomChange(specs_, state_, 0.05, rng);
  ASSERT_EQ(Commit(v1), 1u);
  auto server = StartServer(/*timeout=*/2s);
  ASSERT_TRUE(server);
  const ShardLayout tp2 = FusedReceiverLayout(2);
  auto r0 = Receiver(*server, tp2, 0, state_, 0, false, "rollout-1");  // an older load
  auto r1 = Receiver(*server, tp2, 1, v1, 1, false, "rollout-1");
  AwaitReceivers(*server, 2);
  const std::vector<std::vector<uint64_t>> apart{r0->rx->Path(), r1->rx->Path()};
  for (Rx* r : {r0.get(), r1.get()}) {
    auto n = r->rx->ApplyAgreed(apart);
    ASSERT_TRUE(n.ok());
    EXPECT_EQ(*n, 0u);
    EXPECT_TRUE(r->rx->GetStatus().server_inconsistent);
    EXPECT_NE(r->rx->GetStatus().server_error.find("rank 0 at v00000000"), std::string::npos)
        << r->rx->GetStatus().server_error;
  }
  ExpectHolds(*r0, state_);
  ExpectHolds(*r1, v1);
  ASSERT_TRUE(test::WaitFor([&] {
    auto ss = server->Servers();
    return ss.size() == 1 && ss[0].inconsistent;
  })) << server->StatusJson(false);
  State v2 = transfer_test::RandomChange(specs_, v1, 0.05, rng);
  ASSERT_EQ(Commit(v2), 2u);
  auto report = server->Push(*store_, V(2), Diff(v1, v2));
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->pushed, 1u);  // rank 1; rank 0 is told it is behind
  ASSERT_TRUE(r1->rx->WaitFor(2, 10s).ok());
  ASSERT_TRUE(r0->rx->CatchUp(*store_, 2).ok());  // staged: v0 -> v1 -> v2
  EXPECT_EQ(r0->rx->Path(), (std::vector<uint64_t>{0, 1, 2}));
  const std::vector<std::vector<uint64_t>> joined{r0->rx->Path(), r1->rx->Path()};
  for (Rx* r : {r0.get(), r1.get()}) {
    auto n = r->rx->ApplyAgreed(joined);
    ASSERT_TRUE(n.ok()) << n.status().message();
    EXPECT_FALSE(r->rx->GetStatus().server_inconsistent);
    EXPECT_EQ(r->rx->GetStatus().server_version, 2u);
  }
  ExpectHolds(*r0, v2);
  ExpectHolds(*r1, v2);
}

TEST(PushServers, RanksOfAServerOfSeveralAreRefusedAutoApplyAndAnUnnamedServer) {
  PushReceiverOptions o;
  o.address = "127.0.0.1:1";
  o.layout = {2, false, false};
  o.server_size = 2;
  auto unnamed = PushReceiver::Open(o);
  EXPECT_EQ(unnamed.status().code(), Code::kInvalidArgument);
  EXPECT_NE(unnamed.status().message().find("no server name"), std::string::npos);
  o.server = "rollout-2";
  o.auto_apply = true;
  auto automatic = PushReceiver::Open(o);
  EXPECT_EQ(automatic.status().code(), Code::kInvalidArgument);
  EXPECT_NE(automatic.status().message().find("auto_apply on a rank of server rollout-2"),
            std::string::npos)
      << automatic.status().message();
}

TEST(PushWire, SegmentsRoundTripIntoTheTensor) {
  std::mt19937_64 rng(3);
  const uint64_t numel = (uint64_t{1} << 20) + 77;
  std::vector<uint16_t> old(numel), now;
  for (auto& x : old) x = static_cast<uint16_t>(rng());
  now = old;
  std::vector<uint64_t> dst, pos;
  std::vector<uint16_t> nv, ov;
  for (uint64_t i = 0; i < numel; i += 1 + rng() % 200) {
    now[i] = static_cast<uint16_t>(old[i] + 1 + rng() % 5);
    pos.push_back(dst.size());
    dst.push_back(i);
    nv.push_back(now[i]);
    ov.push_back(old[i]);
  }
  for (bool with_old : {true, false}) {
    std::string data;
    push_internal::AppendOpSegments(
        dst.data(), pos.data(), dst.size(), 2, reinterpret_cast<const uint8_t*>(nv.data()),
        with_old ? reinterpret_cast<const uint8_t*>(ov.data()) : nullptr, nullptr, &data);
    std::string_view in(data);
    push_internal::OpEntries e;
    Status s = push_internal::ReadOpSegments(&in, dst.size(), numel, 2, "t", &e);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(in.empty());
    ASSERT_EQ(e.idx, dst);
    std::vector<uint16_t> t = old;
    push_internal::ApplyOpEntries(e, 2, t.data());
    for (uint64_t i = 0; i < numel; ++i) {
      ASSERT_EQ(t[i], now[i]) << "element " << i << " with_old " << with_old << " sets "
                              << e.sets.size() << " first idx " << e.idx[0] << " val "
                              << reinterpret_cast<const uint16_t*>(e.vals.data())[0];
    }
    if (with_old) {
      EXPECT_LT(data.size(), dst.size() * 2) << "differences are not compact";
    }
  }
}

}  // namespace
}  // namespace dte
