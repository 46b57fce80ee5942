// Commit against a store that changes or was made by others: blobs that
// vanish before the manifest is created (a gc whose grace window the commit
// outlived) fail the commit with no manifest, and a parent cut into another
// block size makes the new version an anchor, never a delta indexed with the
// wrong blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "store/hash.h"
#include "store/manifest.h"
#include "store/materialize.h"
#include "store/ops/commit.h"
#include "store/ops/verify.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::TestCheckpoint;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";

// Two shards and a config; model.embed is exactly 1 MiB, lm_head 700 KiB.
TestCheckpoint Model() {
  TestCheckpoint c;
  c.safetensors.push_back(
      {kShard1,
       {test::Bf16Tensor("model.embed", {1024, 512}, 1), test::Bf16Tensor("model.norm", {512}, 2)},
       {}});
  c.safetensors.push_back({kShard2, {test::Bf16Tensor("lm_head", {700, 512}, 3)}, {}});
  c.raw_files["config.json"] = "{\"hidden_size\": 512}\n";
  return c;
}

class CommitSafetyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_NE(store_, nullptr);
  }

  std::string Write(const TestCheckpoint& c) {
    std::string path = dir_.path() + "/ckpt" + std::to_string(dirs_++);
    Status s = test::WriteCheckpoint(c, path);
    EXPECT_TRUE(s.ok()) << s.message();
    return path;
  }

  std::set<std::string> Keys(const std::string& prefix) {
    auto keys = store_->objects().List(prefix);
    EXPECT_TRUE(keys.ok()) << keys.status().message();
    return keys.ok() ? std::set<std::string>(keys->begin(), keys->end()) : std::set<std::string>();
  }

  // Every file of `version`, read through a fresh Store, equals `c`'s.
  void ExpectVersionHolds(uint64_t version, const TestCheckpoint& c) {
    SCOPED_TRACE(VersionName(version));
    auto store = test::OpenTestStore(store_->uri());
    ASSERT_NE(store, nullptr);
    auto v = store->GetVersion(version);
    ASSERT_TRUE(v.ok()) << v.status().message();
    std::map<std::string, std::string> want = c.raw_files;
    for (const auto& f : c.safetensors) want[f.name] = test::SafetensorsBytes(f);
    ASSERT_EQ((*v)->manifest.files.size(), want.size());
    Materializer reader(store.get());
    for (const auto& f : (*v)->manifest.files) {
      std::string got(f.size, '\0');
      Status s = reader.ReadFile(*v, f, 0, f.size, reinterpret_cast<uint8_t*>(got.data()));
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(got == want[f.name]) << f.name << " differs";
    }
    auto verified = VerifyStore(*store, version, nullptr);
    ASSERT_TRUE(verified.ok()) << verified.status().message();
    EXPECT_TRUE(verified->ok()) << verified->problems.front();
  }

  // Commits `c`, deleting from the store, at the first progress call from
  // the `from_call`th on that sees one, the first blob not in `spare` (as a
  // gc with a short grace window would): the commit must fail with NotFound naming that blob and
  // publish nothing.
  void ExpectVanishedBlobFailsTheCommit(const TestCheckpoint& c, const std::set<std::string>& spare,
                                        int from_call, std::string* victim) {
    const auto manifests = Keys("manifests/");
    CommitOptions o;
    int calls = 0;
    o.progress = [&](uint64_t, uint64_t) {
      if (++calls < from_call || !victim->empty()) return;
      for (const auto& k : Keys("blobs/")) {
        if (spare.count(k)) continue;
        ASSERT_TRUE(store_->objects().Delete(k).ok());
        *victim = k;
        return;
      }
    };
    auto r = CommitDirectory(*store_, Write(c), o);
    ASSERT_FALSE(victim->empty()) << "no blob appeared before the last progress call";
    ASSERT_FALSE(r.ok()) << "published a version naming the deleted " << *victim;
    EXPECT_EQ(r.status().code(), Code::kNotFound) << r.status().message();
    EXPECT_NE(r.status().message().find(*victim), std::string::npos) << r.status().message();
    EXPECT_EQ(Keys("manifests/"), manifests) << "a manifest appeared";
  }

  test::ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  int dirs_ = 0;
};

// repro_gc_vs_slow_commit.sh, deterministically: a blob the commit wrote is
// deleted mid-commit, for an anchor and for a delta. A retry then succeeds.
TEST_F(CommitSafetyTest, BlobDeletedBeforePublishFailsTheCommit) {
  TestCheckpoint c0 = Model();
  std::string victim;
  ASSERT_NO_FATAL_FAILURE(ExpectVanishedBlobFailsTheCommit(c0, Keys("blobs/"), 1, &victim));
  EXPECT_EQ(store_->GetVersion(0).status().code(), Code::kNotFound);
  auto r0 = CommitDirectory(*store_, Write(c0), {});
  ASSERT_TRUE(r0.ok()) << r0.status().message();
  EXPECT_EQ(r0->version, 0u);
  ExpectVersionHolds(0, c0);

  TestCheckpoint c1 = c0;
  test::PerturbElements(&c1.tensor("model.embed").data, 2, 500, 7);
  c1.raw_files["config.json"] = "{\"step\": 1}\n";
  victim.clear();
  ASSERT_NO_FATAL_FAILURE(ExpectVanishedBlobFailsTheCommit(c1, Keys("blobs/"), 1, &victim));
  EXPECT_EQ(store_->GetVersion(1).status().code(), Code::kNotFound);
  auto r1 = CommitDirectory(*store_, Write(c1), {});
  ASSERT_TRUE(r1.ok()) << r1.status().message();
  EXPECT_EQ(r1->parent, std::optional<uint64_t>(0));
  ExpectVersionHolds(1, c1);
}

// A blob the commit did not write but found and reused (left by a failed
// commit, so no manifest references it and gc may sweep it) is checked too.
TEST_F(CommitSafetyTest, ReusedUnreferencedBlobDeletedBeforePublishFailsTheCommit) {
  TestCheckpoint c = Model();
  // A first commit stores config.json, then fails on a truncated shard.
  std::string dir = Write(c);
  CommitOptions o;
  bool truncated = false;
  o.progress = [&](uint64_t, uint64_t) {
    if (std::exchange(truncated, true)) return;
    fs::resize_file(dir + "/" + kShard2, fs::file_size(dir + "/" + kShard2) - 100);
  };
  ASSERT_FALSE(CommitDirectory(*store_, dir, o).ok());
  const std::string config =
      BlobKey(HashBytes(c.raw_files["config.json"].data(), c.raw_files["config.json"].size()));
  ASSERT_EQ(Keys("blobs/").count(config), 1u) << "the failed commit stored no config blob";
  // The retry reuses it (progress call 1 comes while config.json is read,
  // call 2 after its blob is adopted); it vanishes before the retry publishes.
  std::set<std::string> spare = Keys("blobs/");
  spare.erase(config);
  std::string victim;
  ASSERT_NO_FATAL_FAILURE(ExpectVanishedBlobFailsTheCommit(c, spare, 2, &victim));
  EXPECT_EQ(victim, config);
}

// Rewrites anchor `version` in place with `bb`-byte blocks (a valid size,
// docs/formats/manifest.md), as another publisher could have written it.
void ReblockAnchor(Store& store, uint64_t version, uint64_t bb) {
  auto v = store.GetVersion(version);
  ASSERT_TRUE(v.ok()) << v.status().message();
  Manifest m = (*v)->manifest;
  ASSERT_TRUE(m.anchor());
  std::vector<BlockRecord> records;
  uint32_t blob = 0;
  for (auto& f : m.files) {
    if (!f.safetensors) continue;
    auto data = store.objects().Get(BlobKey(m.blobs[blob].hash));
    ASSERT_TRUE(data.ok()) << data.status().message();
    for (auto& t : f.tensors) {
      t.first_block = static_cast<uint32_t>(records.size());
      t.blocks = static_cast<uint32_t>((t.bytes() + bb - 1) / bb);
      for (uint32_t b = 0; b < t.blocks; ++b) {
        uint64_t off = t.begin + uint64_t{b} * bb;
        uint64_t len = std::min<uint64_t>(bb, t.end - off);
        records.push_back({BlockKind::kDenseRaw, blob, off, static_cast<uint32_t>(len), 0,
                           HashBlock(reinterpret_cast<const uint8_t*>(data->data()) + off, len)});
      }
    }
    ++blob;
  }
  m.block_bytes = bb;
  const std::string table = EncodeBlockTable(records);
  m.block_table = {HashBytes(table.data(), table.size()), table.size(), true};
  ASSERT_TRUE(store.objects().Put(BlobKey(m.block_table.hash), table).ok());
  ASSERT_TRUE(store.objects().Delete((*v)->key).ok());
  ASSERT_TRUE(store.objects().CreateExclusive((*v)->key, EncodeManifest(m)).ok());
  store.Forget(version);
  ASSERT_EQ(store.GetVersion(version).value()->manifest.block_bytes, bb);
}

// repro_commit_parent_block_bytes.sh: the latest version uses 1 MiB blocks
// and the same tensor layout. The next commit (256 KiB blocks) must not be a
// delta against it (it indexed the parent's table with its own blocks).
TEST_F(CommitSafetyTest, ParentWithAnotherBlockSizeMakesAnAnchor) {
  TestCheckpoint c0 = Model();
  ASSERT_TRUE(CommitDirectory(*store_, Write(c0), {}).ok());
  ASSERT_NO_FATAL_FAILURE(ReblockAnchor(*store_, 0, 4 * kBB));
  ExpectVersionHolds(0, c0);
  TestCheckpoint c1 = c0;
  test::PerturbElements(&c1.tensor("model.embed").data, 2, 300, 11);
  test::PerturbElements(&c1.tensor("lm_head").data, 2, 30, 12);
  auto r = CommitDirectory(*store_, Write(c1), {});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->version, 1u);
  EXPECT_EQ(r->parent, std::nullopt) << "a delta against a parent with other blocks";
  EXPECT_NE(r->anchor_reason.find(VersionName(0)), std::string::npos) << r->anchor_reason;
  EXPECT_EQ(store_->GetVersion(1).value()->manifest.block_bytes, kBB);
  ExpectVersionHolds(1, c1);
  ExpectVersionHolds(0, c0);
  // The version after it is an ordinary delta again.
  TestCheckpoint c2 = c1;
  test::PerturbElements(&c2.tensor("model.norm").data, 2, 5, 13);
  auto r2 = CommitDirectory(*store_, Write(c2), {});
  ASSERT_TRUE(r2.ok()) << r2.status().message();
  EXPECT_EQ(r2->parent, std::optional<uint64_t>(1));
  ExpectVersionHolds(2, c2);
}

}  // namespace
}  // namespace dte
