// SnapshotSet: reads of a long delta chain start from the nearest snapshot,
// decode only the records after it, and never return wrong bytes when a
// snapshot file is damaged; snapshots survive a restart and a gc rebase.
#include "store/snapshot.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>

#include <filesystem>
#include <string>
#include <vector>

#include "store/base/posix_file.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::ScopedTempDir;
using test::TestTensor;
using test::VersionWriter;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr uint64_t kChain = 24;     // v0 anchor, v1..v24 deltas
constexpr uint64_t kSnapshot = 10;  // the version snapshotted in the middle

// 1 + 4 + 3 blocks (the last one partial).
std::vector<TestTensor> Model() {
  return {test::Bf16Tensor("a.norm", {1000}, 1), test::Bf16Tensor("b.proj", {512, 1024}, 2),
          test::Bf16Tensor("c.head", {300, 1000}, 3)};
}

// One optimizer-like step touching every block of every tensor, so every
// record of a delta is sparse.
std::vector<TestTensor> Step(std::vector<TestTensor> tensors, uint64_t seed) {
  return test::PerturbEveryBlock(std::move(tensors), kBB, 200, seed);
}

class SnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_NE(store_, nullptr);
    writer_ = std::make_unique<VersionWriter>(&store_->objects());
    std::vector<TestTensor> t = Model();
    ASSERT_TRUE(writer_->Write(0, t, true).ok());
    for (uint64_t v = 1; v <= kChain; ++v) {
      t = Step(t, 1000 * v);
      ASSERT_TRUE(writer_->Write(v, t, false).ok());
      for (const auto& r : writer_->records(v)) ASSERT_EQ(r.kind, BlockKind::kSparse);
    }
    OpenSet();
  }

  void OpenSet() {
    set_.reset();
    auto set = SnapshotSet::Open(SnapDir());
    ASSERT_TRUE(set.ok()) << set.status().message();
    set_ = std::move(set).value();
  }

  std::string SnapDir() const { return dir_.path() + "/snapshots"; }

  std::shared_ptr<const Version> Get(uint64_t version) {
    auto v = store_->GetVersion(version);
    EXPECT_TRUE(v.ok()) << v.status().message();
    return v.ok() ? *v : nullptr;
  }

  // Builds a snapshot of `version`; returns the builder's counters.
  void Build(uint64_t version, ReadCounters* counters = nullptr) {
    Materializer reader(store_.get());
    reader.SetBase(set_.get());
    std::atomic<bool> cancel{false};
    Status s = set_->Build(Get(version), &reader, cancel);
    ASSERT_TRUE(s.ok()) << s.message();
    if (counters) {
      counters->blocks = reader.counters().blocks.load();
      counters->records = reader.counters().records.load();
      counters->base_blocks = reader.counters().base_blocks.load();
    }
  }

  // Reads the whole model file of `version` through a reader using the set;
  // checks the bytes and returns the counters.
  void ReadAndCheck(uint64_t version, ReadCounters* counters) {
    SCOPED_TRACE(VersionName(version));
    auto v = Get(version);
    const FileEntry& f = v->manifest.files[1];
    ASSERT_EQ(f.name, VersionWriter::kModelFile);
    Materializer reader(store_.get());
    reader.SetBase(set_.get());
    std::string out(f.size, '\0');
    Status s = reader.ReadFile(v, f, 0, f.size, reinterpret_cast<uint8_t*>(out.data()));
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(out == writer_->file(version)) << "wrong bytes";
    counters->blocks = reader.counters().blocks.load();
    counters->records = reader.counters().records.load();
    counters->base_blocks = reader.counters().base_blocks.load();
    counters->hash_failures = reader.counters().hash_failures.load();
  }

  // Records decoded plus snapshot blocks used, per block read.
  static uint64_t StepsPerBlock(const ReadCounters& c) {
    EXPECT_GT(c.blocks.load(), 0u);
    EXPECT_EQ((c.records + c.base_blocks) % c.blocks, 0u);
    return (c.records + c.base_blocks) / c.blocks;
  }

  std::string SnapshotPath(uint64_t version) {
    return SnapDir() + "/" + SnapshotSet::FileName(*Get(version));
  }

  ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<VersionWriter> writer_;
  std::unique_ptr<SnapshotSet> set_;
};

constexpr uint64_t kBlocks = 1 + 4 + 3;

TEST_F(SnapshotTest, LaterVersionsDecodeOnlyTheRecordsAfterTheSnapshot) {
  ReadCounters build;
  Build(kSnapshot, &build);
  EXPECT_EQ(build.blocks.load(), kBlocks);
  EXPECT_EQ(build.records.load(), (kSnapshot + 1) * kBlocks);  // the first one walks to v0
  ASSERT_TRUE(std::filesystem::exists(SnapshotPath(kSnapshot)));
  for (uint64_t v = kSnapshot; v <= kChain; ++v) {
    ReadCounters c;
    ASSERT_NO_FATAL_FAILURE(ReadAndCheck(v, &c));
    EXPECT_EQ(c.blocks.load(), kBlocks);
    EXPECT_EQ(c.base_blocks.load(), kBlocks);
    EXPECT_EQ(StepsPerBlock(c), v - kSnapshot + 1) << VersionName(v);
  }
  ReadCounters before;  // versions before the snapshot still walk to the anchor
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kSnapshot - 1, &before));
  EXPECT_EQ(before.base_blocks.load(), 0u);
  EXPECT_EQ(StepsPerBlock(before), kSnapshot);
  EXPECT_EQ(set_->Stats().block_reads, (kChain - kSnapshot + 1) * kBlocks);
}

TEST_F(SnapshotTest, BuildingFromAnEarlierSnapshotDecodesOnlyTheGap) {
  Build(kSnapshot);
  ReadCounters build;
  Build(kSnapshot + 8, &build);
  EXPECT_EQ(build.base_blocks.load(), kBlocks);
  EXPECT_EQ(build.records.load(), 8 * kBlocks);
  ReadCounters c;
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kChain, &c));
  EXPECT_EQ(StepsPerBlock(c), kChain - (kSnapshot + 8) + 1);
  SnapshotStats s = set_->Stats();
  EXPECT_EQ(s.count, 2u);
  EXPECT_EQ(s.versions, (std::vector<uint64_t>{kSnapshot, kSnapshot + 8}));
  EXPECT_EQ(s.built, 2u);
  EXPECT_FALSE(s.building.has_value());
  EXPECT_GT(s.bytes, 0u);
}

TEST_F(SnapshotTest, CorruptBlockIsDetectedDroppedAndReadFromTheStore) {
  Build(kSnapshot);
  const std::string path = SnapshotPath(kSnapshot);
  ASSERT_TRUE(test::FlipBits(path, 3 * kBB + 777).ok());  // block record 3
  ReadCounters c;
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kSnapshot + 2, &c));  // right bytes all the same
  EXPECT_EQ(c.hash_failures.load(), 0u);
  EXPECT_EQ(c.base_blocks.load(), 3u);  // records 0..2 came from the snapshot
  SnapshotStats s = set_->Stats();
  EXPECT_EQ(s.hash_failures, 1u);
  EXPECT_EQ(s.count, 0u);
  EXPECT_NE(s.last_error.find("does not match"), std::string::npos) << s.last_error;
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(set_->Has(*Get(kSnapshot)));
  Build(kSnapshot);  // and it can be built again
  EXPECT_TRUE(set_->Has(*Get(kSnapshot)));
}

TEST_F(SnapshotTest, TruncatedFileFallsBackToTheStore) {
  Build(kSnapshot);
  std::filesystem::resize_file(SnapshotPath(kSnapshot), 2 * kBB);
  ReadCounters c;
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kSnapshot, &c));
  EXPECT_EQ(c.base_blocks.load(), 2u);
  EXPECT_EQ(set_->Stats().count, 0u);
}

TEST_F(SnapshotTest, SurvivesReopeningAndStaleTempFilesAreRemoved) {
  Build(kSnapshot);
  const std::string stale = SnapDir() + "/.tmp.v00000003.x.snap.1";
  const std::string live = SnapDir() + "/.tmp.v00000004.x.snap.2";
  ASSERT_TRUE(test::WriteFileBytes(stale, "partial").ok());
  ASSERT_TRUE(test::WriteFileBytes(live, "being written").ok());
  auto writer = OpenFile(live, O_RDWR);  // a writer in another process holds its lock
  ASSERT_TRUE(writer.ok());
  ASSERT_EQ(flock(writer->get(), LOCK_EX | LOCK_NB), 0);
  OpenSet();
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(set_->Has(*Get(kSnapshot)));
  ReadCounters c;
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kSnapshot + 3, &c));
  EXPECT_EQ(StepsPerBlock(c), 4u);
}

// gc rebases a version into a new manifest revision: an anchor with the same
// content. Its snapshot keeps its name and is used for the new revision.
TEST_F(SnapshotTest, RebasedRevisionReusesTheSnapshot) {
  Build(kSnapshot);
  const std::string before = SnapshotPath(kSnapshot);
  auto old = Get(kSnapshot);
  Manifest m = old->manifest;
  m.revision = 1;
  m.parent.reset();
  FileEntry& f = m.files[1];
  const std::string data = writer_->file(kSnapshot).substr(f.header_size);
  const Hash128 blob = HashBytes(data.data(), data.size());
  ASSERT_TRUE(store_->objects().Put(BlobKey(blob), data).ok());
  m.blobs = {BlobRef{blob, data.size(), true}};
  std::vector<BlockRecord> records = old->records;
  for (const TensorEntry& t : f.tensors) {
    for (uint32_t b = 0; b < t.blocks; ++b) {
      BlockRecord& r = records[t.first_block + b];
      r.kind = BlockKind::kDenseRaw;
      r.blob = 0;
      r.offset = t.begin + uint64_t{b} * kBB;
      r.length = static_cast<uint32_t>(std::min(kBB, t.bytes() - uint64_t{b} * kBB));
    }
  }
  const std::string table = EncodeBlockTable(records);
  m.block_table = BlobRef{HashBytes(table.data(), table.size()), table.size(), true};
  ASSERT_TRUE(store_->objects().Put(BlobKey(m.block_table.hash), table).ok());
  ASSERT_TRUE(store_->objects().Put(ManifestKey(kSnapshot, 1), EncodeManifest(m)).ok());
  store_->Forget(kSnapshot);
  auto rebased = Get(kSnapshot);
  ASSERT_EQ(rebased->key, ManifestKey(kSnapshot, 1));
  EXPECT_EQ(SnapshotSet::ContentId(*rebased), SnapshotSet::ContentId(*old));
  std::map<uint64_t, std::shared_ptr<const Version>> versions;
  for (uint64_t v = kSnapshot; v <= kChain; ++v) versions[v] = Get(v);
  EXPECT_EQ(set_->Retain(versions), (std::set<uint64_t>{kSnapshot}));
  EXPECT_TRUE(std::filesystem::exists(before));
  ReadCounters c;
  ASSERT_NO_FATAL_FAILURE(ReadAndCheck(kSnapshot + 5, &c));
  EXPECT_EQ(c.base_blocks.load(), kBlocks);
  EXPECT_EQ(StepsPerBlock(c), 6u);
}

TEST_F(SnapshotTest, RetainDeletesSnapshotsOfVersionsThatLeftTheStore) {
  Build(kSnapshot);
  Build(kSnapshot + 4);
  std::map<uint64_t, std::shared_ptr<const Version>> versions;
  for (uint64_t v = kSnapshot + 1; v <= kChain; ++v) versions[v] = Get(v);
  EXPECT_EQ(set_->Retain(versions), (std::set<uint64_t>{kSnapshot + 4}));
  EXPECT_FALSE(std::filesystem::exists(SnapshotPath(kSnapshot)));
  set_->Remove(kSnapshot + 4);
  EXPECT_FALSE(std::filesystem::exists(SnapshotPath(kSnapshot + 4)));
  EXPECT_EQ(set_->Stats().count, 0u);
}

TEST_F(SnapshotTest, CancelledBuildLeavesNothing) {
  Materializer reader(store_.get());
  std::atomic<bool> cancel{true};
  Status s = set_->Build(Get(kSnapshot), &reader, cancel);
  EXPECT_EQ(s.code(), Code::kAborted) << s.message();
  EXPECT_TRUE(std::filesystem::is_empty(SnapDir()));
  EXPECT_EQ(set_->Stats().count, 0u);
}

TEST(SnapshotName, IsVersionAndContentId) {
  Version v;
  v.manifest.version = 12;
  v.records.resize(3);
  const std::string name = SnapshotSet::FileName(v);
  EXPECT_EQ(name.rfind("v00000012.", 0), 0u) << name;
  EXPECT_EQ(name.size(), 9 + 1 + 32 + 5) << name;
  Version w = v;
  w.records[1].hash = 1;  // other content: another id
  EXPECT_NE(SnapshotSet::ContentId(w), SnapshotSet::ContentId(v));
  w = v;
  w.manifest.block_bytes *= 2;
  EXPECT_NE(SnapshotSet::ContentId(w), SnapshotSet::ContentId(v));
}

}  // namespace
}  // namespace dte
