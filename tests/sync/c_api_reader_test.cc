// The C ABI's readers (sync/capi/c_api.h, "Reading versions"), over a store
// directory and over s3:// on a real S3 server (moto, tests/testutil/s3_server.h):
// the committed versions, a version's tensor table against the checkpoint
// it was committed from, a safetensors file's table, latest after gc took
// versions away, and dtype widths.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "store/hash.h"
#include "store/ops/commit.h"
#include "store/ops/gc.h"
#include "store/store.h"
#include "sync/capi/c_api.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/s3_server.h"

namespace dte {
namespace {

constexpr char kFile[] = "model.safetensors";

// A tensor table row, owned.
struct Row {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  std::string file;
  uint64_t offset = 0;
  std::string hash;
  bool operator==(const Row&) const = default;
};

// The rows of a table the call `open` opens (DTE_OK expected), by name;
// the table is closed.
template <typename Open>
std::map<std::string, Row> Table(const Open& open) {
  std::map<std::string, Row> rows;
  dte_tensor_table* t = nullptr;
  EXPECT_EQ(open(&t), DTE_OK) << dte_last_error();
  if (t == nullptr) return rows;
  const dte_tensor_info* entries = nullptr;
  size_t count = 0;
  EXPECT_EQ(dte_tensor_table_entries(t, &entries, &count), DTE_OK) << dte_last_error();
  for (size_t i = 0; i < count; ++i) {
    const dte_tensor_info& e = entries[i];
    rows[e.name] =
        Row{e.dtype, std::vector<int64_t>(e.shape, e.shape + e.ndim), e.bytes, e.file, e.offset,
            e.hash};
  }
  EXPECT_EQ(dte_tensor_table_close(t), DTE_OK);
  EXPECT_EQ(dte_tensor_table_entries(t, &entries, &count), DTE_INVALID_ARGUMENT);
  return rows;
}

std::vector<uint64_t> List(dte_store* s, std::optional<uint64_t> after = std::nullopt) {
  const uint64_t* versions = nullptr;
  size_t count = 0;
  EXPECT_EQ(dte_store_list_versions(s, after.has_value(), after.value_or(0), &versions, &count),
            DTE_OK)
      << dte_last_error();
  return std::vector<uint64_t>(versions, versions + count);
}

std::optional<uint64_t> Latest(dte_store* s) {
  int has = 0;
  uint64_t version = 0;
  EXPECT_EQ(dte_store_latest(s, &has, &version), DTE_OK) << dte_last_error();
  return has ? std::optional<uint64_t>(version) : std::nullopt;
}

// Sets environment variables for one test and puts back what was there.
class ScopedEnv {
 public:
  void Set(const std::string& name, const std::string& value) {
    const char* old = std::getenv(name.c_str());
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A store (a directory, or s3:// on moto) holding versions of one checkpoint
// of two tensors, each version's checkpoint directory kept.
class CApiReader : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    env_.Set("DTE_S3_MAX_ATTEMPTS", "3");
    env_.Set("DTE_S3_RETRY_BASE_MS", "1");
    env_.Set("DTE_S3_RETRY_MAX_MS", "2");
    if (std::string(GetParam()) == "local") {
      uri_ = tmp_.path() + "/store";
    } else {
      auto server = test::S3TestServer::Get();
      ASSERT_TRUE(server.ok()) << server.status().ToString();
      auto bucket = (*server)->NewBucket();
      ASSERT_TRUE(bucket.ok()) << bucket.status().ToString();
      const S3Options o = (*server)->Options(tmp_.path());
      env_.Set("AWS_ENDPOINT_URL", o.endpoint);
      env_.Set("AWS_REGION", o.region);
      env_.Set("AWS_ACCESS_KEY_ID", o.access_key);
      env_.Set("AWS_SECRET_ACCESS_KEY", o.secret_key);
      env_.Set("AWS_SESSION_TOKEN", "");
      env_.Set("AWS_CONFIG_FILE", "/nonexistent/dte-test-aws-config");
      env_.Set("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/dte-test-aws-credentials");
      uri_ = "s3://" + *bucket + "/policy";
    }
    writer_ = test::OpenTestStore(uri_);
    ASSERT_NE(writer_, nullptr);
    ckpt_.safetensors.push_back(
        {kFile, {test::Bf16Tensor("w", {96, 80}, 1), test::Bf16Tensor("b", {80}, 2)}, {}});
    ckpt_.raw_files["config.json"] = "{}";
  }

  // Commits the next version (w changed); returns its number.
  uint64_t Commit() {
    const uint64_t v = dirs_.size();
    if (v > 0) test::PerturbElements(&ckpt_.tensor("w").data, 2, 40, v);
    dirs_.push_back(tmp_.path() + "/ckpt" + std::to_string(v));
    EXPECT_TRUE(test::WriteCheckpoint(ckpt_, dirs_.back()).ok());
    auto r = CommitDirectory(*writer_, dirs_.back(), {});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return v;
  }

  std::string File(uint64_t version) const { return dirs_.at(version) + "/" + kFile; }

  test::ScopedTempDir tmp_;
  ScopedEnv env_;
  std::string uri_;
  std::unique_ptr<Store> writer_;
  test::TestCheckpoint ckpt_;
  std::vector<std::string> dirs_;
};

TEST_P(CApiReader, ListsTheCommittedVersionsAndTheirTensorTables) {
  for (int i = 0; i < 3; ++i) Commit();
  dte_store* s = nullptr;
  ASSERT_EQ(dte_store_open(uri_.c_str(), nullptr, &s), DTE_OK) << dte_last_error();
  EXPECT_EQ(List(s), (std::vector<uint64_t>{0, 1, 2}));
  EXPECT_EQ(List(s, 0), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(List(s, 2), std::vector<uint64_t>{});
  EXPECT_EQ(Latest(s), 2u);

  // A version's table is its checkpoint file's header (the store keeps it
  // verbatim), with each tensor's hash of the bytes committed.
  auto table = Table([&](dte_tensor_table** t) { return dte_store_version_tensors(s, 1, t); });
  auto header =
      Table([&](dte_tensor_table** t) { return dte_safetensors_tensors(File(1).c_str(), t); });
  ASSERT_EQ(table.size(), 2u);
  const std::string bytes = test::ReadFileBytes(File(1)).value();
  for (auto& [name, row] : header) {
    SCOPED_TRACE(name);
    EXPECT_EQ(row.hash, "");
    EXPECT_EQ(row.file, kFile);
    row.hash = HashBytes(bytes.data() + row.offset, row.bytes).Hex();
    EXPECT_EQ(table[name], row);
    std::string got(row.bytes, '\0');
    ASSERT_EQ(dte_store_read_tensor(s, 1, name.c_str(), got.data(), got.size()), DTE_OK);
    EXPECT_EQ(got, bytes.substr(row.offset, row.bytes));
  }
  EXPECT_EQ(table["w"].dtype, "BF16");
  EXPECT_EQ(table["w"].shape, (std::vector<int64_t>{96, 80}));
  EXPECT_EQ(table["w"].bytes, 96u * 80 * 2);
  EXPECT_EQ(table["b"].offset, table["w"].offset + table["w"].bytes);
  // The tables of versions 0 and 1 differ in w's hash only.
  auto first = Table([&](dte_tensor_table** t) { return dte_store_version_tensors(s, 0, t); });
  EXPECT_NE(first["w"].hash, table["w"].hash);
  EXPECT_EQ(first["b"], table["b"]);

  dte_tensor_table* t = nullptr;
  EXPECT_EQ(dte_store_version_tensors(s, 7, &t), DTE_NOT_FOUND);
  EXPECT_NE(std::string(dte_last_error()).find("v00000007"), std::string::npos) << dte_last_error();
  EXPECT_EQ(t, nullptr);
  EXPECT_EQ(dte_store_close(s), DTE_OK);
}

// gc removes versions on another host: they leave the listing once their
// manifests are gone, and latest stays where it was; a later commit is
// listed after it.
TEST_P(CApiReader, VersionsGcRemovedLeaveTheListingAndLatestStays) {
  for (int i = 0; i < 4; ++i) Commit();
  dte_store* s = nullptr;
  ASSERT_EQ(dte_store_open(uri_.c_str(), "", &s), DTE_OK) << dte_last_error();
  ASSERT_EQ(List(s), (std::vector<uint64_t>{0, 1, 2, 3}));
  ASSERT_EQ(Latest(s), 3u);
  GcOptions o;
  o.keep_last = 2;
  o.grace_seconds = 0;
  auto gc = CollectGarbage(*test::OpenTestStore(uri_), o, nullptr);
  ASSERT_TRUE(gc.ok()) << gc.status().ToString();
  ASSERT_EQ(gc->versions_removed, 2u);
  EXPECT_EQ(List(s), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(Latest(s), 3u);
  // v2, rebased as an anchor, still reads as committed.
  auto table = Table([&](dte_tensor_table** t) { return dte_store_version_tensors(s, 2, t); });
  const std::string bytes = test::ReadFileBytes(File(2)).value();
  std::string got(table["w"].bytes, '\0');
  ASSERT_EQ(dte_store_read_tensor(s, 2, "w", got.data(), got.size()), DTE_OK) << dte_last_error();
  EXPECT_EQ(got, bytes.substr(table["w"].offset, table["w"].bytes));
  dte_tensor_table* none = nullptr;
  EXPECT_EQ(dte_store_version_tensors(s, 0, &none), DTE_NOT_FOUND);
  // A new publisher process (the old one's versions are gc's: with no
  // grace period their blobs are gone).
  writer_ = test::OpenTestStore(uri_);
  Commit();
  EXPECT_EQ(List(s, 3), std::vector<uint64_t>{4});
  EXPECT_EQ(Latest(s), 4u);
  EXPECT_EQ(dte_store_close(s), DTE_OK);
}

TEST_P(CApiReader, AnEmptyStoreListsNothing) {
  dte_store* s = nullptr;
  ASSERT_EQ(dte_store_open(uri_.c_str(), nullptr, &s), DTE_OK) << dte_last_error();
  EXPECT_EQ(List(s), std::vector<uint64_t>{});
  EXPECT_EQ(Latest(s), std::nullopt);
  const uint64_t* versions = nullptr;
  EXPECT_EQ(dte_store_list_versions(s, 0, 0, &versions, nullptr), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(dte_store_close(s), DTE_OK);
}

INSTANTIATE_TEST_SUITE_P(Stores, CApiReader, ::testing::Values("local", "s3"),
                         [](const auto& info) { return std::string(info.param); });

TEST(CApiTensorTable, SafetensorsHeaderIsReadAndValidated) {
  test::ScopedTempDir tmp;
  test::TestSafetensors f{kFile,
                          {{"a", DType::kF32, {3, 2}, std::string(24, '\1')},
                           {"q", DType::kF8E4M3, {5}, std::string(5, '\2')}},
                          {{"format", "pt"}}};
  const std::string path = tmp.path() + "/" + kFile;
  const std::string bytes = test::SafetensorsBytes(f);
  ASSERT_TRUE(test::WriteFileBytes(path, bytes).ok());
  auto rows = Table([&](dte_tensor_table** t) { return dte_safetensors_tensors(path.c_str(), t); });
  const uint64_t data = bytes.size() - 29;  // the data section: 24 + 5 bytes
  EXPECT_EQ(rows["a"], (Row{"F32", {3, 2}, 24, kFile, data, ""}));
  EXPECT_EQ(rows["q"], (Row{"F8_E4M3", {5}, 5, kFile, data + 24, ""}));
  EXPECT_EQ(rows.size(), 2u);  // no "__metadata__"

  dte_tensor_table* t = nullptr;
  ASSERT_TRUE(test::WriteFileBytes(path, bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_EQ(dte_safetensors_tensors(path.c_str(), &t), DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error()).find(path), std::string::npos) << dte_last_error();
  EXPECT_EQ(dte_safetensors_tensors((tmp.path() + "/none.safetensors").c_str(), &t), DTE_NOT_FOUND);
  EXPECT_NE(std::string(dte_last_error()).find("none.safetensors"), std::string::npos);
  EXPECT_EQ(dte_safetensors_tensors(nullptr, &t), DTE_INVALID_ARGUMENT);
  EXPECT_EQ(t, nullptr);
}

TEST(CApiTensorTable, DtypeWidthsAreTheStoresOwn) {
  const std::map<std::string, int32_t> widths = {{"BOOL", 1}, {"F8_E4M3", 1}, {"BF16", 2},
                                                 {"I16", 2},  {"F32", 4},     {"U64", 8}};
  for (const auto& [name, want] : widths) {
    int32_t width = 0;
    EXPECT_EQ(dte_dtype_width(name.c_str(), &width), DTE_OK) << name;
    EXPECT_EQ(width, want) << name;
  }
  int32_t width = 0;
  EXPECT_EQ(dte_dtype_width("bf16", &width), DTE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dte_last_error()).find("\"bf16\""), std::string::npos) << dte_last_error();
  EXPECT_EQ(dte_dtype_width("F32", nullptr), DTE_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace dte
