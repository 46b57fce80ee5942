// BlockCache: LRU by bytes, single-flight loads, errors never cached,
// DropVersion, and consistency under many threads.
#include "fs/block_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/testutil/checkpoint.h"
#include "tests/testutil/wait.h"

namespace dte::fs {
namespace {

BlockCache::Value Filled(size_t n, char c) {
  return std::make_shared<const Bytes>(std::string(n, c));
}

// A loader returning `value` that counts its calls.
BlockCache::Loader Counting(std::atomic<int>* calls, BlockCache::Value value) {
  return [calls, value]() -> Result<BlockCache::Value> {
    (*calls)++;
    return value;
  };
}

// A loader that must not run.
Result<BlockCache::Value> Unexpected() {
  ADD_FAILURE() << "loader ran on a cached key";
  return Status(Code::kInternal, "unexpected load");
}

// Whether `key` is cached. A miss adds nothing (the probe's loader fails, and
// errors are not cached); a hit makes the key the most recently used.
bool Cached(BlockCache& cache, CacheKey key) {
  bool loaded = false;
  auto r = cache.GetOrLoad(key, [&]() -> Result<BlockCache::Value> {
    loaded = true;
    return NotFound("probe");
  });
  return !loaded && r.ok();
}

TEST(BlockCache, HitReturnsTheCachedValueWithoutLoading) {
  BlockCache cache(1000);
  std::atomic<int> calls{0};
  auto a = Filled(10, 'a');
  auto first = cache.GetOrLoad({1, 7}, Counting(&calls, a));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, a);
  auto second = cache.GetOrLoad({1, 7}, Unexpected);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, a);
  EXPECT_EQ(calls.load(), 1);
  // Same slot, other version: another key.
  auto other = cache.GetOrLoad({2, 7}, Counting(&calls, Filled(5, 'b')));
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(**other, "bbbbb");
  const CacheStats s = cache.Stats();
  EXPECT_EQ(s.capacity_bytes, 1000u);
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.bytes, 15u);
  EXPECT_EQ(s.evictions, 0u);
}

TEST(BlockCache, EvictsTheLeastRecentlyUsedBeyondTheCapacityInBytes) {
  BlockCache cache(100);
  std::atomic<int> calls{0};
  ASSERT_TRUE(cache.GetOrLoad({0, 1}, Counting(&calls, Filled(40, 'a'))).ok());
  ASSERT_TRUE(cache.GetOrLoad({0, 2}, Counting(&calls, Filled(40, 'b'))).ok());
  ASSERT_TRUE(cache.GetOrLoad({0, 1}, Unexpected).ok());  // a is now the most recent
  ASSERT_TRUE(cache.GetOrLoad({0, 3}, Counting(&calls, Filled(40, 'c'))).ok());
  EXPECT_TRUE(Cached(cache, {0, 1}));
  EXPECT_FALSE(Cached(cache, {0, 2})) << "b was the least recently used";
  EXPECT_TRUE(Cached(cache, {0, 3}));
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.bytes, 80u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.evictions, 1u);

  // Order now (most recent first): c, a. Exactly full is not over.
  ASSERT_TRUE(cache.GetOrLoad({0, 4}, Counting(&calls, Filled(20, 'd'))).ok());
  EXPECT_EQ(cache.Stats().bytes, 100u);
  EXPECT_EQ(cache.Stats().evictions, 1u);
  // 70 more bytes push out a (40) and c (40): the least recent first.
  ASSERT_TRUE(cache.GetOrLoad({0, 5}, Counting(&calls, Filled(70, 'e'))).ok());
  s = cache.Stats();
  EXPECT_EQ(s.bytes, 90u);
  EXPECT_EQ(s.evictions, 3u);
  EXPECT_FALSE(Cached(cache, {0, 1}));
  EXPECT_FALSE(Cached(cache, {0, 3}));
  EXPECT_TRUE(Cached(cache, {0, 4}));
  EXPECT_TRUE(Cached(cache, {0, 5}));
  EXPECT_EQ(calls.load(), 5);
}

TEST(BlockCache, EvictedValueStaysValidForItsHolder) {
  BlockCache cache(10);
  std::atomic<int> calls{0};
  auto held = cache.GetOrLoad({0, 1}, Counting(&calls, Filled(10, 'x')));
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(cache.GetOrLoad({0, 2}, Counting(&calls, Filled(10, 'y'))).ok());
  EXPECT_FALSE(Cached(cache, {0, 1}));
  EXPECT_EQ(**held, std::string(10, 'x'));
}

TEST(BlockCache, ValueLargerThanTheCapacityIsReturnedButNotCached) {
  BlockCache cache(10);
  std::atomic<int> calls{0};
  ASSERT_TRUE(cache.GetOrLoad({0, 1}, Counting(&calls, Filled(8, 'a'))).ok());
  for (int i = 0; i < 2; ++i) {
    auto big = cache.GetOrLoad({0, 2}, Counting(&calls, Filled(11, 'b')));
    ASSERT_TRUE(big.ok());
    EXPECT_EQ((*big)->size(), 11u);
  }
  EXPECT_EQ(calls.load(), 3) << "the oversized value was cached";
  EXPECT_TRUE(Cached(cache, {0, 1})) << "an uncacheable value evicted others";
  EXPECT_EQ(cache.Stats().bytes, 8u);
}

TEST(BlockCache, ZeroCapacityCachesNothing) {
  BlockCache cache(0);
  std::atomic<int> calls{0};
  for (size_t size : {size_t{5}, size_t{1}}) {
    for (int i = 0; i < 2; ++i) {
      auto r = cache.GetOrLoad({3, size}, Counting(&calls, Filled(size, 'z')));
      ASSERT_TRUE(r.ok());
      EXPECT_EQ((*r)->size(), size);
    }
  }
  EXPECT_EQ(calls.load(), 4) << "a disabled cache served a hit";
  EXPECT_EQ(cache.Stats().entries, 0u);
  EXPECT_EQ(cache.Stats().hits, 0u);
}

// "capacity_bytes == 0 disables caching (every Get misses, Put drops)" holds
// for empty values too. (An empty value costs no bytes, so it is never
// evicted either: with any capacity, empty entries would pile up.)
TEST(BlockCache, ZeroCapacityCachesNotEvenAnEmptyValue) {
  BlockCache cache(0);
  std::atomic<int> calls{0};
  for (int i = 0; i < 2; ++i) {
    auto r = cache.GetOrLoad({3, 0}, Counting(&calls, Filled(0, 'z')));
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE((*r)->empty());
  }
  EXPECT_EQ(calls.load(), 2) << "a disabled cache served a hit";
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(BlockCache, DropVersionRemovesEveryEntryOfThatVersionOnly) {
  BlockCache cache(1000);
  std::atomic<int> calls{0};
  for (uint64_t slot : {0, 1, 2}) {
    ASSERT_TRUE(cache.GetOrLoad({5, slot}, Counting(&calls, Filled(10, 'v'))).ok());
    ASSERT_TRUE(cache.GetOrLoad({6, slot}, Counting(&calls, Filled(20, 'w'))).ok());
  }
  cache.DropVersion(5);
  cache.DropVersion(99);
  CacheStats s = cache.Stats();
  EXPECT_EQ(s.entries, 3u);
  EXPECT_EQ(s.bytes, 60u);
  EXPECT_EQ(s.evictions, 0u) << "dropping is not evicting";
  for (uint64_t slot : {0, 1, 2}) {
    EXPECT_FALSE(Cached(cache, {5, slot}));
    EXPECT_TRUE(Cached(cache, {6, slot}));
  }
  // A dropped key loads again.
  auto again = cache.GetOrLoad({5, 0}, Counting(&calls, Filled(10, 'n')));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(**again, std::string(10, 'n'));
}

// N threads miss on one key while its loader is held back: the loader runs
// once and every thread gets its value (or its error).
class SingleFlight : public ::testing::Test {
 protected:
  static constexpr int kThreads = 8;

  // Starts kThreads GetOrLoad calls of one key, waits until all of them are
  // inside the cache (one loading, the others waiting for it), then lets the
  // loader return `result`.
  std::vector<Result<BlockCache::Value>> Run(BlockCache& cache, Result<BlockCache::Value> result) {
    std::atomic<bool> release{false};
    auto loader = [&]() -> Result<BlockCache::Value> {
      calls_++;
      while (!release.load()) std::this_thread::yield();
      return result;
    };
    const CacheStats before = cache.Stats();
    std::vector<Result<BlockCache::Value>> out(kThreads, Status(Code::kInternal, "not run"));
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] { out[t] = cache.GetOrLoad({9, 9}, loader); });
    }
    EXPECT_TRUE(test::WaitFor([&] {
      const CacheStats s = cache.Stats();
      return s.hits + s.misses - before.hits - before.misses == kThreads;
    })) << "not every call reached the cache";
    release = true;
    for (auto& t : threads) t.join();
    return out;
  }

  std::atomic<int> calls_{0};
};

TEST_F(SingleFlight, ConcurrentMissesOnOneKeyRunTheLoaderOnce) {
  BlockCache cache(1000);
  auto value = Filled(100, 'q');
  for (const auto& r : Run(cache, value)) {
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(*r, value) << "a waiter got another object";
  }
  EXPECT_EQ(calls_.load(), 1);
  const CacheStats s = cache.Stats();
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, kThreads - 1u);
  EXPECT_EQ(s.entries, 1u);
}

TEST_F(SingleFlight, ErrorReachesEveryWaiterAndIsNotCached) {
  BlockCache cache(1000);
  for (const auto& r : Run(cache, Status(Code::kCorruption, "block 3 of w: hash mismatch"))) {
    EXPECT_EQ(r.status().code(), Code::kCorruption);
    EXPECT_EQ(r.status().message(), "block 3 of w: hash mismatch");
  }
  EXPECT_EQ(calls_.load(), 1);
  EXPECT_EQ(cache.Stats().entries, 0u);
  // The next asker loads again, and this time succeeds.
  for (const auto& r : Run(cache, Filled(4, 'k'))) {
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(**r, "kkkk");
  }
  EXPECT_EQ(calls_.load(), 2);
  EXPECT_EQ(cache.Stats().entries, 1u);
}

// Many threads on few keys with a cache that holds a fraction of them, and
// versions dropped meanwhile: every value is the one its key loads, the
// loader ran exactly once per miss, and the byte bound holds.
TEST(BlockCache, ConcurrentLoadsEvictionsAndDropsStayConsistent) {
  constexpr int kThreads = 8, kOps = 3000;
  constexpr uint64_t kVersions = 4, kSlots = 16, kCapacity = 8000;
  BlockCache cache(kCapacity);
  auto content = [](CacheKey k) {
    return std::string(100 + 37 * k.slot + 11 * k.version, static_cast<char>('a' + k.slot));
  };
  std::atomic<uint64_t> loads{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      test::Rng rng(t + 1);
      for (int i = 0; i < kOps; ++i) {
        const CacheKey key{rng.Below(kVersions), rng.Below(kSlots)};
        if (rng.Below(200) == 0) {
          cache.DropVersion(key.version);
          continue;
        }
        auto r = cache.GetOrLoad(key, [&]() -> Result<BlockCache::Value> {
          loads++;
          return std::make_shared<const Bytes>(content(key));
        });
        if (!r.ok() || **r != content(key)) wrong++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0u);
  const CacheStats s = cache.Stats();
  EXPECT_EQ(s.misses, loads.load());
  EXPECT_LE(s.bytes, kCapacity);
  EXPECT_LE(s.entries, kVersions * kSlots);
  EXPECT_GT(s.hits, 0u);
  EXPECT_GT(s.evictions, 0u);
  uint64_t bytes = 0, entries = 0;
  for (uint64_t v = 0; v < kVersions; ++v) {
    for (uint64_t slot = 0; slot < kSlots; ++slot) {
      if (Cached(cache, {v, slot})) {
        bytes += content({v, slot}).size();
        entries++;
      }
    }
  }
  EXPECT_EQ(bytes, s.bytes);
  EXPECT_EQ(entries, s.entries);
}

}  // namespace
}  // namespace dte::fs
