// InodeTable: numbers from kFirstDynamicIno on, one per (version, file),
// stable, never reused, and agreed on by threads interning at once.
#include "fs/inode_table.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "tests/testutil/checkpoint.h"

namespace dte::fs {
namespace {

TEST(InodeTable, FixedInodesAreBelowTheFirstDynamicOne) {
  for (uint64_t fixed : {kRootIno, kLatestIno, kDteDirIno, kStatusIno}) {
    EXPECT_LT(fixed, kFirstDynamicIno);
  }
  InodeTable table;
  EXPECT_EQ(table.Intern(0, kDirFile), kFirstDynamicIno);
  for (uint64_t ino = 0; ino < kFirstDynamicIno; ++ino) {
    EXPECT_FALSE(table.Find(ino).has_value()) << ino;
  }
}

TEST(InodeTable, PairKeepsItsNumberAndUnknownNumbersAreNotFound) {
  InodeTable table;
  const uint64_t dir = table.Intern(12, kDirFile);
  const uint64_t file0 = table.Intern(12, 0);
  const uint64_t file1 = table.Intern(12, 1);
  const uint64_t other = table.Intern(13, 0);
  EXPECT_EQ(dir, kFirstDynamicIno);
  EXPECT_EQ(file0, kFirstDynamicIno + 1);
  EXPECT_EQ(file1, kFirstDynamicIno + 2);
  EXPECT_EQ(other, kFirstDynamicIno + 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(table.Intern(12, 0), file0);
    EXPECT_EQ(table.Intern(12, kDirFile), dir);
    EXPECT_EQ(table.Intern(13, 0), other);
  }
  EXPECT_EQ(table.size(), 4u);
  auto key = table.Find(file1);
  ASSERT_TRUE(key.has_value());
  EXPECT_EQ(key->version, 12u);
  EXPECT_EQ(key->file, 1u);
  EXPECT_EQ(table.Find(dir)->file, kDirFile);
  EXPECT_FALSE(table.Find(kFirstDynamicIno + 4).has_value());
  EXPECT_FALSE(table.Find(UINT64_MAX).has_value());
}

// A version that leaves and comes back keeps its numbers; the table never
// hands out a number twice.
TEST(InodeTable, NumbersAreNeverReused) {
  InodeTable table;
  std::map<std::pair<uint64_t, uint32_t>, uint64_t> seen;
  test::Rng rng(3);
  for (int i = 0; i < 2000; ++i) {
    const uint64_t version = rng.Below(50);
    const uint32_t file = rng.Below(8) == 0 ? kDirFile : static_cast<uint32_t>(rng.Below(6));
    const uint64_t ino = table.Intern(version, file);
    auto [it, inserted] = seen.try_emplace({version, file}, ino);
    EXPECT_EQ(it->second, ino);
    if (inserted) {
      EXPECT_EQ(ino, kFirstDynamicIno + seen.size() - 1);
    }
  }
  EXPECT_EQ(table.size(), seen.size());
  for (const auto& [key, ino] : seen) {
    auto found = table.Find(ino);
    ASSERT_TRUE(found.has_value());
    EXPECT_EQ(std::make_pair(found->version, found->file), key);
  }
}

// Threads intern overlapping pairs in different orders (as lookups of one
// directory on several FUSE workers do): one number per pair, the numbers
// dense, and Find agreeing with every thread.
TEST(InodeTable, ConcurrentInternAgreesOnOneNumberPerPair) {
  constexpr int kThreads = 8;
  constexpr uint64_t kVersionsPerThread = 40, kFiles = 5;
  InodeTable table;
  using Seen = std::map<std::pair<uint64_t, uint32_t>, uint64_t>;
  std::vector<Seen> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      test::Rng rng(t + 100);
      // Overlapping ranges of versions: thread t shares half with thread t+1.
      for (int i = 0; i < 1500; ++i) {
        const uint64_t version = t * kVersionsPerThread / 2 + rng.Below(kVersionsPerThread);
        const uint32_t file = static_cast<uint32_t>(rng.Below(kFiles + 1));
        const uint32_t f = file == kFiles ? kDirFile : file;
        const uint64_t ino = table.Intern(version, f);
        auto [it, inserted] = seen[t].try_emplace({version, f}, ino);
        if (it->second != ino) ADD_FAILURE() << "a pair changed its number";
        auto found = table.Find(ino);
        if (!found || found->version != version || found->file != f) {
          ADD_FAILURE() << "Find(" << ino << ") does not name the pair interned";
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  Seen all;
  for (const auto& s : seen) {
    for (const auto& [key, ino] : s) {
      auto [it, inserted] = all.try_emplace(key, ino);
      EXPECT_EQ(it->second, ino) << "two threads got different numbers for one pair";
    }
  }
  std::vector<uint64_t> numbers;
  for (const auto& [key, ino] : all) numbers.push_back(ino);
  std::sort(numbers.begin(), numbers.end());
  ASSERT_EQ(table.size(), numbers.size());
  for (size_t i = 0; i < numbers.size(); ++i) {
    ASSERT_EQ(numbers[i], kFirstDynamicIno + i) << "numbers are not dense or one is shared";
  }
}

}  // namespace
}  // namespace dte::fs
