// Exporting versions as plain model directories: byte-identical files, and
// the output directory appears only when the export succeeded.
#include "store/ops/export.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "store/ops/commit.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::TestCheckpoint;

TestCheckpoint Model() {
  TestCheckpoint c;
  c.safetensors.push_back(
      {"a.safetensors",
       {test::Bf16Tensor("w1", {600, 600}, 1), test::Bf16Tensor("b1", {600}, 2)},
       {{"format", "pt"}}});
  c.safetensors.push_back({"b.safetensors", {test::Bf16Tensor("w2", {300, 700}, 3)}, {}});
  c.raw_files["config.json"] = "{}\n";
  c.raw_files["tokenizer.json"] = test::RandomBytes(5000, 4);
  return c;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreOptions o;
    o.uri = root() + "/store";
    o.create = true;
    auto s = Store::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().message();
    store_ = std::move(s).value();
    versions_.push_back(Model());
    for (int v = 1; v <= 2; ++v) {
      versions_.push_back(versions_.back());
      test::PerturbElements(&versions_.back().tensor("w1").data, 2, 700, v);
      test::PerturbElements(&versions_.back().tensor("w2").data, 2, 90, 10 + v);
    }
    for (size_t v = 0; v < versions_.size(); ++v) {
      std::string dir = root() + "/in" + std::to_string(v);
      ASSERT_TRUE(test::WriteCheckpoint(versions_[v], dir).ok());
      auto r = CommitDirectory(*store_, dir, {});
      ASSERT_TRUE(r.ok()) << r.status().message();
    }
  }

  std::string root() const { return tmp_.path(); }

  // Asserts OUT does not exist and no sibling temp dir was left.
  void ExpectNothingAt(const std::string& out) {
    EXPECT_FALSE(fs::exists(out)) << out;
    for (const auto& e : fs::directory_iterator(root())) {
      EXPECT_EQ(e.path().filename().string().find(".dte-export-"), std::string::npos)
          << "temp dir left behind: " << e.path();
    }
  }

  // Damages the end of version `v`'s last payload blob: w2's data (the last
  // tensor of the last safetensors file).
  void CorruptDataBlob(uint64_t v) {
    auto ver = store_->GetVersion(v);
    ASSERT_TRUE(ver.ok());
    const BlobRef& blob = (*ver)->manifest.blobs.back();
    const std::string path = store_->uri() + "/" + BlobKey(blob.hash);
    ASSERT_TRUE(test::FlipBits(path, blob.size - 10, 0x5a).ok());
    ASSERT_TRUE(test::FlipBits(path, blob.size - 9, 0xa5).ok());
  }

  test::ScopedTempDir tmp_;
  std::unique_ptr<Store> store_;
  std::vector<TestCheckpoint> versions_;
};

TEST_F(ExportTest, FilesAreByteIdenticalToTheCommittedOnes) {
  for (uint64_t v = 0; v < versions_.size(); ++v) {
    SCOPED_TRACE(v);
    std::string out = root() + "/out" + std::to_string(v);
    uint64_t progressed = 0;
    auto r = ExportVersion(*store_, v, out, [&](uint64_t done, uint64_t) { progressed = done; });
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->version, v);
    EXPECT_EQ(r->files, 4u);
    EXPECT_EQ(progressed, r->bytes);
    std::string in = root() + "/in" + std::to_string(v);
    size_t seen = 0;
    for (const auto& e : fs::directory_iterator(out)) {
      ++seen;
      std::string name = e.path().filename().string();
      auto got = test::ReadFileBytes(e.path().string());
      auto want = test::ReadFileBytes(in + "/" + name);
      ASSERT_TRUE(got.ok() && want.ok()) << name;
      EXPECT_TRUE(*got == *want) << name << " differs";
    }
    EXPECT_EQ(seen, 4u);
  }
}

TEST_F(ExportTest, IntoAnExistingEmptyDirectory) {
  std::string out = root() + "/empty";
  fs::create_directory(out);
  auto r = ExportVersion(*store_, 1, out + "/", nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(fs::exists(out + "/a.safetensors"));
}

TEST_F(ExportTest, NonEmptyOutputDirectoryIsRefusedAndUntouched) {
  std::string out = root() + "/busy";
  fs::create_directory(out);
  ASSERT_TRUE(test::WriteFileBytes(out + "/mine.txt", "keep").ok());
  auto r = ExportVersion(*store_, 1, out, nullptr);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(out), std::string::npos) << r.status().message();
  EXPECT_EQ(test::ReadFileBytes(out + "/mine.txt").value(), "keep");
  EXPECT_EQ(std::distance(fs::directory_iterator(out), fs::directory_iterator()), 1);
}

TEST_F(ExportTest, MissingVersionCreatesNothing) {
  std::string out = root() + "/out";
  auto r = ExportVersion(*store_, 42, out, nullptr);
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_NE(r.status().message().find("v00000042"), std::string::npos);
  ExpectNothingAt(out);
}

// Files before the damaged one were already written into the temp dir: all
// of it must go, and OUT must never appear.
TEST_F(ExportTest, CorruptBlobFailsWithoutLeavingOutputOrTempDir) {
  CorruptDataBlob(2);  // b.safetensors is exported after a.safetensors
  std::string out = root() + "/out";
  auto r = ExportVersion(*store_, 2, out, nullptr);
  ASSERT_FALSE(r.ok()) << "exported a corrupt version";
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().message();
  EXPECT_NE(r.status().message().find("v00000002"), std::string::npos) << r.status().message();
  ExpectNothingAt(out);
  auto ok = ExportVersion(*store_, 0, out, nullptr);  // other versions still export
  EXPECT_TRUE(ok.ok()) << ok.status().message();
}

TEST_F(ExportTest, FailureRemovesTheParentDirectoriesItCreated) {
  CorruptDataBlob(1);
  auto r = ExportVersion(*store_, 1, root() + "/new/deeper/out", nullptr);
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().message();
  EXPECT_FALSE(fs::exists(root() + "/new"));
  auto ok = ExportVersion(*store_, 0, root() + "/new/deeper/out", nullptr);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_TRUE(fs::exists(root() + "/new/deeper/out/b.safetensors"));
}

TEST_F(ExportTest, CorruptAnchorBreaksEveryLaterVersionToo) {
  CorruptDataBlob(0);
  for (uint64_t v = 0; v < versions_.size(); ++v) {
    std::string out = root() + "/out" + std::to_string(v);
    auto r = ExportVersion(*store_, v, out, nullptr);
    EXPECT_EQ(r.status().code(), Code::kCorruption) << v;
    ExpectNothingAt(out);
  }
}

}  // namespace
}  // namespace dte
