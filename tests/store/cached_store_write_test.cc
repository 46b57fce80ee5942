// CachedStore write-through: blobs written through the cache are kept once
// the wrapped store has them, checked against their names, within the
// capacity, and never entered before their files are complete.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "store/cached_store.h"
#include "store/hash.h"
#include "store/internal/chunk_entry.h"
#include "store/manifest.h"
#include "tests/store/cached_store_fixture.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using cached_store_test::CachedStoreTest;
using cached_store_test::CacheFiles;
using cached_store_test::kChunk;
using cached_store_test::RandomBytes;
using cached_store_test::Read;
using test::StoreOp;

std::string KeyOf(const std::string& data) { return BlobKey(HashBytes(data.data(), data.size())); }

// Writes `data` to a fresh spool file of the store; returns its path.
std::string Spool(ObjectStore& store, const std::string& data) {
  const std::string path = store.NewTempPath().value();
  std::ofstream(path, std::ios::binary) << data;
  return path;
}

size_t IndexEntries(Index& index) {
  auto entries = index.ListCacheEntries(internal::kChunkEntryPrefix);
  EXPECT_TRUE(entries.ok()) << entries.status().message();
  return entries.ok() ? entries->size() : 0;
}

TEST_F(CachedStoreTest, WrittenBlobsAreReadBackWithoutARequest) {
  const std::string a = RandomBytes(kChunk * 3 + 500, 1), b = RandomBytes(kChunk + 7, 2);
  const std::string key_a = KeyOf(a), key_b = KeyOf(b);
  {
    auto c = Open();
    ASSERT_TRUE(c->Put(key_a, a).ok());
    const std::string path = Spool(*c, b);
    ASSERT_TRUE(c->PutFile(key_b, path).ok());
    EXPECT_FALSE(std::ifstream(path).good()) << "the spool file was not consumed";
    EXPECT_EQ(remote_->Objects().at(key_a), a);
    EXPECT_EQ(remote_->Objects().at(key_b), b);
    const BlobCacheStats s = c->Stats();
    EXPECT_EQ(s.written, 6u);
    EXPECT_EQ(s.written_bytes, a.size() + b.size());
    EXPECT_EQ(s.chunks, 6u);
    EXPECT_EQ(s.write_errors, 0u);
    EXPECT_EQ(Read(*c, key_a, kChunk - 3, 2 * kChunk), a.substr(kChunk - 3, 2 * kChunk));
    EXPECT_EQ(c->Get(key_b).value(), b);
    EXPECT_EQ(RemoteReads(), 0u);
    EXPECT_EQ(remote_->Calls(StoreOp::kGet), 0u);
    EXPECT_EQ(remote_->Calls(StoreOp::kSize), 0u) << "the size was known from the write";
  }
  // Kept across a restart, like fetched chunks.
  auto c = Open();
  EXPECT_EQ(c->Get(key_a).value(), a);
  EXPECT_EQ(RemoteReads() + remote_->Calls(StoreOp::kGet), 0u);
  EXPECT_EQ(IndexEntries(*index_), 6u);
}

TEST_F(CachedStoreTest, ChunksAreEnteredOnlyAfterTheStoreHasTheBlob) {
  const std::string data = RandomBytes(kChunk * 2, 3);
  const std::string key = KeyOf(data);
  auto c = Open();
  size_t entries_during = 99, files_during = 99;
  remote_->SetHook([&](StoreOp op, const std::string& k) {
    if (op != StoreOp::kPut || k != key) return;
    entries_during = IndexEntries(*index_);
    files_during = CacheFiles(cache_dir()).size();
  });
  ASSERT_TRUE(c->Put(key, data).ok());
  // While the upload ran, the chunk files were complete but unknown to the
  // index: a crash then leaves files that the next Open deletes.
  EXPECT_EQ(entries_during, 0u);
  EXPECT_EQ(files_during, 2u);
  EXPECT_EQ(IndexEntries(*index_), 2u);
}

TEST_F(CachedStoreTest, FailedWritesKeepNothing) {
  const std::string a = RandomBytes(kChunk * 2, 4), b = RandomBytes(kChunk * 2 + 1, 5);
  auto c = Open();
  remote_->FailNth(StoreOp::kPut, 1);
  remote_->FailNth(StoreOp::kPutFile, 1);
  EXPECT_EQ(c->Put(KeyOf(a), a).code(), Code::kIOError);
  const std::string path = Spool(*c, b);
  EXPECT_EQ(c->PutFile(KeyOf(b), path).code(), Code::kIOError);
  EXPECT_EQ(c->Stats().chunks, 0u);
  EXPECT_TRUE(CacheFiles(cache_dir()).empty());
  EXPECT_EQ(IndexEntries(*index_), 0u);
  // Not in the store, not in the cache: reading it is NotFound.
  EXPECT_EQ(c->Get(KeyOf(a)).status().code(), Code::kNotFound);
}

TEST_F(CachedStoreTest, WrittenBytesThatDoNotMatchTheirNameAreNotKept) {
  const std::string key = KeyOf("right");
  auto c = Open();
  ASSERT_TRUE(c->Put(key, "wrong").ok());  // the store's business; not the cache's
  const BlobCacheStats s = c->Stats();
  EXPECT_EQ(s.chunks, 0u);
  EXPECT_EQ(s.write_errors, 1u);
  EXPECT_NE(s.last_error.find("does not match its name"), std::string::npos) << s.last_error;
  EXPECT_TRUE(CacheFiles(cache_dir()).empty());
}

TEST_F(CachedStoreTest, OnlyBlobsWithinTheCapacityAreWrittenThrough) {
  auto c = Open(/*capacity=*/4 * kChunk);
  const std::string big = RandomBytes(kChunk * 4 + 1, 6);
  ASSERT_TRUE(c->Put(KeyOf(big), big).ok());
  ASSERT_TRUE(c->Put("manifests/v00000001.json", "{}").ok());
  EXPECT_EQ(c->Stats().chunks, 0u);
  EXPECT_EQ(c->Stats().write_errors, 0u);
  // A fetched blob, then a written one: the older chunks make room, the
  // bound holds, the written blob is kept whole.
  const std::string old = RandomBytes(kChunk * 2, 7), fresh = RandomBytes(kChunk * 3, 8);
  const std::string old_key = AddBlob(old);
  EXPECT_EQ(c->Get(old_key).value(), old);
  ASSERT_TRUE(c->Put(KeyOf(fresh), fresh).ok());
  const BlobCacheStats s = c->Stats();
  EXPECT_LE(s.bytes, 4 * kChunk);
  EXPECT_EQ(s.evictions, 1u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_TRUE(c->Contains({KeyOf(fresh), i})) << i;
  EXPECT_FALSE(c->Contains({old_key, 0})) << "the least recently used chunk stayed";
  EXPECT_TRUE(c->Contains({old_key, 1}));
  EXPECT_EQ(CacheFiles(cache_dir()).size(), 4u);
}

TEST_F(CachedStoreTest, DeleteThroughTheCacheDropsWrittenChunks) {
  const std::string data = RandomBytes(kChunk + 1, 9);
  const std::string key = KeyOf(data);
  auto c = Open();
  ASSERT_TRUE(c->Put(key, data).ok());
  ASSERT_TRUE(c->Delete(key).ok());
  EXPECT_EQ(c->Stats().chunks, 0u);
  EXPECT_EQ(c->Get(key).status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace dte
