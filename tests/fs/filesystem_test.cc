// dtefs's namespace without FUSE: the root, version directories, `latest`,
// .dte/status, the read-only refusals, and whole-file reads.
#include "fs/filesystem.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <ctime>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "fs/internal/fuse_ops.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

using test::ModelSeries;

constexpr uint64_t kVersions = 3;
constexpr uint64_t kCacheBytes = uint64_t{64} << 20;

std::vector<std::string> Names(const std::vector<DirEntry>& entries) {
  std::vector<std::string> out;
  for (const auto& e : entries) out.push_back(e.name);
  return out;
}

// Versions 0..2 committed, and a Filesystem that has refreshed once.
class FilesystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = env_.Open();
    ASSERT_NE(store_, nullptr);
    before_commit_ = static_cast<int64_t>(std::time(nullptr));
    for (uint64_t v = 0; v < kVersions; ++v) {
      Status s = env_.Commit(*store_, v);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    after_commit_ = static_cast<int64_t>(std::time(nullptr));
    fs_ = std::make_unique<Filesystem>(store_.get(), kCacheBytes);
    Status s = fs_->Refresh();
    ASSERT_TRUE(s.ok()) << s.message();
  }

  const std::map<std::string, std::string>& Files(uint64_t v) { return env_.series().files(v); }

  // The whole content of a file, read through Open and Read in `chunk` pieces.
  std::string ReadAll(uint64_t ino, uint64_t chunk) {
    auto f = fs_->Open(ino, O_RDONLY);
    EXPECT_TRUE(f.ok()) << f.status().message();
    if (!f.ok()) return "";
    std::string all;
    for (;;) {
      auto piece = test::ReadRange(*fs_, **f, all.size(), chunk);
      EXPECT_TRUE(piece.ok()) << piece.status().message();
      if (!piece.ok() || piece->empty()) return all;
      all += *piece;
    }
  }

  nlohmann::json StatusJson() {
    auto j = nlohmann::json::parse(ReadAll(kStatusIno, 1000), nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << ".dte/status is not JSON";
    return j;
  }

  test::SeriesStore env_{kVersions + 1};
  std::unique_ptr<Store> store_;
  std::unique_ptr<Filesystem> fs_;
  int64_t before_commit_ = 0, after_commit_ = 0;
};

TEST_F(FilesystemTest, RootListsVersionsThenLatestLiveAndDte) {
  auto root = fs_->ReadDir(kRootIno);
  ASSERT_TRUE(root.ok()) << root.status().message();
  EXPECT_EQ(Names(*root), (std::vector<std::string>{"v00000000", "v00000001", "v00000002", "latest",
                                                    "live", ".dte"}));
  std::set<uint64_t> inos;
  for (const auto& e : *root) {
    SCOPED_TRACE(e.name);
    inos.insert(e.attr.ino);
    if (e.name == "latest") {
      EXPECT_EQ(e.attr.ino, kLatestIno);
      EXPECT_EQ(e.attr.type, NodeType::kSymlink);
      EXPECT_FALSE(e.attr.immutable) << "latest moves";
    } else if (e.name == ".dte") {
      EXPECT_EQ(e.attr.ino, kDteDirIno);
      EXPECT_EQ(e.attr.type, NodeType::kDirectory);
    } else if (e.name == "live") {
      EXPECT_EQ(e.attr.ino, kLiveDirIno);
      EXPECT_EQ(e.attr.type, NodeType::kDirectory);
      EXPECT_FALSE(e.attr.immutable) << "live changes";
    } else {
      EXPECT_GE(e.attr.ino, kFirstDynamicIno);
      EXPECT_EQ(e.attr.type, NodeType::kDirectory);
      EXPECT_TRUE(e.attr.immutable);
      EXPECT_EQ(fs_->Lookup(kRootIno, e.name)->ino, e.attr.ino);
    }
  }
  EXPECT_EQ(inos.size(), root->size()) << "two entries share an inode";

  auto attr = fs_->GetAttr(kRootIno);
  ASSERT_TRUE(attr.ok()) << attr.status().message();
  EXPECT_EQ(attr->type, NodeType::kDirectory);
  EXPECT_FALSE(attr->immutable) << "the root changes as versions come and go";

  auto dte = fs_->ReadDir(kDteDirIno);
  ASSERT_TRUE(dte.ok()) << dte.status().message();
  ASSERT_EQ(Names(*dte), (std::vector<std::string>{"control", "status"}));
  EXPECT_EQ((*dte)[1].attr.ino, kStatusIno);
  EXPECT_EQ((*dte)[1].attr.type, NodeType::kRegular);
  EXPECT_EQ(test::LookupIno(*fs_, kRootIno, ".dte"), kDteDirIno);
  EXPECT_EQ(test::LookupIno(*fs_, kDteDirIno, "status"), kStatusIno);
}

TEST_F(FilesystemTest, LatestIsASymlinkToTheNewestVersion) {
  auto target = fs_->ReadLink(kLatestIno);
  ASSERT_TRUE(target.ok()) << target.status().message();
  EXPECT_EQ(*target, "v00000002");
  auto attr = fs_->Lookup(kRootIno, "latest");
  ASSERT_TRUE(attr.ok()) << attr.status().message();
  EXPECT_EQ(attr->ino, kLatestIno);
  EXPECT_EQ(attr->type, NodeType::kSymlink);
  EXPECT_EQ(attr->size, target->size());
  EXPECT_EQ(fs_->GetAttr(kLatestIno)->size, target->size());
  // The target resolves, relative to the root, to the newest directory.
  EXPECT_EQ(test::LookupIno(*fs_, kRootIno, *target),
            test::LookupIno(*fs_, kRootIno, VersionName(kVersions - 1)));
  EXPECT_EQ(fs_->ReadLink(kRootIno).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(fs_->ReadLink(kStatusIno).status().code(), Code::kInvalidArgument);
}

TEST_F(FilesystemTest, VersionDirListsExactlyItsFilesWithSizesAndCommitTime) {
  for (uint64_t v = 0; v < kVersions; ++v) {
    SCOPED_TRACE(VersionName(v));
    const int64_t created = ParseRfc3339(store_->GetVersion(v).value()->manifest.created);
    EXPECT_GE(created, before_commit_);
    EXPECT_LE(created, after_commit_);
    auto dir = fs_->Lookup(kRootIno, VersionName(v));
    ASSERT_TRUE(dir.ok()) << dir.status().message();
    EXPECT_EQ(dir->mtime, created);
    auto entries = fs_->ReadDir(dir->ino);
    ASSERT_TRUE(entries.ok()) << entries.status().message();
    std::vector<std::string> want;
    for (const auto& [name, bytes] : Files(v)) want.push_back(name);
    EXPECT_EQ(Names(*entries), want);
    for (const auto& e : *entries) {
      SCOPED_TRACE(e.name);
      EXPECT_EQ(e.attr.type, NodeType::kRegular);
      EXPECT_EQ(e.attr.size, Files(v).at(e.name).size());
      EXPECT_EQ(e.attr.mtime, created);
      EXPECT_TRUE(e.attr.immutable);
      auto looked_up = fs_->Lookup(dir->ino, e.name);
      ASSERT_TRUE(looked_up.ok()) << looked_up.status().message();
      EXPECT_EQ(looked_up->ino, e.attr.ino);
      EXPECT_EQ(looked_up->size, e.attr.size);
      auto attr = fs_->GetAttr(e.attr.ino);
      ASSERT_TRUE(attr.ok()) << attr.status().message();
      EXPECT_EQ(attr->size, e.attr.size);
      EXPECT_EQ(attr->mtime, created);
    }
  }
}

TEST_F(FilesystemTest, UnknownNamesAndInodesAreNotFound) {
  const uint64_t dir = test::LookupIno(*fs_, kRootIno, "v00000001");
  const uint64_t file = test::LookupIno(*fs_, dir, "config.json");
  ASSERT_NE(file, 0u);
  for (const char* name : {"v00000003", "v00000001 ", "v0000001", "v000000001", "V00000001",
                           "v0000000x", "vlatest", "nonsense", "", "status", "config.json"}) {
    EXPECT_EQ(fs_->Lookup(kRootIno, name).status().code(), Code::kNotFound) << "'" << name << "'";
  }
  EXPECT_EQ(fs_->Lookup(kDteDirIno, "stat").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(dir, "missing.safetensors").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(dir, "v00000001").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(file, "x").status().code(), Code::kNotFound) << "a file is no directory";
  EXPECT_EQ(fs_->Lookup(kLatestIno, "config.json").status().code(), Code::kNotFound);
  const uint64_t unknown = 1000000;
  EXPECT_EQ(fs_->GetAttr(unknown).status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->ReadDir(unknown).status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Open(unknown, O_RDONLY).status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->GetAttr(9).status().code(), Code::kNotFound) << "reserved, unused inode";
  EXPECT_EQ(fs_->ReadDir(file).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(fs_->Open(dir, O_RDONLY).status().code(), Code::kInvalidArgument);
}

TEST_F(FilesystemTest, WriteOpensAreRefusedWithTheReadOnlyError) {
  const uint64_t file = test::FileIno(*fs_, 2, ModelSeries::kShard1);
  ASSERT_NE(file, 0u);
  for (uint64_t ino : {file, kStatusIno}) {
    for (int flags :
         {O_WRONLY, O_RDWR, O_RDONLY | O_TRUNC, O_WRONLY | O_APPEND, O_RDWR | O_CREAT | O_TRUNC}) {
      SCOPED_TRACE("inode " + std::to_string(ino) + " flags " + std::to_string(flags));
      auto f = fs_->Open(ino, flags);
      ASSERT_FALSE(f.ok());
      EXPECT_EQ(f.status().code(), Code::kUnimplemented);
      EXPECT_EQ(ErrnoOf(f.status()), EROFS);
      EXPECT_NE(f.status().message().find("read-only"), std::string::npos) << f.status().message();
    }
    EXPECT_TRUE(fs_->Open(ino, O_RDONLY).ok());
    EXPECT_TRUE(fs_->Open(ino, O_RDONLY | O_NONBLOCK | O_CLOEXEC).ok());
  }
  EXPECT_EQ(ErrnoOf(ReadOnlyError("mkdir /v00000009")), EROFS);
  EXPECT_EQ(ErrnoOf(NotFound("x")), ENOENT);
  EXPECT_EQ(ErrnoOf(Corruption("x")), EIO);
  EXPECT_EQ(ReadErrnoOf(NotFound("blob")), EIO);
  EXPECT_EQ(ReadErrnoOf(Corruption("x")), EIO);
  EXPECT_EQ(ReadErrnoOf(InvalidArgument("x")), EINVAL);
}

TEST_F(FilesystemTest, WholeFilesReadBackAsCommitted) {
  for (uint64_t v = 0; v < kVersions; ++v) {
    for (const auto& [name, bytes] : Files(v)) {
      SCOPED_TRACE(VersionName(v) + "/" + name);
      const uint64_t ino = test::FileIno(*fs_, v, name);
      EXPECT_TRUE(ReadAll(ino, 128 << 10) == bytes);
      EXPECT_TRUE(ReadAll(ino, 1 << 20) == bytes);
    }
  }
}

TEST_F(FilesystemTest, ReadsAtAndPastTheEndAreShort) {
  const std::string& want = Files(1).at(ModelSeries::kShard2);
  auto f = fs_->Open(test::FileIno(*fs_, 1, ModelSeries::kShard2), O_RDONLY);
  ASSERT_TRUE(f.ok()) << f.status().message();
  auto tail = test::ReadRange(*fs_, **f, want.size() - 10, 4096);
  ASSERT_TRUE(tail.ok()) << tail.status().message();
  EXPECT_TRUE(*tail == want.substr(want.size() - 10));
  for (uint64_t off : {want.size(), want.size() + 1, want.size() + (1 << 30)}) {
    auto past = test::ReadRange(*fs_, **f, off, 4096);
    ASSERT_TRUE(past.ok()) << past.status().message();
    EXPECT_TRUE(past->empty()) << off;
  }
  auto none = test::ReadRange(*fs_, **f, 17, 0);
  ASSERT_TRUE(none.ok()) << none.status().message();
  EXPECT_TRUE(none->empty());
}

TEST_F(FilesystemTest, StatusFileIsJsonWithVersionsAndCounters) {
  nlohmann::json j = StatusJson();
  EXPECT_EQ(j["store"], env_.uri());
  EXPECT_EQ(j["versions"].get<std::vector<uint64_t>>(), (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ(j["latest"], 2);
  EXPECT_EQ(j["read_errors"], 0);
  EXPECT_EQ(j["cache"]["capacity_bytes"], kCacheBytes);
  EXPECT_TRUE(j["errors"].is_array() && j["errors"].empty()) << j.dump();
  for (const char* key : {"reads", "bytes_served", "blocks_decoded", "records_decoded",
                          "payload_bytes", "hash_failures", "inodes"}) {
    EXPECT_TRUE(j[key].is_number_unsigned()) << key;
  }
  auto attr = fs_->GetAttr(kStatusIno);
  ASSERT_TRUE(attr.ok()) << attr.status().message();
  EXPECT_EQ(attr->type, NodeType::kRegular);
  EXPECT_FALSE(attr->immutable);
  EXPECT_GT(attr->size, 0u);

  // The file is a snapshot taken at open: later reads do not change it.
  auto f = fs_->Open(kStatusIno, O_RDONLY);
  ASSERT_TRUE(f.ok()) << f.status().message();
  const std::string first = test::ReadRange(*fs_, **f, 0, 1 << 20).value();
  EXPECT_EQ(ReadAll(test::FileIno(*fs_, 0, "config.json"), 4096), Files(0).at("config.json"));
  EXPECT_EQ(test::ReadRange(*fs_, **f, 0, 1 << 20).value(), first);
  EXPECT_EQ(test::ReadRange(*fs_, **f, 5, 7).value(), first.substr(5, 7));
  EXPECT_TRUE(test::ReadRange(*fs_, **f, first.size(), 10).value().empty());
  nlohmann::json later = StatusJson();
  EXPECT_GT(later["reads"], j["reads"]);
  EXPECT_GT(later["bytes_served"], j["bytes_served"]);
  EXPECT_GT(later["inodes"], 0);
}

// Listing and opening decode nothing; reading one tensor decodes exactly the
// blocks it overlaps, once, and a second read is served from the cache.
TEST_F(FilesystemTest, ReadingOneTensorDecodesOnlyItsBlocks) {
  auto v = store_->GetVersion(2);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const FileEntry* shard = nullptr;
  for (const auto& f : (*v)->manifest.files) {
    if (f.name == ModelSeries::kShard1) shard = &f;
  }
  ASSERT_NE(shard, nullptr);
  ASSERT_EQ(shard->tensors[1].name, "model.embed");
  const TensorEntry& embed = shard->tensors[1];
  ASSERT_EQ(embed.blocks, 3u);

  const uint64_t ino = test::FileIno(*fs_, 2, ModelSeries::kShard1);
  ASSERT_TRUE(fs_->ReadDir(test::LookupIno(*fs_, kRootIno, "v00000002")).ok());
  auto f = fs_->Open(ino, O_RDONLY);
  ASSERT_TRUE(f.ok()) << f.status().message();
  nlohmann::json before = StatusJson();
  EXPECT_EQ(before["blocks_decoded"], 0) << "listing or opening decoded a block";
  EXPECT_EQ(before["cache"]["misses"], 0);

  const std::string& want = Files(2).at(ModelSeries::kShard1);
  const uint64_t off = shard->header_size + embed.begin;
  for (int pass = 0; pass < 2; ++pass) {
    auto got = test::ReadRange(*fs_, **f, off, embed.bytes());
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_TRUE(*got == want.substr(off, embed.bytes()));
  }
  nlohmann::json after = StatusJson();
  EXPECT_EQ(after["blocks_decoded"], embed.blocks);
  EXPECT_GE(after["records_decoded"], embed.blocks);
  EXPECT_EQ(after["cache"]["misses"], embed.blocks);
  EXPECT_EQ(after["cache"]["hits"], embed.blocks) << "the second read decoded again";
  EXPECT_EQ(after["cache"]["entries"], embed.blocks);
  EXPECT_EQ(after["cache"]["bytes"], embed.bytes());
  EXPECT_EQ(after["bytes_served"].get<uint64_t>() - before["bytes_served"].get<uint64_t>(),
            2 * embed.bytes());
  EXPECT_EQ(after["hash_failures"], 0);

  // A range across the header, model.norm and into model.embed's block 0
  // adds the header and nothing but block 0, which is cached already.
  auto head = test::ReadRange(*fs_, **f, 5, off + 10);
  ASSERT_TRUE(head.ok()) << head.status().message();
  EXPECT_TRUE(*head == want.substr(5, off + 10));
  nlohmann::json last = StatusJson();
  EXPECT_EQ(last["blocks_decoded"], embed.blocks + 1) << "only model.norm's block is new";
  EXPECT_EQ(last["cache"]["entries"], embed.blocks + 2) << "plus model.norm and the header";
}

TEST(FilesystemEmptyStore, ShowsOnlyDteAndNoLatest) {
  test::ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path() + "/store");
  ASSERT_NE(store, nullptr);
  Filesystem fs(store.get(), 0);
  ASSERT_TRUE(fs.Refresh().ok());
  auto root = fs.ReadDir(kRootIno);
  ASSERT_TRUE(root.ok()) << root.status().message();
  EXPECT_EQ(Names(*root), std::vector<std::string>{".dte"});
  EXPECT_EQ(fs.ReadLink(kLatestIno).status().code(), Code::kNotFound);
  EXPECT_EQ(fs.Lookup(kRootIno, "latest").status().code(), Code::kNotFound);
  EXPECT_EQ(fs.Lookup(kRootIno, "v00000000").status().code(), Code::kNotFound);
  auto j = nlohmann::json::parse(fs.StatusJson(), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_TRUE(j["versions"].empty());
  EXPECT_TRUE(j["latest"].is_null());
  EXPECT_EQ(j["cache"]["capacity_bytes"], 0);
}

}  // namespace
}  // namespace dte::fs
