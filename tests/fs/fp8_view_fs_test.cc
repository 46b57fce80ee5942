// fp8/ without FUSE: the namespace, inodes, and reads of arbitrary ranges of
// FP8 view files against a whole-file quantization of the committed BF16
// tensors; failing BF16 reads and non-finite weights fail the FP8 read.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fs/filesystem.h"
#include "fs/internal/fuse_ops.h"
#include "kernels/fp8.h"
#include "store/ops/commit.h"
#include "store/safetensors.h"
#include "tests/fs/fs_fixture.h"

namespace dte::fs {
namespace {

using nlohmann::json;
using test::TestCheckpoint;
using test::TestSafetensors;
using test::TestTensor;

constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";
constexpr uint64_t kVersions = 2;

// A small Llama-like model: a projection spanning several 256 KiB store
// blocks whose block rows straddle them, a partial last block row and
// column, a skipped head and embedding, a norm.
TestCheckpoint Model(uint64_t step) {
  TestCheckpoint c;
  c.safetensors.push_back(
      {kShard1,
       {test::Bf16Tensor("model.embed_tokens.weight", {100, 64}, 1),
        test::Bf16Tensor("model.layers.0.mlp.up_proj.weight", {700, 300}, 2),
        test::Bf16Tensor("model.norm.weight", {64}, 3),
        test::Bf16Tensor("model.layers.0.self_attn.o_proj.weight", {64, 64}, 4)},
       {{"format", "pt"}}});
  c.safetensors.push_back(
      {kShard2, {test::Bf16Tensor("lm_head.weight", {100, 64}, 5)}, {{"format", "pt"}}});
  if (step > 0) {
    test::PerturbElements(&c.tensor("model.layers.0.mlp.up_proj.weight").data, 2, 500, step);
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (const auto& f : c.safetensors) {
    for (const auto& t : f.tensors) index["weight_map"][t.name] = f.name;
  }
  c.raw_files["model.safetensors.index.json"] = index.dump(2);
  c.raw_files["config.json"] = R"({"model_type": "llama", "step": )" + std::to_string(step) + "}";
  return c;
}

// The FP8 form of a safetensors file, quantized whole, tensor by tensor:
// the projections, with partial blocks, or (!partial) those that are whole
// blocks.
std::string QuantizedFile(const TestSafetensors& in, uint64_t block, bool partial = true) {
  TestSafetensors out{in.name, {}, in.metadata};
  for (const TestTensor& t : in.tensors) {
    const bool whole = t.shape.size() == 2 && t.shape[0] % static_cast<int64_t>(block) == 0 &&
                       t.shape[1] % static_cast<int64_t>(block) == 0;
    const bool quantize = t.shape.size() == 2 && t.name.find("_proj.weight") != std::string::npos &&
                          (partial || whole);
    if (!quantize) {
      out.tensors.push_back(t);
      continue;
    }
    kernels::Fp8Layout l{static_cast<uint64_t>(t.shape[0]), static_cast<uint64_t>(t.shape[1]),
                         block, block, kernels::Fp8ScaleRule::kPlain};
    std::vector<uint16_t> bf16(l.num_elements());
    std::memcpy(bf16.data(), t.data.data(), t.data.size());
    std::string q(l.num_elements(), '\0');
    std::vector<float> s(l.num_blocks());
    EXPECT_EQ(kernels::Fp8Quantize(l, bf16.data(), reinterpret_cast<uint8_t*>(q.data()), s.data(),
                                   t.name),
              "");
    out.tensors.push_back({t.name, DType::kF8E4M3, t.shape, q});
    out.tensors.push_back(
        {t.name + "_scale_inv",
         DType::kF32,
         {static_cast<int64_t>(l.grid_rows()), static_cast<int64_t>(l.grid_cols())},
         std::string(reinterpret_cast<const char*>(s.data()), s.size() * 4)});
  }
  return test::SafetensorsBytes(out);
}

class Fp8FsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (uint64_t v = 0; v < kVersions; ++v) Commit(v, Model(v));
    Mount();
  }
  void Commit(uint64_t version, const TestCheckpoint& c) {
    const std::string in = dir_.path() + "/in" + std::to_string(version);
    ASSERT_TRUE(test::WriteCheckpoint(c, in).ok());
    if (!store_) store_ = test::OpenTestStore(dir_.path() + "/store");
    CommitOptions o;
    o.version = version;
    auto r = CommitDirectory(*store_, in, o);
    ASSERT_TRUE(r.ok()) << r.status().message();
  }
  // Neither projection of the model is whole blocks of 128 (700 x 300, 64 x
  // 64): by default the mount quantizes partial blocks (the opt-in) so that
  // the reads of partial block rows and columns are tested.
  void Mount(uint64_t cache_bytes = uint64_t{64} << 20, uint64_t block = 128, bool partial = true) {
    fs_ = std::make_unique<Filesystem>(store_.get(), cache_bytes);
    Fp8ViewOptions o;
    o.block_rows = o.block_cols = block;
    o.policy.quantize_partial_blocks = partial;
    fs_->EnableFp8(o);
    ASSERT_TRUE(fs_->Refresh().ok());
  }
  uint64_t Fp8FileIno(uint64_t version, const std::string& name) {
    uint64_t dir = test::LookupIno(*fs_, kFp8DirIno, VersionName(version));
    return dir == 0 ? 0 : test::LookupIno(*fs_, dir, name);
  }
  Result<std::string> ReadFile(uint64_t ino, uint64_t offset, uint64_t len) {
    auto f = fs_->Open(ino, O_RDONLY);
    if (!f.ok()) return f.status();
    return test::ReadRange(*fs_, **f, offset, len);
  }

  test::ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_F(Fp8FsTest, TreeListsEveryVersionAndLatestWithInodesOfItsOwn) {
  auto root = fs_->ReadDir(kRootIno);
  ASSERT_TRUE(root.ok());
  std::set<std::string> names;
  for (const DirEntry& e : *root) names.insert(e.name);
  EXPECT_TRUE(names.count("fp8"));
  auto dir = fs_->ReadDir(kFp8DirIno);
  ASSERT_TRUE(dir.ok()) << dir.status().message();
  ASSERT_EQ(dir->size(), 3u);
  EXPECT_EQ((*dir)[0].name, "v00000000");
  EXPECT_EQ((*dir)[2].name, "latest");
  EXPECT_EQ((*dir)[2].attr.ino, kFp8LatestIno);
  EXPECT_EQ(*fs_->ReadLink(kFp8LatestIno), "v00000001");
  std::set<uint64_t> inos;
  for (uint64_t v = 0; v < kVersions; ++v) {
    const uint64_t bf16_dir = test::LookupIno(*fs_, kRootIno, VersionName(v));
    const uint64_t fp8_dir = test::LookupIno(*fs_, kFp8DirIno, VersionName(v));
    EXPECT_NE(bf16_dir, fp8_dir);
    EXPECT_EQ(fp8_dir, (*dir)[v].attr.ino);
    inos.insert({bf16_dir, fp8_dir});
    for (const char* name : {kShard1, kShard2, "config.json"}) {
      const uint64_t a = Fp8FileIno(v, name);
      EXPECT_EQ(a, Fp8FileIno(v, name)) << "stable";
      EXPECT_TRUE(inos.insert(a).second) << name;
      EXPECT_TRUE(inos.insert(test::FileIno(*fs_, v, name)).second) << name;
      auto attr = fs_->GetAttr(a);
      ASSERT_TRUE(attr.ok());
      EXPECT_TRUE(attr->immutable);
      EXPECT_EQ(attr->type, NodeType::kRegular);
    }
  }
  EXPECT_EQ(fs_->Lookup(kFp8DirIno, "v00000009").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(kFp8DirIno, ".dte").status().code(), Code::kNotFound);
  EXPECT_EQ(fs_->Lookup(kFp8DirIno, "fp8").status().code(), Code::kNotFound);
}

TEST_F(Fp8FsTest, RandomRangesEqualAWholeFileQuantization) {
  std::mt19937_64 rng(7);
  for (uint64_t block : {uint64_t{128}, uint64_t{48}}) {
    Mount(uint64_t{64} << 20, block);
    for (uint64_t v = 0; v < kVersions; ++v) {
      for (const TestSafetensors& shard : Model(v).safetensors) {
        SCOPED_TRACE(VersionName(v) + "/" + shard.name + " block " + std::to_string(block));
        const std::string want = QuantizedFile(shard, block);
        const uint64_t ino = Fp8FileIno(v, shard.name);
        ASSERT_EQ(fs_->GetAttr(ino)->size, want.size());
        auto whole = ReadFile(ino, 0, want.size() + 10);
        ASSERT_TRUE(whole.ok()) << whole.status().message();
        ASSERT_TRUE(*whole == want);
        for (int i = 0; i < 200; ++i) {
          const uint64_t off = rng() % want.size();
          const uint64_t len = 1 + rng() % (i % 2 ? 300000 : 5000);
          auto got = ReadFile(ino, off, len);
          ASSERT_TRUE(got.ok()) << got.status().message();
          ASSERT_TRUE(*got == want.substr(off, len)) << off << "+" << len;
        }
      }
    }
  }
  auto j = json::parse(fs_->StatusJson());
  EXPECT_GT(j["fp8"]["rows_quantized"].get<uint64_t>(), 0u);
  EXPECT_GT(j["fp8"]["row_hits"].get<uint64_t>(), 0u);
}

// Readers racing over one file share each block row's quantization (the
// cache is single flight) and all see the same bytes; also run under TSan.
TEST_F(Fp8FsTest, ConcurrentReadersSeeTheSameBytes) {
  const std::string want = QuantizedFile(Model(1).safetensors[0], 128);
  const uint64_t ino = Fp8FileIno(1, kShard1);
  std::vector<std::thread> readers;
  std::atomic<int> wrong{0};
  for (int k = 0; k < 8; ++k) {
    readers.emplace_back([&, k] {
      std::mt19937_64 rng(k);
      auto f = fs_->Open(ino, O_RDONLY);
      if (!f.ok()) return (void)wrong++;
      for (int i = 0; i < 50; ++i) {
        const uint64_t off = rng() % want.size();
        const uint64_t len = 1 + rng() % 200000;
        auto got = test::ReadRange(*fs_, **f, off, len);
        if (!got.ok() || *got != want.substr(off, len)) wrong++;
      }
    });
  }
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  auto j = json::parse(fs_->StatusJson());
  EXPECT_EQ(j["fp8"]["rows_quantized"], 6 + 1) << "each block row once (up_proj 6, o_proj 1)";
}

TEST_F(Fp8FsTest, NoCacheStillServesTheSameBytes) {
  Mount(/*cache_bytes=*/0);
  const TestSafetensors shard = Model(1).safetensors[0];
  const std::string want = QuantizedFile(shard, 128);
  auto got = ReadFile(Fp8FileIno(1, kShard1), 1000, want.size());
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_TRUE(*got == want.substr(1000));
}

TEST_F(Fp8FsTest, ConfigAndIndexAreRewritten) {
  auto config = ReadFile(Fp8FileIno(1, "config.json"), 0, 1 << 20);
  ASSERT_TRUE(config.ok());
  json c = json::parse(*config);
  EXPECT_EQ(c["step"], 1);
  EXPECT_EQ(c["quantization_config"]["quant_method"], "fp8");
  EXPECT_EQ(c["quantization_config"]["modules_to_not_convert"],
            json({"lm_head", "model.embed_tokens"}));
  auto index = ReadFile(Fp8FileIno(0, "model.safetensors.index.json"), 0, 1 << 20);
  ASSERT_TRUE(index.ok());
  json i = json::parse(*index);
  EXPECT_EQ(i["weight_map"]["model.layers.0.self_attn.o_proj.weight_scale_inv"], kShard1);
  const uint64_t total = QuantizedFile(Model(0).safetensors[0], 128).size() +
                         QuantizedFile(Model(0).safetensors[1], 128).size();
  EXPECT_LT(i["metadata"]["total_size"].get<uint64_t>(), total);  // headers not counted
}

// Without the opt-in a weight that is not whole blocks is served as its
// BF16 bytes and listed in modules_to_not_convert: under 128 x 128 blocks
// neither projection is quantized and the shard is the BF16 file byte for
// byte; under 64 x 64 blocks o_proj is quantized and up_proj is not.
TEST_F(Fp8FsTest, WeightsOffTheBlockAreServedAsTheirBf16Bytes) {
  for (uint64_t block : {uint64_t{128}, uint64_t{64}}) {
    SCOPED_TRACE("block " + std::to_string(block));
    Mount(uint64_t{64} << 20, block, /*partial=*/false);
    const TestSafetensors shard = Model(1).safetensors[0];
    const std::string want = QuantizedFile(shard, block, /*partial=*/false);
    auto got = ReadFile(Fp8FileIno(1, kShard1), 0, want.size() + 10);
    ASSERT_TRUE(got.ok()) << got.status().message();
    EXPECT_TRUE(*got == want);
    auto bf16 = ReadFile(test::FileIno(*fs_, 1, kShard1), 0, want.size() + 10);
    ASSERT_TRUE(bf16.ok()) << bf16.status().message();
    EXPECT_EQ(*got == *bf16, block == 128);
    auto h = ParseSafetensorsFile(*got, kShard1);
    ASSERT_TRUE(h.ok()) << h.status().message();
    const auto up = std::find_if(h->tensors.begin(), h->tensors.end(), [](const TensorInfo& t) {
      return t.name == "model.layers.0.mlp.up_proj.weight";
    });
    ASSERT_NE(up, h->tensors.end());
    EXPECT_EQ(up->dtype, DType::kBF16);
    EXPECT_TRUE(got->substr(h->data_offset + up->begin, up->bytes()) == shard.tensors[1].data);
    auto config = ReadFile(Fp8FileIno(1, "config.json"), 0, 1 << 20);
    ASSERT_TRUE(config.ok());
    std::vector<std::string> kept = {"lm_head", "model.embed_tokens", "model.layers.0.mlp.up_proj"};
    if (block == 128) kept.push_back("model.layers.0.self_attn.o_proj");
    EXPECT_EQ(json::parse(*config)["quantization_config"]["modules_to_not_convert"], json(kept));
    EXPECT_EQ(json::parse(fs_->StatusJson())["fp8"]["partial_blocks"], false);
  }
}

TEST_F(Fp8FsTest, QuantizedConfigIsRefusedNamingTheVersion) {
  TestCheckpoint c = Model(2);
  c.raw_files["config.json"] = R"({"quantization_config": {"quant_method": "fp8"}})";
  Commit(2, c);
  ASSERT_TRUE(fs_->Refresh().ok());
  auto a = fs_->Lookup(kFp8DirIno, "v00000002");
  ASSERT_EQ(a.status().code(), Code::kInvalidArgument);
  EXPECT_NE(a.status().message().find("v00000002/config.json"), std::string::npos);
  auto j = json::parse(fs_->StatusJson());
  ASSERT_EQ(j["errors"].size(), 1u);
  EXPECT_NE(j["errors"][0].get<std::string>().find("quantization_config"), std::string::npos);
  EXPECT_TRUE(fs_->Lookup(kRootIno, "v00000002").ok()) << "the BF16 version still reads";
}

TEST_F(Fp8FsTest, NonFiniteWeightFailsTheReadOfItsBlockRow) {
  TestCheckpoint c = Model(2);
  std::string& data = c.tensor("model.layers.0.mlp.up_proj.weight").data;
  const uint16_t nan = 0x7FC0;
  std::memcpy(&data[2 * (300 * 200 + 5)], &nan, 2);  // row 200: block row 1
  Commit(2, c);
  ASSERT_TRUE(fs_->Refresh().ok());
  const std::string want = QuantizedFile(Model(1).safetensors[0], 128);
  const uint64_t ino = Fp8FileIno(2, kShard1);
  auto f = fs_->Open(ino, O_RDONLY);
  ASSERT_TRUE(f.ok());
  // Header and block row 0 read; block row 1 fails.
  auto h = ParseSafetensorsFile(want, kShard1);
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->tensors[1].name, "model.layers.0.mlp.up_proj.weight");
  const uint64_t weights = h->data_offset + h->tensors[1].begin;
  auto row0 = test::ReadRange(*fs_, **f, 0, weights + 128 * 300);
  ASSERT_TRUE(row0.ok()) << row0.status().message();
  auto row1 = test::ReadRange(*fs_, **f, weights + 128 * 300, 10);
  ASSERT_EQ(row1.status().code(), Code::kIOError);
  EXPECT_EQ(ReadErrnoOf(row1.status()), EIO);
  EXPECT_NE(row1.status().message().find("model.layers.0.mlp.up_proj.weight"), std::string::npos)
      << row1.status().message();
  EXPECT_NE(row1.status().message().find("element (200, 5), in block row 1 (rows 128..255)"),
            std::string::npos);
  auto j = json::parse(fs_->StatusJson());
  EXPECT_EQ(j["read_errors"], 1);
}

TEST_F(Fp8FsTest, CorruptBf16BlockFailsTheFp8ReadWithCorruption) {
  auto v = store_->GetVersion(0);
  ASSERT_TRUE(v.ok());
  const FileEntry& shard = (*v)->manifest.files[1];  // sorted: config, shard 1, shard 2, index
  ASSERT_EQ(shard.name, kShard1);
  const BlockRecord& rec = (*v)->records[shard.tensors[1].first_block + 1];
  ASSERT_TRUE(test::FlipBits(dir_.path() + "/store/" + BlobKey((*v)->manifest.blobs[rec.blob].hash),
                             rec.offset + rec.length / 2)
                  .ok());
  const std::string want = QuantizedFile(Model(0).safetensors[0], 128);
  auto all = ReadFile(Fp8FileIno(0, kShard1), 0, want.size());
  ASSERT_EQ(all.status().code(), Code::kCorruption) << all.status().message();
  EXPECT_EQ(ReadErrnoOf(all.status()), EIO);
  auto head = ReadFile(Fp8FileIno(0, kShard1), 0, 1000);  // the header and embedding read
  ASSERT_TRUE(head.ok());
  EXPECT_TRUE(*head == want.substr(0, 1000));
}

TEST_F(Fp8FsTest, NoFp8HidesTheTree) {
  fs_ = std::make_unique<Filesystem>(store_.get(), 1 << 20);
  ASSERT_TRUE(fs_->Refresh().ok());
  EXPECT_EQ(fs_->Lookup(kRootIno, "fp8").status().code(), Code::kNotFound);
  EXPECT_FALSE(fs_->GetAttr(kFp8DirIno).ok());
  EXPECT_TRUE(json::parse(fs_->StatusJson())["fp8"].is_null());
}

}  // namespace
}  // namespace dte::fs
