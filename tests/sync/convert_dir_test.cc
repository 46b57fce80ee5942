// Per-rank MCore safetensors files -> HF model directory, read back with
// the store's safetensors parser and compared byte for byte.
#include "sync/convert/convert_dir.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "store/ops/commit.h"
#include "store/safetensors.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/convert_fixtures.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;

class ConvertDirTest : public testing::Test {
 protected:
  void SetUp() override {
    layout_.tp = 2;
    layout_.ep = 2;
    layout_.vocab_divisible_by = 8;
    auto plan = PlanConversion(test::TinyQwen3Moe(8, 4), layout_);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    plan_ = *plan;
    hf_ = test::RandomHfState(plan_, DType::kBF16, 9);
    auto state = ShardHfState(plan_, hf_);
    ASSERT_TRUE(state.ok()) << state.status().ToString();
    in_ = tmp_.path() + "/mcore";
    // One file per rank; non-expert tensors only in the EP rank 0 files.
    std::map<std::string, test::TestSafetensors> files;
    for (const auto& [key, t] : *state) {
      test::TestSafetensors& f = files[RankFileName(key.tp_rank, key.ep_rank)];
      f.name = RankFileName(key.tp_rank, key.ep_rank);
      f.tensors.push_back({key.name, t.dtype, t.shape, t.data});
    }
    test::TestCheckpoint ckpt;
    for (auto& [name, f] : files) ckpt.safetensors.push_back(f);
    ckpt.raw_files["config.json"] = "{\"model_type\": \"qwen3_moe\"}\n";
    ckpt.raw_files["tokenizer.json"] = "{}\n";
    ASSERT_TRUE(test::WriteCheckpoint(ckpt, in_).ok());
  }

  Result<HfDirResult> Convert(const std::string& out, uint64_t max_file_bytes) {
    auto source = RankFileSource::Open(in_, layout_);
    if (!source.ok()) return source.status();
    HfDirOptions options;
    options.max_file_bytes = max_file_bytes;
    options.copy_from = in_;
    return WriteHfDirectory(plan_, **source, out, options);
  }

  test::ScopedTempDir tmp_;
  ParallelLayout layout_;
  std::vector<ConvertUnit> plan_;
  std::map<std::string, TensorData> hf_;
  std::string in_;
};

TEST_F(ConvertDirTest, WritesShardedHfDirectoryBitForBit) {
  const std::string out = tmp_.path() + "/hf";
  auto result = Convert(out, 4096);  // small files: several shards and an index
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GT(result->files, 1u);
  EXPECT_FALSE(fs::exists(out + ".partial"));
  auto index_text = test::ReadFileBytes(out + "/model.safetensors.index.json");
  ASSERT_TRUE(index_text.ok());
  auto index = ParseSafetensorsIndex(*index_text, "index");
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(index->weight_map.size(), hf_.size());
  EXPECT_EQ(index->shards.size(), result->files);
  size_t seen = 0;
  for (const std::string& shard : index->shards) {
    auto bytes = test::ReadFileBytes(out + "/" + shard);
    ASSERT_TRUE(bytes.ok());
    auto header = ParseSafetensorsFile(*bytes, shard);
    ASSERT_TRUE(header.ok()) << header.status().ToString();
    EXPECT_EQ(header->metadata.at("format"), "pt");
    for (const TensorInfo& t : header->tensors) {
      const TensorData& want = hf_.at(t.name);
      EXPECT_EQ(index->weight_map.at(t.name), shard);
      EXPECT_EQ(t.dtype, want.dtype);
      EXPECT_EQ(t.shape, want.shape);
      EXPECT_TRUE(bytes->substr(header->data_offset + t.begin, t.bytes()) == want.data) << t.name;
      seen++;
    }
  }
  EXPECT_EQ(seen, hf_.size());
  EXPECT_EQ(test::ReadFileBytes(out + "/tokenizer.json").value(), "{}\n");
  EXPECT_TRUE(fs::exists(out + "/config.json"));
  EXPECT_EQ(Convert(out, 4096).status().code(), Code::kAlreadyExists);
}

TEST_F(ConvertDirTest, OneFileWithoutIndexWhenItFits) {
  const std::string out = tmp_.path() + "/single";
  auto result = Convert(out, 1ull << 30);
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(result->files, 1u);
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/model.safetensors.index.json"));
}

TEST_F(ConvertDirTest, SameFileAndSameVersionAsTheHfCheckpoint) {
  // The HF checkpoint written directly, tensors in plan order.
  test::TestCheckpoint direct;
  direct.safetensors.push_back({"model.safetensors", {}, {{"format", "pt"}}});
  for (const ConvertUnit& u : plan_) {
    for (const PlannedTensor& t : u.tensors) {
      const TensorData& d = hf_.at(t.name);
      direct.safetensors[0].tensors.push_back({t.name, d.dtype, d.shape, d.data});
    }
  }
  direct.raw_files["config.json"] = "{\"model_type\": \"qwen3_moe\"}\n";
  direct.raw_files["tokenizer.json"] = "{}\n";
  const std::string hf_dir = tmp_.path() + "/direct", out = tmp_.path() + "/converted";
  ASSERT_TRUE(test::WriteCheckpoint(direct, hf_dir).ok());
  ASSERT_TRUE(Convert(out, 1ull << 30).ok());
  EXPECT_TRUE(test::ReadFileBytes(out + "/model.safetensors").value() ==
              test::SafetensorsBytes(direct.safetensors[0]));
  auto store = test::OpenTestStore(tmp_.path() + "/store");
  ASSERT_NE(store, nullptr);
  auto v0 = CommitDirectory(*store, hf_dir, CommitOptions{});
  ASSERT_TRUE(v0.ok()) << v0.status().ToString();
  auto v1 = CommitDirectory(*store, out, CommitOptions{});
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(v1->anchor_reason, "");
  EXPECT_EQ(v1->changed_elements, 0u);
  EXPECT_EQ(v1->elements, v0->elements);
}

TEST_F(ConvertDirTest, MissingRankFileNamesShardAndFile) {
  fs::remove(in_ + "/" + RankFileName(1, 1));
  const std::string out = tmp_.path() + "/hf";
  auto result = Convert(out, 1ull << 30);
  ASSERT_EQ(result.status().code(), Code::kNotFound);
  EXPECT_NE(result.status().message().find("tp rank 1, ep rank 1"), std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("mp_rank_01_001.safetensors"), std::string::npos);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(out + ".partial"));
}

TEST_F(ConvertDirTest, RankFileOutsideLayoutIsRejected) {
  fs::copy_file(in_ + "/" + RankFileName(1, 0), in_ + "/" + RankFileName(2, 0));
  auto result = Convert(tmp_.path() + "/hf", 1ull << 30);
  ASSERT_EQ(result.status().code(), Code::kInvalidArgument);
  EXPECT_NE(result.status().message().find("mp_rank_02_000"), std::string::npos);
}

}  // namespace
}  // namespace dte
