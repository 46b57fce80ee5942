// Stores are untrusted: hand-planted manifests whose block tables disagree
// with their parents' block size or block lengths, or claim huge payloads,
// are Corruption naming version, file, tensor and block -- never an
// out-of-bounds write or a giant allocation. Versions are planted with the
// manifest encoders, as a damaged or hostile store would hold them.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "store/hash.h"
#include "store/manifest.h"
#include "store/materialize.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::ScopedTempDir;
using test::TestTensor;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr const char* kModel = test::VersionWriter::kModelFile;

TestTensor U8(const std::string& name, uint64_t bytes, uint64_t seed) {
  return {name, DType::kU8, {static_cast<int64_t>(bytes)}, test::RandomBytes(bytes, seed)};
}

BlobRef Put(ObjectStore& o, const std::string& bytes) {
  BlobRef b{HashBytes(bytes.data(), bytes.size()), bytes.size(), true};
  EXPECT_TRUE(o.Put(BlobKey(b.hash), bytes).ok());
  return b;
}

// Plants `version` holding kModel with `tensors` cut into `bb`-byte blocks,
// with the given block table and data blobs, exactly as given.
void Plant(ObjectStore& o, uint64_t version, std::optional<uint64_t> parent, uint64_t bb,
           const std::vector<TestTensor>& tensors, const std::vector<BlockRecord>& records,
           std::vector<BlobRef> blobs) {
  const std::string bytes = test::SafetensorsBytes({kModel, tensors, {}});
  uint64_t data = 0;
  for (const auto& t : tensors) data += t.data.size();
  Manifest m;
  m.version = version;
  m.parent = parent;
  m.created = NowRfc3339();
  m.block_bytes = bb;
  FileEntry model{kModel, bytes.size(), true, {}, {}, bytes.size() - data, {}};
  model.header_blob = Put(o, bytes.substr(0, model.header_size)).hash;
  uint64_t pos = 0;
  uint32_t block = 0;
  for (const auto& t : tensors) {
    TensorEntry e{t.name, t.dtype, t.shape, pos, pos + t.data.size(), {}, 0, 0, 0};
    e.hash = HashBytes(t.data.data(), t.data.size());
    e.first_block = block;
    e.blocks = static_cast<uint32_t>((e.bytes() + bb - 1) / bb);
    block += e.blocks;
    pos = e.end;
    model.tensors.push_back(e);
  }
  m.files = {model};
  m.blobs = std::move(blobs);
  m.block_table = Put(o, EncodeBlockTable(records));
  ASSERT_TRUE(o.CreateExclusive(ManifestKey(version, 0), EncodeManifest(m)).ok());
}

// Plants an anchor whose records are kDenseRaw into one data blob.
void PlantAnchor(ObjectStore& o, uint64_t version, uint64_t bb,
                 const std::vector<TestTensor>& tensors) {
  std::string data;
  std::vector<BlockRecord> records;
  for (const auto& t : tensors) {
    for (uint64_t off = 0; off < t.data.size(); off += bb) {
      uint64_t len = std::min<uint64_t>(bb, t.data.size() - off);
      records.push_back({BlockKind::kDenseRaw, 0, data.size() + off, static_cast<uint32_t>(len), 0,
                         HashBlock(reinterpret_cast<const uint8_t*>(t.data.data()) + off, len)});
    }
    data += t.data;
  }
  Plant(o, version, std::nullopt, bb, tensors, records, {Put(o, data)});
}

// A kSame record whose block hash is that of `len` bytes of `t` at `off`.
BlockRecord Same(const TestTensor& t, uint64_t off, uint64_t len) {
  return {BlockKind::kSame,
          0,
          0,
          0,
          0,
          HashBlock(reinterpret_cast<const uint8_t*>(t.data.data()) + off, len)};
}

void ExpectNames(const Status& s, const std::vector<std::string>& parts) {
  EXPECT_EQ(s.code(), Code::kCorruption) << s.message();
  for (const auto& p : parts) EXPECT_NE(s.message().find(p), std::string::npos) << s.message();
}

// ReadBlock into a buffer much larger than the block, prefilled: before the
// fix the parent's longer record was copied whole (and matched the planted
// hash), so the bytes past the block were overwritten and the read "worked".
void ExpectReadBlockRefuses(Store& store, uint64_t version, size_t tensor, uint32_t block,
                            const std::vector<std::string>& parts) {
  auto v = store.GetVersion(version);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const FileEntry& f = (*v)->manifest.files[0];
  const TensorEntry& t = f.tensors[tensor];
  const uint64_t bb = (*v)->manifest.block_bytes;
  const uint64_t len = std::min<uint64_t>(bb, t.bytes() - block * bb);
  std::vector<uint8_t> out(8 * kBB, 0xee);
  Materializer reader(&store);
  ExpectNames(reader.ReadBlock(*v, f, t, block, out.data()), parts);
  for (size_t i = len; i < out.size(); ++i) {
    ASSERT_EQ(out[i], 0xee) << "wrote past the " << len << "-byte block at byte " << i;
  }
}

// Whole-file reads (ReadFile's partial-block buffer, StreamFile's workers)
// stop at the same Corruption.
void ExpectFileReadsRefuse(Store& store, uint64_t version, const std::vector<std::string>& parts) {
  auto v = store.GetVersion(version);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const FileEntry& f = (*v)->manifest.files[0];
  Materializer reader(&store);
  std::string out(f.size, '\0');
  ExpectNames(reader.ReadFile(*v, f, 0, f.size, reinterpret_cast<uint8_t*>(out.data())), parts);
  auto sink = [](uint64_t, const uint8_t*, size_t) { return Status::Ok(); };
  ExpectNames(reader.StreamFile(*v, f, sink), parts);
}

std::string ReadAll(Store& store, uint64_t version) {
  auto v = store.GetVersion(version);
  EXPECT_TRUE(v.ok()) << v.status().message();
  if (!v.ok()) return "";
  const FileEntry& f = (*v)->manifest.files[0];
  std::string out(f.size, '\0');
  Materializer reader(&store);
  Status s = reader.ReadFile(*v, f, 0, f.size, reinterpret_cast<uint8_t*>(out.data()));
  EXPECT_TRUE(s.ok()) << s.message();
  return out;
}

class UntrustedStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_NE(store_, nullptr);
  }
  ObjectStore& objects() { return store_->objects(); }

  ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
};

// The planting itself is sound: an anchor with 1 MiB blocks (a valid
// block_bytes) reads back exactly.
TEST_F(UntrustedStoreTest, PlantedAnchorWithOneMegabyteBlocksReadsBack) {
  std::vector<TestTensor> t = {U8("a", 4 * kBB + 5, 1), U8("b", 16, 2)};
  PlantAnchor(objects(), 0, 4 * kBB, t);
  EXPECT_TRUE(ReadAll(*store_, 0) == test::SafetensorsBytes({kModel, t, {}}));
}

// repro_parent_layout_overflow.sh: the parent has the same record count, but
// its record for the child's 16-byte last block is a full 256 KiB dense one.
TEST_F(UntrustedStoreTest, ParentDenseRecordLongerThanTheBlockIsCorruption) {
  TestTensor a0 = U8("a", 2 * kBB, 1);
  PlantAnchor(objects(), 0, kBB, {a0});
  TestTensor a1{"a", DType::kU8, {static_cast<int64_t>(kBB + 16)}, a0.data.substr(0, kBB + 16)};
  Plant(objects(), 1, 0, kBB, {a1}, {Same(a0, 0, kBB), Same(a0, kBB, 16)}, {});
  const std::vector<std::string> parts = {"v00000000/model.safetensors tensor \"a\" block 1",
                                          "wrong length"};
  ASSERT_NO_FATAL_FAILURE(ExpectReadBlockRefuses(*store_, 1, 0, 1, parts));
  ExpectFileReadsRefuse(*store_, 1, parts);
  // Block 0 is sound and still reads.
  auto v = store_->GetVersion(1);
  std::vector<uint8_t> out(kBB);
  Materializer reader(store_.get());
  ASSERT_TRUE(
      reader
          .ReadBlock(*v, (*v)->manifest.files[0], (*v)->manifest.files[0].tensors[0], 0, out.data())
          .ok());
  EXPECT_TRUE(std::string(out.begin(), out.end()) == a0.data.substr(0, kBB));
}

// repro_commit_parent_block_bytes.sh, read side: a delta whose parent cuts
// its data into 1 MiB blocks. Same record count, so only the block size
// tells them apart; the parent's 1 MiB record stands for the child's 256 KiB
// block 0.
TEST_F(UntrustedStoreTest, ParentWithAnotherBlockSizeIsCorruption) {
  std::vector<TestTensor> t0 = {U8("a", 4 * kBB, 1), U8("b", 16, 2)};
  PlantAnchor(objects(), 0, 4 * kBB, t0);
  TestTensor a1{"a", DType::kU8, {static_cast<int64_t>(kBB)}, t0[0].data.substr(0, kBB)};
  Plant(objects(), 1, 0, kBB, {a1, t0[1]}, {Same(t0[0], 0, kBB), Same(t0[1], 0, 16)}, {});
  ASSERT_EQ(store_->GetVersion(0).value()->records.size(),
            store_->GetVersion(1).value()->records.size());
  const std::vector<std::string> parts = {"v00000001/model.safetensors tensor \"a\" block 0",
                                          "parent v00000000 has a different layout"};
  ASSERT_NO_FATAL_FAILURE(ExpectReadBlockRefuses(*store_, 1, 0, 0, parts));
  ExpectFileReadsRefuse(*store_, 1, parts);
  EXPECT_TRUE(ReadAll(*store_, 0) == test::SafetensorsBytes({kModel, t0, {}}));
}

// ReadBlock of a block the tensor does not have is refused, not read from
// another tensor's (or no) record.
TEST_F(UntrustedStoreTest, ReadBlockBeyondTheTensorIsRefused) {
  std::vector<TestTensor> t = {U8("a", kBB, 1), U8("b", kBB, 2)};
  PlantAnchor(objects(), 0, kBB, t);
  auto v = store_->GetVersion(0);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const FileEntry& f = (*v)->manifest.files[0];
  std::vector<uint8_t> out(kBB);
  Materializer reader(store_.get());
  for (size_t i = 0; i < 2; ++i) {
    Status s = reader.ReadBlock(*v, f, f.tensors[i], 1, out.data());
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
    EXPECT_NE(s.message().find("no such block"), std::string::npos) << s.message();
  }
}

// repro_planted_huge_alloc.sh: dense_zstd records claiming ~4 GiB payloads in
// a blob the manifest says is 1 TiB (it has 16 bytes). Before the fix every
// reader thread resized a 4 GiB buffer before the short read was noticed;
// now the version does not load.
TEST_F(UntrustedStoreTest, OversizedPayloadLengthIsCorruptionBeforeAnyRead) {
  TestTensor a = U8("a", 40 * kBB, 1);
  BlobRef blob = Put(objects(), std::string(16, 'z'));
  blob.size = uint64_t{1} << 40;
  std::vector<BlockRecord> records(40, {BlockKind::kDenseZstd, 0, 0, 0xFFFFFFF0u, 0, {}});
  Plant(objects(), 0, std::nullopt, kBB, {a}, records, {blob});
  auto v = store_->GetVersion(0);
  ExpectNames(v.status(),
              {"v00000000", "model.safetensors tensor \"a\" block 0", "oversized payload"});
  // Through an index-backed store too (the index only holds loaded versions).
  auto indexed = test::OpenTestStore(store_->uri(), dir_.path() + "/cache");
  ASSERT_NE(indexed, nullptr);
  EXPECT_EQ(indexed->GetVersion(0).status().code(), Code::kCorruption);
}

// The same bound for a delta's sparse record; a payload of a plausible size
// (the block plus framing) still loads.
TEST_F(UntrustedStoreTest, OversizedSparsePayloadInADeltaIsCorruption) {
  std::vector<TestTensor> t = {U8("a", kBB, 1), U8("b", 100, 2)};
  PlantAnchor(objects(), 0, kBB, t);
  BlobRef blob = Put(objects(), std::string(16, 's'));
  blob.size = uint64_t{1} << 40;
  std::vector<BlockRecord> ok = {Same(t[0], 0, kBB), {BlockKind::kSparse, 0, 0, 200, 1, {}}};
  Plant(objects(), 1, 0, kBB, t, ok, {blob});
  EXPECT_TRUE(store_->GetVersion(1).ok()) << store_->GetVersion(1).status().message();
  std::vector<BlockRecord> bad = {Same(t[0], 0, kBB), {BlockKind::kSparse, 0, 0, 100000, 1, {}}};
  Plant(objects(), 2, 0, kBB, t, bad, {blob});
  ExpectNames(store_->GetVersion(2).status(),
              {"v00000002", "model.safetensors tensor \"b\" block 0", "oversized payload"});
}

}  // namespace
}  // namespace dte
