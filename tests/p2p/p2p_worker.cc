// One rank of a two-round P2P run over the TCP transport, for
// tests/sync/p2p_test.cc, which starts one process per rank.
//
//   p2p_worker RANK WORLD RENDEZVOUS_DIR SEED MODE VICTIM TIMEOUT_MS
//
// Every rank derives the same scenario from SEED and WORLD: a random model,
// sender and receiver layouts and roles, and a sequence of sparse updates
// (many tensors untouched, so many ops carry zero counts). Senders diff their
// shards; receivers start from the old shards, run the protocol once per
// update and compare with the direct sharding of the new state.
//
// MODE: "ok"; "nccl": the same over the NCCL transport (one GPU per rank,
// device = RANK); "die1"/"die2": rank VICTIM exits just before round 1/2 of the
// first update; "stop1": VICTIM stops itself (SIGSTOP) before round 1. The
// die and stop modes make VICTIM the only sender, so every other rank waits
// on it.
//
// Prints one line, "OK <stats>", "ERROR <message>" or "MISMATCH <what>", then
// waits for end of input on stdin before exiting, so its sockets stay open
// until the test has every rank's line. alarm(60) ends a hung worker.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/change_detect.h"
#include "sync/transfer/p2p.h"
#include "sync/transfer/transfer_plan.h"
#include "sync/transport/transport.h"
#include "tests/sync/transfer_test_util.h"

namespace dte {
namespace {

using transfer_test::Bytes;
using transfer_test::State;

struct Args {
  int rank = 0, world = 1;
  std::string dir;
  uint64_t seed = 0;
  std::string mode;
  int victim = -1;
  int timeout_ms = 20000;
};

struct Scenario {
  transfer_test::ModelConfig cfg;
  ShardLayout sender, receiver;
  P2PRoles roles;
  std::vector<PlanTensor> specs;
  std::vector<State> states;  // states[0] old, then one per update
};

int PowerOfTwoAtMost(int n, std::mt19937_64& rng) {
  int p = 1;
  while (p * 2 <= n && p < 8) p *= 2;
  return 1 << (rng() % (__builtin_ctz(static_cast<unsigned>(p)) + 1));
}

std::vector<int> Shuffled(int n, std::mt19937_64& rng) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

Scenario MakeScenario(const Args& a) {
  std::mt19937_64 rng(a.seed * 1000 + a.world);
  static const uint64_t kGqa[][2] = {{8, 1}, {8, 2}, {16, 4}, {32, 8}, {8, 8}, {16, 2}};
  Scenario s;
  const auto& g = kGqa[rng() % 6];
  s.cfg.heads = g[0];
  s.cfg.kv_heads = g[1];
  s.receiver = FusedReceiverLayout(PowerOfTwoAtMost(a.world, rng));
  s.sender = ShardLayout{PowerOfTwoAtMost(a.world, rng)};
  std::vector<int> perm = Shuffled(a.world, rng);
  s.roles.sender_ranks.assign(perm.begin(), perm.begin() + s.sender.tp);
  perm = Shuffled(a.world, rng);
  s.roles.receiver_ranks.assign(perm.begin(), perm.begin() + s.receiver.tp);
  if (a.mode != "ok" && a.mode != "nccl") {
    // The victim alone sends; the others receive, as many as a power of two
    // allows (all of them when WORLD - 1 is one).
    int tp = 1;
    while (tp * 2 <= a.world - 1 && tp < 8) tp *= 2;
    s.sender = ShardLayout{1};
    s.roles.sender_ranks = {a.victim};
    s.receiver = FusedReceiverLayout(tp);
    s.roles.receiver_ranks.clear();
    for (int r = 0; r < a.world && static_cast<int>(s.roles.receiver_ranks.size()) < tp; ++r) {
      if (r != a.victim) s.roles.receiver_ranks.push_back(r);
    }
  }
  auto [specs, old_state] = transfer_test::RandomModel(s.cfg, rng);
  s.specs = specs;
  s.states.push_back(old_state);
  for (int step = 0; step < 3; ++step) {
    State next = s.states.back();
    for (const PlanTensor& t : specs) {
      // 40% of tensors untouched: whole pairs of zero counts.
      if (rng() % 10 < 4) continue;
      const double density = std::vector<double>{0.001, 0.01, 0.05}[rng() % 3];
      State one{{t.name, next[t.name]}};
      next[t.name] = transfer_test::RandomChange({t}, one, density, rng)[t.name];
    }
    s.states.push_back(std::move(next));
  }
  return s;
}

// This rank's updates as a sender for states[step] -> states[step + 1].
struct SenderData {
  std::vector<std::vector<uint64_t>> idx;
  std::vector<Bytes> vals;
  std::vector<SparseUpdate> updates;
};

SenderData Diff(const Scenario& s, const TransferPlan& plan, int sender, int step) {
  SenderData d;
  const State o = transfer_test::ShardModel(s.cfg, s.specs, s.states[step], s.sender, sender);
  const State n = transfer_test::ShardModel(s.cfg, s.specs, s.states[step + 1], s.sender, sender);
  for (const PlanTensor& t : plan.sender_tensors[sender]) {
    const int w = DTypeWidth(t.dtype);
    const size_t numel = ShapeElements(t.shape);
    std::vector<uint64_t> idx(numel);
    Bytes vals(numel * w);
    const size_t k = kernels::DetectChangesParallel(o.at(t.name).data(), n.at(t.name).data(), numel,
                                                    w, idx.data(), vals.data());
    idx.resize(k);
    vals.resize(k * w);
    d.idx.push_back(std::move(idx));
    d.vals.push_back(std::move(vals));
  }
  for (size_t i = 0; i < d.idx.size(); ++i) {
    d.updates.push_back({d.idx[i].data(), d.vals[i].data(), d.idx[i].size()});
  }
  return d;
}

int IndexOf(const std::vector<int>& v, int x) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] == x) return static_cast<int>(i);
  }
  return -1;
}

// Runs every update; returns the line to print.
std::string Run(const Args& a) {
  const Scenario s = MakeScenario(a);
  Result<TransferPlan> plan = MakeTransferPlan(s.specs, s.cfg.Geometry(), s.sender, s.receiver);
  if (!plan.ok()) return "ERROR " + plan.status().message();
  const int sender = IndexOf(s.roles.sender_ranks, a.rank);
  const int receiver = IndexOf(s.roles.receiver_ranks, a.rank);
  State shards;
  std::vector<ShardBuffer> buffers;
  if (receiver >= 0) {
    shards = transfer_test::ShardModel(s.cfg, s.specs, s.states[0], s.receiver, receiver);
    for (const PlanTensor& t : plan->receiver_tensors[receiver]) {
      buffers.push_back({shards.at(t.name).data(), shards.at(t.name).size()});
    }
  }
  const TransportOptions to{a.rank, a.world, a.dir, std::chrono::milliseconds(a.timeout_ms), {}};
  // "nccl": one GPU per rank (device = rank).
  Result<std::unique_ptr<Transport>> t =
      a.mode == "nccl" ? ConnectNcclTransport({to, a.rank, 2048}) : ConnectTcpTransport(to);
  if (!t.ok()) return "ERROR " + t.status().message();
  P2POptions options;
  if (a.rank == a.victim) {
    options.before_round = [&](int round) {
      if (a.mode == "die" + std::to_string(round)) _exit(3);
      if (a.mode == "stop" + std::to_string(round)) raise(SIGSTOP);
    };
  }
  P2PStats total;
  for (size_t step = 0; step + 1 < s.states.size(); ++step) {
    SenderData d;
    if (sender >= 0) d = Diff(s, *plan, sender, static_cast<int>(step));
    P2PStats st;
    const Status run = RunTwoRoundSync(**t, *plan, s.roles, d.updates, buffers, options, &st);
    if (!run.ok()) return "ERROR " + run.message();
    total.ops_sent += st.ops_sent;
    total.nonzero_ops_sent += st.nonzero_ops_sent;
    total.elements_received += st.elements_received;
    if (receiver < 0) continue;
    const State want =
        transfer_test::ShardModel(s.cfg, s.specs, s.states[step + 1], s.receiver, receiver);
    for (const auto& [name, bytes] : want) {
      if (shards.at(name) != bytes) {
        return "MISMATCH step " + std::to_string(step) + " tensor " + name;
      }
    }
  }
  return "OK ops=" + std::to_string(total.ops_sent) +
         " nonzero=" + std::to_string(total.nonzero_ops_sent) +
         " received=" + std::to_string(total.elements_received);
}

}  // namespace
}  // namespace dte

int main(int argc, char** argv) {
  alarm(60);
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s RANK WORLD DIR SEED MODE VICTIM TIMEOUT_MS\n", argv[0]);
    return 2;
  }
  dte::Args a;
  a.rank = std::atoi(argv[1]);
  a.world = std::atoi(argv[2]);
  a.dir = argv[3];
  a.seed = std::strtoull(argv[4], nullptr, 10);
  a.mode = argv[5];
  a.victim = std::atoi(argv[6]);
  a.timeout_ms = std::atoi(argv[7]);
  const std::string line = dte::Run(a);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  char buf[64];
  while (read(0, buf, sizeof(buf)) > 0) {
  }
  return 0;
}
