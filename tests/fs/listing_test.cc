// A Filesystem given full listings that lack versions it shows (as a
// listing damaged in transit would): nothing leaves and `latest` stays
// while the manifests are in the store, .dte/status counts what was seen,
// and a version leaves once its manifest is really gone.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fs/filesystem.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

constexpr uint64_t kVersions = 4;

class ListingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    writer_ = env_.Open();
    reader_ = env_.Open();
    ASSERT_TRUE(writer_ && reader_);
    for (uint64_t v = 0; v < kVersions; ++v) {
      Status s = env_.Commit(*writer_, v);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    fs_ = std::make_unique<Filesystem>(reader_.get(), uint64_t{16} << 20);
    ASSERT_TRUE(fs_->Refresh().ok());
    all_ = fs_->Versions();
    ASSERT_EQ(all_.size(), kVersions);
  }

  // The store's listing without `versions`.
  std::map<uint64_t, std::string> Lacking(std::initializer_list<uint64_t> versions) {
    std::map<uint64_t, std::string> out = all_;
    for (uint64_t v : versions) out.erase(v);
    return out;
  }
  void Apply(std::map<uint64_t, std::string> listed) {
    Status s = fs_->ApplyListing(std::move(listed));
    ASSERT_TRUE(s.ok()) << s.message();
  }
  std::vector<uint64_t> Shown() {
    std::vector<uint64_t> out;
    auto root = fs_->ReadDir(kRootIno);
    EXPECT_TRUE(root.ok()) << root.status().message();
    if (!root.ok()) return out;
    for (const DirEntry& e : *root) {
      if (e.name[0] == 'v') out.push_back(std::stoull(e.name.substr(1)));
    }
    return out;
  }
  nlohmann::json Listings() { return nlohmann::json::parse(fs_->StatusJson())["listings"]; }

  test::SeriesStore env_{kVersions};
  std::unique_ptr<Store> writer_, reader_;
  std::unique_ptr<Filesystem> fs_;
  std::map<uint64_t, std::string> all_;
};

TEST_F(ListingTest, ListingsThatLackVersionsChangeNothingWhileTheirManifestsAreThere) {
  const std::vector<uint64_t> every{0, 1, 2, 3};
  Apply(Lacking({1}));
  EXPECT_EQ(Shown(), every);
  EXPECT_TRUE(fs_->Lookup(kRootIno, "v00000001").ok());
  Apply(Lacking({3}));
  EXPECT_EQ(Shown(), every);
  EXPECT_EQ(fs_->ReadLink(kLatestIno).value(), "v00000003");
  EXPECT_EQ(fs_->Latest()->manifest.version, 3u);
  Apply({});
  EXPECT_EQ(Shown(), every);
  nlohmann::json l = Listings();
  EXPECT_EQ(l["lacking"], 3);
  EXPECT_EQ(l["kept"], 6);
  EXPECT_EQ(l["gone"], 0);
  EXPECT_EQ(l["latest_held"], 2);
  ASSERT_EQ(l["events"].size(), 6u);
  EXPECT_NE(l["events"][1].get<std::string>().find("lacks v00000003 (manifests/v00000003.json), "
                                                   "but its manifest is there: kept; latest "
                                                   "stays v00000003"),
            std::string::npos)
      << l["events"];
  EXPECT_EQ(nlohmann::json::parse(fs_->StatusJson())["max_version_seen"], 3);
  // The next whole listing: nothing to check.
  Apply(all_);
  EXPECT_EQ(Listings()["lacking"], 3);
}

TEST_F(ListingTest, VersionLeavesOnceItsManifestIsGone) {
  // History rewritten from v2 on: the newest two manifests deleted.
  ASSERT_TRUE(writer_->objects().Delete(all_.at(3)).ok());
  ASSERT_TRUE(writer_->objects().Delete(all_.at(2)).ok());
  Apply(Lacking({1, 2, 3}));
  EXPECT_EQ(Shown(), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(fs_->ReadLink(kLatestIno).value(), "v00000001");
  EXPECT_EQ(fs_->Lookup(kRootIno, "v00000003").status().code(), Code::kNotFound);
  nlohmann::json l = Listings();
  EXPECT_EQ(l["gone"], 2);
  EXPECT_EQ(l["kept"], 1);
  EXPECT_EQ(l["latest_held"], 0);
  EXPECT_NE(l["events"][0].get<std::string>().find("v00000003 left the store: its manifest "
                                                   "manifests/v00000003.json is gone"),
            std::string::npos)
      << l["events"];
  // The store's own listing says the same.
  ASSERT_TRUE(fs_->Refresh().ok());
  EXPECT_EQ(Shown(), (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(nlohmann::json::parse(fs_->StatusJson())["max_version_seen"], 3);
}

// The newest version's manifest cannot be loaded again (it was evicted from
// memory, and the store's copy no longer reads): `latest` stays the copy
// loaded before, never an older version.
TEST_F(ListingTest, LatestStaysWhenTheNewestCannotBeLoadedAgain) {
  StoreOptions o;
  o.uri = env_.uri();
  o.version_cache_bytes = 1;  // holds only the version used last
  auto opened = Store::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  std::unique_ptr<Store> store = std::move(opened).value();
  Filesystem fs(store.get(), uint64_t{16} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  ASSERT_EQ(fs.Latest()->manifest.version, 3u);
  ASSERT_TRUE(fs.VersionOf(0).ok());  // v3 leaves the memory cache
  ASSERT_TRUE(writer_->objects().Put(all_.at(3), "not a manifest").ok());
  ASSERT_TRUE(fs.Refresh().ok());
  EXPECT_EQ(fs.ReadLink(kLatestIno).value(), "v00000003");
  ASSERT_NE(fs.Latest(), nullptr);
  EXPECT_EQ(fs.Latest()->manifest.version, 3u) << "latest went back";
  EXPECT_EQ(fs.LiveStatus().latest_version, 3u);
}

}  // namespace
}  // namespace dte::fs
