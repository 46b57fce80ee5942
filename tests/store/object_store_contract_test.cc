// The contract of store/object_store.h, run against every implementation
// (LocalStore on a temporary directory, S3Store on a real S3-compatible
// server on loopback, and the test MemoryStore), so the fake stays faithful
// to the real thing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "store/local_store.h"
#include "store/object_store.h"
#include "store/s3_store.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/s3_server.h"

namespace dte {
namespace {

struct LocalEnv {
  static constexpr const char* kName = "Local";
  test::ScopedTempDir dir;
  std::unique_ptr<ObjectStore> store;
  LocalEnv() {
    auto opened = LocalStore::Open(dir.path());
    EXPECT_TRUE(opened.ok()) << opened.status().ToString();
    if (opened.ok()) store = std::move(*opened);
  }
};

// A fresh prefix of the bucket on moto's signature-checking server. Fails
// (never skips) when the server cannot be started.
struct S3Env {
  static constexpr const char* kName = "S3";
  test::ScopedTempDir spool;
  std::unique_ptr<ObjectStore> store;
  S3Env() {
    static std::atomic<int> counter{0};
    auto server = test::S3TestServer::GetSigned();
    if (!server.ok()) {
      ADD_FAILURE() << "no S3 test server: " << server.status().ToString();
      return;
    }
    const std::string prefix =
        "contract/" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    auto opened = OpenS3Store(test::S3TestServer::kSignedBucket, prefix,
                              (*server)->Options(spool.path()), /*create=*/true);
    EXPECT_TRUE(opened.ok()) << opened.status().ToString();
    if (opened.ok()) store = std::move(*opened);
  }
};

struct MemoryEnv {
  static constexpr const char* kName = "Memory";
  std::unique_ptr<ObjectStore> store = std::make_unique<test::MemoryStore>();
};

struct EnvName {
  template <typename T>
  static std::string GetName(int) {
    return T::kName;
  }
};

template <typename Env>
class ObjectStoreContract : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NE(env_.store, nullptr); }
  ObjectStore& store() { return *env_.store; }

  Env env_;
};

using Envs = ::testing::Types<LocalEnv, S3Env, MemoryEnv>;
TYPED_TEST_SUITE(ObjectStoreContract, Envs, EnvName);

// Bytes that are not text, so encodings and NULs are exercised.
std::string Binary(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return s;
}

TYPED_TEST(ObjectStoreContract, PutThenGetRoundTrips) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{3} << 20}) {
    const std::string key = "blobs/ab/obj" + std::to_string(n);
    const std::string data = Binary(n, 7);
    ASSERT_TRUE(this->store().Put(key, data).ok());
    auto got = this->store().Get(key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, data) << key;
    auto size = this->store().Size(key);
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(*size, std::optional<uint64_t>(n));
  }
}

TYPED_TEST(ObjectStoreContract, PutReplacesForGetAndRanges) {
  ASSERT_TRUE(this->store().Put("refs/head", "old bytes").ok());
  ASSERT_TRUE(this->store().GetRange("refs/head", 0, 3).ok());  // may cache the old object
  ASSERT_TRUE(this->store().Put("refs/head", "NEW").ok());
  EXPECT_EQ(this->store().Get("refs/head").value(), "NEW");
  EXPECT_EQ(this->store().GetRange("refs/head", 0, 3).value(), "NEW");
  EXPECT_EQ(this->store().Size("refs/head").value(), std::optional<uint64_t>(3));
}

TYPED_TEST(ObjectStoreContract, MissingObjectIsNotFoundNamingKey) {
  auto got = this->store().Get("manifests/v00000009.json");
  ASSERT_EQ(got.status().code(), Code::kNotFound);
  EXPECT_NE(got.status().message().find("manifests/v00000009.json"), std::string::npos);
  EXPECT_EQ(this->store().GetRange("blobs/x", 0, 1).status().code(), Code::kNotFound);
  char byte;
  EXPECT_EQ(this->store().ReadRange("blobs/x", 0, 1, &byte).code(), Code::kNotFound);
  EXPECT_EQ(this->store().ModifiedTime("blobs/x").status().code(), Code::kNotFound);
  EXPECT_EQ(this->store().Touch("blobs/x").code(), Code::kNotFound);
  auto size = this->store().Size("blobs/x");
  ASSERT_TRUE(size.ok());
  EXPECT_FALSE(size->has_value());
  // Below an object, as if it were a directory.
  ASSERT_TRUE(this->store().Put("blobs/file", "x").ok());
  EXPECT_EQ(this->store().Get("blobs/file/sub").status().code(), Code::kNotFound);
  EXPECT_EQ(this->store().GetRange("blobs/file/sub", 0, 1).status().code(), Code::kNotFound);
  EXPECT_FALSE(this->store().Size("blobs/file/sub").value().has_value());
  EXPECT_TRUE(this->store().Delete("blobs/file/sub").ok());
}

TYPED_TEST(ObjectStoreContract, RangesReturnTheRequestedBytes) {
  const std::string data = Binary(10000, 3);
  ASSERT_TRUE(this->store().Put("blobs/r", data).ok());
  for (auto [off, len] : {std::pair<uint64_t, uint64_t>{0, 10000},
                          {0, 1},
                          {9999, 1},
                          {4096, 777},
                          {10000, 0},
                          {123, 0}}) {
    auto got = this->store().GetRange("blobs/r", off, len);
    ASSERT_TRUE(got.ok()) << off << "+" << len << ": " << got.status().ToString();
    EXPECT_EQ(*got, data.substr(off, len)) << off << "+" << len;
    std::string buf(len + 2, '#');
    ASSERT_TRUE(this->store().ReadRange("blobs/r", off, len, buf.data() + 1).ok());
    EXPECT_EQ(buf, "#" + data.substr(off, len) + "#") << "ReadRange wrote outside its range";
  }
}

TYPED_TEST(ObjectStoreContract, RangePastTheEndIsCorruptionNamingKeyAndOffsets) {
  ASSERT_TRUE(this->store().Put("blobs/short", "12345678").ok());
  auto got = this->store().GetRange("blobs/short", 5, 10);
  ASSERT_EQ(got.status().code(), Code::kCorruption);
  const std::string& m = got.status().message();
  EXPECT_NE(m.find("blobs/short"), std::string::npos) << m;
  EXPECT_NE(m.find("[5, 15)"), std::string::npos) << m;
  EXPECT_NE(m.find("8 bytes"), std::string::npos) << m;
  char buf[16];
  EXPECT_EQ(this->store().ReadRange("blobs/short", 8, 1, buf).code(), Code::kCorruption);
  EXPECT_EQ(this->store().GetRange("blobs/short", 9, 0).status().code(), Code::kCorruption);
  EXPECT_EQ(this->store().GetRange("blobs/short", UINT64_MAX, 2).status().code(),
            Code::kInvalidArgument);
}

TYPED_TEST(ObjectStoreContract, CreateExclusiveRefusesAnExistingKey) {
  const std::string key = "manifests/v00000003.json";
  ASSERT_TRUE(this->store().CreateExclusive(key, "first").ok());
  Status again = this->store().CreateExclusive(key, "second");
  ASSERT_EQ(again.code(), Code::kAlreadyExists);
  EXPECT_NE(again.message().find(key + " already exists"), std::string::npos) << again.message();
  EXPECT_EQ(this->store().Get(key).value(), "first");
}

TYPED_TEST(ObjectStoreContract, CreateExclusiveHasOneWinnerAcrossThreads) {
  constexpr int kThreads = 16;
  for (int round = 0; round < 5; ++round) {
    const std::string key = "manifests/v" + std::to_string(round) + ".json";
    std::latch start(kThreads);
    std::vector<Status> results(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        start.arrive_and_wait();
        results[i] = this->store().CreateExclusive(key, Binary(65536, static_cast<uint8_t>(i)));
      });
    }
    for (auto& t : threads) t.join();
    int winner = -1;
    for (int i = 0; i < kThreads; ++i) {
      if (results[i].ok()) {
        EXPECT_EQ(winner, -1) << "two winners in round " << round;
        winner = i;
      } else {
        EXPECT_EQ(results[i].code(), Code::kAlreadyExists) << results[i].ToString();
      }
    }
    ASSERT_NE(winner, -1) << "no winner in round " << round;
    EXPECT_EQ(this->store().Get(key).value(), Binary(65536, static_cast<uint8_t>(winner)));
  }
}

TYPED_TEST(ObjectStoreContract, ListIsSortedAndFilteredByPrefix) {
  // Byte order differs from a per-directory walk: '-' and '.' sort before '/'.
  const std::vector<std::string> keys = {
      "z",          "blobs/ab/1", "manifests/v10", "a.b",          "blobs/ab-x",
      "blobs/ab.c", "blobs/a/2",  "blobs/b",       "manifests/v2", "blobs/ab/0/9"};
  for (const auto& k : keys) ASSERT_TRUE(this->store().Put(k, k).ok()) << k;
  auto all = this->store().List("");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  std::vector<std::string> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(*all, sorted);
  EXPECT_EQ(this->store().List("blobs/a").value(),
            (std::vector<std::string>{"blobs/a/2", "blobs/ab-x", "blobs/ab.c", "blobs/ab/0/9",
                                      "blobs/ab/1"}));
  EXPECT_EQ(this->store().List("blobs/ab/").value(),
            (std::vector<std::string>{"blobs/ab/0/9", "blobs/ab/1"}));
  EXPECT_EQ(this->store().List("manifests/v1").value(), std::vector<std::string>{"manifests/v10"});
  EXPECT_TRUE(this->store().List("nothing/").value().empty());
  EXPECT_TRUE(this->store().List("blobs/b/").value().empty());
}

TYPED_TEST(ObjectStoreContract, DeleteIsIdempotent) {
  ASSERT_TRUE(this->store().Put("blobs/d", "x").ok());
  ASSERT_TRUE(this->store().GetRange("blobs/d", 0, 1).ok());
  EXPECT_TRUE(this->store().Delete("blobs/d").ok());
  EXPECT_EQ(this->store().Get("blobs/d").status().code(), Code::kNotFound);
  EXPECT_EQ(this->store().GetRange("blobs/d", 0, 1).status().code(), Code::kNotFound);
  EXPECT_TRUE(this->store().Delete("blobs/d").ok());
  EXPECT_TRUE(this->store().Delete("never/was").ok());
  EXPECT_TRUE(this->store().List("").value().empty());
}

TYPED_TEST(ObjectStoreContract, RejectsInvalidKeysNamingThem) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"../x", "../x"},
      {"a//b", "a//b"},
      {"/abs", "/abs"},
      {"a/./b", "a/./b"},
      {std::string("a\0b", 3), "a\\x00b"},
      {"x\\y", "x\\y"},
      {"a/", "a/"},
      {"..", ".."},
      {"a/../b", "a/../b"},
      {"a b", "a b"},
      {"", "\"\""},
      {std::string(256, 'k'), std::string(256, 'k')}};
  ObjectStore& s = this->store();
  for (const auto& [key, shown] : bad) {
    char buf[1];
    for (const Status& st :
         {s.Put(key, "x"), s.CreateExclusive(key, "x"), s.Get(key).status(),
          s.GetRange(key, 0, 1).status(), s.ReadRange(key, 0, 1, buf), s.Size(key).status(),
          s.Delete(key), s.ModifiedTime(key).status(), s.Touch(key)}) {
      ASSERT_EQ(st.code(), Code::kInvalidArgument) << shown << ": " << st.ToString();
      EXPECT_NE(st.message().find(shown), std::string::npos) << st.message();
    }
  }
  for (const std::string prefix : {"/abs", "../", "a//", "a\\", "./x"}) {
    EXPECT_EQ(s.List(prefix).status().code(), Code::kInvalidArgument) << prefix;
  }
  EXPECT_TRUE(s.List("").value().empty()) << "a rejected key was written";
}

TYPED_TEST(ObjectStoreContract, PutFileConsumesTheSpoolFile) {
  auto path = this->store().NewTempPath();
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  const std::string data = Binary(200000, 9);
  std::ofstream(*path, std::ios::binary) << data;
  ASSERT_TRUE(this->store().PutFile("blobs/big", *path).ok());
  EXPECT_EQ(this->store().Get("blobs/big").value(), data);
  EXPECT_FALSE(std::ifstream(*path).good()) << *path << " was not consumed";
  EXPECT_EQ(this->store().List("").value(), std::vector<std::string>{"blobs/big"});
  auto again = this->store().PutFile("blobs/other", *path);
  EXPECT_EQ(again.code(), Code::kNotFound) << again.ToString();
}

TYPED_TEST(ObjectStoreContract, NewTempPathsAreDistinct) {
  auto a = this->store().NewTempPath();
  auto b = this->store().NewTempPath();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
}

TYPED_TEST(ObjectStoreContract, ModifiedTimeIsWhenWritten) {
  const int64_t before = static_cast<int64_t>(std::time(nullptr));
  ASSERT_TRUE(this->store().Put("blobs/t", "x").ok());
  const int64_t after = static_cast<int64_t>(std::time(nullptr));
  auto mtime = this->store().ModifiedTime("blobs/t");
  ASSERT_TRUE(mtime.ok());
  EXPECT_GE(*mtime, before - 1);  // filesystem timestamps may trail the clock slightly
  EXPECT_LE(*mtime, after);
  EXPECT_TRUE(this->store().Touch("blobs/t").ok());
}

TYPED_TEST(ObjectStoreContract, ReadersNeverSeePartialReplacements) {
  const std::string a(300000, 'a'), b(700000, 'b');
  ASSERT_TRUE(this->store().Put("refs/live", a).ok());
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, torn{0};
  std::thread reader([&] {
    while (!done.load() || reads.load() < 20) {
      auto got = this->store().Get("refs/live");
      if (!got.ok() || (*got != a && *got != b)) ++torn;
      ++reads;
    }
  });
  Status put;
  for (int i = 0; i < 40 && put.ok(); ++i) put = this->store().Put("refs/live", i % 2 ? a : b);
  done = true;
  reader.join();
  ASSERT_TRUE(put.ok()) << put.ToString();
  EXPECT_EQ(torn.load(), 0) << "of " << reads.load() << " reads";
  EXPECT_GT(reads.load(), 0);
}

}  // namespace
}  // namespace dte
