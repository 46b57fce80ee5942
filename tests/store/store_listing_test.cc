// Store listings cross-checked against the manifests (store/store.h,
// ListVersions, ListCommitted, ManifestExists, ConfirmedLatest): a listing that drops a
// version, names one that is not there, or lists a delta without its parent
// is listed again, never believed on its own.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::MemoryStore;
using test::TestTensor;
using test::VersionWriter;

// An ObjectStore over a MemoryStore whose next listings of manifests/ go
// through `damage` (each call of it takes one: null means no more damage).
class DamagingStore final : public ObjectStore {
 public:
  using Damage = std::function<void(std::vector<std::string>*)>;

  MemoryStore& base() { return base_; }
  void DamageNext(int times, Damage damage) {
    damage_ = std::move(damage);
    times_ = times;
  }
  int manifest_lists() const { return manifest_lists_; }

  std::string Describe() const override { return base_.Describe(); }
  Status Put(const std::string& k, std::string_view d) override { return base_.Put(k, d); }
  Status PutFile(const std::string& k, const std::string& p) override {
    return base_.PutFile(k, p);
  }
  Status CreateExclusive(const std::string& k, std::string_view d) override {
    return base_.CreateExclusive(k, d);
  }
  Result<std::string> Get(const std::string& k) override { return base_.Get(k); }
  Result<std::string> GetRange(const std::string& k, uint64_t o, uint64_t n) override {
    return base_.GetRange(k, o, n);
  }
  Status ReadRange(const std::string& k, uint64_t o, uint64_t n, void* dst) override {
    return base_.ReadRange(k, o, n, dst);
  }
  Result<std::optional<uint64_t>> Size(const std::string& k) override { return base_.Size(k); }
  Result<std::vector<std::string>> List(const std::string& prefix) override {
    ASSIGN_OR_RETURN(auto keys, base_.List(prefix));
    if (prefix != "manifests/") return keys;
    ++manifest_lists_;
    if (times_ > 0 && damage_) {
      --times_;
      damage_(&keys);
    }
    return keys;
  }
  Status Delete(const std::string& k) override { return base_.Delete(k); }
  Result<int64_t> ModifiedTime(const std::string& k) override { return base_.ModifiedTime(k); }
  Status Touch(const std::string& k) override { return base_.Touch(k); }
  Result<std::string> NewTempPath() override { return base_.NewTempPath(); }

 private:
  MemoryStore base_;
  Damage damage_;
  int times_ = 0;
  int manifest_lists_ = 0;
};

void Drop(std::vector<std::string>* keys, const std::string& key) { std::erase(*keys, key); }

std::vector<TestTensor> Model() {
  return {test::Bf16Tensor("w", {300, 600}, 1), test::Bf16Tensor("b", {600}, 2)};
}

// Quick retries, as the store's policy reads them from the environment.
class StoreListing : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("DTE_S3_MAX_ATTEMPTS", "3", 1);
    ::setenv("DTE_S3_RETRY_BASE_MS", "1", 1);
    ::setenv("DTE_S3_RETRY_MAX_MS", "2", 1);
    auto objects = std::make_unique<DamagingStore>();
    objects_ = objects.get();
    StoreOptions o;
    o.uri = "memory:test";
    o.create = true;
    auto store = Store::OpenOver(std::move(objects), o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
    VersionWriter w(&objects_->base());
    std::vector<TestTensor> t = Model();
    for (uint64_t v = 0; v < 4; ++v) {
      test::PerturbElements(&t[0].data, 2, 100, v + 1);
      ASSERT_TRUE(w.Write(v, t, v == 0).ok());
    }
  }
  void TearDown() override {
    ::unsetenv("DTE_S3_MAX_ATTEMPTS");
    ::unsetenv("DTE_S3_RETRY_BASE_MS");
    ::unsetenv("DTE_S3_RETRY_MAX_MS");
  }
  std::map<uint64_t, std::string> All() const {
    std::map<uint64_t, std::string> all;
    for (uint64_t v = 0; v < 4; ++v) all[v] = ManifestKey(v, 0);
    return all;
  }

  DamagingStore* objects_ = nullptr;
  std::unique_ptr<Store> store_;
};

TEST_F(StoreListing, KnownVersionALaterListingLacksIsConfirmedAndListedAgain) {
  ASSERT_EQ(store_->ListVersions().value(), All());
  const int before = objects_->manifest_lists();
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(3, 0)); });
  auto listed = store_->ListVersions(/*fresh=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, All());
  EXPECT_EQ(objects_->manifest_lists() - before, 2);
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
}

TEST_F(StoreListing, VersionConfirmedGoneLeavesTheListing) {
  ASSERT_EQ(store_->ListVersions().value(), All());
  ASSERT_TRUE(objects_->base().Delete(ManifestKey(3, 0)).ok());
  auto listed = store_->ListVersions(/*fresh=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  auto expected = All();
  expected.erase(3);
  EXPECT_EQ(*listed, expected);
}

TEST_F(StoreListing, ListingThatKeepsLackingAVersionFailsNamingItAndTheAttempts) {
  ASSERT_EQ(store_->ListVersions().value(), All());
  objects_->DamageNext(100, [](auto* keys) { Drop(keys, ManifestKey(2, 0)); });
  auto listed = store_->ListVersions(/*fresh=*/true);
  ASSERT_FALSE(listed.ok());
  EXPECT_EQ(listed.status().code(), Code::kCorruption);
  const std::string& m = listed.status().message();
  EXPECT_NE(m.find("lacks manifests/v00000002.json"), std::string::npos) << m;
  EXPECT_NE(m.find("exists when read directly"), std::string::npos) << m;
  EXPECT_NE(m.find("failed 3 times"), std::string::npos) << m;
}

TEST_F(StoreListing, DeltaListedWithoutItsParentIsListedAgain) {
  ASSERT_TRUE(store_->GetVersion(3).ok());  // loads v3, a delta of v2
  store_->Forget(2);                        // known now only as v3's parent
  const int before = objects_->manifest_lists();
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(2, 0)); });
  auto listed = store_->ListVersions(/*fresh=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, All());
  EXPECT_EQ(objects_->manifest_lists() - before, 2);
}

// A reader's latest: a listed version whose manifest is there, read once,
// and never an older one while it stays; each damaged listing is counted.
TEST_F(StoreListing, LatestIsTheNewestListedVersionThatExistsAndNeverGoesBack) {
  std::atomic<int> v3_reads{0};
  objects_->base().SetHook([&](test::StoreOp op, const std::string& key) {
    if (op == test::StoreOp::kSize && key == ManifestKey(3, 0)) v3_reads++;
  });
  objects_->DamageNext(1, [](auto* keys) { keys->push_back(ManifestKey(9, 0)); });
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
  EXPECT_EQ(v3_reads, 1) << "v3's manifest read again";
  EXPECT_EQ(store_->listing_damage().count, 0u);
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(3, 0)); });
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
  const Store::ListingDamage damage = store_->listing_damage();
  EXPECT_EQ(damage.count, 1u);
  ASSERT_EQ(damage.recent.size(), 1u);
  EXPECT_NE(damage.recent[0].find("lacks manifests/v00000003.json"), std::string::npos)
      << damage.recent[0];
  // Gone for real: the next one down, read in turn.
  ASSERT_TRUE(objects_->base().Delete(ManifestKey(3, 0)).ok());
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(2));
  EXPECT_EQ(store_->listing_damage().count, 1u);
}

TEST_F(StoreListing, ManyVersionsGoneAtOnceAreConfirmedByASecondListing) {
  VersionWriter w(&objects_->base());
  for (uint64_t v = 4; v < 24; ++v) ASSERT_TRUE(w.Write(v, Model(), true).ok());
  ASSERT_EQ(store_->ListVersions().value().size(), 24u);
  for (uint64_t v = 1; v < 21; ++v) ASSERT_TRUE(objects_->base().Delete(ManifestKey(v, 0)).ok());
  // One more listing drops v00000000, which exists: the second listing
  // shows it, so the first is listed again.
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(0, 0)); });
  const uint64_t heads = objects_->base().Calls(test::StoreOp::kSize);
  const int lists = objects_->manifest_lists();
  auto listed = store_->ListVersions(/*fresh=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, (std::map<uint64_t, std::string>{{0, ManifestKey(0, 0)},
                                                      {21, ManifestKey(21, 0)},
                                                      {22, ManifestKey(22, 0)},
                                                      {23, ManifestKey(23, 0)}}));
  // Each listing: the newest 16 of the 20 or 21 missing read directly, the
  // rest against one more listing.
  EXPECT_EQ(objects_->base().Calls(test::StoreOp::kSize) - heads, 2 * Store::kMaxDirectChecks);
  EXPECT_EQ(objects_->manifest_lists() - lists, 4);
}

// A version asked for by number that one listing lacks is looked for in a
// fresh listing before it is called not committed.
TEST_F(StoreListing, VersionOneListingLacksIsFoundInTheNext) {
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(3, 0)); });
  auto v = store_->GetVersion(3);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ((*v)->key, ManifestKey(3, 0));
  const int lists = objects_->manifest_lists();
  auto missing = store_->GetVersion(9);
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("v00000009) is not committed"), std::string::npos)
      << missing.status().message();
  EXPECT_EQ(objects_->manifest_lists() - lists, 2);
}

// A first listing (nothing known yet) whose newest key was changed into
// v00000009's: the store lists again before it answers.
TEST_F(StoreListing, LatestOfAListingThatNamesAVersionNotThereListsAgain) {
  objects_->DamageNext(1, [](auto* keys) {
    Drop(keys, ManifestKey(3, 0));
    keys->push_back(ManifestKey(9, 0));
  });
  const int lists = objects_->manifest_lists();
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
  EXPECT_EQ(objects_->manifest_lists() - lists, 2);
}

// The committed versions (what dtectl log and the C ABI list): a listing
// that names a version not there is listed again, and what the listings
// name above the newest that exists is left out; one that lacks the newest
// is listed again too.
TEST_F(StoreListing, CommittedVersionsAreThoseOfAListingWhoseNewestExists) {
  objects_->DamageNext(2, [](auto* keys) { keys->push_back(ManifestKey(9, 0)); });
  int lists = objects_->manifest_lists();
  EXPECT_EQ(store_->ListCommitted().value(), All());
  EXPECT_EQ(objects_->manifest_lists() - lists, 2);
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(3, 0)); });
  lists = objects_->manifest_lists();
  EXPECT_EQ(store_->ListCommitted().value(), All());
  EXPECT_EQ(objects_->manifest_lists() - lists, 2);
  EXPECT_EQ(store_->Latest().value(), std::optional<uint64_t>(3));
}

TEST_F(StoreListing, ManifestExistsReadsTheKeyItself) {
  EXPECT_TRUE(store_->ManifestExists(3, ManifestKey(3, 0)).value());
  EXPECT_FALSE(store_->ManifestExists(3, ManifestKey(3, 1)).value());
  EXPECT_FALSE(store_->ManifestExists(9, ManifestKey(9, 0)).value());
  EXPECT_EQ(store_->ManifestExists(3, ManifestKey(4, 0)).status().code(), Code::kInvalidArgument);
}

TEST_F(StoreListing, ConfirmedLatestBelievesNoListingThatLacksTheExpectedVersion) {
  ASSERT_EQ(store_->ListVersions().value(), All());
  store_->Forget(3);  // as a publisher that knows only what it committed
  objects_->DamageNext(1, [](auto* keys) { Drop(keys, ManifestKey(3, 0)); });
  EXPECT_EQ(store_->ConfirmedLatest(3).value(), std::optional<uint64_t>(3));
}

TEST_F(StoreListing, ConfirmedLatestBelievesNoListedVersionThatIsNotThere) {
  objects_->DamageNext(1, [](auto* keys) { keys->push_back(ManifestKey(9, 0)); });
  EXPECT_EQ(store_->ConfirmedLatest(3).value(), std::optional<uint64_t>(3));
  objects_->DamageNext(100, [](auto* keys) { keys->push_back(ManifestKey(9, 0)); });
  auto latest = store_->ConfirmedLatest(3);
  ASSERT_FALSE(latest.ok());
  EXPECT_EQ(latest.status().code(), Code::kIOError);
  const std::string& m = latest.status().message();
  EXPECT_NE(m.find("manifests/v00000009.json as the latest version, which does not exist"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("3 listings"), std::string::npos) << m;
}

TEST_F(StoreListing, ConfirmedLatestReportsARealNewerVersionOrARealLoss) {
  VersionWriter w(&objects_->base());
  ASSERT_TRUE(w.Write(4, Model(), true).ok());  // another writer's version
  EXPECT_EQ(store_->ConfirmedLatest(3).value(), std::optional<uint64_t>(4));
  ASSERT_TRUE(objects_->base().Delete(ManifestKey(4, 0)).ok());
  ASSERT_TRUE(objects_->base().Delete(ManifestKey(3, 0)).ok());
  EXPECT_EQ(store_->ConfirmedLatest(3).value(), std::optional<uint64_t>(2));
}

TEST_F(StoreListing, MissingBlockTableIsNamedNotTheManifest) {
  auto v = store_->GetVersion(3).value();
  const std::string table = BlobKey(v->manifest.block_table.hash);
  store_->Forget(3);
  ASSERT_TRUE(objects_->base().Delete(table).ok());
  auto again = store_->GetVersion(3);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kNotFound);
  const std::string& m = again.status().message();
  EXPECT_NE(m.find(table), std::string::npos) << m;
  EXPECT_NE(m.find("its manifest manifests/v00000003.json exists"), std::string::npos) << m;
  EXPECT_EQ(m.find("is gone"), std::string::npos) << m;
}

}  // namespace
}  // namespace dte
