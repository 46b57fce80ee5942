// Verifying stores: a clean store passes; each kind of damage is reported
// with the blob key or version that a user must look at.
#include "store/ops/verify.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "store/ops/commit.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::TestCheckpoint;

// A store with an anchor v0 and deltas v1, v2, committed from checkpoints.
class VerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    TestCheckpoint c;
    c.safetensors.push_back(
        {"model.safetensors",
         {test::Bf16Tensor("w", {1000, 700}, 1), test::Bf16Tensor("b", {700}, 2)},
         {}});
    c.raw_files["config.json"] = "{\"layers\": 1}\n";
    for (int v = 0; v <= 2; ++v) {
      if (v > 0) test::PerturbElements(&c.tensor("w").data, 2, 400, v);
      std::string dir = tmp_.path() + "/in" + std::to_string(v);
      ASSERT_TRUE(test::WriteCheckpoint(c, dir).ok());
      auto r = CommitDirectory(*store, dir, {});
      ASSERT_TRUE(r.ok()) << r.status().message();
    }
    for (uint64_t v = 0; v <= 2; ++v) versions_[v] = store->GetVersion(v).value()->manifest;
  }

  std::string uri() const { return tmp_.path() + "/store"; }

  // A fresh Store (nothing cached in memory), with an index when `cache`.
  std::unique_ptr<Store> Open(bool cache = false) {
    StoreOptions o;
    o.uri = uri();
    o.create = true;
    if (cache) o.cache_dir = tmp_.path() + "/cache";
    auto s = Store::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().message();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  VerifyReport Verify(std::optional<uint64_t> version = std::nullopt, bool cache = false) {
    auto store = Open(cache);
    if (store == nullptr) return {};
    auto r = VerifyStore(*store, version, nullptr);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : VerifyReport{};
  }

  std::string BlobPath(const Hash128& h) const { return uri() + "/" + BlobKey(h); }

  ::testing::AssertionResult Reports(const VerifyReport& report, const std::string& needle,
                                     const std::string& also = "") {
    std::string all;
    for (const auto& p : report.problems) {
      if (p.find(needle) != std::string::npos && p.find(also) != std::string::npos) {
        return ::testing::AssertionSuccess();
      }
      all += "\n  " + p;
    }
    return ::testing::AssertionFailure()
           << "no problem names " << needle << " " << also << "; problems:" << all;
  }

  test::ScopedTempDir tmp_;
  Manifest versions_[3];
};

TEST_F(VerifyTest, CleanStoreIsOk) {
  std::set<std::string> blobs;
  for (const auto& m : versions_) {
    blobs.insert(m.block_table.hash.Hex());
    for (const auto& b : m.blobs) blobs.insert(b.hash.Hex());
    for (const auto& f : m.files) blobs.insert((f.safetensors ? f.header_blob : f.blob).Hex());
  }
  for (bool cache : {false, true}) {
    SCOPED_TRACE(cache);
    VerifyReport r = Verify(std::nullopt, cache);
    EXPECT_TRUE(r.ok()) << r.problems.front();
    EXPECT_EQ(r.versions, 3u);
    EXPECT_EQ(r.files, 6u);
    EXPECT_EQ(r.tensors, 6u);
    EXPECT_EQ(r.blobs, blobs.size());
  }
  VerifyReport one = Verify(2);
  EXPECT_TRUE(one.ok());
  EXPECT_EQ(one.versions, 1u);
}

TEST_F(VerifyTest, FlippedBitInADeltaBlobNamesTheBlob) {
  const BlobRef& delta = versions_[1].blobs.at(0);
  ASSERT_TRUE(test::FlipBits(BlobPath(delta.hash), delta.size / 3, 0x04).ok());
  VerifyReport r = Verify();
  EXPECT_TRUE(Reports(r, BlobKey(delta.hash), "does not match its hash"));
  // v1 itself cannot materialize either; v0 is unaffected.
  EXPECT_TRUE(Reports(r, "v00000001"));
  EXPECT_FALSE(Reports(r, "v00000000"));
}

TEST_F(VerifyTest, TruncatedBlobNamesTheBlob) {
  const BlobRef& delta = versions_[2].blobs.at(0);
  fs::resize_file(BlobPath(delta.hash), delta.size - 7);
  VerifyReport r = Verify();
  EXPECT_TRUE(Reports(r, BlobKey(delta.hash), "truncated"));
}

TEST_F(VerifyTest, MissingBlobNamesTheBlob) {
  const Hash128 header = versions_[0].files[1].header_blob;
  ASSERT_TRUE(fs::remove(BlobPath(header)));
  VerifyReport r = Verify();
  EXPECT_TRUE(Reports(r, BlobKey(header), "missing"));
}

TEST_F(VerifyTest, CorruptManifestNamesTheVersion) {
  const std::string key = uri() + "/" + ManifestKey(1, 0);
  std::string text = test::ReadFileBytes(key).value();
  ASSERT_TRUE(test::WriteFileBytes(key, text.substr(0, text.size() / 2)).ok());
  VerifyReport r = Verify();
  EXPECT_TRUE(Reports(r, ManifestKey(1, 0)));
}

// The cache index keeps its own copy of every manifest; verify must check
// the store's objects, not that copy.
TEST_F(VerifyTest, CorruptManifestIsFoundEvenWithACachedCopy) {
  ASSERT_TRUE(Verify(std::nullopt, /*cache=*/true).ok());  // fills the index
  const std::string key = uri() + "/" + ManifestKey(1, 0);
  std::string text = test::ReadFileBytes(key).value();
  text.replace(text.find("\"changed_elements\""), 9, "\"xhanged_");
  ASSERT_TRUE(test::WriteFileBytes(key, text).ok());
  EXPECT_TRUE(Reports(Verify(std::nullopt, /*cache=*/true), ManifestKey(1, 0)));
  EXPECT_TRUE(Reports(Verify(1, /*cache=*/true), ManifestKey(1, 0)));
}

TEST_F(VerifyTest, OneVersionIsCheckedWithItsWholeChain) {
  const BlobRef& anchor_data = versions_[0].blobs.at(0);
  fs::resize_file(BlobPath(anchor_data.hash), anchor_data.size / 2);
  VerifyReport r = Verify(2);
  EXPECT_EQ(r.versions, 1u);
  EXPECT_TRUE(Reports(r, BlobKey(anchor_data.hash), "truncated"));
  // Materializing v2 reaches the damaged anchor block.
  EXPECT_TRUE(Reports(r, "v00000000/model.safetensors", BlobKey(anchor_data.hash)));
}

TEST_F(VerifyTest, MissingParentIsReported) {
  ASSERT_TRUE(fs::remove(uri() + "/" + ManifestKey(0, 0)));
  VerifyReport r = Verify();
  EXPECT_TRUE(Reports(r, "v00000001", "parent v00000000 is missing"));
  EXPECT_EQ(r.versions, 2u);
}

TEST_F(VerifyTest, UnknownVersionIsNotFound) {
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = VerifyStore(*store, 17, nullptr);
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_NE(r.status().message().find("17"), std::string::npos);
}

}  // namespace
}  // namespace dte
