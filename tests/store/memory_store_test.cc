// The fault injection of the test MemoryStore (its plain behaviour is covered
// by object_store_contract_test.cc).
#include "tests/testutil/memory_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <vector>

namespace dte::test {
namespace {

TEST(MemoryStore, FailNthFailsOnlyThatCall) {
  MemoryStore store;
  store.FailNth(StoreOp::kPut, 2, IOError("disk on fire"));
  EXPECT_TRUE(store.Put("a", "1").ok());
  Status second = store.Put("b", "2");
  EXPECT_EQ(second.code(), Code::kIOError);
  EXPECT_EQ(second.message(), "put b: disk on fire");
  EXPECT_TRUE(store.Put("c", "3").ok());
  EXPECT_EQ(store.List("").value(), (std::vector<std::string>{"a", "c"}));
  EXPECT_TRUE(store.Get("b").status().code() == Code::kNotFound) << "failed put stored data";
}

TEST(MemoryStore, FaultsAreCountedPerOperationKind) {
  MemoryStore store;
  ASSERT_TRUE(store.Put("a", "1").ok());
  store.FailNth(StoreOp::kGet, 1);
  EXPECT_TRUE(store.GetRange("a", 0, 1).ok());  // another kind: unaffected
  EXPECT_TRUE(store.Size("a").ok());
  EXPECT_EQ(store.Get("a").status().code(), Code::kIOError);
  EXPECT_TRUE(store.Get("a").ok());
  EXPECT_EQ(store.Calls(StoreOp::kGet), 2u);
  EXPECT_EQ(store.Calls(StoreOp::kGetRange), 1u);
  EXPECT_EQ(store.Calls(StoreOp::kPut), 1u);
}

TEST(MemoryStore, FailAllLastsUntilCleared) {
  MemoryStore store;
  store.FailAll(StoreOp::kCreateExclusive, Unavailable("throttled"));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(store.CreateExclusive("manifests/v1", "x").code(), Code::kUnavailable);
  }
  store.ClearFaults();
  EXPECT_TRUE(store.CreateExclusive("manifests/v1", "x").ok());
}

TEST(MemoryStore, DroppedWritesAreAcknowledgedButLost) {
  MemoryStore store;
  store.SetDropWrites(true);
  EXPECT_TRUE(store.Put("blobs/a", "x").ok());
  EXPECT_TRUE(store.CreateExclusive("manifests/v1", "x").ok());
  auto spool = store.NewTempPath();
  ASSERT_TRUE(spool.ok());
  std::ofstream(*spool) << "spooled";
  EXPECT_TRUE(store.PutFile("blobs/b", *spool).ok());
  EXPECT_TRUE(store.Objects().empty());
  store.SetDropWrites(false);
  EXPECT_TRUE(store.Put("blobs/a", "x").ok());
  EXPECT_EQ(store.Objects().size(), 1u);
}

TEST(MemoryStore, DelaySlowsOnlyThatKind) {
  MemoryStore store;
  ASSERT_TRUE(store.Put("a", "x").ok());
  store.SetDelay(StoreOp::kGet, std::chrono::milliseconds(100));
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(store.Get("a").ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  start = std::chrono::steady_clock::now();
  ASSERT_TRUE(store.Size("a").ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
}

TEST(MemoryStore, HookSeesEachCallAndMayReenterTheStore) {
  MemoryStore store;
  std::vector<std::string> seen;
  store.SetHook([&](StoreOp op, const std::string& key) {
    seen.push_back(std::string(StoreOpName(op)) + " " + key);
    // Another writer sneaks in before the manifest is created.
    if (op == StoreOp::kCreateExclusive) {
      ASSERT_TRUE(store.Put(key, "racer").ok());
    }
  });
  EXPECT_EQ(store.CreateExclusive("manifests/v2", "mine").code(), Code::kAlreadyExists);
  store.SetHook(nullptr);
  EXPECT_EQ(store.Get("manifests/v2").value(), "racer");
  EXPECT_EQ(seen, (std::vector<std::string>{"create_exclusive manifests/v2", "put manifests/v2"}));
}

TEST(MemoryStore, FixedClockStampsWritesAndTouches) {
  MemoryStore store;
  store.SetNow(1000);
  ASSERT_TRUE(store.Put("blobs/a", "x").ok());
  EXPECT_EQ(store.ModifiedTime("blobs/a").value(), 1000);
  store.SetNow(5000);
  EXPECT_EQ(store.ModifiedTime("blobs/a").value(), 1000);
  ASSERT_TRUE(store.Touch("blobs/a").ok());
  EXPECT_EQ(store.ModifiedTime("blobs/a").value(), 5000);
}

TEST(MemoryStore, OperationNamesAreDistinct) {
  std::vector<std::string> names;
  for (size_t i = 0; i < kStoreOpCount; ++i) {
    names.push_back(StoreOpName(static_cast<StoreOp>(i)));
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::unique(names.begin(), names.end()), names.end());
}

}  // namespace
}  // namespace dte::test
