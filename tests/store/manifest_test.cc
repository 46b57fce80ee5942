// Manifest JSON and block table encoding, object keys and name checks.
#include "store/manifest.h"

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

namespace dte {
namespace {

constexpr char kWhat[] = "/stores/a/manifests/v00000005.json";
constexpr uint64_t kHeader = 64;

Hash128 H(uint64_t high, uint64_t low) { return Hash128{high, low}; }

TensorEntry Tensor(std::string name, DType dtype, std::vector<int64_t> shape, uint64_t begin,
                   uint32_t first_block, uint64_t seed) {
  TensorEntry t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.begin = begin;
  t.end = begin + t.elements() * static_cast<uint64_t>(DTypeWidth(dtype));
  t.hash = H(seed, ~seed);
  t.changed = seed * 3;
  t.first_block = first_block;
  t.blocks = static_cast<uint32_t>((t.bytes() + kDefaultBlockBytes - 1) / kDefaultBlockBytes);
  return t;
}

// A delta with a raw file and a safetensors file of three tensors (two
// blocks, one block, empty); every field has a distinct non-default value.
Manifest Sample() {
  Manifest m;
  m.version = 5;
  m.revision = 2;
  m.parent = 4;
  m.created = "2026-01-02T03:04:05Z";
  m.block_table = BlobRef{H(0xb7, 0x7b), 16 + 32 * 3, true};
  m.blobs = {BlobRef{H(0xd1, 0x1d), 777, true}, BlobRef{H(0xd2, 0x2d), 888, false}};
  FileEntry config;
  config.name = "config.json";
  config.size = 10;
  config.blob = H(0xc0, 0x0c);
  FileEntry model;
  model.name = "model.safetensors";
  model.safetensors = true;
  model.header_blob = H(0x4e, 0xe4);
  model.header_size = kHeader;
  model.tensors.push_back(Tensor("a.weight", DType::kBF16, {4, 65536}, 0, 0, 11));
  model.tensors.push_back(Tensor("b.bias", DType::kF32, {3}, 524288, 2, 12));
  model.tensors.push_back(Tensor("c.empty", DType::kU8, {0, 7}, 524300, 3, 13));
  model.size = kHeader + 524300;
  m.files = {config, model};
  m.stats = VersionStats{3, 262147, 99, 1665, 524300};
  return m;
}

TensorEntry& TensorAt(Manifest& m, size_t i) { return m.files[1].tensors[i]; }

void ExpectCorrupt(const Result<Manifest>& r, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(r.ok()) << "accepted; expected an error containing " << *parts.begin();
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().message();
  EXPECT_NE(r.status().message().find(kWhat), std::string::npos) << r.status().message();
  for (const auto& p : parts) {
    EXPECT_NE(r.status().message().find(p), std::string::npos) << r.status().message();
  }
}

Result<Manifest> DecodeMutated(const std::function<void(Manifest&)>& mutate) {
  Manifest m = Sample();
  mutate(m);
  return DecodeManifest(EncodeManifest(m), kWhat);
}

// The sample's JSON with the single occurrence of `from` replaced.
std::string EditedJson(const std::string& from, const std::string& to) {
  std::string text = EncodeManifest(Sample());
  size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << from << " is not unique";
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(Manifest, RoundTripKeepsEveryField) {
  const Manifest m = Sample();
  const std::string text = EncodeManifest(m);
  auto d = DecodeManifest(text, kWhat);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(EncodeManifest(*d), text);
  EXPECT_EQ(d->version, 5u);
  EXPECT_EQ(d->revision, 2u);
  EXPECT_EQ(d->parent, std::optional<uint64_t>(4));
  EXPECT_EQ(d->created, m.created);
  EXPECT_EQ(d->block_table.hash, m.block_table.hash);
  ASSERT_EQ(d->blobs.size(), 2u);
  EXPECT_FALSE(d->blobs[1].added);
  EXPECT_EQ(d->blobs[1].size, 888u);
  ASSERT_EQ(d->files.size(), 2u);
  EXPECT_FALSE(d->files[0].safetensors);
  EXPECT_EQ(d->files[0].blob, m.files[0].blob);
  const FileEntry& f = d->files[1];
  EXPECT_TRUE(f.safetensors);
  EXPECT_EQ(f.header_blob, m.files[1].header_blob);
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors[0].shape, (std::vector<int64_t>{4, 65536}));
  EXPECT_EQ(f.tensors[1].dtype, DType::kF32);
  EXPECT_EQ(f.tensors[1].hash, H(12, ~uint64_t{12}));
  EXPECT_EQ(f.tensors[1].changed, 36u);
  EXPECT_EQ(f.tensors[1].first_block, 2u);
  EXPECT_EQ(f.tensors[2].blocks, 0u);
  EXPECT_EQ(d->stats.changed_elements, 99u);
  EXPECT_EQ(d->stats.dense_bytes, 524300u);
}

TEST(Manifest, FullTableAndDistanceRoundTrip) {
  Manifest m = Sample();
  m.full =
      FullTable{BlobRef{H(0xf1, 0x1f), 16 + 32 * 3, true}, {BlobRef{H(0xf2, 0x2f), 999, true}}};
  m.since_full = AnchorDistance{0, 0};
  auto d = DecodeManifest(EncodeManifest(m), kWhat);
  ASSERT_TRUE(d.ok()) << d.status().message();
  ASSERT_TRUE(d->full.has_value());
  EXPECT_EQ(d->full->block_table.hash, H(0xf1, 0x1f));
  ASSERT_EQ(d->full->blobs.size(), 1u);
  EXPECT_EQ(d->full->blobs[0].size, 999u);
  EXPECT_TRUE(d->self_contained());
  EXPECT_FALSE(d->anchor());
  m.full.reset();
  m.since_full = AnchorDistance{7, 12345};
  d = DecodeManifest(EncodeManifest(m), kWhat);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_FALSE(d->self_contained());
  ASSERT_TRUE(d->since_full.has_value());
  EXPECT_EQ(d->since_full->versions, 7u);
  EXPECT_EQ(d->since_full->bytes, 12345u);
}

TEST(Manifest, FormatOneManifestsStillRead) {
  // What an older dte wrote: format 1, no full table, no distance.
  auto d = DecodeManifest(EditedJson("\"format_version\": 2", "\"format_version\": 1"), kWhat);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_FALSE(d->full.has_value());
  EXPECT_FALSE(d->since_full.has_value());
  EXPECT_EQ(d->version, 5u);
}

TEST(Manifest, RejectsAFullTableOnAnAnchorOrMalformed) {
  ExpectCorrupt(DecodeMutated([](Manifest& m) {
                  m.parent.reset();
                  m.full = FullTable{BlobRef{H(1, 2), 48, true}, {}};
                }),
                {"an anchor has no full table"});
  Manifest m = Sample();
  m.full = FullTable{BlobRef{H(1, 2), 48, true}, {}};
  std::string text = EncodeManifest(m);
  const size_t at = text.find("\"full\": {");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 9, "\"full\": [1], \"x\": {");
  ExpectCorrupt(DecodeManifest(text, kWhat), {"full is not an object"});
}

TEST(Manifest, AnchorRoundTripsWithoutParent) {
  Manifest m = Sample();
  m.parent.reset();
  auto d = DecodeManifest(EncodeManifest(m), kWhat);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_TRUE(d->anchor());
  EXPECT_NE(EncodeManifest(m).find("\"kind\": \"anchor\""), std::string::npos);
}

TEST(Manifest, RejectsForeignFormatAndVersion) {
  ExpectCorrupt(DecodeManifest(EditedJson("\"dte-manifest\"", "\"dte-store\""), kWhat),
                {"not a dte manifest"});
  ExpectCorrupt(DecodeManifest(EditedJson("\"format_version\": 2", "\"format_version\": 3"), kWhat),
                {"format_version 3"});
  ExpectCorrupt(DecodeManifest(EditedJson("\"format_version\": 2", "\"format_version\": 0"), kWhat),
                {"format_version 0"});
  ExpectCorrupt(DecodeManifest("{\"format\": \"dte-manifest\"", kWhat), {"not valid JSON"});
  ExpectCorrupt(DecodeManifest("[1, 2]", kWhat), {"not valid JSON"});
  ExpectCorrupt(DecodeManifest(EditedJson("\"created\"", "\"made\""), kWhat),
                {"missing field \"created\""});
  ExpectCorrupt(DecodeManifest(EditedJson("\"revision\": 2", "\"revision\": \"2\""), kWhat),
                {"\"revision\" has the wrong type"});
}

TEST(Manifest, RejectsNumbersTheFieldCannotHold) {
  const std::pair<std::string, std::string> edits[] = {
      {"\"format_version\": 2", "\"format_version\": 4294967298"},  // would read as 2
      {"\"version\": 5", "\"version\": -1"},
      {"\"version\": 5", "\"version\": 5.5"},
      {"\"revision\": 2", "\"revision\": 4294967298"},
      {"\"first_block\": 2", "\"first_block\": 4294967298"},
      {"\"changed\": 36", "\"changed\": 36.5"},
      {"\"size\": 888", "\"size\": -888"},
      {"\"added\": false", "\"added\": 0"},
  };
  for (const auto& [from, to] : edits) {
    SCOPED_TRACE(to);
    ExpectCorrupt(DecodeManifest(EditedJson(from, to), kWhat), {"out of range"});
  }
}

TEST(Manifest, RejectsUnsafeFileNames) {
  for (const std::string& bad :
       {std::string("a/b"), std::string(".."), std::string("."), std::string(""),
        std::string("a\0b", 3), std::string("a\\b"), std::string("/etc"), std::string(256, 'x')}) {
    ExpectCorrupt(DecodeMutated([&](Manifest& m) { m.files[0].name = bad; }), {"unsafe file name"});
    ExpectCorrupt(DecodeMutated([&](Manifest& m) { m.files[1].name = bad; }), {"unsafe file name"});
  }
  ExpectCorrupt(DecodeMutated([](Manifest& m) { m.files[0].name = m.files[1].name; }),
                {"duplicate file model.safetensors"});
}

TEST(Manifest, RejectsTensorLayoutDefects) {
  // A hole between a.weight and b.bias (b keeps a consistent byte length).
  ExpectCorrupt(DecodeMutated([](Manifest& m) {
                  TensorAt(m, 1).begin += 4;
                  TensorAt(m, 1).end += 4;
                  TensorAt(m, 2).begin += 4;
                  TensorAt(m, 2).end += 4;
                }),
                {"\"b.bias\" is not contiguous"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 1).shape = {4}; }),
                {"\"b.bias\"", "does not match dtype x shape"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 1).dtype = DType::kF64; }),
                {"\"b.bias\"", "does not match dtype x shape"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 1).end -= 1; }),
                {"\"b.bias\"", "does not match dtype x shape"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) {
                  TensorAt(m, 1).shape = {-3, -1};
                }),
                {"negative dimension"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 0).blocks = 3; }),
                {"\"a.weight\"", "block count"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 2).blocks = 1; }),
                {"\"c.empty\"", "block count"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { TensorAt(m, 1).first_block = 3; }),
                {"block ranges out of order"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { m.files[1].size += 1; }),
                {"size does not match header and tensors"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { m.files[1].header_size = 4; }),
                {"size does not match header and tensors"});
  ExpectCorrupt(DecodeManifest(EditedJson("\"BF16\"", "\"BF17\""), kWhat),
                {"unknown dtype \"BF17\""});
}

TEST(Manifest, RejectsParentNotOlderThanVersion) {
  ExpectCorrupt(DecodeMutated([](Manifest& m) { m.parent = 5; }), {"parent is not older"});
  ExpectCorrupt(DecodeMutated([](Manifest& m) { m.parent = 6; }), {"parent is not older"});
  EXPECT_TRUE(DecodeMutated([](Manifest& m) { m.parent = 0; }).ok());
}

TEST(Manifest, RejectsBlockBytesOutOfRange) {
  ExpectCorrupt(DecodeManifest(EditedJson("\"block_bytes\": 262144", "\"block_bytes\": 0"), kWhat),
                {"block_bytes"});
  ExpectCorrupt(
      DecodeManifest(EditedJson("\"block_bytes\": 262144", "\"block_bytes\": 262143"), kWhat),
      {"block_bytes"});
}

TEST(Manifest, RejectsBadHashHex) {
  const std::string tensor_hex = H(12, ~uint64_t{12}).Hex();
  ASSERT_EQ(tensor_hex.size(), 32u);
  for (const std::string& bad :
       {tensor_hex.substr(1), tensor_hex + "0", "g" + tensor_hex.substr(1), std::string("")}) {
    ExpectCorrupt(DecodeManifest(EditedJson(tensor_hex, bad), kWhat),
                  {"\"b.bias\"", "field \"hash\" is not a 32-digit hex hash"});
  }
  const std::string blob_hex = H(0xd1, 0x1d).Hex();
  ExpectCorrupt(DecodeManifest(EditedJson(blob_hex, blob_hex.substr(2)), kWhat),
                {"field \"hash\" is not a 32-digit hex hash"});
  const std::string header_hex = H(0x4e, 0xe4).Hex();
  ExpectCorrupt(DecodeManifest(EditedJson(header_hex, "x" + header_hex.substr(1)), kWhat),
                {"model.safetensors", "\"header_blob\""});
}

std::vector<BlockRecord> SampleRecords() {
  return {BlockRecord{BlockKind::kSame, 0, 0, 0, 0, 0x1111222233334444ull},
          BlockRecord{BlockKind::kDenseRaw, 1, 262144, 262144, 131072, 0x5555ull},
          BlockRecord{BlockKind::kDenseZstd, 2, (uint64_t{1} << 40) + 3, 4000, 7, UINT64_MAX},
          BlockRecord{BlockKind::kSparse, UINT32_MAX, UINT64_MAX - 9, UINT32_MAX, UINT32_MAX, 1}};
}

TEST(BlockTable, RoundTripKeepsEveryRecord) {
  const auto records = SampleRecords();
  const std::string bytes = EncodeBlockTable(records);
  EXPECT_EQ(bytes.size(), 16 + 32 * records.size());
  EXPECT_EQ(bytes.substr(0, 8), "DTEBLKT1");
  auto d = DecodeBlockTable(bytes, "table");
  ASSERT_TRUE(d.ok()) << d.status().message();
  ASSERT_EQ(d->size(), records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ((*d)[i].kind, records[i].kind);
    EXPECT_EQ((*d)[i].blob, records[i].blob);
    EXPECT_EQ((*d)[i].offset, records[i].offset);
    EXPECT_EQ((*d)[i].length, records[i].length);
    EXPECT_EQ((*d)[i].changed, records[i].changed);
    EXPECT_EQ((*d)[i].hash, records[i].hash);
  }
  auto empty = DecodeBlockTable(EncodeBlockTable({}), "table");
  ASSERT_TRUE(empty.ok()) << empty.status().message();
  EXPECT_TRUE(empty->empty());
}

void ExpectBadTable(const std::string& bytes, const std::string& part) {
  auto d = DecodeBlockTable(bytes, "blobs/ab/abc block table");
  ASSERT_FALSE(d.ok()) << "accepted; expected " << part;
  EXPECT_EQ(d.status().code(), Code::kCorruption);
  EXPECT_NE(d.status().message().find("blobs/ab/abc block table"), std::string::npos);
  EXPECT_NE(d.status().message().find(part), std::string::npos) << d.status().message();
}

TEST(BlockTable, RejectsBadMagicSizeKindAndVersion) {
  const std::string good = EncodeBlockTable(SampleRecords());
  std::string bad_magic = good;
  bad_magic[7] = '2';
  ExpectBadTable(bad_magic, "not a block table");
  ExpectBadTable(good.substr(0, 15), "not a block table");
  ExpectBadTable("", "not a block table");
  ExpectBadTable(good.substr(0, good.size() - 1), "does not match its count");
  ExpectBadTable(good.substr(0, good.size() - 32), "does not match its count");
  ExpectBadTable(good + std::string(32, '\0'), "does not match its count");
  std::string big_count = good;
  big_count[15] = '\x7f';  // count = 0x7f000004
  ExpectBadTable(big_count, "does not match its count");
  for (char kind : {'\x04', '\xff'}) {
    std::string bad_kind = good;
    bad_kind[16 + 32 * 2] = kind;
    ExpectBadTable(bad_kind, "record 2 has an unknown kind");
  }
  std::string version2 = good;
  version2[8] = '\x02';
  ExpectBadTable(version2, "unsupported block table format");
}

TEST(ManifestKey, FormatsAndParsesCanonicalKeys) {
  EXPECT_EQ(VersionName(12), "v00000012");
  EXPECT_EQ(VersionName(123456789), "v123456789");
  EXPECT_EQ(ManifestKey(12, 0), "manifests/v00000012.json");
  EXPECT_EQ(ManifestKey(12, 3), "manifests/v00000012.r3.json");
  EXPECT_EQ(ParseManifestKey("manifests/v00000012.json"), std::make_pair(uint64_t{12}, 0u));
  EXPECT_EQ(ParseManifestKey("manifests/v00000012.r3.json"), std::make_pair(uint64_t{12}, 3u));
  for (uint64_t v : {uint64_t{0}, uint64_t{7}, uint64_t{99999999}, uint64_t{123456789012}}) {
    for (uint32_t r : {0u, 1u, 17u}) {
      EXPECT_EQ(ParseManifestKey(ManifestKey(v, r)), std::make_pair(v, r)) << ManifestKey(v, r);
    }
  }
}

TEST(ManifestKey, RejectsJunk) {
  for (const char* key : {"",
                          "manifests/",
                          "manifests/v.json",
                          "manifests/v12.json",
                          "manifests/v0000012.json",
                          "manifests/v000000012.json",
                          "manifests/v00000012.r0.json",
                          "manifests/v00000012.r03.json",
                          "manifests/v00000012.r4294967296.json",
                          "manifests/v00000012.r.json",
                          "manifests/v00000012.rx.json",
                          "manifests/v00000012.json.tmp",
                          "manifests/v00000012.JSON",
                          "manifests/v0000001a.json",
                          "manifests/v-0000012.json",
                          "manifests/x00000012.json",
                          "manifests/V00000012.json",
                          "blobs/v00000012.json",
                          "manifests/sub/v00000012.json",
                          "manifests/v00000012..json",
                          "manifests/v00000012.r3.r4.json",
                          "xmanifests/v00000012.json"}) {
    EXPECT_FALSE(ParseManifestKey(key).has_value()) << key;
  }
}

TEST(ManifestKey, BlobKeyIsFanOutByFirstByte) {
  Hash128 h = H(0xab12000000000000ull, 5);
  EXPECT_EQ(BlobKey(h), "blobs/ab/" + h.Hex());
}

TEST(FileName, PlainNamesOnly) {
  for (const char* ok : {"config.json", "model-00001-of-00002.safetensors", ".hidden", "a..b"}) {
    EXPECT_TRUE(IsPlainFileName(ok)) << ok;
  }
  for (const std::string& bad :
       {std::string(""), std::string("."), std::string(".."), std::string("a/b"),
        std::string("a\\b"), std::string("a\0", 2), std::string(256, 'n')}) {
    EXPECT_FALSE(IsPlainFileName(bad)) << bad;
  }
  EXPECT_TRUE(IsPlainFileName(std::string(255, 'n')));
}

TEST(Manifest, CreatedTimeIsRfc3339Utc) {
  const std::string now = NowRfc3339();
  ASSERT_EQ(now.size(), 20u) << now;
  EXPECT_EQ(now[4], '-');
  EXPECT_EQ(now[10], 'T');
  EXPECT_EQ(now[19], 'Z');
  EXPECT_GE(now.substr(0, 4), "2024");
}

TEST(Manifest, FindTensorNamesItsFileAndPosition) {
  Manifest m = Sample();
  FileEntry more;
  more.name = "model-2.safetensors";
  more.safetensors = true;
  more.tensors.push_back(Tensor("0.first", DType::kF32, {2}, 0, 0, 21));
  more.tensors.push_back(Tensor("z.last", DType::kF32, {2}, 8, 1, 22));
  m.files.push_back(more);
  for (int pass = 0; pass < 2; ++pass) {  // the first builds the index
    auto b = m.FindTensor("b.bias");
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->file, &m.files[1]);
    EXPECT_EQ(b->tensor, &m.files[1].tensors[1]);
    EXPECT_EQ(b->file_index, 1u);
    EXPECT_EQ(b->tensor_index, 1u);
    auto z = m.FindTensor("z.last");
    ASSERT_TRUE(z.has_value());
    EXPECT_EQ(z->file_index, 2u);
    EXPECT_EQ(z->tensor_index, 1u);
    EXPECT_EQ(m.FindTensor("0.first")->tensor->hash, H(21, ~uint64_t{21}));
    EXPECT_FALSE(m.FindTensor("b.bia").has_value());
    EXPECT_FALSE(m.FindTensor("config.json").has_value());  // a file, not a tensor
  }
}

TEST(Manifest, FindTensorOfACopyPointsIntoTheCopy) {
  const Manifest m = Sample();
  ASSERT_TRUE(m.FindTensor("a.weight").has_value());  // index built on m
  Manifest copy = m;
  EXPECT_EQ(copy.FindTensor("a.weight")->tensor, &copy.files[1].tensors[0]);
  Manifest assigned;
  ASSERT_FALSE(assigned.FindTensor("a.weight").has_value());
  assigned = copy;
  EXPECT_EQ(assigned.FindTensor("a.weight")->tensor, &assigned.files[1].tensors[0]);
  Manifest moved = std::move(assigned);
  EXPECT_EQ(moved.FindTensor("c.empty")->tensor, &moved.files[1].tensors[2]);
}

TEST(Manifest, FindTensorSeesTensorsRenamedOrAddedAfterTheFirstLookup) {
  Manifest m = Sample();
  ASSERT_TRUE(m.FindTensor("a.weight").has_value());
  m.files[1].tensors[0].name = "a.renamed";
  EXPECT_FALSE(m.FindTensor("a.weight").has_value());
  EXPECT_EQ(m.FindTensor("a.renamed")->tensor_index, 0u);
  m.files[1].tensors.push_back(Tensor("d.added", DType::kF32, {1}, 524300, 3, 14));
  EXPECT_EQ(m.FindTensor("d.added")->tensor_index, 3u);
}

TEST(Manifest, FindTensorFromManyThreadsAtOnce) {
  Manifest m = Sample();
  for (int i = 0; i < 200; ++i) {
    m.files[1].tensors.push_back(Tensor("t" + std::to_string(i), DType::kF32, {1}, 0, 0, i));
  }
  const Manifest& shared = m;
  std::vector<std::thread> threads;
  std::vector<int> found(8, 0);
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 200; ++i) {
        auto at = shared.FindTensor("t" + std::to_string(i));
        found[k] += at && at->tensor_index == static_cast<uint32_t>(i) + 3 ? 1 : 0;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(found, std::vector<int>(8, 200));
}

TEST(Manifest, SameTensorLayoutComparesOnlySafetensorsLayout) {
  const Manifest m = Sample();
  std::vector<FileEntry> files = m.files;
  files[1].tensors[0].hash = H(1, 1);  // content differs: still the same layout
  files[1].tensors[0].changed = 0;
  files[0].size = 12345;  // raw files do not matter
  files[0].name = "generation_config.json";
  EXPECT_TRUE(SameTensorLayout(m, files, m.block_bytes));
  EXPECT_FALSE(SameTensorLayout(m, files, m.block_bytes * 2));  // blocks cut differently
  auto differs = [&](const std::function<void(std::vector<FileEntry>&)>& edit) {
    std::vector<FileEntry> f = m.files;
    edit(f);
    return !SameTensorLayout(m, f, m.block_bytes);
  };
  EXPECT_TRUE(differs([](auto& f) { f[1].tensors[1].name = "b.other"; }));
  EXPECT_TRUE(differs([](auto& f) { f[1].tensors[1].dtype = DType::kI32; }));
  EXPECT_TRUE(differs([](auto& f) { f[1].tensors[0].shape = {65536, 4}; }));
  EXPECT_TRUE(differs([](auto& f) { f[1].tensors.pop_back(); }));
  EXPECT_TRUE(differs([](auto& f) { f[1].name = "model-00001.safetensors"; }));
  EXPECT_TRUE(differs([](auto& f) {
    FileEntry extra = f[1];
    extra.name = "z.safetensors";
    f.push_back(extra);
  }));
}

}  // namespace
}  // namespace dte
