// gc against damaged listings (store/ops/gc.h, "No listing is trusted alone"):
// each manifests/ listing of a run damaged in turn (a kept version dropped,
// a version that does not exist added) costs no blob and no version, and
// listings that keep lacking a kept version stop gc before it deletes a
// blob.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "store/ops/commit.h"
#include "store/ops/gc.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/listing_damage.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::ListingDamageStore;

constexpr uint64_t kVersions = 4;

class GcListing : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("DTE_S3_MAX_ATTEMPTS", "3", 1);
    ::setenv("DTE_S3_RETRY_BASE_MS", "1", 1);
    ::setenv("DTE_S3_RETRY_MAX_MS", "2", 1);
    Open();
    test::TestCheckpoint c;
    c.safetensors.push_back({"model.safetensors", {test::Bf16Tensor("w", {512, 400}, 1)}, {}});
    for (uint64_t v = 0; v < kVersions; ++v) {
      test::PerturbElements(&c.tensor("w").data, 2, 200, v + 1);
      c.raw_files["config.json"] = "{\"step\": " + std::to_string(v) + "}";
      const std::string dir = tmp_.path() + "/in" + std::to_string(v);
      ASSERT_TRUE(test::WriteCheckpoint(c, dir).ok());
      auto r = CommitDirectory(*store_, dir, {});
      ASSERT_TRUE(r.ok()) << r.status().message();
    }
    blobs_ = Blobs();
  }
  void TearDown() override {
    ::unsetenv("DTE_S3_MAX_ATTEMPTS");
    ::unsetenv("DTE_S3_RETRY_BASE_MS");
    ::unsetenv("DTE_S3_RETRY_MAX_MS");
  }

  // A new Store on the same directory, as a new dtectl process opens it
  // (no index: gc's first listing is its plan's).
  void Open() {
    auto base = OpenObjectStore(tmp_.path() + "/store", /*create=*/true);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    auto damaging = std::make_unique<ListingDamageStore>(std::move(*base), "manifests/");
    objects_ = damaging.get();
    StoreOptions o;
    o.uri = tmp_.path() + "/store";
    o.create = true;
    auto store = Store::OpenOver(std::move(damaging), o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    store_ = std::move(*store);
  }
  std::set<std::string> Blobs() {
    auto keys = objects_->base().List("blobs/");
    EXPECT_TRUE(keys.ok());
    return keys.ok() ? std::set<std::string>(keys->begin(), keys->end()) : std::set<std::string>();
  }
  Result<GcResult> Gc() {
    GcOptions o;
    o.keep_last = 8;
    o.grace_seconds = 0;
    return CollectGarbage(*store_, o, nullptr);
  }

  test::ScopedTempDir tmp_;
  ListingDamageStore* objects_ = nullptr;
  std::unique_ptr<Store> store_;
  std::set<std::string> blobs_;
};

TEST_F(GcListing, NoSingleDamagedListingCostsABlobOrAVersion) {
  auto clean = Gc();
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  ASSERT_EQ(clean->blobs_deleted, 0u);
  const int listings = objects_->listings();
  ASSERT_GE(listings, 4);  // plan, manifests to delete, the sweep, its second look
  const std::vector<ListingDamageStore::Damage> damages = {
      ListingDamageStore::Dropping(ManifestKey(3, 0)),
      ListingDamageStore::Dropping(ManifestKey(1, 0)),
      ListingDamageStore::Adding(ManifestKey(9, 0))};
  for (size_t d = 0; d < damages.size(); ++d) {
    for (int n = 0; n < listings; ++n) {
      Open();
      objects_->DamageListing(n, damages[d]);
      auto r = Gc();
      ASSERT_TRUE(r.ok()) << "damage " << d << " of listing " << n << ": " << r.status().ToString();
      EXPECT_EQ(r->blobs_deleted, 0u) << "damage " << d << " of listing " << n;
      EXPECT_EQ(r->versions_removed, 0u);
      EXPECT_EQ(Blobs(), blobs_) << "damage " << d << " of listing " << n;
      // (A first listing that lacks the newest version, with nothing seen
      // before it, plans without it: it is neither kept nor removed.)
      Open();
      for (uint64_t v = 0; v < kVersions; ++v) {
        auto version = store_->GetVersion(v);
        EXPECT_TRUE(version.ok()) << version.status().ToString();
      }
    }
  }
}

TEST_F(GcListing, ListingsThatKeepLackingAKeptVersionStopGcBeforeAnyBlob) {
  Open();
  for (int n = 1; n < 40; ++n) {
    objects_->DamageListing(n, ListingDamageStore::Dropping(ManifestKey(3, 0)));
  }
  auto r = Gc();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorruption);
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("lacks manifests/v00000003.json"), std::string::npos) << m;
  EXPECT_NE(m.find("failed 3 times"), std::string::npos) << m;
  EXPECT_EQ(Blobs(), blobs_);
}

TEST_F(GcListing, AVersionThatIsReallyGoneLosesItsBlobs) {
  auto v3 = store_->GetVersion(3);
  ASSERT_TRUE(v3.ok());
  const std::string table = BlobKey((*v3)->manifest.block_table.hash);
  ASSERT_TRUE(objects_->base().Delete(ManifestKey(3, 0)).ok());
  Open();
  auto r = Gc();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_GT(r->blobs_deleted, 0u);
  EXPECT_FALSE(Blobs().count(table));
}

}  // namespace
}  // namespace dte
