// Retention: keep-last-K and keep-every-K with rebasing, blob sweeping under
// a grace window, and dry runs.
#include "store/ops/gc.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "store/materialize.h"
#include "store/ops/commit.h"
#include "store/ops/verify.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::TestCheckpoint;

constexpr uint64_t kVersions = 6;

// A chain v0 (anchor) .. v5 (deltas) and every version's expected files.
class GcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = Open();
    ASSERT_NE(store_, nullptr);
    TestCheckpoint c;
    c.safetensors.push_back(
        {"model.safetensors",
         {test::Bf16Tensor("w", {1024, 400}, 1), test::Bf16Tensor("v", {333, 3}, 2)},
         {}});
    for (uint64_t v = 0; v < kVersions; ++v) {
      if (v > 0) {
        test::PerturbElements(&c.tensor("w").data, 2, 200, v);
        test::PerturbElements(&c.tensor("v").data, 2, 2, 50 + v);
      }
      c.raw_files["config.json"] = "{\"step\": " + std::to_string(v) + "}";
      std::string dir = tmp_.path() + "/in" + std::to_string(v);
      ASSERT_TRUE(test::WriteCheckpoint(c, dir).ok());
      auto r = CommitDirectory(*store_, dir, {});
      ASSERT_TRUE(r.ok()) << r.status().message();
      files_[v] = {{"config.json", c.raw_files["config.json"]},
                   {"model.safetensors", test::SafetensorsBytes(c.safetensors[0])}};
      hashes_[v] = TensorHashes(v);
    }
  }

  std::unique_ptr<Store> Open(const std::string& cache = "", const std::string& name = "store") {
    StoreOptions o;
    o.uri = tmp_.path() + "/" + name;
    o.cache_dir = cache;
    o.create = true;
    auto s = Store::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().message();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  std::vector<Hash128> TensorHashes(uint64_t v) {
    std::vector<Hash128> out;
    auto ver = store_->GetVersion(v);
    EXPECT_TRUE(ver.ok()) << ver.status().message();
    if (!ver.ok()) return out;
    for (const auto& f : (*ver)->manifest.files) {
      for (const auto& t : f.tensors) out.push_back(t.hash);
    }
    return out;
  }

  std::set<std::string> Keys(const std::string& prefix, Store* store = nullptr) {
    auto k = (store ? store : store_.get())->objects().List(prefix);
    EXPECT_TRUE(k.ok());
    return k.ok() ? std::set<std::string>(k->begin(), k->end()) : std::set<std::string>{};
  }

  // Every blob key a committed version's manifest names.
  std::set<std::string> ReachableBlobs(Store& store) {
    std::set<std::string> out;
    auto versions = store.ListVersions();
    EXPECT_TRUE(versions.ok());
    if (!versions.ok()) return out;
    for (const auto& [v, key] : *versions) {
      const Manifest& m = store.GetVersionAt(v, key).value()->manifest;
      out.insert(BlobKey(m.block_table.hash));
      for (const auto& b : m.blobs) out.insert(BlobKey(b.hash));
      if (m.full) {
        out.insert(BlobKey(m.full->block_table.hash));
        for (const auto& b : m.full->blobs) out.insert(BlobKey(b.hash));
      }
      for (const auto& f : m.files) out.insert(BlobKey(f.safetensors ? f.header_blob : f.blob));
    }
    return out;
  }

  void ExpectMaterializes(Store& store, uint64_t v) {
    SCOPED_TRACE(VersionName(v));
    auto ver = store.GetVersion(v);
    ASSERT_TRUE(ver.ok()) << ver.status().message();
    Materializer reader(&store);
    for (const auto& f : (*ver)->manifest.files) {
      std::string got;
      Status s = reader.StreamFile(*ver, f, [&](uint64_t, const uint8_t* d, size_t n) {
        got.append(reinterpret_cast<const char*>(d), n);
        return Status::Ok();
      });
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(got == files_[v][f.name]) << f.name << " differs";
    }
  }

  // Commits the inputs of versions [0, kVersions) written by SetUp to `store`.
  void CommitInputs(Store& store, const CommitOptions& o) {
    for (uint64_t v = 0; v < kVersions; ++v) {
      auto r = CommitDirectory(store, tmp_.path() + "/in" + std::to_string(v), o);
      ASSERT_TRUE(r.ok()) << r.status().message();
      ASSERT_EQ(r->version, v);
    }
  }

  void ExpectVerifies(Store& store) {
    auto verified = VerifyStore(store, std::nullopt, nullptr);
    ASSERT_TRUE(verified.ok()) << verified.status().message();
    EXPECT_TRUE(verified->ok()) << verified->problems.front();
  }

  test::ScopedTempDir tmp_;
  std::unique_ptr<Store> store_;
  std::map<uint64_t, std::map<std::string, std::string>> files_;
  std::map<uint64_t, std::vector<Hash128>> hashes_;
};

TEST_F(GcTest, KeepLastRebasesTheOldestKeptAndSweepsTheRest) {
  GcOptions o;
  o.keep_last = 3;
  o.grace_seconds = 0;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 3u);
  EXPECT_EQ(r->versions_removed, 3u);
  EXPECT_EQ(r->versions_rebased, 1u);
  EXPECT_GT(r->blobs_deleted, 0u);
  EXPECT_GT(r->bytes_freed, 0u);
  EXPECT_EQ(Keys("manifests/"),
            (std::set<std::string>{ManifestKey(3, 1), ManifestKey(4, 0), ManifestKey(5, 0)}));
  auto fresh = Open();
  ASSERT_NE(fresh, nullptr);
  for (Store* store : {store_.get(), fresh.get()}) {  // this one, and a fresh one
    auto v3 = store->GetVersion(3);
    ASSERT_TRUE(v3.ok()) << v3.status().message();
    EXPECT_TRUE((*v3)->manifest.anchor());
    EXPECT_EQ((*v3)->manifest.revision, 1u);
    EXPECT_EQ(store->GetVersion(4).value()->manifest.parent, std::optional<uint64_t>(3));
    for (uint64_t v = 0; v < 3; ++v) {
      EXPECT_EQ(store->GetVersion(v).status().code(), Code::kNotFound) << v;
    }
  }
  for (uint64_t v = 3; v < kVersions; ++v) {
    ExpectMaterializes(*fresh, v);
    EXPECT_EQ(TensorHashes(v), hashes_[v]) << "rebase changed content hashes";
  }
  EXPECT_EQ(Keys("blobs/"), ReachableBlobs(*fresh)) << "unreachable blobs were kept";
  auto verified = VerifyStore(*fresh, std::nullopt, nullptr);
  ASSERT_TRUE(verified.ok());
  EXPECT_TRUE(verified->ok()) << verified->problems.front();
}

TEST_F(GcTest, LargeGraceKeepsUnreachableBlobs) {
  const auto blobs_before = Keys("blobs/");
  GcOptions o;
  o.keep_last = 2;
  o.grace_seconds = 3600;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->blobs_deleted, 0u);
  EXPECT_EQ(r->versions_removed, 4u);
  auto after = Keys("blobs/");
  for (const auto& k : blobs_before) EXPECT_EQ(after.count(k), 1u) << k << " deleted in grace";
  EXPECT_EQ(Keys("manifests/").size(), 2u) << "manifests are not protected by the grace";
  auto fresh = Open();
  for (uint64_t v = 4; v < kVersions; ++v) ExpectMaterializes(*fresh, v);
}

TEST_F(GcTest, DryRunChangesNothing) {
  auto snapshot = [&] {
    std::map<std::string, std::string> all;
    for (const auto& k : Keys("")) all[k] = store_->objects().Get(k).value();
    return all;
  };
  const auto before = snapshot();
  GcOptions o;
  o.keep_last = 2;
  o.grace_seconds = 0;
  o.dry_run = true;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 2u);
  EXPECT_EQ(r->versions_removed, 4u);
  EXPECT_TRUE(snapshot() == before) << "a dry run modified the store";
}

TEST_F(GcTest, NothingToRemoveKeepsTheChainAsIs) {
  const auto before = Keys("");
  GcOptions o;
  o.keep_last = kVersions + 3;
  o.grace_seconds = 0;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_removed, 0u);
  EXPECT_EQ(r->versions_rebased, 0u);
  EXPECT_EQ(r->blobs_deleted, 0u);
  EXPECT_EQ(Keys(""), before);
}

TEST_F(GcTest, KeepLastZeroIsRefused) {
  GcOptions o;
  o.keep_last = 0;
  EXPECT_EQ(CollectGarbage(*store_, o, nullptr).status().code(), Code::kInvalidArgument);
}

TEST_F(GcTest, GcWithAnIndexThenCommitAndReopen) {
  store_.reset();
  const std::string cache = tmp_.path() + "/cache";
  auto store = Open(cache);
  ASSERT_NE(store, nullptr);
  GcOptions o;
  o.keep_last = 2;
  o.grace_seconds = 0;
  ASSERT_TRUE(CollectGarbage(*store, o, nullptr).ok());
  EXPECT_EQ(store->index()->ListVersions().value(), store->ListVersions().value());
  TestCheckpoint c;
  c.safetensors.push_back({"model.safetensors", {test::Bf16Tensor("w", {1024, 400}, 1)}, {}});
  ASSERT_TRUE(test::WriteCheckpoint(c, tmp_.path() + "/next").ok());
  auto r = CommitDirectory(*store, tmp_.path() + "/next", {});
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->version, kVersions);
  store.reset();
  store = Open(cache);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->index()->ListVersions().value(), store->ListVersions().value());
  for (uint64_t v = 4; v < kVersions; ++v) ExpectMaterializes(*store, v);
}

// repro_gc_deletes_new_version.sh, deterministically: another publisher (its
// own Store, as another process) commits v6 while gc is rebasing v5, from
// the rebase's progress callback. gc must neither delete v6's manifest (it
// did: v6 was not in its keep set) nor sweep v6's blobs, even with no grace.
TEST_F(GcTest, VersionCommittedDuringTheRebaseSurvives) {
  TestCheckpoint c;
  c.safetensors.push_back(
      {"model.safetensors",
       {test::Bf16Tensor("w", {1024, 400}, 1), test::Bf16Tensor("v", {333, 3}, 2)},
       {}});
  for (uint64_t v = 1; v <= kVersions; ++v) {  // v6 = v5 plus one more step
    test::PerturbElements(&c.tensor("w").data, 2, 200, v);
    test::PerturbElements(&c.tensor("v").data, 2, 2, 50 + v);
  }
  c.raw_files["config.json"] = "{\"step\": 6}";
  ASSERT_FALSE(test::SafetensorsBytes(c.safetensors[0]) ==
               files_[kVersions - 1]["model.safetensors"]);
  const std::string dir = tmp_.path() + "/in6";
  ASSERT_TRUE(test::WriteCheckpoint(c, dir).ok());
  files_[kVersions] = {{"config.json", c.raw_files["config.json"]},
                       {"model.safetensors", test::SafetensorsBytes(c.safetensors[0])}};
  auto publisher = Open();
  ASSERT_NE(publisher, nullptr);
  int calls = 0;
  std::optional<Result<CommitResult>> committed;
  GcOptions o;
  o.keep_last = 1;
  o.grace_seconds = 0;
  auto r = CollectGarbage(*store_, o, [&](uint64_t, uint64_t) {
    if (calls++ == 0) committed = CommitDirectory(*publisher, dir, {});
  });
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE(committed.has_value()) << "the rebase reported no progress";
  ASSERT_TRUE(committed->ok()) << committed->status().message();
  EXPECT_EQ((*committed)->version, kVersions);
  EXPECT_EQ((*committed)->parent, std::optional<uint64_t>(kVersions - 1)) << "not a delta";
  EXPECT_EQ(r->versions_rebased, 1u);
  EXPECT_EQ(r->versions_removed, kVersions - 1) << "v6 counted as removed";
  EXPECT_EQ(Keys("manifests/"),
            (std::set<std::string>{ManifestKey(kVersions - 1, 1), ManifestKey(kVersions, 0)}));
  auto fresh = Open();
  ASSERT_NE(fresh, nullptr);
  for (uint64_t v = kVersions - 1; v <= kVersions; ++v) ExpectMaterializes(*fresh, v);
  EXPECT_EQ(Keys("blobs/"), ReachableBlobs(*fresh));
  auto verified = VerifyStore(*fresh, std::nullopt, nullptr);
  ASSERT_TRUE(verified.ok()) << verified.status().message();
  EXPECT_TRUE(verified->ok()) << verified->problems.front();
  // A second gc sees v6 as the newest version and keeps it alone.
  auto again = CollectGarbage(*fresh, o, nullptr);
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->versions_removed, 1u);
  ExpectMaterializes(*fresh, kVersions);
}

// keep_last 1, keep_every 2 of v0..v5 keeps {0, 2, 4, 5}: v2 and v4 lose
// their parents and become deltas against the previous kept version.
GcOptions KeepEvery2() {
  GcOptions o;
  o.keep_last = 1;
  o.keep_every = 2;
  o.grace_seconds = 0;
  return o;
}

TEST_F(GcTest, KeepEveryRebasesOntoThePreviousKeptVersion) {
  auto r = CollectGarbage(*store_, KeepEvery2(), nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 4u);
  EXPECT_EQ(r->versions_removed, 2u);
  EXPECT_EQ(r->versions_rebased, 2u);
  EXPECT_EQ(Keys("manifests/"), (std::set<std::string>{ManifestKey(0, 0), ManifestKey(2, 1),
                                                       ManifestKey(4, 1), ManifestKey(5, 0)}));
  auto fresh = Open();
  ASSERT_NE(fresh, nullptr);
  AnchorDistance distance;
  for (uint64_t v : {2, 4}) {
    SCOPED_TRACE(VersionName(v));
    const Manifest& m = fresh->GetVersion(v).value()->manifest;
    EXPECT_EQ(m.revision, 1u);
    EXPECT_EQ(m.parent, std::optional<uint64_t>(v - 2));
    EXPECT_FALSE(m.full.has_value());
    // A delta of the changes of two steps, not a dense copy.
    EXPECT_GT(m.stats.stored_bytes, 0u);
    EXPECT_LT(m.stats.stored_bytes * 10, m.stats.dense_bytes);
    // Changed elements are counted against the new parent.
    const FileEntry& f = m.files[1];
    ASSERT_EQ(f.name, "model.safetensors");
    const uint64_t changed =
        test::CountDifferingElements(std::string_view(files_[v - 2][f.name]).substr(f.header_size),
                                     std::string_view(files_[v][f.name]).substr(f.header_size), 2);
    EXPECT_EQ(m.stats.changed_elements, changed);
    distance = AnchorDistance{distance.versions + 1, distance.bytes + m.stats.stored_bytes};
    ASSERT_TRUE(m.since_full.has_value());
    EXPECT_EQ(m.since_full->versions, distance.versions);
    EXPECT_EQ(m.since_full->bytes, distance.bytes);
  }
  EXPECT_EQ(fresh->GetVersion(5).value()->manifest.parent, std::optional<uint64_t>(4));
  for (uint64_t v : {0, 2, 4, 5}) {
    ExpectMaterializes(*fresh, v);
    EXPECT_EQ(TensorHashes(v), hashes_[v]) << "rebase changed content hashes";
  }
  for (uint64_t v : {1, 3}) EXPECT_EQ(fresh->GetVersion(v).status().code(), Code::kNotFound);
  EXPECT_EQ(Keys("blobs/"), ReachableBlobs(*fresh)) << "unreachable blobs were kept";
  ExpectVerifies(*fresh);
}

// The rebased delta is what a commit of the same bytes onto the same parent
// writes: the same records, the same payload blob, the same block table.
TEST_F(GcTest, RebasedDeltaEqualsACommitOntoThePreviousKeptVersion) {
  ASSERT_TRUE(CollectGarbage(*store_, KeepEvery2(), nullptr).ok());
  auto other = Open("", "other");
  ASSERT_NE(other, nullptr);
  for (uint64_t v : {0, 2}) {
    auto r = CommitDirectory(*other, tmp_.path() + "/in" + std::to_string(v), {});
    ASSERT_TRUE(r.ok()) << r.status().message();
  }
  const Manifest& want = other->GetVersion(1).value()->manifest;
  const Manifest& got = store_->GetVersion(2).value()->manifest;
  ASSERT_EQ(want.parent, std::optional<uint64_t>(0));
  ASSERT_EQ(got.blobs.size(), 1u);
  ASSERT_EQ(want.blobs.size(), 1u);
  EXPECT_EQ(got.blobs[0].hash, want.blobs[0].hash);
  EXPECT_EQ(got.block_table.hash, want.block_table.hash);
  EXPECT_EQ(got.stats.changed_elements, want.stats.changed_elements);
}

TEST_F(GcTest, KeepEveryDryRunCountsAndChangesNothing) {
  std::map<std::string, std::string> before;
  for (const auto& k : Keys("")) before[k] = store_->objects().Get(k).value();
  GcOptions o = KeepEvery2();
  o.dry_run = true;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 4u);
  EXPECT_EQ(r->versions_removed, 2u);
  EXPECT_EQ(r->versions_rebased, 2u);
  std::map<std::string, std::string> after;
  for (const auto& k : Keys("")) after[k] = store_->objects().Get(k).value();
  EXPECT_TRUE(after == before) << "a dry run modified the store";
}

// With no kept version below it, the oldest kept one becomes an anchor.
TEST_F(GcTest, KeepEveryMakesTheOldestKeptVersionAnAnchor) {
  GcOptions o;
  o.keep_last = 4;
  o.grace_seconds = 0;
  ASSERT_TRUE(CollectGarbage(*store_, o, nullptr).ok());  // keeps v2 .. v5
  o.keep_last = 1;
  o.keep_every = 4;
  auto r = CollectGarbage(*store_, o, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 2u);
  EXPECT_EQ(r->versions_rebased, 1u);
  auto fresh = Open();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->ListVersions().value().size(), 2u);
  const Manifest& v4 = fresh->GetVersion(4).value()->manifest;
  EXPECT_TRUE(v4.anchor());
  EXPECT_EQ(v4.since_full->versions, 0u);
  EXPECT_EQ(fresh->GetVersion(5).value()->manifest.parent, std::optional<uint64_t>(4));
  for (uint64_t v : {4, 5}) ExpectMaterializes(*fresh, v);
  ExpectVerifies(*fresh);
}

// A kept policy anchor whose parent is removed becomes an anchor made of its
// full table, writing no payload; the next kept version is a delta onto it.
TEST_F(GcTest, KeptPolicyAnchorBecomesAnAnchorOfItsFullTable) {
  auto policy = Open("", "policy");
  ASSERT_NE(policy, nullptr);
  CommitOptions co;
  co.anchor_policy = AnchorPolicy{0, 3};  // v3 carries a full table
  CommitInputs(*policy, co);
  const Manifest before = policy->GetVersion(3).value()->manifest;
  ASSERT_TRUE(before.full.has_value());
  GcOptions o;
  o.keep_last = 1;
  o.keep_every = 3;
  o.grace_seconds = 0;
  auto r = CollectGarbage(*policy, o, nullptr);  // keeps v0, v3, v5
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->versions_kept, 3u);
  EXPECT_EQ(r->versions_rebased, 2u);
  auto fresh = Open("", "policy");
  ASSERT_NE(fresh, nullptr);
  const Manifest& v3 = fresh->GetVersion(3).value()->manifest;
  EXPECT_TRUE(v3.anchor());
  EXPECT_FALSE(v3.full.has_value());
  EXPECT_EQ(v3.block_table.hash, before.full->block_table.hash);
  ASSERT_EQ(v3.blobs.size(), before.full->blobs.size());
  EXPECT_EQ(v3.blobs[0].hash, before.full->blobs[0].hash);
  EXPECT_EQ(fresh->GetVersion(5).value()->manifest.parent, std::optional<uint64_t>(3));
  for (uint64_t v : {0, 3, 5}) ExpectMaterializes(*fresh, v);
  EXPECT_EQ(Keys("blobs/", fresh.get()), ReachableBlobs(*fresh));
  ExpectVerifies(*fresh);
}

}  // namespace
}  // namespace dte
