// Materializer: random access along a delta chain decodes only the blocks a
// range overlaps, exact bytes or Corruption, and whole-file streaming.
// Versions are written by test::VersionWriter, so every record kind is known.
#include "store/materialize.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "store/local_store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/forwarding_store.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::ScopedTempDir;
using test::TestTensor;
using test::VersionWriter;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr const char* kModel = VersionWriter::kModelFile;

// A model of three BF16 tensors: a small one first (so the big one starts at
// an unaligned file offset), 8 MiB = 32 full blocks, and 3 blocks with a
// partial last one.
std::vector<TestTensor> Model() {
  return {test::Bf16Tensor("a.norm", {1000}, 1), test::Bf16Tensor("b.embed", {4096, 1024}, 2),
          test::Bf16Tensor("c.head", {300, 1000}, 3)};
}

// One optimizer-like step touching every block of every tensor, so every
// record of a delta is sparse.
std::vector<TestTensor> Step(std::vector<TestTensor> tensors, uint64_t seed) {
  return test::PerturbEveryBlock(std::move(tensors), kBB, 300, seed);
}

// Store with an anchor v0 and sparse deltas v1..v3 in which every block is a
// kSparse record (checked), so a block at v3 takes 1 dense + 3 sparse records.
class ChainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = test::OpenTestStore(dir_.path() + "/store");
    ASSERT_NE(store_, nullptr);
    builder_ = std::make_unique<VersionWriter>(&store_->objects());
    std::vector<TestTensor> t = Model();
    for (const auto& x : t) sizes_.push_back(x.data.size());
    ASSERT_TRUE(builder_->Write(0, t, true).ok());
    for (uint64_t v = 1; v <= 3; ++v) {
      t = Step(t, 100 * v);
      ASSERT_TRUE(builder_->Write(v, t, false).ok());
      for (const auto& r : builder_->records(v)) ASSERT_EQ(r.kind, BlockKind::kSparse);
    }
    auto v3 = store_->GetVersion(3);
    ASSERT_TRUE(v3.ok()) << v3.status().message();
    v3_ = *v3;
    model_ = &v3_->manifest.files[1];
    ASSERT_EQ(model_->name, kModel);
  }

  // Reads [off, off+len) of the model at `version` with fresh counters.
  std::string Read(uint64_t version, uint64_t off, uint64_t len, ReadCounters* counters) {
    auto v = store_->GetVersion(version);
    EXPECT_TRUE(v.ok()) << v.status().message();
    Materializer reader(store_.get());
    std::string out(len, '\0');
    Status s = reader.ReadFile(*v, (*v)->manifest.files[1], off, len,
                               reinterpret_cast<uint8_t*>(out.data()));
    EXPECT_TRUE(s.ok()) << s.message();
    counters->blocks = reader.counters().blocks.load();
    counters->records = reader.counters().records.load();
    counters->hash_failures = reader.counters().hash_failures.load();
    return out;
  }

  // Blocks of the model overlapping file range [off, off+len), from the
  // tensor sizes alone.
  uint64_t OverlappingBlocks(uint64_t off, uint64_t len) const {
    uint64_t n = 0, begin = model_->header_size;
    for (uint64_t size : sizes_) {
      for (uint64_t b = begin; b < begin + size; b += kBB) {
        uint64_t e = std::min(b + kBB, begin + size);
        if (b < off + len && off < e) ++n;
      }
      begin += size;
    }
    return n;
  }

  void ExpectRangeAtV3(uint64_t off, uint64_t len) {
    SCOPED_TRACE("range " + std::to_string(off) + "+" + std::to_string(len));
    ReadCounters c;
    std::string got = Read(3, off, len, &c);
    EXPECT_TRUE(got == builder_->file(3).substr(off, len)) << "wrong bytes";
    uint64_t blocks = OverlappingBlocks(off, len);
    EXPECT_EQ(c.blocks.load(), blocks);
    EXPECT_EQ(c.records.load(), 4 * blocks);  // v0 dense + v1..v3 sparse per block
    EXPECT_EQ(c.hash_failures.load(), 0u);
  }

  uint64_t TensorStart(size_t i) const { return model_->header_size + model_->tensors[i].begin; }

  ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<VersionWriter> builder_;
  std::shared_ptr<const Version> v3_;
  const FileEntry* model_ = nullptr;
  std::vector<uint64_t> sizes_;  // of the tensors, in file order
};

TEST_F(ChainTest, OneMegabyteRangeDecodesOnlyOverlappingBlocks) {
  ASSERT_EQ(model_->tensors[1].blocks, 32u);
  ExpectRangeAtV3(TensorStart(1) + 3 * kBB + 1001, 1 << 20);  // 5 blocks of 32
  ExpectRangeAtV3(TensorStart(1) + 8 * kBB, 1 << 20);         // exactly 4 blocks
  ReadCounters c;
  Read(3, TensorStart(1) + 3 * kBB + 1001, 1 << 20, &c);
  EXPECT_EQ(c.blocks.load(), 5u) << "the reference count itself is off";
}

TEST_F(ChainTest, SmallRangesAcrossHeaderTensorAndBlockBoundaries) {
  const uint64_t h = model_->header_size;
  ExpectRangeAtV3(3, 40);                               // header only: no block
  ExpectRangeAtV3(h - 10, 20);                          // header into a.norm
  ExpectRangeAtV3(TensorStart(1) - 5, 10);              // a.norm into b.embed
  ExpectRangeAtV3(TensorStart(2) - 7, 9);               // b.embed into c.head
  ExpectRangeAtV3(TensorStart(1) + kBB - 1, 2);         // block 0 into block 1
  ExpectRangeAtV3(TensorStart(2) + 2 * kBB - 3, 3000);  // into the partial last block
  ExpectRangeAtV3(0, model_->size);                     // everything
}

TEST_F(ChainTest, SingleBytesAtOddOffsets) {
  for (uint64_t off : {model_->header_size + 1, TensorStart(1) + 7 * kBB + 12345,
                       TensorStart(1) + 31 * kBB + kBB - 1, TensorStart(2) + 3, model_->size - 1}) {
    ExpectRangeAtV3(off, 1);
  }
}

TEST_F(ChainTest, EveryVersionMaterializesWithItsChainLength) {
  for (uint64_t v = 0; v <= 3; ++v) {
    ReadCounters c;
    std::string got = Read(v, 0, builder_->file(v).size(), &c);
    EXPECT_TRUE(got == builder_->file(v)) << VersionName(v);
    EXPECT_EQ(c.records.load(), (v + 1) * c.blocks.load()) << VersionName(v);
  }
}

TEST_F(ChainTest, StreamFileDeliversTheWholeFileInOrder) {
  Materializer reader(store_.get());
  std::string got;
  Status s = reader.StreamFile(v3_, *model_, [&](uint64_t off, const uint8_t* d, size_t n) {
    EXPECT_EQ(off, got.size());
    got.append(reinterpret_cast<const char*>(d), n);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(got == builder_->file(3));
}

TEST_F(ChainTest, RawFileAndBoundsChecks) {
  const FileEntry& config = v3_->manifest.files[0];
  Materializer reader(store_.get());
  std::string out(config.size, '\0');
  ASSERT_TRUE(
      reader.ReadFile(v3_, config, 0, config.size, reinterpret_cast<uint8_t*>(out.data())).ok());
  EXPECT_EQ(out, "{\"version\": 3}");
  uint8_t b = 0;
  Status past = reader.ReadFile(v3_, *model_, model_->size, 1, &b);
  EXPECT_EQ(past.code(), Code::kInvalidArgument);
  EXPECT_NE(past.message().find("v00000003/model.safetensors"), std::string::npos);
  EXPECT_EQ(reader.ReadFile(v3_, *model_, 5, UINT64_MAX, &b).code(), Code::kInvalidArgument);
  EXPECT_TRUE(reader.ReadFile(v3_, *model_, model_->size, 0, &b).ok());
}

TEST_F(ChainTest, ReadBlockFillsAPartialLastBlock) {
  const TensorEntry& head = model_->tensors[2];
  ASSERT_EQ(head.blocks, 3u);
  Materializer reader(store_.get());
  std::vector<uint8_t> out(kBB, 0xee);
  ASSERT_TRUE(reader.ReadBlock(v3_, *model_, head, 2, out.data()).ok());
  const uint64_t len = head.bytes() - 2 * kBB;
  EXPECT_EQ(std::string(reinterpret_cast<char*>(out.data()), len),
            builder_->file(3).substr(TensorStart(2) + 2 * kBB, len));
  EXPECT_EQ(out[len], 0xee) << "wrote past the block";
}

TEST_F(ChainTest, FlippedAnchorByteIsCorruptionNeverWrongBytes) {
  const BlobRef data = store_->GetVersion(0).value()->manifest.blobs[0];
  ASSERT_TRUE(test::FlipBits(store_->objects().Describe() + "/" + BlobKey(data.hash),
                             model_->tensors[1].begin + 5 * kBB + 77)
                  .ok());
  Materializer reader(store_.get());
  std::string out(10, '\0');
  auto* dst = reinterpret_cast<uint8_t*>(out.data());
  Status s = reader.ReadFile(v3_, *model_, TensorStart(1) + 5 * kBB + 70, 10, dst);
  EXPECT_EQ(s.code(), Code::kCorruption) << s.message();
  EXPECT_NE(s.message().find("b.embed\" block 5"), std::string::npos) << s.message();
  // The block was read twice (the second time from the store) before the
  // blob was called corrupt.
  EXPECT_NE(s.message().find("read twice from the store"), std::string::npos) << s.message();
  EXPECT_EQ(reader.counters().hash_failures.load(), 2u);
  EXPECT_TRUE(reader.ReadFile(v3_, *model_, TensorStart(1) + 6 * kBB, 10, dst).ok());
}

// An ObjectStore whose first ranged read of one key comes back with one
// byte flipped, as an answer damaged in transit would; later reads are
// whole.
class FirstReadFlipped final : public test::ForwardingStore {
 public:
  FirstReadFlipped(std::unique_ptr<ObjectStore> base, std::string key, uint64_t at)
      : ForwardingStore(std::move(base)), key_(std::move(key)), at_(at) {}
  int flips() const { return flips_; }

  Status ReadRange(const std::string& k, uint64_t o, uint64_t n, void* dst) override {
    RETURN_IF_ERROR(base().ReadRange(k, o, n, dst));
    if (k == key_ && flips_ == 0 && o <= at_ && at_ < o + n) {
      static_cast<uint8_t*>(dst)[at_ - o] ^= 0x10;
      flips_++;
    }
    return Status::Ok();
  }

 private:
  const std::string key_;
  const uint64_t at_;
  int flips_ = 0;
};

TEST_F(ChainTest, ByteFlippedInTransitIsReadAgainAndNeverServed) {
  const BlobRef data = store_->GetVersion(0).value()->manifest.blobs[0];
  const uint64_t at = model_->tensors[1].begin + 5 * kBB + 77;
  auto local = LocalStore::Open(dir_.path() + "/store");
  ASSERT_TRUE(local.ok()) << local.status().message();
  auto flipping =
      std::make_unique<FirstReadFlipped>(std::move(local).value(), BlobKey(data.hash), at);
  FirstReadFlipped* flips = flipping.get();
  StoreOptions options;
  options.uri = dir_.path() + "/store";
  auto store = Store::OpenOver(std::move(flipping), options);
  ASSERT_TRUE(store.ok()) << store.status().message();
  auto v3 = (*store)->GetVersion(3);
  ASSERT_TRUE(v3.ok()) << v3.status().message();
  Materializer reader(store->get());
  std::string out(10, '\0');
  Status s = reader.ReadFile(*v3, (*v3)->manifest.files[1], TensorStart(1) + 5 * kBB + 70, 10,
                             reinterpret_cast<uint8_t*>(out.data()));
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(flips->flips(), 1);
  EXPECT_EQ(reader.counters().hash_failures.load(), 1u);  // seen, then read again
  EXPECT_EQ(out, builder_->file(3).substr(TensorStart(1) + 5 * kBB + 70, 10));
}

TEST_F(ChainTest, MissingParentInTheChainIsNamed) {
  ASSERT_TRUE(store_->objects().Delete(ManifestKey(1, 0)).ok());
  auto fresh = test::OpenTestStore(store_->uri());
  ASSERT_NE(fresh, nullptr);
  auto v3 = fresh->GetVersion(3);
  ASSERT_TRUE(v3.ok()) << v3.status().message();
  Materializer reader(fresh.get());
  uint8_t b = 0;
  Status s = reader.ReadFile(*v3, (*v3)->manifest.files[1], TensorStart(1), 1, &b);
  EXPECT_EQ(s.code(), Code::kNotFound) << s.message();
  EXPECT_NE(s.message().find("v00000001"), std::string::npos) << s.message();
}

// Block hashes match but a tensor hash does not (a manifest damaged in a
// way its grammar cannot see): only the tensor-hash check notices.
TEST_F(ChainTest, StreamFileChecksTensorHashesOnRequest) {
  Manifest m = v3_->manifest;
  m.revision = 1;
  m.files[1].tensors[2].hash.low ^= 1;
  ASSERT_TRUE(store_->objects().Put(ManifestKey(3, 1), EncodeManifest(m)).ok());
  store_->Forget(3);
  auto bad = store_->GetVersion(3);
  ASSERT_TRUE(bad.ok()) << bad.status().message();
  ASSERT_EQ((*bad)->key, ManifestKey(3, 1));
  Materializer reader(store_.get());
  auto sink = [](uint64_t, const uint8_t*, size_t) { return Status::Ok(); };
  Status checked = reader.StreamFile(*bad, (*bad)->manifest.files[1], sink, true);
  EXPECT_EQ(checked.code(), Code::kCorruption) << checked.message();
  EXPECT_NE(checked.message().find("c.head"), std::string::npos) << checked.message();
  EXPECT_TRUE(reader.StreamFile(*bad, (*bad)->manifest.files[1], sink, false).ok());
}

// More than one 16 MiB streaming chunk: the sink sees the file in order, one
// call at a time, and its first error ends the stream.
TEST(Materializer, StreamFileAcrossChunksInOrderAndStopsAtASinkError) {
  ScopedTempDir dir;
  auto store = test::OpenTestStore(dir.path());
  ASSERT_NE(store, nullptr);
  VersionWriter writer(&store->objects());
  std::vector<TestTensor> t = {test::Bf16Tensor("a", {5 << 20}, 1),   // 10 MiB
                               test::Bf16Tensor("b", {3, 7}, 2),      // 42 bytes
                               test::Bf16Tensor("c", {6 << 20}, 3)};  // 12 MiB
  ASSERT_TRUE(writer.Write(0, t, true).ok());
  ASSERT_TRUE(writer.Write(1, Step(t, 4), false).ok());
  auto v = store->GetVersion(1);
  ASSERT_TRUE(v.ok()) << v.status().message();
  const FileEntry& file = (*v)->manifest.files[1];
  Materializer reader(store.get());
  std::string got;
  std::atomic<int> inside{0};
  int calls = 0;
  Status s = reader.StreamFile(*v, file, [&](uint64_t off, const uint8_t* d, size_t n) {
    EXPECT_EQ(inside.fetch_add(1), 0) << "overlapping sink calls";
    EXPECT_EQ(off, got.size());
    got.append(reinterpret_cast<const char*>(d), n);
    ++calls;
    inside.fetch_sub(1);
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_GE(calls, 3) << "header and at least two data chunks";
  EXPECT_TRUE(got == writer.file(1));
  calls = 0;
  s = reader.StreamFile(*v, file, [&](uint64_t, const uint8_t*, size_t) {
    return ++calls == 2 ? IOError("disk full") : Status::Ok();
  });
  EXPECT_EQ(s.code(), Code::kIOError);
  EXPECT_NE(s.message().find("disk full"), std::string::npos) << s.message();
  EXPECT_EQ(calls, 2) << "the sink was called after it failed";
}

}  // namespace
}  // namespace dte
