// The fixture of the CachedStore tests (cached_store_test.cc,
// cached_store_write_test.cc): a fake remote store holding blobs named by
// their content, a real index and a cache directory.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "store/cached_store.h"
#include "store/hash.h"
#include "store/manifest.h"
#include "tests/testutil/forwarding_store.h"
#include "tests/testutil/memory_store.h"

namespace dte::cached_store_test {

using test::ForwardingStore;
using test::MemoryStore;
using test::ScopedTempDir;
using test::StoreOp;

inline constexpr uint64_t kChunk = 256 << 10;

inline std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// Every chunk file under the cache directory (temporary ones included).
inline std::vector<std::string> CacheFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out.push_back(e.path().string());
  }
  return out;
}

// A fake remote store holding blobs named by their content, an index and a
// cache directory; Open() wraps a fresh handle on the fake store (shared by
// every CachedStore the test opens).
class CachedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto index = Index::Open(dir_.path() + "/index");
    ASSERT_TRUE(index.ok()) << index.status().message();
    index_ = std::move(index).value();
  }

  // Stores `data` as a blob; returns its key.
  std::string AddBlob(const std::string& data) {
    std::string key = BlobKey(HashBytes(data.data(), data.size()));
    EXPECT_TRUE(remote_->Put(key, data).ok());
    return key;
  }

  std::unique_ptr<CachedStore> Open(uint64_t capacity = uint64_t{1} << 30,
                                    uint64_t chunk = kChunk) {
    CachedStoreOptions o;
    o.dir = cache_dir();
    o.capacity_bytes = capacity;
    o.chunk_bytes = chunk;
    auto cached = CachedStore::Open(std::make_unique<Forward>(remote_.get()), index_.get(), o);
    EXPECT_TRUE(cached.ok()) << cached.status().message();
    return cached.ok() ? std::move(cached).value() : nullptr;
  }

  std::string cache_dir() const { return dir_.path() + "/blobs"; }
  uint64_t RemoteReads() const { return remote_->Calls(StoreOp::kReadRange); }

  // An ObjectStore that forwards to the shared fake (which must outlive it).
  class Forward final : public ForwardingStore {
   public:
    explicit Forward(MemoryStore* s) : ForwardingStore(s) {}
  };

  ScopedTempDir dir_;
  std::unique_ptr<MemoryStore> remote_ = std::make_unique<MemoryStore>("remote");
  std::unique_ptr<Index> index_;
};

inline std::string Read(CachedStore& c, const std::string& key, uint64_t offset, uint64_t len) {
  auto r = c.GetRange(key, offset, len);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : "";
}

}  // namespace dte::cached_store_test
