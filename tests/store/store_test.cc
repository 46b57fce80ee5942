// Store: opening, listing and validating versions, and the cache index as a
// cache (rebuilt, re-synced, bypassed when bad). Versions are written by
// test::VersionWriter, independent of the commit pipeline.
#include "store/store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "store/materialize.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::ScopedTempDir;
using test::TestTensor;
using test::VersionWriter;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr const char* kModel = VersionWriter::kModelFile;

// A small two-tensor model (three blocks) and one sparse step of it.
std::vector<TestTensor> Model() {
  return {test::Bf16Tensor("w", {300, 600}, 1), test::Bf16Tensor("b", {600}, 2)};
}

std::vector<TestTensor> Step(std::vector<TestTensor> tensors, uint64_t seed) {
  test::PerturbElements(&tensors[0].data, 2, 100, seed);
  return tensors;
}

TEST(Store, OpenNeedsAStoreUnlessCreating) {
  ScopedTempDir dir;
  StoreOptions o;
  o.uri = dir.path() + "/none";
  auto missing = Store::Open(o);
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  o.uri = dir.path();  // exists, but has no marker
  auto unmarked = Store::Open(o);
  EXPECT_EQ(unmarked.status().code(), Code::kNotFound);
  EXPECT_NE(unmarked.status().message().find("not a dte store"), std::string::npos);
  auto created = test::OpenTestStore(dir.path(), dir.path() + "/cache");
  ASSERT_NE(created, nullptr);
  EXPECT_EQ(created->store_id().size(), 32u);
  EXPECT_EQ(created->CachePath(), dir.path() + "/cache/" + created->store_id());
  std::string id = created->store_id();
  created.reset();
  EXPECT_EQ(Store::Open(o).value()->store_id(), id);
}

TEST(Store, GetVersionOfAMissingVersionIsNotFoundNamingIt) {
  ScopedTempDir dir;
  for (const std::string& cache : {std::string(""), dir.path() + "/cache"}) {
    auto store = test::OpenTestStore(dir.path() + "/store", cache);
    ASSERT_NE(store, nullptr);
    auto v = store->GetVersion(7);
    EXPECT_EQ(v.status().code(), Code::kNotFound);
    EXPECT_NE(v.status().message().find("v00000007"), std::string::npos) << v.status().message();
    EXPECT_FALSE(store->Latest()->has_value());
  }
}

TEST(Store, ListVersionsPicksTheNewestRevisionAndIgnoresOtherKeys) {
  ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path());
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  ASSERT_TRUE(b.Write(1, Step(Model(), 9), false).ok());
  std::string text = store->objects().Get(ManifestKey(1, 0)).value();
  Manifest m = DecodeManifest(text, "v1").value();
  m.revision = 2;
  ASSERT_TRUE(store->objects().Put(ManifestKey(1, 2), EncodeManifest(m)).ok());
  ASSERT_TRUE(store->objects().Put("manifests/README", "not a manifest").ok());
  auto versions = store->ListVersions();
  ASSERT_TRUE(versions.ok());
  EXPECT_EQ(*versions,
            (std::map<uint64_t, std::string>{{0, ManifestKey(0, 0)}, {1, ManifestKey(1, 2)}}));
  EXPECT_EQ(store->Latest().value(), std::optional<uint64_t>(1));
  EXPECT_EQ(store->GetVersion(1).value()->manifest.revision, 2u);
}

TEST(Store, DeletingTheCacheDirLosesNothing) {
  ScopedTempDir dir;
  const std::string uri = dir.path() + "/store", cache = dir.path() + "/cache";
  auto store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  std::vector<TestTensor> t = Model();
  ASSERT_TRUE(b.Write(0, t, true).ok());
  ASSERT_TRUE(b.Write(1, Step(t, 5), false).ok());
  ASSERT_TRUE(store->SyncIndex(false).ok());
  EXPECT_EQ(store->index()->ListVersions()->size(), 2u);
  const std::string cache_path = store->CachePath();
  store.reset();
  fs::remove_all(cache);
  store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  ASSERT_NE(store->index(), nullptr);
  EXPECT_TRUE(fs::exists(cache_path + "/index"));
  auto indexed = store->index()->ListVersions();
  ASSERT_TRUE(indexed.ok());
  EXPECT_TRUE(indexed->empty()) << "opening a store loads versions only when asked for";
  auto v1 = store->GetVersion(1);
  ASSERT_TRUE(v1.ok()) << v1.status().message();
  Materializer reader(store.get());
  std::string out(b.file(1).size(), '\0');
  ASSERT_TRUE(reader
                  .ReadFile(*v1, (*v1)->manifest.files[1], 0, out.size(),
                            reinterpret_cast<uint8_t*>(out.data()))
                  .ok());
  EXPECT_TRUE(out == b.file(1));
  EXPECT_TRUE(store->index()->ListVersions()->count(1)) << "a version read is indexed";
  ASSERT_TRUE(store->SyncIndex(false).ok());
  EXPECT_EQ(store->index()->ListVersions().value(), store->ListVersions().value());
}

TEST(Store, StaleIndexEntriesAreDroppedOnOpen) {
  ScopedTempDir dir;
  const std::string uri = dir.path() + "/store", cache = dir.path() + "/cache";
  auto store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  ASSERT_TRUE(b.Write(1, Model(), true).ok());
  ASSERT_TRUE(b.Write(2, Model(), true).ok());
  ASSERT_TRUE(store->SyncIndex(false).ok());
  ASSERT_EQ(store->index()->ListVersions()->size(), 3u);
  store.reset();
  auto plain = test::OpenTestStore(uri);  // no index: removes a version behind the cache's back
  ASSERT_NE(plain, nullptr);
  ASSERT_TRUE(plain->objects().Delete(ManifestKey(2, 0)).ok());
  Manifest m = DecodeManifest(plain->objects().Get(ManifestKey(1, 0)).value(), "v1").value();
  m.revision = 1;
  ASSERT_TRUE(plain->objects().Put(ManifestKey(1, 1), EncodeManifest(m)).ok());
  store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  auto indexed = store->index()->ListVersions();
  ASSERT_TRUE(indexed.ok());
  // The stale entries of versions 1 and 2 are gone; the new revision of 1
  // is indexed when it is read.
  EXPECT_EQ(*indexed, (std::map<uint64_t, std::string>{{0, ManifestKey(0, 0)}}));
  EXPECT_EQ(store->GetVersion(2).status().code(), Code::kNotFound);
  EXPECT_EQ(store->GetVersion(1).value()->key, ManifestKey(1, 1));
  EXPECT_EQ(store->index()->ListVersions().value(),
            (std::map<uint64_t, std::string>{{0, ManifestKey(0, 0)}, {1, ManifestKey(1, 1)}}));
}

// The parsed versions a Store keeps in memory are bounded by
// version_cache_bytes; the newest one used always stays.
TEST(Store, ParsedVersionsInMemoryAreBounded) {
  ScopedTempDir dir;
  const std::string uri = dir.path() + "/store";
  {
    auto writer = test::OpenTestStore(uri);
    ASSERT_NE(writer, nullptr);
    VersionWriter b(&writer->objects());
    std::vector<TestTensor> t = Model();
    ASSERT_TRUE(b.Write(0, t, true).ok());
    for (uint64_t v = 1; v < 6; ++v) ASSERT_TRUE(b.Write(v, Step(t, v), false).ok());
  }
  StoreOptions o;
  o.uri = uri;
  o.version_cache_bytes = 1;
  auto store = Store::Open(o).value();
  for (uint64_t v = 0; v < 6; ++v) {
    auto got = store->GetVersion(v);
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_EQ((*got)->manifest.version, v);
    EXPECT_EQ(store->cached_versions(), 1u);
  }
  o.version_cache_bytes = uint64_t{64} << 20;
  store = Store::Open(o).value();
  for (uint64_t v = 0; v < 6; ++v) ASSERT_TRUE(store->GetVersion(v).ok());
  EXPECT_EQ(store->cached_versions(), 6u);
  EXPECT_GT(store->cached_version_bytes(), 0u);
}

TEST(Store, BadIndexEntryFallsBackToTheStore) {
  ScopedTempDir dir;
  const std::string uri = dir.path() + "/store", cache = dir.path() + "/cache";
  auto store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  ASSERT_TRUE(store->SyncIndex(false).ok());
  const std::string index_dir = store->CachePath() + "/index";
  const Manifest m = store->GetVersion(0).value()->manifest;
  store.reset();
  {
    auto index = Index::Open(index_dir);
    ASSERT_TRUE(index.ok()) << index.status().message();
    ASSERT_TRUE((*index)->PutVersion(m, Index::Entry{ManifestKey(0, 0), "{junk", "junk", ""}).ok());
  }
  store = test::OpenTestStore(uri, cache);
  ASSERT_NE(store, nullptr);
  auto v = store->GetVersion(0);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v.value()->records.size(), b.records(0).size());
}

TEST(Store, CorruptBlockTableBlobIsCorruption) {
  ScopedTempDir dir;
  const std::string uri = dir.path() + "/store";
  auto store = test::OpenTestStore(uri);
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  const Hash128 table = store->GetVersion(0).value()->manifest.block_table.hash;
  ASSERT_TRUE(test::FlipBits(uri + "/" + BlobKey(table), 40).ok());
  for (const std::string& cache : {std::string(""), dir.path() + "/cache"}) {
    auto fresh = test::OpenTestStore(uri, cache);  // a corrupt version stays out of the index
    ASSERT_NE(fresh, nullptr);
    auto v = fresh->GetVersion(0);
    EXPECT_EQ(v.status().code(), Code::kCorruption) << v.status().message();
    EXPECT_NE(v.status().message().find(table.Hex()), std::string::npos) << v.status().message();
    EXPECT_NE(v.status().message().find(ManifestKey(0, 0)), std::string::npos);
  }
}

TEST(Store, ManifestDefectsAreCorruptionNamingTheKey) {
  ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path());
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  std::string text = store->objects().Get(ManifestKey(0, 0)).value();
  ASSERT_TRUE(store->objects().Put(ManifestKey(5, 0), text).ok());  // says version 0
  ASSERT_TRUE(store->objects().Put(ManifestKey(6, 0), text.substr(0, 100)).ok());
  auto five = store->GetVersion(5);
  EXPECT_EQ(five.status().code(), Code::kCorruption);
  EXPECT_NE(five.status().message().find("v00000005.json"), std::string::npos)
      << five.status().message();
  auto six = store->GetVersion(6);
  EXPECT_EQ(six.status().code(), Code::kCorruption);
  EXPECT_NE(six.status().message().find("v00000006.json"), std::string::npos)
      << six.status().message();
}

TEST(Store, ForgetDropsTheIndexEntry) {
  ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path() + "/s", dir.path() + "/c");
  ASSERT_NE(store, nullptr);
  VersionWriter b(&store->objects());
  ASSERT_TRUE(b.Write(0, Model(), true).ok());
  ASSERT_TRUE(store->GetVersion(0).ok());
  ASSERT_TRUE(store->index()->GetVersion(0)->has_value());
  store->Forget(0);
  EXPECT_FALSE(store->index()->GetVersion(0)->has_value());
  EXPECT_TRUE(store->GetVersion(0).ok()) << "forgotten, not deleted";
}

// A two-block BF16 tensor (kBB + 100 bytes) in an anchor with one blob.
struct TableCase {
  Manifest m;
  std::vector<BlockRecord> records;
  TableCase() {
    m.version = 3;
    m.blobs = {BlobRef{Hash128{1, 2}, kBB + 100, true}};
    FileEntry f{kModel, 8 + kBB + 100, true, {}, {}, 8, {}};
    f.tensors.push_back(
        TensorEntry{"w", DType::kBF16, {int64_t{kBB / 2 + 50}}, 0, kBB + 100, {}, 0, 0, 2});
    m.files = {f};
    records = {BlockRecord{BlockKind::kDenseRaw, 0, 0, uint32_t{kBB}, 0, 1},
               BlockRecord{BlockKind::kDenseRaw, 0, kBB, 100, 0, 2}};
  }
  Status Check() const { return CheckBlockTable(m, records, "vX"); }
};

void ExpectTableError(const TableCase& c, const std::string& part) {
  Status s = c.Check();
  EXPECT_EQ(s.code(), Code::kCorruption) << "accepted; expected " << part;
  EXPECT_NE(s.message().find(part), std::string::npos) << s.message();
}

TEST(CheckBlockTable, AcceptsAConsistentTable) {
  TableCase c;
  EXPECT_TRUE(c.Check().ok()) << c.Check().message();
  c.m.parent = 2;  // a delta may use every kind
  c.records[0] = BlockRecord{BlockKind::kSame, 9, 0, 0, 0, 1};
  c.records[1] = BlockRecord{BlockKind::kSparse, 0, 10, 20, 3, 2};
  EXPECT_TRUE(c.Check().ok()) << c.Check().message();
}

TEST(CheckBlockTable, CatchesOutOfBlobRecords) {
  TableCase c;
  c.records[1].offset = kBB + 1;  // 100 bytes from here end 1 past the blob
  ExpectTableError(c, "\"w\" block 1 points outside its blob");
  c = TableCase();
  c.records[1].blob = 1;
  ExpectTableError(c, "\"w\" block 1 points outside its blob");
  c = TableCase();
  c.records[0].offset = UINT64_MAX - 10;
  ExpectTableError(c, "\"w\" block 0 points outside its blob");
  c = TableCase();
  c.records[1].length = 99;
  ExpectTableError(c, "\"w\" block 1 has the wrong length");
}

TEST(CheckBlockTable, CatchesParentReferencesInAnAnchor) {
  for (BlockKind kind : {BlockKind::kSparse, BlockKind::kSame}) {
    TableCase c;
    c.records[1] = BlockRecord{kind, 0, 0, 10, 1, 2};
    ExpectTableError(c, "refers to a parent, but the version is an anchor");
  }
}

TEST(CheckBlockTable, CatchesTablesOfTheWrongLength) {
  TableCase c;
  c.records.pop_back();
  ExpectTableError(c, "too short");
  c = TableCase();
  c.records.push_back(c.records[1]);
  ExpectTableError(c, "too long");
}

}  // namespace
}  // namespace dte
