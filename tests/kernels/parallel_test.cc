#include "kernels/parallel.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/testutil/wait.h"

namespace dte::kernels {
namespace {

// Restores the default pool size when a test that changes it ends.
class PoolSizeGuard {
 public:
  ~PoolSizeGuard() { SetNumThreads(0); }
};

// Runs ParallelFor and returns how often each index was visited.
std::vector<int> Visits(size_t n, size_t grain) {
  std::vector<std::atomic<int>> hits(n);
  ParallelFor(n, grain, [&](size_t b, size_t e) {
    ASSERT_LE(b, e);
    ASSERT_LE(e, n);
    for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
  });
  std::vector<int> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = hits[i].load();
  return out;
}

TEST(Parallel, CoversEveryIndexExactlyOnceForManySizesAndGrains) {
  PoolSizeGuard guard;
  for (size_t threads : {1, 2, 3, 8}) {
    SetNumThreads(threads);
    for (size_t n : {0, 1, 2, 7, 64, 1000, 4097, 100000}) {
      for (size_t grain : {0, 1, 3, 64, 5000}) {
        const std::vector<int> v = Visits(n, grain);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(v[i], 1) << "threads=" << threads << " n=" << n << " grain=" << grain
                             << " i=" << i;
        }
      }
    }
  }
}

TEST(Parallel, RangesAreAtLeastGrainLongWhenNIsLarge) {
  PoolSizeGuard guard;
  SetNumThreads(4);
  std::mutex mu;
  std::vector<std::pair<size_t, size_t>> ranges;
  ParallelFor(10000, 1000, [&](size_t b, size_t e) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.emplace_back(b, e);
  });
  ASSERT_GT(ranges.size(), 1u);
  for (const auto& [b, e] : ranges) EXPECT_GE(e - b, 1000u);
}

TEST(Parallel, UsesSeveralThreadsWhenPoolHasThem) {
  PoolSizeGuard guard;
  SetNumThreads(4);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> arrived{0};
  // Each range waits for a second range to start, so one thread cannot take
  // every range.
  ParallelFor(16, 1, [&](size_t, size_t) {
    arrived.fetch_add(1);
    EXPECT_TRUE(test::WaitFor([&] { return arrived.load() >= 2; }, std::chrono::seconds(20)))
        << "no second range started";
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_GE(ids.size(), 2u);
}

TEST(Parallel, NestedCallRunsInlineOnCallingThread) {
  PoolSizeGuard guard;
  SetNumThreads(4);
  std::atomic<size_t> inner_total{0};
  std::atomic<int> foreign{0};
  ParallelFor(8, 1, [&](size_t b, size_t e) {
    const std::thread::id outer = std::this_thread::get_id();
    for (size_t i = b; i < e; ++i) {
      ParallelFor(1000, 1, [&](size_t ib, size_t ie) {
        if (std::this_thread::get_id() != outer) foreign.fetch_add(1);
        inner_total.fetch_add(ie - ib);
      });
    }
  });
  EXPECT_EQ(inner_total.load(), 8u * 1000u);
  EXPECT_EQ(foreign.load(), 0);
}

TEST(Parallel, ConcurrentCallersAllComplete) {
  PoolSizeGuard guard;
  SetNumThreads(3);
  constexpr int kCallers = 6;
  std::vector<size_t> sums(kCallers);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&sums, c] {
      for (int round = 0; round < 50; ++round) {
        std::atomic<size_t> sum{0};
        ParallelFor(5000, 10, [&](size_t b, size_t e) {
          size_t local = 0;
          for (size_t i = b; i < e; ++i) local += i;
          sum.fetch_add(local);
        });
        sums[c] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(sums[c], 50u * (4999u * 5000u / 2));
}

TEST(Parallel, ResizeWhileOtherThreadsRunKeepsResultsCorrect) {
  PoolSizeGuard guard;
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::thread worker([&] {
    while (!stop.load()) {
      if (Visits(3000, 7) != std::vector<int>(3000, 1)) bad.fetch_add(1);
    }
  });
  for (int i = 0; i < 40; ++i) SetNumThreads(1 + i % 4);
  stop.store(true);
  worker.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(Parallel, SetNumThreadsClampsAndZeroRestoresDefault) {
  PoolSizeGuard guard;
  SetNumThreads(3);
  EXPECT_EQ(NumThreads(), 3u);
  SetNumThreads(kMaxThreads + 5);
  EXPECT_EQ(NumThreads(), kMaxThreads);
  SetNumThreads(0);
  EXPECT_EQ(NumThreads(), DefaultNumThreads());
}

TEST(Parallel, DefaultHonoursValidDteThreadsAndIgnoresInvalid) {
  PoolSizeGuard guard;
  const char* old = getenv("DTE_THREADS");
  const std::string saved = old != nullptr ? old : "";
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  setenv("DTE_THREADS", "5", 1);
  EXPECT_EQ(DefaultNumThreads(), 5u);
  SetNumThreads(0);
  EXPECT_EQ(NumThreads(), 5u);
  for (const char* bad : {"0", "-2", "abc", "7x", "", "999999"}) {
    setenv("DTE_THREADS", bad, 1);
    EXPECT_EQ(DefaultNumThreads(), hardware) << "DTE_THREADS=" << bad;
  }
  if (old != nullptr) {
    setenv("DTE_THREADS", saved.c_str(), 1);
  } else {
    unsetenv("DTE_THREADS");
  }
}

}  // namespace
}  // namespace dte::kernels
