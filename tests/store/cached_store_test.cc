// CachedStore, the local blob cache of remote stores: reads through chunks,
// the LRU bound, restart through the index, damaged and left-over files, and
// single-flight fetches; against the in-memory fake store and a real index.
#include "store/cached_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

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
using test::MemoryStore;
using test::ScopedTempDir;
using test::StoreOp;

TEST_F(CachedStoreTest, ReadsFetchWholeChunksOnceAndMatch) {
  const std::string data = RandomBytes(kChunk * 3 + 1000, 1);
  const std::string key = AddBlob(data);
  auto c = Open();
  // A small read fetches its whole chunk (one request); reads inside it,
  // and Get of the other chunks, need one request per chunk more.
  EXPECT_EQ(Read(*c, key, 10, 100), data.substr(10, 100));
  EXPECT_EQ(RemoteReads(), 1u);
  EXPECT_EQ(Read(*c, key, 5000, 70000), data.substr(5000, 70000));
  EXPECT_EQ(RemoteReads(), 1u);
  auto whole = c->Get(key);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  EXPECT_EQ(*whole, data);
  EXPECT_EQ(RemoteReads(), 4u);
  // Across chunk borders, and the short last chunk.
  EXPECT_EQ(Read(*c, key, kChunk - 7, 2 * kChunk + 14), data.substr(kChunk - 7, 2 * kChunk + 14));
  std::string tail(1000, '\0');
  ASSERT_TRUE(c->ReadRange(key, 3 * kChunk, 1000, tail.data()).ok());
  EXPECT_EQ(tail, data.substr(3 * kChunk));
  EXPECT_EQ(RemoteReads(), 4u);
  const BlobCacheStats s = c->Stats();
  EXPECT_EQ(s.chunks, 4u);
  EXPECT_EQ(s.bytes, data.size());
  EXPECT_EQ(s.fetches, 4u);
  EXPECT_EQ(CacheFiles(cache_dir()).size(), 4u);
}

TEST_F(CachedStoreTest, RangePastTheEndIsCorruptionAndMissingBlobIsNotFound) {
  const std::string key = AddBlob(RandomBytes(1000, 2));
  auto c = Open();
  auto past = c->GetRange(key, 900, 200);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), Code::kCorruption);
  EXPECT_NE(past.status().message().find(key), std::string::npos);
  auto missing = c->Get(BlobKey(HashBytes("nope", 4)));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
}

TEST_F(CachedStoreTest, OtherKeysAreNeverCached) {
  ASSERT_TRUE(remote_->Put("manifests/v00000001.json", "{}").ok());
  auto c = Open();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->Get("manifests/v00000001.json").ok());
  EXPECT_EQ(remote_->Calls(StoreOp::kGet), 3u);
  EXPECT_EQ(c->Stats().chunks, 0u);
  // Not an S3 store: no incremental listing to forward.
  EXPECT_EQ(c->ListAfter("manifests/", "", 10).status().code(), Code::kUnimplemented);
}

TEST_F(CachedStoreTest, WholeBlobThatDoesNotMatchItsNameIsNeitherKeptNorReturned) {
  const std::string key = BlobKey(HashBytes("right", 5));
  ASSERT_TRUE(remote_->Put(key, "wrong").ok());
  auto c = Open();
  auto r = c->Get(key);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorruption);
  EXPECT_EQ(RemoteReads(), 2u);  // read twice: a damaged transfer gets a second chance
  EXPECT_EQ(c->Stats().chunks, 0u);
}

TEST_F(CachedStoreTest, LeastRecentlyUsedChunksAreEvictedWithinTheCapacity) {
  std::vector<std::string> keys;
  for (uint32_t i = 0; i < 4; ++i) keys.push_back(AddBlob(RandomBytes(kChunk, 10 + i)));
  auto c = Open(/*capacity=*/3 * kChunk);
  for (int i = 0; i < 3; ++i) Read(*c, keys[i], 0, 10);
  Read(*c, keys[0], 0, 10);  // 0 is now the most recently used; 1 the least
  Read(*c, keys[3], 0, 10);
  const BlobCacheStats s = c->Stats();
  EXPECT_EQ(s.chunks, 3u);
  EXPECT_LE(s.bytes, 3 * kChunk);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_TRUE(c->Contains({keys[0], 0}));
  EXPECT_FALSE(c->Contains({keys[1], 0}));
  EXPECT_TRUE(c->Contains({keys[2], 0}));
  EXPECT_TRUE(c->Contains({keys[3], 0}));
  EXPECT_EQ(CacheFiles(cache_dir()).size(), 3u);
  // A chunk larger than the whole cache is served but not kept.
  const std::string big = AddBlob(RandomBytes(kChunk, 20));
  auto small = Open(/*capacity=*/kChunk / 2);
  EXPECT_EQ(Read(*small, big, 0, 10).size(), 10u);
  EXPECT_EQ(small->Stats().chunks, 0u);
}

TEST_F(CachedStoreTest, KeptChunksAndTheirUseOrderSurviveARestart) {
  std::vector<std::string> data, keys;
  for (uint32_t i = 0; i < 3; ++i) {
    data.push_back(RandomBytes(kChunk + 5, 30 + i));
    keys.push_back(AddBlob(data.back()));
  }
  {
    auto c = Open(/*capacity=*/8 * kChunk);
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(c->Get(keys[i]).ok());  // 2 chunks each
    Read(*c, keys[0], 0, 10);  // blob 0's first chunk is the most recently used
  }
  // The store is gone: what was kept is still readable, with no request.
  remote_->FailAll(StoreOp::kReadRange, IOError("unreachable"));
  remote_->FailAll(StoreOp::kSize, IOError("unreachable"));
  auto c = Open(/*capacity=*/8 * kChunk);
  EXPECT_EQ(c->Stats().chunks, 6u);
  for (int i = 0; i < 3; ++i) {
    auto r = c->Get(keys[i]);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(*r, data[i]);
  }
  EXPECT_EQ(RemoteReads(), 6u);  // the first daemon's fetches only
  // Reopening with a smaller capacity keeps the most recently used.
  Read(*c, keys[0], 0, 10);
  c.reset();
  auto smaller = Open(/*capacity=*/kChunk);
  EXPECT_EQ(smaller->Stats().chunks, 1u);
  EXPECT_TRUE(smaller->Contains({keys[0], 0}));
  EXPECT_EQ(CacheFiles(cache_dir()).size(), 1u);
}

TEST_F(CachedStoreTest, DamagedCacheFileIsDroppedAndFetchedAgainNeverServed) {
  const std::string data = RandomBytes(kChunk, 40);
  const std::string key = AddBlob(data);
  auto c = Open();
  ASSERT_EQ(Read(*c, key, 0, 10), data.substr(0, 10));
  auto files = CacheFiles(cache_dir());
  ASSERT_EQ(files.size(), 1u);
  {
    std::fstream f(files[0], std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70000);  // the second page
    f.put(static_cast<char>(data[70000] ^ 0x40));
  }
  // The damaged page is found, the chunk fetched again: right bytes.
  EXPECT_EQ(Read(*c, key, 69990, 20), data.substr(69990, 20));
  EXPECT_EQ(RemoteReads(), 2u);
  EXPECT_EQ(c->Stats().dropped, 1u);
  EXPECT_NE(c->Stats().last_error.find("checksum"), std::string::npos);
  EXPECT_EQ(Read(*c, key, 69990, 20), data.substr(69990, 20));
  EXPECT_EQ(RemoteReads(), 2u);  // the fetched copy is kept again
  // Damaged while the store is unreachable: an error, never wrong bytes.
  files = CacheFiles(cache_dir());
  ASSERT_EQ(files.size(), 1u);
  std::filesystem::resize_file(files[0], 1000);
  remote_->FailAll(StoreOp::kReadRange, IOError("unreachable"));
  auto r = c->GetRange(key, 69990, 20);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIOError);
  EXPECT_EQ(c->Stats().chunks, 0u);
}

TEST_F(CachedStoreTest, DropMakesTheNextReadFetchAgain) {
  const std::string data = RandomBytes(3 * kChunk, 50);
  const std::string key = AddBlob(data);
  auto c = Open();
  ASSERT_TRUE(c->Get(key).ok());
  EXPECT_EQ(RemoteReads(), 3u);
  c->Drop(key, kChunk + 10, 20);  // one chunk
  EXPECT_EQ(c->Stats().chunks, 2u);
  EXPECT_EQ(Read(*c, key, kChunk, 100), data.substr(kChunk, 100));
  EXPECT_EQ(RemoteReads(), 4u);
  ASSERT_TRUE(c->Delete(key).ok());
  EXPECT_EQ(c->Stats().chunks, 0u);
  EXPECT_TRUE(CacheFiles(cache_dir()).empty());
}

TEST_F(CachedStoreTest, OpenRemovesWhatACrashLeftAndKeepsTheRest) {
  const std::string a = RandomBytes(kChunk, 60), b = RandomBytes(kChunk, 61);
  const std::string key_a = AddBlob(a), key_b = AddBlob(b);
  {
    auto c = Open();
    Read(*c, key_a, 0, 1);
    Read(*c, key_b, 0, 1);
  }
  auto files = CacheFiles(cache_dir());
  ASSERT_EQ(files.size(), 2u);
  // A chunk cut short (a crash of the machine before the data reached the
  // disk), a temporary file of a killed writer, a file no entry names.
  const std::string file_b = *std::find_if(files.begin(), files.end(), [&](const std::string& f) {
    return f.find(key_b.substr(9)) != std::string::npos;
  });
  std::filesystem::resize_file(file_b, 100);
  std::ofstream(cache_dir() + "/tmp/12345-0") << "partial";
  const std::string orphan = cache_dir() + "/" + internal::ChunkFileName(key_a, 7, 99);
  std::ofstream(orphan) << "orphan";
  auto c = Open();
  EXPECT_EQ(c->Stats().chunks, 1u);
  EXPECT_TRUE(c->Contains({key_a, 0}));
  EXPECT_FALSE(c->Contains({key_b, 0}));
  EXPECT_EQ(CacheFiles(cache_dir()).size(), 1u);
  EXPECT_EQ(Read(*c, key_b, 0, kChunk), b);
  auto entries = index_->ListCacheEntries(internal::kChunkEntryPrefix);
  ASSERT_TRUE(entries.ok());
  EXPECT_EQ(entries->size(), 2u);
}

TEST_F(CachedStoreTest, ChangedChunkSizeStartsAfresh) {
  const std::string key = AddBlob(RandomBytes(2 * kChunk, 70));
  {
    auto c = Open();
    ASSERT_TRUE(c->Get(key).ok());
  }
  auto c = Open(uint64_t{1} << 30, 2 * kChunk);
  EXPECT_EQ(c->Stats().chunks, 0u);
  EXPECT_TRUE(CacheFiles(cache_dir()).empty());
  auto bad = CachedStore::Open(std::make_unique<MemoryStore>(), index_.get(),
                               CachedStoreOptions{cache_dir(), 1 << 30, 1000, 8});
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
}

TEST_F(CachedStoreTest, ConcurrentReadersOfOneChunkFetchItOnce) {
  const std::string data = RandomBytes(kChunk, 80);
  const std::string key = AddBlob(data);
  auto c = Open();
  c->NoteSize(key, data.size());  // no HEAD: every reader goes straight to the chunk
  // The fetch is slow, so readers arrive while it is under way (or, if one
  // is late, find the chunk kept); either way there is one fetch.
  remote_->SetDelay(StoreOp::kReadRange, std::chrono::milliseconds(100));
  std::vector<std::thread> readers;
  std::vector<std::string> got(8);
  for (size_t i = 0; i < got.size(); ++i) {
    readers.emplace_back([&, i] { got[i] = Read(*c, key, 1000 * i, 5000); });
  }
  for (auto& t : readers) t.join();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], data.substr(1000 * i, 5000));
  EXPECT_EQ(RemoteReads(), 1u);
  EXPECT_EQ(remote_->Calls(StoreOp::kSize), 0u);
  EXPECT_EQ(c->Stats().fetches, 1u);
}

TEST_F(CachedStoreTest, PrefetchKeepsChunksAndReportsWhatItFetched) {
  const std::string data = RandomBytes(2 * kChunk + 3, 90);
  const std::string key = AddBlob(data);
  auto c = Open();
  auto chunks = c->ChunksOf(key, 0, data.size());
  ASSERT_TRUE(chunks.ok());
  ASSERT_EQ(chunks->size(), 3u);
  EXPECT_EQ(c->ChunkLength((*chunks)[2]), 3u);
  for (const ChunkId& id : *chunks) {
    auto fetched = c->Prefetch(id);
    ASSERT_TRUE(fetched.ok()) << fetched.status().message();
    EXPECT_EQ(*fetched, c->ChunkLength(id));
  }
  EXPECT_EQ(*c->Prefetch((*chunks)[0]), 0u);  // already kept
  remote_->FailAll(StoreOp::kReadRange, IOError("unreachable"));
  auto whole = c->Get(key);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(*whole, data);
}

TEST(ChunkEntry, RoundTripsAndRejectsDamage) {
  internal::ChunkEntry e{kChunk, 12345678, 42, 7, {1, 2, 0xffffffffffffffffULL}};
  const std::string v = internal::EncodeChunkEntry(e);
  auto back = internal::DecodeChunkEntry(v);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->chunk_bytes, e.chunk_bytes);
  EXPECT_EQ(back->blob_size, e.blob_size);
  EXPECT_EQ(back->generation, e.generation);
  EXPECT_EQ(back->tick, e.tick);
  EXPECT_EQ(back->pages, e.pages);
  EXPECT_FALSE(internal::DecodeChunkEntry(v.substr(0, v.size() - 1)));
  EXPECT_FALSE(internal::DecodeChunkEntry("\x02" + v.substr(1)));
  const std::string key = BlobKey(HashBytes("x", 1));
  auto parsed = internal::ParseChunkEntryKey(internal::ChunkEntryKey(key, 0x1234));
  ASSERT_TRUE(parsed);
  EXPECT_EQ(parsed->first, key);
  EXPECT_EQ(parsed->second, 0x1234u);
  EXPECT_FALSE(internal::ParseChunkEntryKey("blobchunk/xyz/00000000"));
  const std::string name = internal::ChunkFileName(key, 3, 0xabc);
  auto file = internal::ParseChunkFileName(name.substr(0, 2), name.substr(3));
  ASSERT_TRUE(file);
  EXPECT_EQ(file->blob_key, key);
  EXPECT_EQ(file->chunk, 3u);
  EXPECT_EQ(file->generation, 0xabcu);
  EXPECT_FALSE(internal::ParseChunkFileName("00", name.substr(3)));
}

TEST(IndexCacheEntries, ListByPrefixAndUpdateInOneBatch) {
  ScopedTempDir dir;
  auto index = Index::Open(dir.path() + "/index");
  ASSERT_TRUE(index.ok());
  ASSERT_TRUE((*index)->UpdateCacheEntries({{"a/1", "x"}, {"a/2", "y"}, {"b/1", "z"}}, {}).ok());
  ASSERT_TRUE((*index)->UpdateCacheEntries({{"a/3", "w"}}, {"a/1", "missing"}).ok());
  auto listed = (*index)->ListCacheEntries("a/");
  ASSERT_TRUE(listed.ok());
  const std::vector<std::pair<std::string, std::string>> want = {{"a/2", "y"}, {"a/3", "w"}};
  EXPECT_EQ(*listed, want);
  auto one = (*index)->GetCacheEntry("b/1");
  ASSERT_TRUE(one.ok() && one->has_value());
  EXPECT_EQ(**one, "z");
}

}  // namespace
}  // namespace dte
