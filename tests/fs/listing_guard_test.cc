// ListingGuard with a fake store: listings that lack versions the mount
// shows change nothing while the manifests are there, and a version leaves
// only once a read of its manifest finds it gone.
#include "fs/listing_guard.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "store/manifest.h"

namespace dte::fs {
namespace {

using VersionMap = ListingGuard::VersionMap;

// The manifests that exist, and every manifest read the guard made.
struct FakeManifests {
  std::set<std::string> keys;
  std::set<std::string> failing;  // reads of these fail
  std::vector<std::string> reads;

  Result<bool> Exists(uint64_t, const std::string& key) {
    reads.push_back(key);
    if (failing.count(key)) return IOError("read of " + key + " failed: injected");
    return keys.count(key) > 0;
  }
};

VersionMap Listing(std::initializer_list<uint64_t> versions) {
  VersionMap out;
  for (uint64_t v : versions) out[v] = ManifestKey(v, 0);
  return out;
}

class ListingGuardTest : public ::testing::Test {
 protected:
  ListingGuardTest() {
    for (uint64_t v = 0; v < 4; ++v) store_.keys.insert(ManifestKey(v, 0));
  }

  FakeManifests store_;
  ListingGuard guard_{[this](uint64_t v, const std::string& key) { return store_.Exists(v, key); }};
  const VersionMap shown_ = Listing({0, 1, 2, 3});
};

TEST(ListingGuard, CompleteListingCostsNoRead) {
  FakeManifests store;
  ListingGuard guard([&](uint64_t v, const std::string& key) { return store.Exists(v, key); });
  const VersionMap listed = Listing({0, 1, 2});
  EXPECT_EQ(guard.Complete(listed, Listing({0, 1})), listed);
  EXPECT_EQ(guard.Complete(listed, {}), listed);
  EXPECT_TRUE(store.reads.empty());
  EXPECT_EQ(guard.Stats().lacking, 0u);
}

TEST(ListingGuard, ListingsTheStoreMadeAgainAreReportedOnceEach) {
  ListingGuard guard([](uint64_t, const std::string&) -> Result<bool> { return true; });
  guard.NoteDamagedListings(0, {});
  EXPECT_EQ(guard.Stats().damaged, 0u);
  guard.NoteDamagedListings(2,
                            {"lacks manifests/v00000001.json", "lacks manifests/v00000003.json"});
  guard.NoteDamagedListings(2,
                            {"lacks manifests/v00000001.json", "lacks manifests/v00000003.json"});
  guard.NoteDamagedListings(3, {"lacks manifests/v00000001.json", "lacks manifests/v00000003.json",
                                "lacks manifests/v00000002.json"});
  const ListingGuardStats s = guard.Stats();
  EXPECT_EQ(s.damaged, 3u);
  ASSERT_EQ(s.events.size(), 3u);
  EXPECT_EQ(s.events[0], "the store listed its versions again: lacks manifests/v00000001.json");
  EXPECT_EQ(s.events[2], "the store listed its versions again: lacks manifests/v00000002.json");
  EXPECT_EQ(s.lacking, 0u);
}

TEST_F(ListingGuardTest, ListingThatLacksAnOldVersionChangesNothing) {
  EXPECT_EQ(guard_.Complete(Listing({0, 2, 3}), shown_), shown_);
  EXPECT_EQ(store_.reads, (std::vector<std::string>{ManifestKey(1, 0)}));
  const ListingGuardStats s = guard_.Stats();
  EXPECT_EQ(s.lacking, 1u);
  EXPECT_EQ(s.kept, 1u);
  EXPECT_EQ(s.gone, 0u);
  EXPECT_EQ(s.latest_held, 0u);
  ASSERT_EQ(s.events.size(), 1u);
  EXPECT_NE(s.events[0].find("lacks v00000001 (manifests/v00000001.json)"), std::string::npos)
      << s.events[0];
}

TEST_F(ListingGuardTest, ListingThatLacksTheNewestHoldsLatest) {
  EXPECT_EQ(guard_.Complete(Listing({0, 1, 2}), shown_), shown_);
  const ListingGuardStats s = guard_.Stats();
  EXPECT_EQ(s.kept, 1u);
  EXPECT_EQ(s.latest_held, 1u);
  ASSERT_EQ(s.events.size(), 1u);
  EXPECT_NE(s.events[0].find("latest stays v00000003"), std::string::npos) << s.events[0];
  // An empty listing: every version is read and kept.
  EXPECT_EQ(guard_.Complete({}, shown_), shown_);
  EXPECT_EQ(guard_.Stats().kept, 5u);
  EXPECT_EQ(guard_.Stats().latest_held, 2u);
}

TEST_F(ListingGuardTest, VersionLeavesOnceItsManifestIsGone) {
  store_.keys.erase(ManifestKey(0, 0));
  store_.keys.erase(ManifestKey(3, 0));
  EXPECT_EQ(guard_.Complete(Listing({1, 2}), shown_), Listing({1, 2}));
  const ListingGuardStats s = guard_.Stats();
  EXPECT_EQ(s.gone, 2u);
  EXPECT_EQ(s.kept, 0u);
  EXPECT_EQ(s.latest_held, 0u) << "latest went back: its manifest is gone";
  ASSERT_EQ(s.events.size(), 2u);
  EXPECT_NE(s.events[0].find("v00000003 left the store: its manifest manifests/v00000003.json is "
                             "gone (read directly); it was latest"),
            std::string::npos)
      << s.events[0];
}

TEST_F(ListingGuardTest, ManifestThatCannotBeReadKeepsItsVersion) {
  store_.keys.erase(ManifestKey(2, 0));
  store_.failing.insert(ManifestKey(2, 0));
  EXPECT_EQ(guard_.Complete(Listing({0, 1, 3}), shown_), shown_);
  EXPECT_EQ(guard_.Stats().unchecked, 1u);
  EXPECT_NE(guard_.Stats().events[0].find("injected"), std::string::npos);
  store_.failing.clear();
  EXPECT_EQ(guard_.Complete(Listing({0, 1, 3}), shown_), Listing({0, 1, 3}));
  EXPECT_EQ(guard_.Stats().gone, 1u);
}

// gc's rebase: a newer revision in the listing replaces the shown one
// without a read; an older one (the newer key lost in transit) does not.
TEST_F(ListingGuardTest, NewerRevisionReplacesAndOlderRevisionDoesNot) {
  VersionMap rebased = shown_;
  rebased[2] = ManifestKey(2, 1);
  EXPECT_EQ(guard_.Complete(rebased, shown_), rebased);
  EXPECT_TRUE(store_.reads.empty());
  store_.keys.insert(ManifestKey(2, 1));
  EXPECT_EQ(guard_.Complete(shown_, rebased), rebased);
  EXPECT_EQ(store_.reads, (std::vector<std::string>{ManifestKey(2, 1)}));
  EXPECT_EQ(guard_.Stats().kept, 1u);
}

TEST_F(ListingGuardTest, ChecksPerListingAreBoundedNewestFirst) {
  store_.keys.clear();
  const size_t n = ListingGuard::kMaxChecksPerListing + 10;
  VersionMap shown;
  for (uint64_t v = 0; v < n; ++v) shown[v] = ManifestKey(v, 0);  // none exists
  const VersionMap first = guard_.Complete({}, shown);
  EXPECT_EQ(store_.reads.size(), ListingGuard::kMaxChecksPerListing);
  EXPECT_EQ(store_.reads.front(), ManifestKey(n - 1, 0));
  EXPECT_EQ(first.size(), 10u) << "the versions not read yet stay";
  EXPECT_EQ(first.rbegin()->first, 9u);
  EXPECT_EQ(guard_.Stats().unchecked, 10u);
  EXPECT_TRUE(guard_.Complete({}, first).empty());
  EXPECT_EQ(guard_.Stats().gone, n);
}

}  // namespace
}  // namespace dte::fs
