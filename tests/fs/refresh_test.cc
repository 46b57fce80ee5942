// Versions coming and going under a Filesystem: Refresh picks up committed
// versions and drops the ones gc removed, inode numbers stay put, and files
// opened before their version left keep reading its bytes.
//
// Commits and gc go through their own Store handle, as `dtectl` in another
// process would; the Filesystem sees the store only through Refresh.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "store/ops/gc.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

using test::ModelSeries;

constexpr uint64_t kInitial = 4;  // versions committed before the test body

// (version, file name) -> inode; the directory itself has the name "".
using InodeMap = std::map<std::pair<uint64_t, std::string>, uint64_t>;

class RefreshTest : public ::testing::Test {
 protected:
  void SetUp() override {
    writer_ = env_.Open();
    reader_ = env_.Open();
    ASSERT_TRUE(writer_ && reader_);
    for (uint64_t v = 0; v < kInitial; ++v) Commit(v);
    fs_ = std::make_unique<Filesystem>(reader_.get(), uint64_t{64} << 20);
    Refresh();
  }

  void Commit(uint64_t v) {
    Status s = env_.Commit(*writer_, v);
    ASSERT_TRUE(s.ok()) << s.message();
  }
  void Refresh() {
    Status s = fs_->Refresh();
    ASSERT_TRUE(s.ok()) << s.message();
  }
  // gc with the default grace period: blobs of removed versions stay for a
  // while, as they do in production.
  void Gc(uint64_t keep_last) {
    GcOptions o;
    o.keep_last = keep_last;
    auto r = CollectGarbage(*writer_, o, {});
    ASSERT_TRUE(r.ok()) << r.status().message();
  }

  // Every version directory and file the root lists, with its inode.
  InodeMap ListedInodes() {
    InodeMap out;
    auto root = fs_->ReadDir(kRootIno);
    EXPECT_TRUE(root.ok()) << root.status().message();
    if (!root.ok()) return out;
    for (const auto& d : *root) {
      if (d.name == "latest" || d.name == "live" || d.name == ".dte") continue;
      const uint64_t v = std::stoull(d.name.substr(1));
      out[{v, ""}] = d.attr.ino;
      auto files = fs_->ReadDir(d.attr.ino);
      EXPECT_TRUE(files.ok()) << files.status().message();
      if (!files.ok()) continue;
      for (const auto& f : *files) out[{v, f.name}] = f.attr.ino;
    }
    return out;
  }

  std::vector<std::string> RootNames() {
    std::vector<std::string> out;
    auto root = fs_->ReadDir(kRootIno);
    EXPECT_TRUE(root.ok()) << root.status().message();
    if (root.ok()) {
      for (const auto& e : *root) out.push_back(e.name);
    }
    return out;
  }

  std::unique_ptr<OpenFile> Open(uint64_t v, const std::string& name) {
    auto f = fs_->Open(test::FileIno(*fs_, v, name), O_RDONLY);
    EXPECT_TRUE(f.ok()) << f.status().message();
    return f.ok() ? std::move(f).value() : nullptr;
  }

  // The file reads back as committed, in 128 KiB requests as the kernel
  // sends them.
  void ExpectReadsAsCommitted(const OpenFile& f, uint64_t v, const std::string& name,
                              Filesystem* fs = nullptr) {
    SCOPED_TRACE(VersionName(v) + "/" + name);
    const std::string& want = env_.series().files(v).at(name);
    for (uint64_t off = 0; off < want.size(); off += 128 << 10) {
      auto got = test::ReadRange(fs ? *fs : *fs_, f, off, 128 << 10);
      ASSERT_TRUE(got.ok()) << "at " << off << ": " << got.status().message();
      ASSERT_TRUE(*got == want.substr(off, 128 << 10)) << "wrong bytes at " << off;
    }
  }

  nlohmann::json StatusJson() { return nlohmann::json::parse(fs_->StatusJson()); }

  test::SeriesStore env_{kInitial + 2};
  std::unique_ptr<Store> writer_, reader_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_F(RefreshTest, InodesAreStableAcrossLookupsAndRefreshAndNeverReused) {
  const InodeMap first = ListedInodes();
  ASSERT_EQ(first.size(), kInitial * (1 + env_.series().files(0).size()));
  std::set<uint64_t> distinct;
  uint64_t highest = 0;
  for (const auto& [key, ino] : first) {
    EXPECT_GE(ino, kFirstDynamicIno);
    distinct.insert(ino);
    highest = std::max(highest, ino);
  }
  EXPECT_EQ(distinct.size(), first.size()) << "two nodes share an inode";
  for (const auto& [key, ino] : first) {
    const auto& [v, name] = key;
    const uint64_t dir = test::LookupIno(*fs_, kRootIno, VersionName(v));
    EXPECT_EQ(name.empty() ? dir : test::LookupIno(*fs_, dir, name), ino);
    EXPECT_EQ(fs_->GetAttr(ino)->ino, ino);
  }
  Refresh();
  Refresh();
  EXPECT_EQ(ListedInodes(), first);

  Commit(kInitial);
  Refresh();
  const InodeMap second = ListedInodes();
  for (const auto& [key, ino] : second) {
    SCOPED_TRACE(VersionName(key.first) + "/" + key.second);
    if (key.first < kInitial) {
      EXPECT_EQ(first.at(key), ino);
    } else {
      EXPECT_GT(ino, highest) << "a new node got an old number";
      EXPECT_TRUE(distinct.insert(ino).second);
    }
  }
  EXPECT_EQ(test::LookupIno(*fs_, kRootIno, "latest"), kLatestIno);
  EXPECT_EQ(test::LookupIno(*fs_, kRootIno, ".dte"), kDteDirIno);
  EXPECT_EQ(test::LookupIno(*fs_, kDteDirIno, "status"), kStatusIno);
}

TEST_F(RefreshTest, CommittedVersionAppearsAtRefreshAndLatestMoves) {
  Commit(kInitial);
  EXPECT_EQ(fs_->Lookup(kRootIno, "v00000004").status().code(), Code::kNotFound)
      << "the version set changed without a Refresh";
  EXPECT_EQ(fs_->ReadLink(kLatestIno).value(), "v00000003");
  Refresh();
  EXPECT_EQ(RootNames(),
            (std::vector<std::string>{"v00000000", "v00000001", "v00000002", "v00000003",
                                      "v00000004", "latest", "live", ".dte"}));
  EXPECT_EQ(fs_->ReadLink(kLatestIno).value(), "v00000004");
  for (const auto& [name, bytes] : env_.series().files(kInitial)) {
    auto f = Open(kInitial, name);
    ASSERT_NE(f, nullptr);
    ExpectReadsAsCommitted(*f, kInitial, name);
  }
  EXPECT_EQ(StatusJson()["latest"], kInitial);
}

TEST_F(RefreshTest, RemovedVersionsLeaveAtRefreshAndTheirInodesGoStale) {
  const InodeMap before = ListedInodes();
  auto cached = Open(0, ModelSeries::kShard1);
  ASSERT_NE(cached, nullptr);
  ExpectReadsAsCommitted(*cached, 0, ModelSeries::kShard1);
  ASSERT_GT(StatusJson()["cache"]["entries"].get<uint64_t>(), 0u);

  Gc(2);  // removes v0 and v1, rebases v2
  EXPECT_EQ(RootNames().size(), kInitial + 3) << "the version set changed without a Refresh";
  Refresh();
  EXPECT_EQ(RootNames(),
            (std::vector<std::string>{"v00000002", "v00000003", "latest", "live", ".dte"}));
  for (const auto& [key, ino] : before) {
    SCOPED_TRACE(VersionName(key.first) + "/" + key.second);
    if (key.first >= 2) {
      EXPECT_TRUE(fs_->GetAttr(ino).ok()) << "a kept version's inode went stale";
      continue;
    }
    EXPECT_EQ(fs_->GetAttr(ino).status().code(), Code::kNotFound);
    if (key.second.empty()) {
      EXPECT_EQ(fs_->ReadDir(ino).status().code(), Code::kNotFound);
      EXPECT_EQ(fs_->Lookup(ino, "config.json").status().code(), Code::kNotFound);
      EXPECT_EQ(fs_->Lookup(kRootIno, VersionName(key.first)).status().code(), Code::kNotFound);
    } else {
      EXPECT_EQ(fs_->Open(ino, O_RDONLY).status().code(), Code::kNotFound);
    }
  }
  nlohmann::json j = StatusJson();
  EXPECT_EQ(j["versions"].get<std::vector<uint64_t>>(), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(j["cache"]["entries"], 0) << "blocks of a removed version stayed cached";
  EXPECT_EQ(j["cache"]["bytes"], 0);
}

// gc rewrote v2 as an anchor under a new manifest revision: the same
// directory and files, with the same inode numbers and bytes.
TEST_F(RefreshTest, RebasedVersionKeepsItsInodesAndBytes) {
  const InodeMap before = ListedInodes();
  auto kept = Open(3, ModelSeries::kShard1);  // a delta whose parent is rebased
  ASSERT_NE(kept, nullptr);
  Gc(2);
  Refresh();
  ASSERT_TRUE(reader_->GetVersion(2).value()->manifest.anchor()) << "v2 was not rebased";
  const InodeMap after = ListedInodes();
  for (const auto& [key, ino] : after) EXPECT_EQ(before.at(key), ino);
  for (uint64_t v : {2, 3}) {
    for (const auto& [name, bytes] : env_.series().files(v)) {
      auto f = Open(v, name);
      ASSERT_NE(f, nullptr);
      ExpectReadsAsCommitted(*f, v, name);
    }
  }
  ExpectReadsAsCommitted(*kept, 3, ModelSeries::kShard1);
}

// docs/fs.md: "A file that is already open keeps its version and keeps
// reading until it is closed; its bytes still come from the blobs, which gc
// keeps for its grace period." v0 is the anchor, which is read alone.
TEST_F(RefreshTest, OpenFileOfARemovedAnchorKeepsReading) {
  std::map<std::string, std::unique_ptr<OpenFile>> open;
  for (const auto& [name, bytes] : env_.series().files(0)) open[name] = Open(0, name);
  Gc(2);
  Refresh();
  ASSERT_EQ(fs_->Lookup(kRootIno, "v00000000").status().code(), Code::kNotFound);
  for (const auto& [name, f] : open) {
    ASSERT_NE(f, nullptr);
    ExpectReadsAsCommitted(*f, 0, name);
  }
}

// The same for deltas: v1 is a delta of v0 (both removed), and the file of
// v2 was opened at its old revision, a delta of v1. Their blocks need the
// removed parents' records, whose blobs are still within gc's grace period.
TEST_F(RefreshTest, OpenFileOfARemovedDeltaKeepsReading) {
  auto removed = Open(1, ModelSeries::kShard1);
  auto superseded = Open(2, ModelSeries::kShard1);
  ASSERT_TRUE(removed && superseded);
  ASSERT_TRUE(removed->version->manifest.parent.has_value());
  Gc(2);
  Refresh();
  ExpectReadsAsCommitted(*removed, 1, ModelSeries::kShard1);
  ExpectReadsAsCommitted(*superseded, 2, ModelSeries::kShard1);
}

// gc on another host rewrote v2 under a new manifest revision and deleted
// the old one before this mount refreshed: a lookup of v2, not loaded yet,
// finds the new revision instead of failing.
TEST_F(RefreshTest, VersionRewrittenByGcBeforeARefreshIsFoundAtItsNewRevision) {
  StoreOptions o;
  o.uri = env_.uri();
  o.version_cache_bytes = 1;  // v2 is not held in memory when gc runs
  auto opened = Store::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  std::unique_ptr<Store> store = std::move(opened).value();
  Filesystem fs(store.get(), uint64_t{16} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  const std::string old_key = ManifestKey(2, 0);
  ASSERT_TRUE(writer_->objects().Size(old_key).value().has_value());
  Gc(2);
  ASSERT_FALSE(writer_->objects().Size(old_key).value().has_value()) << "gc kept the old revision";
  for (uint64_t v : {2, 3}) {
    auto dir = fs.Lookup(kRootIno, VersionName(v));
    ASSERT_TRUE(dir.ok()) << VersionName(v) << ": " << dir.status().message();
    auto file = fs.Lookup(dir->ino, ModelSeries::kShard1);
    ASSERT_TRUE(file.ok()) << file.status().message();
    auto f = fs.Open(file->ino, O_RDONLY);
    ASSERT_TRUE(f.ok()) << f.status().message();
    ExpectReadsAsCommitted(**f, v, ModelSeries::kShard1, &fs);
  }
  EXPECT_TRUE(fs.VersionOf(2).value()->manifest.anchor());
  EXPECT_NE(fs.Versions().at(2), old_key);
}

// A version whose manifest does not load is skipped, reported once in
// .dte/status, and the others stay readable.
TEST_F(RefreshTest, VersionThatDoesNotLoadIsSkippedAndReportedOnce) {
  ASSERT_TRUE(writer_->objects().Put(ManifestKey(kInitial, 0), "not a manifest").ok());
  Refresh();
  Refresh();
  EXPECT_EQ(fs_->Lookup(kRootIno, "v00000004").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->ReadLink(kLatestIno).value(), "v00000003");
  nlohmann::json j = StatusJson();
  ASSERT_EQ(j["errors"].size(), 1u) << j["errors"].dump();
  EXPECT_NE(j["errors"][0].get<std::string>().find(ManifestKey(kInitial, 0)), std::string::npos)
      << j["errors"][0];
  auto f = Open(3, "config.json");
  ASSERT_NE(f, nullptr);
  ExpectReadsAsCommitted(*f, 3, "config.json");
}

// A mount loads no version but the newest: listing the root parses no
// manifest, a lookup or an open loads one version, and the Store keeps at
// most its bound of parsed versions in memory whatever the mount touched.
TEST_F(RefreshTest, VersionsAreLoadedWhenUsedAndTheirCacheIsBounded) {
  StoreOptions o;
  o.uri = env_.uri();
  o.version_cache_bytes = 1;  // keeps only the version used last
  auto opened = Store::Open(o);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  std::unique_ptr<Store> store = std::move(opened).value();
  Filesystem fs(store.get(), uint64_t{16} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  EXPECT_EQ(store->cached_versions(), 1u);
  ASSERT_NE(fs.Latest(), nullptr);
  EXPECT_EQ(fs.Latest()->manifest.version, kInitial - 1);
  auto root = fs.ReadDir(kRootIno);
  ASSERT_TRUE(root.ok()) << root.status().message();
  EXPECT_EQ(root->size(), kInitial + 3);  // versions, latest, live, .dte
  EXPECT_EQ(store->cached_versions(), 1u);
  for (uint64_t v = 0; v < kInitial; ++v) {
    auto dir = fs.Lookup(kRootIno, VersionName(v));
    ASSERT_TRUE(dir.ok()) << dir.status().message();
    auto file = fs.Lookup(dir->ino, ModelSeries::kShard1);
    ASSERT_TRUE(file.ok()) << file.status().message();
    auto f = fs.Open(file->ino, O_RDONLY);
    ASSERT_TRUE(f.ok()) << f.status().message();
    ExpectReadsAsCommitted(**f, v, ModelSeries::kShard1, &fs);
    EXPECT_EQ(store->cached_versions(), 1u) << "after reading " << VersionName(v);
  }
  // New versions are checked as they arrive; the newest becomes latest.
  Commit(kInitial);
  Commit(kInitial + 1);
  ASSERT_TRUE(fs.Refresh().ok());
  EXPECT_EQ(fs.Latest()->manifest.version, kInitial + 1);
  EXPECT_EQ(store->cached_versions(), 1u);
}

}  // namespace
}  // namespace dte::fs
