// dtefs's read path: any byte range of any version equals the committed
// bytes, whatever the cache size; a corrupt blob fails exactly the reads that
// need it, with Corruption, and is not remembered once repaired; parallel
// reads of one block decode it once.
#include "fs/read_path.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "fs/filesystem.h"
#include "store/ops/gc.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

using test::ModelSeries;

constexpr uint64_t kVersions = 4;
constexpr uint64_t kBB = kDefaultBlockBytes;

const FileEntry& FileNamed(const Version& v, const std::string& name) {
  for (const auto& f : v.manifest.files) {
    if (f.name == name) return f;
  }
  ADD_FAILURE() << "no file " << name;
  return v.manifest.files.at(0);
}

uint32_t FileIndex(const Version& v, const std::string& name) {
  return static_cast<uint32_t>(&FileNamed(v, name) - v.manifest.files.data());
}

// Offsets where reads are likely to go wrong: the header's end, every
// tensor's start and end, every block boundary, and the file's end.
std::vector<uint64_t> Boundaries(const FileEntry& f) {
  std::vector<uint64_t> out = {0, f.size};
  if (!f.safetensors) return out;
  out.push_back(f.header_size);
  for (const auto& t : f.tensors) {
    for (uint64_t b = t.begin; b < t.end; b += kBB) out.push_back(f.header_size + b);
    out.push_back(f.header_size + t.end);
  }
  return out;
}

class ReadPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = env_.Open();
    ASSERT_NE(store_, nullptr);
    for (uint64_t v = 0; v < kVersions; ++v) {
      Status s = env_.Commit(*store_, v);
      ASSERT_TRUE(s.ok()) << s.message();
      auto ver = store_->GetVersion(v);
      ASSERT_TRUE(ver.ok()) << ver.status().message();
      versions_.push_back(*ver);
    }
  }

  // Reads [off, off + len) of file `name` of version v through `rp`.
  Result<std::string> Read(ReadPath& rp, uint64_t v, const std::string& name, uint64_t off,
                           uint64_t len) {
    std::string out(len, '\0');
    RETURN_IF_ERROR(rp.Read(versions_[v], FileIndex(*versions_[v], name), off, len,
                            reinterpret_cast<uint8_t*>(out.data())));
    return out;
  }

  void ExpectRange(ReadPath& rp, uint64_t v, const std::string& name, uint64_t off, uint64_t len) {
    const std::string& want = env_.series().files(v).at(name);
    auto got = Read(rp, v, name, off, len);
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_TRUE(*got == want.substr(off, len))
        << VersionName(v) << "/" << name << " range " << off << "+" << len;
    // The same range as pieces: in order, none empty, together the same bytes
    // (read after all of them were taken, so a piece evicted meanwhile must
    // still be held).
    std::vector<ReadPath::Piece> pieces;
    Status s = rp.ReadPieces(versions_[v], FileIndex(*versions_[v], name), off, len, &pieces);
    ASSERT_TRUE(s.ok()) << s.message();
    std::string joined;
    for (const ReadPath::Piece& p : pieces) {
      EXPECT_GT(p.size, 0u);
      EXPECT_NE(p.hold, nullptr);
      joined.append(p.data, p.size);
    }
    EXPECT_TRUE(joined == want.substr(off, len))
        << "pieces of " << VersionName(v) << "/" << name << " range " << off << "+" << len;
  }

  // The path of the blob holding block `block` of tensor `tensor` of version
  // v (a dense record: v must be an anchor), and an offset inside its bytes.
  std::pair<std::string, uint64_t> DenseBlockByte(uint64_t v, const std::string& file,
                                                  size_t tensor, uint32_t block) {
    const Version& ver = *versions_[v];
    const BlockRecord& rec = ver.records[FileNamed(ver, file).tensors[tensor].first_block + block];
    EXPECT_TRUE(rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd);
    return {env_.PathOf(BlobKey(ver.manifest.blobs[rec.blob].hash)), rec.offset + rec.length / 2};
  }

  test::SeriesStore env_{kVersions};
  std::unique_ptr<Store> store_;
  std::vector<std::shared_ptr<const Version>> versions_;
};

// Random ranges, half of them starting next to a boundary, with lengths from
// one byte to several blocks; with the cache off, smaller than a few blocks
// (constant eviction), and large.
TEST_F(ReadPathTest, RandomRangesEqualTheCommittedBytes) {
  test::Rng rng(7);
  for (uint64_t cache : {uint64_t{0}, 3 * kBB, uint64_t{64} << 20}) {
    ReadPath rp(store_.get(), cache);
    for (uint64_t v = 0; v < kVersions; ++v) {
      for (const auto& f : versions_[v]->manifest.files) {
        SCOPED_TRACE("cache " + std::to_string(cache));
        const std::vector<uint64_t> edges = Boundaries(f);
        for (int i = 0; i < 25; ++i) {
          uint64_t off = rng.Below(f.size);
          if (i % 2 == 0) {
            const uint64_t edge = edges[rng.Below(edges.size())];
            off = std::min(f.size, edge - std::min<uint64_t>(edge, rng.Below(5)));
          }
          const uint64_t caps[] = {1, 16, 4096, 2 * kBB + 5000};
          const uint64_t len = std::min(f.size - off, 1 + rng.Below(caps[rng.Below(4)]));
          ExpectRange(rp, v, f.name, off, len);
        }
      }
    }
    const CacheStats s = rp.cache().Stats();
    EXPECT_LE(s.bytes, cache);
    EXPECT_TRUE(cache != 3 * kBB || s.evictions > 0) << "a small cache never evicted";
    EXPECT_TRUE(cache != 0 || s.entries == 0) << "a disabled cache kept an entry";
  }
}

TEST_F(ReadPathTest, RangeBeyondTheFileIsInvalidArgument) {
  ReadPath rp(store_.get(), 1 << 20);
  const uint64_t size = env_.series().files(1).at("config.json").size();
  uint8_t b[16] = {};
  const uint32_t config = FileIndex(*versions_[1], "config.json");
  EXPECT_EQ(rp.Read(versions_[1], config, size, 1, b).code(), Code::kInvalidArgument);
  EXPECT_EQ(rp.Read(versions_[1], config, size - 1, 2, b).code(), Code::kInvalidArgument);
  EXPECT_EQ(rp.Read(versions_[1], config, 1, UINT64_MAX, b).code(), Code::kInvalidArgument);
  EXPECT_TRUE(rp.Read(versions_[1], config, size, 0, b).ok());
}

// A flipped byte in block 1 of v0's model.embed: reads that need that block,
// at v0 and at every delta built on it, fail with Corruption naming the
// tensor; other blocks, files and versions' raw files still read. Once the
// byte is repaired, the same reads succeed: errors are not cached.
TEST_F(ReadPathTest, CorruptBlockFailsOnlyTheReadsThatNeedIt) {
  Filesystem fs(store_.get(), uint64_t{64} << 20);
  ASSERT_TRUE(fs.Refresh().ok());
  const FileEntry& shard = FileNamed(*versions_[0], ModelSeries::kShard1);
  const uint64_t block1 = shard.header_size + shard.tensors[1].begin + kBB;
  const auto [path, byte] = DenseBlockByte(0, ModelSeries::kShard1, 1, 1);
  ASSERT_TRUE(test::FlipBits(path, byte).ok());

  for (uint64_t v = 0; v < kVersions; ++v) {
    SCOPED_TRACE(VersionName(v));
    auto f = fs.Open(test::FileIno(fs, v, ModelSeries::kShard1), O_RDONLY);
    ASSERT_TRUE(f.ok()) << f.status().message();
    const std::string& want = env_.series().files(v).at(ModelSeries::kShard1);
    for (uint64_t off : {block1 + 100, block1 - 10, block1 + kBB - 1}) {
      auto bad = test::ReadRange(fs, **f, off, 20);
      ASSERT_EQ(bad.status().code(), Code::kCorruption) << "at " << off;
      EXPECT_NE(bad.status().message().find("model.embed"), std::string::npos)
          << bad.status().message();
    }
    for (uint64_t off : {uint64_t{0}, block1 - kBB, block1 + kBB}) {
      auto good = test::ReadRange(fs, **f, off, kBB);
      ASSERT_TRUE(good.ok()) << "at " << off << ": " << good.status().message();
      EXPECT_TRUE(*good == want.substr(off, kBB)) << "at " << off;
    }
    for (const char* name : {ModelSeries::kShard2, "config.json"}) {
      auto other = fs.Open(test::FileIno(fs, v, name), O_RDONLY);
      ASSERT_TRUE(other.ok());
      const std::string& content = env_.series().files(v).at(name);
      auto all = test::ReadRange(fs, **other, 0, content.size());
      ASSERT_TRUE(all.ok()) << name << ": " << all.status().message();
      EXPECT_TRUE(*all == content) << name;
    }
  }
  auto j = nlohmann::json::parse(fs.StatusJson());
  EXPECT_EQ(j["read_errors"], 3 * kVersions);
  EXPECT_GE(j["hash_failures"].get<uint64_t>(), 1u);
  ASSERT_EQ(j["errors"].size(), kVersions) << "one error per (version, file)";
  EXPECT_NE(j["errors"][0].get<std::string>().find("model.embed"), std::string::npos);

  ASSERT_TRUE(test::FlipBits(path, byte).ok());
  for (uint64_t v = 0; v < kVersions; ++v) {
    auto f = fs.Open(test::FileIno(fs, v, ModelSeries::kShard1), O_RDONLY);
    ASSERT_TRUE(f.ok());
    auto repaired = test::ReadRange(fs, **f, block1, kBB);
    ASSERT_TRUE(repaired.ok()) << VersionName(v) << ": " << repaired.status().message();
    EXPECT_TRUE(*repaired == env_.series().files(v).at(ModelSeries::kShard1).substr(block1, kBB));
  }
}

// A flipped byte in a safetensors header blob fails reads of the header only;
// one in a raw file's blob fails that file only.
TEST_F(ReadPathTest, CorruptHeaderOrRawBlobFailsOnlyItsBytes) {
  const FileEntry& shard = FileNamed(*versions_[2], ModelSeries::kShard2);
  const FileEntry& config = FileNamed(*versions_[2], "config.json");
  ASSERT_TRUE(test::FlipBits(env_.PathOf(BlobKey(shard.header_blob)), 20).ok());
  ASSERT_TRUE(test::FlipBits(env_.PathOf(BlobKey(config.blob)), 3).ok());
  ReadPath rp(store_.get(), 1 << 20);
  const uint64_t h = shard.header_size;
  for (auto [off, len] : {std::pair<uint64_t, uint64_t>{0, 8}, {h - 1, 1}, {h - 5, 100}}) {
    auto bad = Read(rp, 2, ModelSeries::kShard2, off, len);
    EXPECT_EQ(bad.status().code(), Code::kCorruption) << off << "+" << len;
    EXPECT_NE(bad.status().message().find(BlobKey(shard.header_blob)), std::string::npos)
        << bad.status().message();
  }
  ExpectRange(rp, 2, ModelSeries::kShard2, h, shard.size - h);
  EXPECT_EQ(Read(rp, 2, "config.json", 0, config.size).status().code(), Code::kCorruption);
  ExpectRange(rp, 2, ModelSeries::kShard1, 0, FileNamed(*versions_[2], ModelSeries::kShard1).size);
}

// The kernel splits a 256 KiB block into parallel 128 KiB reads (and readers
// of one tensor collide): each block is decoded once.
TEST_F(ReadPathTest, ParallelReadsOfOneBlockDecodeItOnce) {
  ReadPath rp(store_.get(), uint64_t{64} << 20);
  const FileEntry& shard = FileNamed(*versions_[3], ModelSeries::kShard1);
  const uint64_t start = shard.header_size + shard.tensors[1].begin;
  const std::string& want = env_.series().files(3).at(ModelSeries::kShard1);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      // Threads 0-3 read block 0 in halves, 4-7 block 1 in halves.
      const uint64_t off = start + (t / 4) * kBB + (t % 2) * (kBB / 2);
      auto got = Read(rp, 3, ModelSeries::kShard1, off, kBB / 2);
      if (!got.ok() || *got != want.substr(off, kBB / 2)) wrong++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(rp.counters().blocks.load(), 2u);
  EXPECT_EQ(rp.cache().Stats().misses, 2u);
  EXPECT_EQ(rp.cache().Stats().hits, 6u);
}

// gc rewrote v1 as an anchor (revision 1) and, its grace period over,
// deleted the blobs only revision 0 used: a file still open at revision 0
// fails to read. A reader of revision 1 must get revision 1's bytes, never
// the other revision's error, even when both ask for the same block at once.
// (The cache is off: only loads in flight are shared.)
TEST_F(ReadPathTest, ReaderOfTheCurrentRevisionGetsNoErrorOfASupersededOne) {
  auto reader = env_.Open();
  ASSERT_NE(reader, nullptr);
  auto old_revision = reader->GetVersion(1);
  ASSERT_TRUE(old_revision.ok()) << old_revision.status().message();
  GcOptions o;
  o.keep_last = kVersions - 1;
  o.grace_seconds = 0;
  auto gc = CollectGarbage(*store_, o, {});
  ASSERT_TRUE(gc.ok()) << gc.status().message();
  ASSERT_EQ(gc->versions_rebased, 1u);
  auto listed = reader->ListVersions();
  ASSERT_TRUE(listed.ok());
  auto current = reader->GetVersionAt(1, listed->at(1));
  ASSERT_TRUE(current.ok()) << current.status().message();
  ASSERT_EQ((*current)->manifest.revision, 1u);

  ReadPath rp(reader.get(), 0);
  const FileEntry& shard = FileNamed(**current, ModelSeries::kShard1);
  const uint32_t index = FileIndex(**current, ModelSeries::kShard1);
  const uint64_t off = shard.header_size + shard.tensors[1].begin;
  const std::string want = env_.series().files(1).at(ModelSeries::kShard1).substr(off, kBB);
  std::string probe(kBB, '\0');
  ASSERT_FALSE(
      rp.Read(*old_revision, index, off, kBB, reinterpret_cast<uint8_t*>(probe.data())).ok())
      << "revision 0 still reads: there is no error to share";

  std::atomic<bool> done{false};
  std::thread old_reader([&] {
    std::string buf(kBB, '\0');
    while (!done.load()) {
      rp.Read(*old_revision, index, off, kBB, reinterpret_cast<uint8_t*>(buf.data())).IgnoreError();
    }
  });
  int failures = 0;
  std::string first_error;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (int i = 0; i < 3000 && std::chrono::steady_clock::now() < deadline; ++i) {
    std::string buf(kBB, '\0');
    Status s = rp.Read(*current, index, off, kBB, reinterpret_cast<uint8_t*>(buf.data()));
    if (s.ok()) {
      EXPECT_TRUE(buf == want);
    } else if (failures++ == 0) {
      first_error = s.message();
    }
  }
  done = true;
  old_reader.join();
  EXPECT_EQ(failures, 0) << "reads of " << VersionName(1)
                         << " revision 1 failed with: " << first_error;
}

}  // namespace
}  // namespace dte::fs
