// Following a store: RefreshNew picks up committed versions (on a store
// without incremental listing it lists everything), and a store that stops
// answering is reported once per outage, in .dte/status.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "fs/filesystem.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

nlohmann::json StatusOf(Filesystem& fs) { return nlohmann::json::parse(fs.StatusJson()); }

size_t OutageErrors(Filesystem& fs) {
  size_t n = 0;
  const nlohmann::json status = StatusOf(fs);
  for (const auto& e : status["errors"]) {
    n += e.get<std::string>().find("cannot list the store") != std::string::npos;
  }
  return n;
}

TEST(Poll, RefreshNewShowsCommittedVersions) {
  test::SeriesStore env(3);
  auto writer = env.Open(), reader = env.Open();
  ASSERT_TRUE(writer && reader);
  ASSERT_TRUE(env.Commit(*writer, 0).ok());
  Filesystem fs(reader.get(), uint64_t{16} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  ASSERT_TRUE(env.Commit(*writer, 1).ok());
  ASSERT_TRUE(env.Commit(*writer, 2).ok());
  ASSERT_TRUE(fs.RefreshNew().ok());
  ASSERT_NE(fs.Latest(), nullptr);
  EXPECT_EQ(fs.Latest()->manifest.version, 2u);
  EXPECT_EQ(fs.Versions().size(), 3u);
  auto link = fs.ReadLink(kLatestIno);
  ASSERT_TRUE(link.ok());
  EXPECT_EQ(*link, VersionName(2));
  // A local store has no incremental listing: every refresh lists it all.
  EXPECT_EQ(StatusOf(fs)["poll"]["full_listings"], 2);
}

TEST(Poll, FailingStoreIsReportedOncePerOutage) {
  test::SeriesStore env(1);
  auto store = env.Open();
  ASSERT_TRUE(store);
  Filesystem fs(store.get(), 0);
  fs.NotePoll(Status::Ok());
  EXPECT_FALSE(fs.StoreFailing());
  for (int i = 0; i < 3; ++i) fs.NotePoll(IOError("S3 ListObjectsV2: connection refused"));
  EXPECT_TRUE(fs.StoreFailing());
  EXPECT_EQ(OutageErrors(fs), 1u);
  nlohmann::json poll = StatusOf(fs)["poll"];
  EXPECT_EQ(poll["polls"], 4);
  EXPECT_EQ(poll["failed"], 3);
  EXPECT_TRUE(poll["failing"].get<bool>());
  EXPECT_NE(poll["last_error"].get<std::string>().find("connection refused"), std::string::npos);

  fs.NotePoll(Status::Ok());
  EXPECT_FALSE(fs.StoreFailing());
  EXPECT_FALSE(StatusOf(fs)["poll"]["failing"].get<bool>());
  EXPECT_EQ(OutageErrors(fs), 1u);
  // A second outage is a second report.
  fs.NotePoll(IOError("S3 ListObjectsV2: timed out"));
  EXPECT_EQ(OutageErrors(fs), 2u);
  EXPECT_EQ(fs.PollCount(), 6u);
}

}  // namespace
}  // namespace dte::fs
