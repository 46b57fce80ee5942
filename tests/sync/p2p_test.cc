// The two-round protocol over the TCP transport with 2 to 8 ranks as
// separate processes (tests/p2p/p2p_worker.cc), fault cases, the transport's
// framing checks, and the group-chunking order used by the NCCL transport.
#include "sync/transfer/p2p.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "sync/transport/internal/chunk.h"
#include "sync/transport/transport.h"

namespace dte {
namespace {

namespace fs = std::filesystem;

std::string WorkerPath() {
  return (fs::read_symlink("/proc/self/exe").parent_path() / "p2p_worker").string();
}

struct TempDir {
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "dte-p2p-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string path;
};

// Reads one line (without the newline) or up to end of file.
std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line;
}

// Starts one worker process per rank, collects every rank's line (empty for
// a rank that died), then lets them exit and reaps them. Workers end
// themselves on a 60 s alarm, so a hang fails the test instead of stalling.
std::vector<std::string> RunRanks(int world, uint64_t seed, const std::string& mode, int victim,
                                  int timeout_ms) {
  TempDir dir;
  const std::string worker = WorkerPath();
  std::vector<pid_t> pids;
  std::vector<int> outs, ins;
  for (int r = 0; r < world; ++r) {
    const std::vector<std::string> args = {
        worker, std::to_string(r),      std::to_string(world),     dir.path, std::to_string(seed),
        mode,   std::to_string(victim), std::to_string(timeout_ms)};
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    int out[2], in[2];
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(in, O_CLOEXEC), 0);
    const pid_t pid = fork();
    if (pid == 0) {  // only async-signal-safe calls until exec
      dup2(out[1], 1);
      dup2(in[0], 0);
      execv(worker.c_str(), argv.data());
      _exit(127);
    }
    close(out[1]);
    close(in[0]);
    pids.push_back(pid);
    outs.push_back(out[0]);
    ins.push_back(in[1]);
  }
  // A stopped victim never writes nor exits: read the others first, then
  // kill it (its line is then empty).
  const bool stop = mode.rfind("stop", 0) == 0;
  std::vector<std::string> lines(world);
  for (int r = 0; r < world; ++r) {
    if (!stop || r != victim) lines[r] = ReadLine(outs[r]);
  }
  if (stop) kill(pids[victim], SIGKILL);
  for (int r = 0; r < world; ++r) {
    close(ins[r]);
    close(outs[r]);
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
  }
  return lines;
}

std::string Join(const std::vector<std::string>& lines) {
  std::string s;
  for (size_t r = 0; r < lines.size(); ++r) s += "\n  rank " + std::to_string(r) + ": " + lines[r];
  return s;
}

uint64_t Field(const std::string& line, const std::string& key) {
  const size_t at = line.find(key + "=");
  return at == std::string::npos ? 0 : std::stoull(line.substr(at + key.size() + 1));
}

TEST(P2P, RandomPlansWithManyZeroCountsDeliverExactShardsOnTwoToEightRanks) {
  ASSERT_TRUE(fs::exists(WorkerPath())) << "build the p2p_worker target: " << WorkerPath();
  uint64_t ops = 0, nonzero = 0, received = 0;
  for (int world = 2; world <= 8; ++world) {
    for (uint64_t seed : {1, 2}) {
      const std::vector<std::string> lines = RunRanks(world, seed, "ok", -1, 30000);
      for (const std::string& line : lines) {
        ASSERT_EQ(line.rfind("OK", 0), 0u) << "world " << world << " seed " << seed << Join(lines);
        ops += Field(line, "ops");
        nonzero += Field(line, "nonzero");
        received += Field(line, "received");
      }
    }
  }
  // The runs exercised what they claim: many zero counts, and real data.
  EXPECT_GT(ops, 2 * nonzero);
  EXPECT_GT(nonzero, 0u);
  EXPECT_GT(received, 0u);
}

void ExpectSurvivorsNameVictim(const std::vector<std::string>& lines, int victim,
                               const std::string& cause) {
  const std::string named = "rank " + std::to_string(victim) + " " + cause;
  EXPECT_EQ(lines[victim], "") << Join(lines);
  for (size_t r = 0; r < lines.size(); ++r) {
    if (static_cast<int>(r) == victim) continue;
    EXPECT_EQ(lines[r].rfind("ERROR", 0), 0u) << Join(lines);
    EXPECT_NE(lines[r].find(named), std::string::npos)
        << "expected '" << named << "'" << Join(lines);
  }
}

TEST(P2P, RankKilledBeforeCountsMakesEveryOtherRankFailNamingIt) {
  ExpectSurvivorsNameVictim(RunRanks(5, 11, "die1", 2, 30000), 2, "closed the connection");
  ExpectSurvivorsNameVictim(RunRanks(3, 12, "die1", 0, 30000), 0, "closed the connection");
}

TEST(P2P, RankKilledBetweenRoundsMakesEveryOtherRankFailNamingIt) {
  ExpectSurvivorsNameVictim(RunRanks(5, 13, "die2", 4, 30000), 4, "closed the connection");
  ExpectSurvivorsNameVictim(RunRanks(2, 14, "die2", 1, 30000), 1, "closed the connection");
}

TEST(P2P, StoppedRankMakesOthersTimeOutNamingIt) {
  // The victim is alive but silent: only the deadline can end the wait.
  const std::vector<std::string> lines = RunRanks(3, 15, "stop1", 1, 1000);
  for (int r : {0, 2}) {
    EXPECT_NE(lines[r].find("timed out after 1000 ms waiting for rank 1"), std::string::npos)
        << Join(lines);
  }
}

TEST(P2P, NcclTransportRunsTheSameProtocolOrFailsCleanly) {
  // On a machine with two GPUs and NCCL this is a real run; elsewhere every
  // rank must report why it could not start, not hang or crash.
  const std::vector<std::string> lines = RunRanks(2, 3, "nccl", -1, 20000);
  const bool ok = lines[0].rfind("OK", 0) == 0;
  for (const std::string& line : lines) {
    if (ok) {
      EXPECT_EQ(line.rfind("OK", 0), 0u) << Join(lines);
    } else {
      EXPECT_EQ(line.rfind("ERROR", 0), 0u) << Join(lines);
      EXPECT_NE(line.find("NCCL transport rank"), std::string::npos) << Join(lines);
    }
  }
}

// Two TCP ranks in one process (threads) for framing checks.
template <typename Fn0, typename Fn1>
void WithTwoRanks(int timeout_ms, const Fn0& rank0, const Fn1& rank1) {
  TempDir dir;
  auto connect = [&](int rank) {
    return ConnectTcpTransport({rank, 2, dir.path, std::chrono::milliseconds(timeout_ms), {}});
  };
  std::thread other([&] {
    Result<std::unique_ptr<Transport>> t = connect(1);
    ASSERT_TRUE(t.ok()) << t.status().message();
    rank1(**t);
  });
  Result<std::unique_ptr<Transport>> t = connect(0);
  ASSERT_TRUE(t.ok()) << t.status().message();
  rank0(**t);
  other.join();
}

TEST(TcpTransport, MessagesMatchInOrderIncludingEmptyOnesAndSelfSends) {
  WithTwoRanks(
      20000,
      [](Transport& t) {
        const std::vector<uint8_t> a = {1, 2, 3}, b(100000, 7), self = {9, 9};
        std::vector<uint8_t> got_self(2), got(5);
        const SendBuffer sends[] = {
            {1, a.data(), 3}, {1, nullptr, 0}, {1, b.data(), b.size()}, {0, self.data(), 2}};
        const RecvBuffer recvs[] = {{0, got_self.data(), 2}, {1, got.data(), 5}};
        ASSERT_TRUE(t.Exchange(sends, recvs).ok());
        EXPECT_EQ(got_self, self);
        EXPECT_EQ(got, (std::vector<uint8_t>{5, 4, 3, 2, 1}));
      },
      [](Transport& t) {
        std::vector<uint8_t> a(3), empty, b(100000);
        const std::vector<uint8_t> back = {5, 4, 3, 2, 1};
        const SendBuffer sends[] = {{0, back.data(), 5}};
        const RecvBuffer recvs[] = {{0, a.data(), 3}, {0, nullptr, 0}, {0, b.data(), b.size()}};
        ASSERT_TRUE(t.Exchange(sends, recvs).ok());
        EXPECT_EQ(a, (std::vector<uint8_t>{1, 2, 3}));
        EXPECT_EQ(b, std::vector<uint8_t>(100000, 7));
      });
}

TEST(TcpTransport, LargeMessagesBothWaysAtOnceDoNotDeadlock) {
  // 8 MiB each way in one group: far beyond the socket buffers, so each side
  // must keep reading while its own sends are blocked.
  constexpr size_t kBytes = size_t{8} << 20;
  auto run = [](Transport& t) {
    const int peer = 1 - t.rank();
    std::vector<uint8_t> out(kBytes), in(kBytes);
    for (size_t i = 0; i < kBytes; ++i) out[i] = static_cast<uint8_t>(i * 31 + t.rank());
    const SendBuffer sends[] = {{peer, out.data(), kBytes / 2},
                                {peer, out.data() + kBytes / 2, kBytes / 2}};
    const RecvBuffer recvs[] = {{peer, in.data(), kBytes / 2},
                                {peer, in.data() + kBytes / 2, kBytes / 2}};
    const Status st = t.Exchange(sends, recvs);
    ASSERT_TRUE(st.ok()) << st.message();
    for (size_t i = 0; i < kBytes; ++i) {
      ASSERT_EQ(in[i], static_cast<uint8_t>(i * 31 + peer)) << "byte " << i;
    }
  };
  WithTwoRanks(20000, run, run);
}

TEST(TcpTransport, SizeMismatchIsCorruptionNamingThePeerAndPropagates) {
  WithTwoRanks(
      20000,
      [](Transport& t) {
        const std::vector<uint8_t> a(8, 1);
        const SendBuffer sends[] = {{1, a.data(), 8}};
        std::vector<uint8_t> reply(4);
        const RecvBuffer recvs[] = {{1, reply.data(), 4}};
        const Status st = t.Exchange(sends, recvs);
        // Rank 1 failed first and told us why.
        EXPECT_FALSE(st.ok());
        EXPECT_NE(st.message().find("rank 1 aborted the exchange"), std::string::npos)
            << st.message();
        EXPECT_NE(st.message().find("rank 0 sent a message of 8 bytes where 16 were expected"),
                  std::string::npos)
            << st.message();
      },
      [](Transport& t) {
        std::vector<uint8_t> got(16);
        const RecvBuffer recvs[] = {{0, got.data(), 16}};
        const Status st = t.Exchange({}, recvs);
        EXPECT_EQ(st.code(), Code::kCorruption) << st.message();
        EXPECT_NE(st.message().find("rank 0 sent a message of 8 bytes"), std::string::npos)
            << st.message();
        // Broken for good: later calls return the same error.
        EXPECT_EQ(t.Exchange({}, {}).message(), st.message());
      });
}

// --- Group chunking (the NCCL transport's order), checked by simulation ---

using MsgKey = std::tuple<int, int, size_t>;  // (sender, receiver, k)
using Groups = std::vector<std::vector<transport_internal::GroupedOp>>;

struct Job {
  std::vector<std::vector<SendBuffer>> sends;  // [rank]
  std::vector<std::vector<RecvBuffer>> recvs;
};

Job RandomJob(int ranks, std::mt19937_64& rng) {
  Job j;
  j.sends.resize(ranks);
  j.recvs.resize(ranks);
  for (int a = 0; a < ranks; ++a) {
    for (int b = 0; b < ranks; ++b) {
      if (a == b) continue;
      for (int k = static_cast<int>(rng() % 6); k > 0; --k) {
        const size_t bytes = rng() % 4 == 0 ? 0 : 1 + rng() % 100;
        j.sends[a].push_back({b, nullptr, bytes});
        j.recvs[b].push_back({a, nullptr, bytes});
      }
    }
  }
  // Each rank posts its sends and receives in a shuffled order that keeps
  // the per-pair order (what the protocol guarantees).
  for (int r = 0; r < ranks; ++r) {
    std::stable_sort(j.sends[r].begin(), j.sends[r].end(),
                     [](const SendBuffer& x, const SendBuffer& y) { return x.peer > y.peer; });
  }
  return j;
}

// The message key of each op of a rank's groups.
std::vector<std::vector<MsgKey>> Keys(int rank, const Job& j, const Groups& groups) {
  std::vector<size_t> send_k(j.sends[rank].size()), recv_k(j.recvs[rank].size());
  std::map<int, size_t> ns, nr;
  for (size_t i = 0; i < send_k.size(); ++i) send_k[i] = ns[j.sends[rank][i].peer]++;
  for (size_t i = 0; i < recv_k.size(); ++i) recv_k[i] = nr[j.recvs[rank][i].peer]++;
  std::vector<std::vector<MsgKey>> out;
  for (const auto& g : groups) {
    out.emplace_back();
    for (const auto& op : g) {
      out.back().push_back(op.send ? MsgKey{rank, op.peer, send_k[op.index]}
                                   : MsgKey{op.peer, rank, recv_k[op.index]});
    }
  }
  return out;
}

// Runs groups in order per rank; a message completes when both endpoints'
// current groups hold it. Returns false on a deadlock.
bool Completes(const std::vector<std::vector<std::vector<MsgKey>>>& plan) {
  const size_t ranks = plan.size();
  std::vector<size_t> cur(ranks, 0);
  std::set<MsgKey> done;
  for (;;) {
    bool progress = false;
    std::vector<std::set<MsgKey>> current(ranks);
    for (size_t r = 0; r < ranks; ++r) {
      if (cur[r] < plan[r].size())
        current[r].insert(plan[r][cur[r]].begin(), plan[r][cur[r]].end());
    }
    for (size_t r = 0; r < ranks; ++r) {
      for (const MsgKey& m : current[r]) {
        const int other = std::get<0>(m) == static_cast<int>(r) ? std::get<1>(m) : std::get<0>(m);
        if (!done.count(m) && current[other].count(m)) {
          done.insert(m);
          progress = true;
        }
      }
    }
    bool finished = true;
    for (size_t r = 0; r < ranks; ++r) {
      while (cur[r] < plan[r].size() &&
             std::all_of(plan[r][cur[r]].begin(), plan[r][cur[r]].end(),
                         [&](const MsgKey& m) { return done.count(m) > 0; })) {
        ++cur[r];
        progress = true;
      }
      finished = finished && cur[r] == plan[r].size();
    }
    if (finished) return true;
    if (!progress) return false;
  }
}

TEST(TransportChunking, GlobalOrderGroupsNeverDeadlockAndStayBounded) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 300; ++trial) {
    const int ranks = 2 + trial % 7;
    const size_t max_ops = 1 + trial % 5;
    const Job j = RandomJob(ranks, rng);
    std::vector<std::vector<std::vector<MsgKey>>> plan;
    size_t nonempty = 0, grouped = 0;
    for (int r = 0; r < ranks; ++r) {
      const Groups g = transport_internal::ChunkInGlobalOrder(r, j.sends[r], j.recvs[r], max_ops);
      for (const auto& group : g) {
        ASSERT_LE(group.size(), max_ops);
        grouped += group.size();
      }
      for (const SendBuffer& s : j.sends[r]) nonempty += s.bytes != 0;
      for (const RecvBuffer& rb : j.recvs[r]) nonempty += rb.bytes != 0;
      plan.push_back(Keys(r, j, g));
    }
    ASSERT_EQ(grouped, nonempty) << "trial " << trial;  // zero-byte messages dropped, nothing else
    ASSERT_TRUE(Completes(plan)) << "trial " << trial;
  }
}

TEST(TransportChunking, SimulatorCatchesTheDeadlockOfSendsFirstGroups) {
  // Two ranks each send three messages to the other; groups of two cut each
  // rank's list as sends then receives: both first groups hold only sends.
  std::vector<std::vector<std::vector<MsgKey>>> plan(2);
  for (int r = 0; r < 2; ++r) {
    const int o = 1 - r;
    plan[r] = {{{r, o, 0}, {r, o, 1}}, {{r, o, 2}, {o, r, 0}}, {{o, r, 1}, {o, r, 2}}};
  }
  EXPECT_FALSE(Completes(plan));
}

}  // namespace
}  // namespace dte
