#include "store/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>

#include "tests/testutil/paths.h"

namespace dte {
namespace {

constexpr char kFile[] = "/ckpt/model-00001-of-00002.safetensors";

std::string Prefix(uint64_t n) {
  std::string p(8, '\0');
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>(n >> (8 * i));
  return p;
}

std::string Entry(std::string_view name, std::string_view dtype, std::string_view shape,
                  uint64_t begin, uint64_t end) {
  std::ostringstream s;
  s << '"' << name << "\":{\"dtype\":\"" << dtype << "\",\"shape\":" << shape
    << ",\"data_offsets\":[" << begin << ',' << end << "]}";
  return s.str();
}

// Parses `json` as the header of a file whose data section is `data` bytes.
Result<SafetensorsHeader> Parse(std::string_view json, uint64_t data) {
  return ParseSafetensorsHeader(json, 8 + json.size() + data, kFile);
}

template <typename T>
void ExpectInvalid(const Result<T>& r, std::initializer_list<std::string_view> parts,
                   std::string_view file = kFile) {
  ASSERT_FALSE(r.ok()) << "accepted; expected an error naming " << *parts.begin();
  const std::string& msg = r.status().message();
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << msg;
  EXPECT_NE(msg.find(file), std::string::npos) << msg;
  for (std::string_view part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dte_st_XXXXXX").string();
    EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string Write(const std::string& name, std::string_view bytes) const {
    std::string p = path_ + "/" + name;
    std::ofstream(p, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    return p;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Safetensors, ParsesAllFifteenDtypes) {
  const char* kNames[] = {"BOOL", "U8",  "I8",  "F8_E4M3", "F8_E5M2", "U16", "I16", "F16",
                          "BF16", "U32", "I32", "F32",     "U64",     "I64", "F64"};
  const int kWidths[] = {1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8};
  std::string json = "{";
  uint64_t pos = 0;
  for (int i = 0; i < 15; ++i) {
    if (i > 0) json += ",";
    json += Entry(std::string("t") + kNames[i], kNames[i], "[2,3]", pos, pos + 6 * kWidths[i]);
    pos += 6 * kWidths[i];
  }
  auto r = Parse(json + "}", pos);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->tensors.size(), 15u);
  EXPECT_EQ(r->data_size, pos);
  EXPECT_EQ(r->header_len, json.size() + 1);
  EXPECT_EQ(r->data_offset, 8 + json.size() + 1);
  uint64_t begin = 0;
  for (int i = 0; i < 15; ++i) {
    const TensorInfo& t = r->tensors[i];
    EXPECT_EQ(t.name, std::string("t") + kNames[i]);
    EXPECT_STREQ(DTypeName(t.dtype), kNames[i]);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(t.elements(), 6u);
    EXPECT_EQ(t.begin, begin);
    EXPECT_EQ(t.bytes(), uint64_t(6 * kWidths[i]));
    begin = t.end;
  }
}

TEST(Safetensors, AcceptsZeroElementTensors) {
  auto r = Parse("{" + Entry("a", "F32", "[0,4]", 0, 0) + "," + Entry("b", "U8", "[2]", 0, 2) +
                     "," + Entry("c", "BF16", "[3,0]", 2, 2) + "}",
                 2);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->tensors.size(), 3u);
  EXPECT_EQ(r->tensors[0].name, "a");
  EXPECT_EQ(r->tensors[0].elements(), 0u);
  EXPECT_EQ(r->tensors[1].name, "b");
  EXPECT_EQ(r->tensors[2].name, "c");
  EXPECT_EQ(r->tensors[2].begin, 2u);
  EXPECT_EQ(r->tensors[2].bytes(), 0u);
}

TEST(Safetensors, AcceptsScalarTensorAndEmptyHeader) {
  auto scalar = Parse("{" + Entry("s", "F64", "[]", 0, 8) + "}", 8);
  ASSERT_TRUE(scalar.ok()) << scalar.status().message();
  EXPECT_TRUE(scalar->tensors[0].shape.empty());
  EXPECT_EQ(scalar->tensors[0].elements(), 1u);
  auto empty = Parse("{}", 0);
  ASSERT_TRUE(empty.ok()) << empty.status().message();
  EXPECT_TRUE(empty->tensors.empty());
  EXPECT_EQ(empty->data_size, 0u);
}

TEST(Safetensors, AcceptsHeaderPaddedWithSpaces) {
  std::string json = "{" + Entry("w", "F16", "[4]", 0, 8) + "}       ";
  auto r = Parse(json, 8);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->header_len, json.size());
  EXPECT_EQ(r->tensors[0].end, 8u);
}

TEST(Safetensors, ReturnsTensorsSortedByDataOffset) {
  auto r = Parse("{" + Entry("z", "U8", "[3]", 4, 7) + "," + Entry("a", "I32", "[1]", 0, 4) + "," +
                     Entry("m", "U8", "[1]", 7, 8) + "}",
                 8);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->tensors.size(), 3u);
  EXPECT_EQ(r->tensors[0].name, "a");
  EXPECT_EQ(r->tensors[1].name, "z");
  EXPECT_EQ(r->tensors[2].name, "m");
}

TEST(Safetensors, ParsesMetadataAndIgnoresUnknownEntryKeys) {
  auto r = Parse(R"({"__metadata__":{"format":"pt","step":"7"},"w":{"extra":{"x":[1,{"y":null}]},)"
                 R"("dtype":"U8","shape":[1],"note":true,"data_offsets":[0,1]}})",
                 1);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));
  ASSERT_EQ(r->tensors.size(), 1u);
  EXPECT_EQ(r->tensors[0].name, "w");
}

TEST(Safetensors, AcceptsMultibyteUtf8Names) {
  auto r =
      Parse("{" + Entry("caf\xC3\xA9.\xE2\x82\xAC.\xF0\x9F\x98\x80", "U8", "[1]", 0, 1) + "}", 1);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->tensors[0].name, "caf\xC3\xA9.\xE2\x82\xAC.\xF0\x9F\x98\x80");
}

TEST(Safetensors, ParsesWholeFileInMemory) {
  std::string json = "{" + Entry("w", "U16", "[2]", 0, 4) + "}";
  auto r = ParseSafetensorsFile(Prefix(json.size()) + json + "abcd", kFile);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->data_offset, 8 + json.size());
  EXPECT_EQ(r->data_size, 4u);
}

TEST(Safetensors, RejectsFileShorterThanPrefix) {
  TempDir dir;
  for (std::string_view bytes : {std::string_view(""), std::string_view("\x02\0\0\0\0", 5)}) {
    std::string path = dir.Write("short.safetensors", bytes);
    ExpectInvalid(ReadSafetensorsHeader(path), {"truncated"}, path);
    ExpectInvalid(ReadSafetensorsHeaderBytes(path), {"truncated"}, path);
    ExpectInvalid(ParseSafetensorsFile(bytes, kFile), {"truncated"});
  }
}

TEST(Safetensors, RejectsHeaderLongerThanLimit) {
  TempDir dir;
  std::string path = dir.Write("big.safetensors", Prefix(kMaxSafetensorsHeader + 1) + "{}");
  ExpectInvalid(ReadSafetensorsHeader(path), {"100000001", "limit"}, path);
  ExpectInvalid(ReadSafetensorsHeaderBytes(path), {"100000001", "limit"}, path);
}

TEST(Safetensors, RejectsHeaderLongerThanFile) {
  TempDir dir;
  std::string path = dir.Write("hdr.safetensors", Prefix(64) + "{}");
  ExpectInvalid(ReadSafetensorsHeader(path), {"header length 64", "beyond the end"}, path);
  ExpectInvalid(ParseSafetensorsFile(Prefix(~0ull) + "{}", kFile), {"header length"});
}

TEST(Safetensors, RejectsTruncatedDataSection) {
  ExpectInvalid(Parse("{" + Entry("w", "F32", "[4]", 0, 16) + "}", 15),
                {"truncated", "'w'", "16", "15"});
}

TEST(Safetensors, RejectsTrailingBytesAfterData) {
  ExpectInvalid(Parse("{" + Entry("w", "F32", "[4]", 0, 16) + "}", 17), {"1 trailing bytes"});
  ExpectInvalid(Parse("{}", 3), {"3 trailing bytes"});
}

TEST(Safetensors, RejectsInvalidUtf8) {
  const std::string_view kBad[] = {
      "\x80",              // lone continuation byte
      "\xC0\xAF",          // overlong '/'
      "\xE0\x80\xAF",      // overlong, 3 bytes
      "\xF0\x80\x80\xAF",  // overlong, 4 bytes
      "\xED\xA0\x80",      // surrogate U+D800
      "\xF4\x90\x80\x80",  // U+110000
      "\xF8\x88\x80\x80",  // 5-byte form
      "\xC3",              // truncated sequence
      "\xE2\x28\xA1",      // bad continuation
  };
  for (std::string_view bad : kBad) {
    SCOPED_TRACE(testing::PrintToString(std::string(bad)));
    ExpectInvalid(Parse("{" + Entry(std::string(bad), "U8", "[1]", 0, 1) + "}", 1),
                  {"not valid UTF-8", "byte 2"});
  }
}

TEST(Safetensors, RejectsInvalidJson) {
  for (std::string_view json :
       {"", "{", "{\"a\":}", "{}x", "{\"a\":{\"dtype\":\"U8\",}}", "{\"\\ud800\":1}"}) {
    SCOPED_TRACE(json);
    ExpectInvalid(Parse(json, 0), {"not valid JSON"});
  }
}

TEST(Safetensors, RejectsJsonThatIsNotAnObject) {
  for (std::string_view json : {"[]", "\"x\"", "1", "null", "true"}) {
    ExpectInvalid(Parse(json, 0), {"not an object"});
  }
}

TEST(Safetensors, RejectsEntryThatIsNotAnObject) {
  ExpectInvalid(Parse(R"({"w":[1,2]})", 0), {"'w'", "not a JSON object"});
  ExpectInvalid(Parse(R"({"w":"F32"})", 0), {"'w'", "not a JSON object"});
}

TEST(Safetensors, RejectsEntryMissingField) {
  ExpectInvalid(Parse(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", 1), {"'w'", "'dtype'"});
  ExpectInvalid(Parse(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", 1), {"'w'", "'shape'"});
  ExpectInvalid(Parse(R"({"w":{"dtype":"U8","shape":[1]}})", 1), {"'w'", "'data_offsets'"});
}

TEST(Safetensors, RejectsFieldsOfWrongType) {
  const std::pair<std::string_view, std::string_view> kCases[] = {
      {R"({"w":{"dtype":1,"shape":[1],"data_offsets":[0,1]}})", "dtype is not a string"},
      {R"({"w":{"dtype":"U8","shape":"1","data_offsets":[0,1]}})", "shape is not an array"},
      {R"({"w":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", "not an integer"},
      {R"({"w":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", "not an integer"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":{"a":0}}})", "not an array"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,null]}})", "not an integer"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "exactly 2"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,1]}})", "exactly 2"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,1]}})", "negative"},
      {R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}})", "not an integer"},
  };
  for (const auto& [json, part] : kCases) {
    SCOPED_TRACE(json);
    ExpectInvalid(Parse(json, 1), {"tensor 'w'", part});
  }
}

TEST(Safetensors, RejectsUnknownDtype) {
  ExpectInvalid(Parse("{" + Entry("w", "F4", "[2]", 0, 1) + "}", 1), {"'w'", "unknown dtype 'F4'"});
  ExpectInvalid(Parse("{" + Entry("w", "f32", "[1]", 0, 4) + "}", 4), {"'w'", "'f32'"});
}

TEST(Safetensors, RejectsNegativeShapeDim) {
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[2,-1]", 0, 0) + "}", 0), {"'w'", "negative"});
}

TEST(Safetensors, RejectsNonIntegerShapeDim) {
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[1.5]", 0, 1) + "}", 1), {"'w'", "not an integer"});
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[2e0]", 0, 2) + "}", 2), {"'w'", "not an integer"});
}

TEST(Safetensors, RejectsShapeDimOverflowingInt64) {
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[9223372036854775808]", 0, 1) + "}", 1),
                {"'w'", "9223372036854775808", "overflows"});
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[18446744073709551616]", 0, 1) + "}", 1),
                {"'w'", "too large"});
}

TEST(Safetensors, RejectsShapeWhoseElementCountOverflows) {
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[4294967296,4294967296]", 0, 0) + "}", 0),
                {"'w'", "overflows"});
  // Fits as elements, not as bytes.
  ExpectInvalid(Parse("{" + Entry("w", "F64", "[4611686018427387904]", 0, 0) + "}", 0),
                {"'w'", "overflows"});
}

TEST(Safetensors, RejectsByteLengthNotMatchingShape) {
  ExpectInvalid(Parse("{" + Entry("w", "BF16", "[2,3]", 0, 6) + "}", 6),
                {"'w'", "hold 6 bytes", "needs 12"});
}

TEST(Safetensors, RejectsBeginAfterEnd) {
  ExpectInvalid(Parse("{" + Entry("w", "U8", "[0]", 4, 2) + "}", 4), {"'w'", "[4, 2]"});
}

TEST(Safetensors, RejectsOverlappingTensors) {
  ExpectInvalid(
      Parse("{" + Entry("a", "U8", "[4]", 0, 4) + "," + Entry("b", "U8", "[4]", 2, 6) + "}", 6),
      {"'b'", "overlaps", "'a'"});
  ExpectInvalid(
      Parse("{" + Entry("a", "U8", "[4]", 0, 4) + "," + Entry("z", "U8", "[0]", 2, 2) + "}", 4),
      {"'z'", "overlaps", "'a'"});
}

TEST(Safetensors, RejectsHoleBetweenTensors) {
  ExpectInvalid(
      Parse("{" + Entry("a", "U8", "[4]", 0, 4) + "," + Entry("b", "U8", "[2]", 6, 8) + "}", 8),
      {"hole of 2 bytes", "'b'"});
  ExpectInvalid(Parse("{" + Entry("b", "U8", "[2]", 3, 5) + "}", 5), {"hole of 3 bytes", "'b'"});
}

TEST(Safetensors, RejectsDuplicateTensorNames) {
  ExpectInvalid(
      Parse("{" + Entry("w", "U8", "[1]", 0, 1) + "," + Entry("w", "U8", "[1]", 1, 2) + "}", 2),
      {"duplicate tensor name 'w'"});
}

TEST(Safetensors, RejectsDuplicateKeyInEntry) {
  ExpectInvalid(Parse(R"({"w":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1),
                {"'w'", "duplicate key 'dtype'"});
}

TEST(Safetensors, RejectsDuplicateMetadata) {
  ExpectInvalid(Parse(R"({"__metadata__":{"a":"1"},"__metadata__":{}})", 0), {"duplicate"});
  ExpectInvalid(Parse(R"({"__metadata__":{"a":"1","a":"2"}})", 0), {"duplicate", "'a'"});
}

TEST(Safetensors, RejectsMetadataThatIsNotAStringMap) {
  for (std::string_view meta :
       {"[]", "\"pt\"", "null", "{\"a\":1}", "{\"a\":{}}", "{\"a\":null}", "{\"a\":[\"x\"]}"}) {
    SCOPED_TRACE(meta);
    ExpectInvalid(Parse("{\"__metadata__\":" + std::string(meta) + "}", 0), {"__metadata__"});
  }
}

TEST(Safetensors, ReadsHeaderFromFileAndKeepsItsBytes) {
  TempDir dir;
  std::string json = R"({"__metadata__":{"format":"pt"},)" + Entry("w", "I64", "[2]", 0, 16) + "}";
  std::string head = Prefix(json.size()) + json;
  std::string path = dir.Write("m.safetensors", head + std::string(16, '\x11'));
  std::string bytes;
  auto r = ReadSafetensorsHeader(path, &bytes);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(bytes, head);
  EXPECT_EQ(r->metadata.at("format"), "pt");
  EXPECT_EQ(r->data_size, 16u);
  auto raw = ReadSafetensorsHeaderBytes(path);
  ASSERT_TRUE(raw.ok()) << raw.status().message();
  EXPECT_EQ(*raw, head);
}

TEST(Safetensors, ReadsHeaderOfHugeSparseFileWithoutItsData) {
  TempDir dir;
  const uint64_t kData = 8ull << 30;  // 8 GiB, never written
  std::string json = "{" + Entry("w", "BF16", "[4294967296]", 0, kData) + "}";
  std::string path = dir.Write("huge.safetensors", Prefix(json.size()) + json);
  ASSERT_EQ(truncate(path.c_str(), off_t(8 + json.size() + kData)), 0);
  auto r = ReadSafetensorsHeader(path);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->tensors[0].bytes(), kData);
}

TEST(Safetensors, ReadReportsMissingFileAndDirectory) {
  TempDir dir;
  auto missing = ReadSafetensorsHeader(dir.path() + "/absent.safetensors");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_NE(missing.status().message().find("absent.safetensors"), std::string::npos);
  ExpectInvalid(ReadSafetensorsHeader(dir.path()), {"not a regular file"}, dir.path());
}

TEST(Safetensors, BuildHeaderRoundTrips) {
  std::vector<TensorInfo> tensors = {
      {"model.embed\"q\\", DType::kBF16, {3, 2}, 0, 12},
      {"z\x01\n\t", DType::kF32, {0}, 12, 12},
      {"caf\xC3\xA9", DType::kBool, {}, 12, 13},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"x\x1f", "line\r\nb\\"}};
  std::string built = BuildSafetensorsHeader(tensors, meta);
  ASSERT_EQ(built.size() % 8, 0u);
  auto r = ParseSafetensorsFile(built + std::string(13, '\0'), kFile);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->metadata, meta);
  ASSERT_EQ(r->tensors.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r->tensors[i].name, tensors[i].name);
    EXPECT_EQ(r->tensors[i].dtype, tensors[i].dtype);
    EXPECT_EQ(r->tensors[i].shape, tensors[i].shape);
    EXPECT_EQ(r->tensors[i].begin, tensors[i].begin);
    EXPECT_EQ(r->tensors[i].end, tensors[i].end);
  }
}

// Expected bytes below were produced by the Python safetensors 0.8 writer.
TEST(Safetensors, BuildHeaderMatchesPythonWriterBytes) {
  std::string two = R"({"x":{"dtype":"F64","shape":[3],"data_offsets":[0,24]},)"
                    R"("y":{"dtype":"F64","shape":[3],"data_offsets":[24,48]}}  )";
  EXPECT_EQ(
      BuildSafetensorsHeader({{"x", DType::kF64, {3}, 0, 24}, {"y", DType::kF64, {3}, 24, 48}}, {}),
      Prefix(112) + two);
  std::string esc = R"({"__metadata__":{"k":")"
                    "\x7f"
                    R"(\b\f\u001f\t\\/"},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}   )";
  EXPECT_EQ(BuildSafetensorsHeader({{"t", DType::kU8, {1}, 0, 1}}, {{"k", "\x7f\b\f\x1f\t\\/"}}),
            Prefix(esc.size()) + esc);
  EXPECT_EQ(BuildSafetensorsHeader({}, {}), Prefix(8) + "{}      ");
}

TEST(Safetensors, ParsesIndex) {
  auto r = ParseSafetensorsIndex(
      R"({"metadata":{"total_size":36},"weight_map":{"b":"model-00002-of-00002.safetensors",)"
      R"("a":"model-00001-of-00002.safetensors","c":"model-00001-of-00002.safetensors"}})",
      kFile);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->weight_map.size(), 3u);
  EXPECT_EQ(r->weight_map.at("b"), "model-00002-of-00002.safetensors");
  EXPECT_EQ(r->shards, (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}));
}

TEST(Safetensors, IndexRejectsInvalidJsonAndMissingWeightMap) {
  ExpectInvalid(ParseSafetensorsIndex("{\"weight_map\":", kFile), {"not valid JSON"});
  ExpectInvalid(ParseSafetensorsIndex("[]", kFile), {"not an object"});
  ExpectInvalid(ParseSafetensorsIndex(R"({"metadata":{}})", kFile), {"missing \"weight_map\""});
  ExpectInvalid(ParseSafetensorsIndex(R"({"weight_map":[]})", kFile), {"weight_map"});
  ExpectInvalid(ParseSafetensorsIndex(R"({"weight_map":{"w":1}})", kFile), {"'w'", "not a string"});
  ExpectInvalid(ParseSafetensorsIndex(R"({"weight_map":{"w":"a","w":"b"}})", kFile),
                {"duplicate", "'w'"});
}

TEST(Safetensors, IndexRejectsShardNamesThatAreNotPlainFileNames) {
  for (std::string_view shard : {"", "../x.safetensors", "a/b.safetensors", "a\\\\b", ".hidden",
                                 "..", "a..b", "x\\u0000y"}) {
    SCOPED_TRACE(shard);
    std::string json = R"({"weight_map":{"w":")" + std::string(shard) + "\"}}";
    ExpectInvalid(ParseSafetensorsIndex(json, kFile), {"'w'", "not a plain file name"});
  }
}

// --- Interoperability with the Python safetensors package (the reference). ---

const char* const kPython = test::ProjectPython();

// Writes each file described by the spec file argv[1], one line per item:
// "file PATH", "meta KEY VALUE", "tensor NAME DTYPE NBYTES DIM...", with
// names, keys and values hex-encoded behind an 'x'.
constexpr char kWriterScript[] = R"(import ctypes, sys
from safetensors import TensorSpec, serialize_file
def text(h):
    return bytes.fromhex(h[1:]).decode("utf-8")
jobs, keep = [], []
for line in open(sys.argv[1]):
    w = line.split()
    if w[0] == "file":
        jobs.append([w[1], {}, None])
    elif w[0] == "meta":
        jobs[-1][2] = jobs[-1][2] or {}
        jobs[-1][2][text(w[1])] = text(w[2])
    else:
        n = int(w[3])
        buf = ctypes.create_string_buffer(bytes(i % 251 for i in range(n)), max(n, 1))
        keep.append(buf)
        jobs[-1][1][text(w[1])] = TensorSpec(dtype=w[2], shape=[int(d) for d in w[4:]],
                                             data_ptr=ctypes.addressof(buf), data_len=n)
for path, tensors, metadata in jobs:
    serialize_file(tensors, path, metadata=metadata)
)";

constexpr char kReaderScript[] = R"(import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "numpy") as f:
    print("meta", sorted(f.metadata().items()))
    for k in sorted(f.keys()):
        s = f.get_slice(k)
        print(k, s.get_dtype(), s.get_shape())
    print("b", f.get_tensor("b").tolist())
)";

std::string Hex(std::string_view s) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out = "x";
  for (unsigned char c : s) out += {kDigits[c >> 4], kDigits[c & 15]};
  return out;
}

// Runs `script` with the project's Python and returns its output; a missing
// interpreter or package, or a non-zero exit, fails the test.
std::string RunPython(const TempDir& dir, const std::string& script, const std::string& arg) {
  EXPECT_EQ(access(kPython, X_OK), 0) << kPython << " is required for interop tests";
  std::string cmd =
      std::string(kPython) + " " + dir.Write("script.py", script) + " " + arg + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << cmd;
    return "";
  }
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << cmd << "\n" << out;
  return out;
}

struct PyTensor {
  std::string name;
  const char* py_dtype;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes() const {
    uint64_t n = DTypeWidth(dtype);
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct PyFile {
  std::string name;
  std::vector<PyTensor> tensors;
  std::map<std::string, std::string> metadata;  // empty: none passed
};

std::vector<PyFile> InteropFiles() {
  const char* kPy[] = {"bool",   "uint8",   "int8",    "float8_e4m3fn", "float8_e5m2",
                       "uint16", "int16",   "float16", "bfloat16",      "uint32",
                       "int32",  "float32", "uint64",  "int64",         "float64"};
  PyFile all{"dtypes.safetensors", {}, {}};
  for (int i = 0; i < 15; ++i) {
    DType d = static_cast<DType>(i);
    all.tensors.push_back({std::string("w.") + DTypeName(d), kPy[i], d, {i % 4 + 1, 3}});
  }
  PyFile meta{"meta.safetensors",
              {{"model.layers.0.mlp.up_proj.weight", "bfloat16", DType::kBF16, {8, 4}},
               {"model.layers.0.input_layernorm.weight", "float32", DType::kF32, {4}},
               {"model.embed_tokens.weight", "bfloat16", DType::kBF16, {16, 4}}},
              {{"format", "pt"}}};
  PyFile edge{"edge.safetensors",
              {{"empty", "float32", DType::kF32, {0, 4}},
               {"Empty", "uint8", DType::kU8, {3, 0}},
               {"scalar", "bfloat16", DType::kBF16, {}},
               {"q\"b\\s/\t\x01\x1b caf\xC3\xA9 \xF0\x9F\x98\x80", "uint8", DType::kU8, {5}}},
              {{"note", "a\"b\\c\n\x01\x1f\x7f caf\xC3\xA9"}}};
  PyFile empty{"empty.safetensors", {}, {{"format", "pt"}}};
  PyFile multi{"multi.safetensors",
               {{"x", "int32", DType::kI32, {2}}},
               {{"format", "pt"}, {"a", "1"}, {"b", ""}, {"zeta", "z"}, {"k\xC3\xA9", "v"}}};
  return {all, meta, edge, empty, multi};
}

void CheckPythonFile(const PyFile& f, const std::string& path) {
  SCOPED_TRACE(f.name);
  std::string bytes;
  auto r = ReadSafetensorsHeader(path, &bytes);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->metadata, f.metadata);
  ASSERT_EQ(r->tensors.size(), f.tensors.size());
  uint64_t total = 0;
  for (const PyTensor& want : f.tensors) {
    auto it = std::find_if(r->tensors.begin(), r->tensors.end(),
                           [&](const TensorInfo& t) { return t.name == want.name; });
    ASSERT_NE(it, r->tensors.end()) << want.name;
    EXPECT_EQ(it->dtype, want.dtype) << want.name;
    EXPECT_EQ(it->shape, want.shape) << want.name;
    EXPECT_EQ(it->bytes(), want.bytes()) << want.name;
    total += want.bytes();
  }
  EXPECT_EQ(r->data_size, total);
  // The Python writer orders metadata keys by hash, so only a header with at
  // most one key has a single correct byte string.
  if (f.metadata.size() <= 1) {
    EXPECT_EQ(BuildSafetensorsHeader(r->tensors, r->metadata), bytes);
  }
}

TEST(Safetensors, ParsesFilesWrittenByPythonAndBuildsIdenticalHeaders) {
  TempDir dir;
  std::vector<PyFile> files = InteropFiles();
  std::string spec;
  for (const PyFile& f : files) {
    spec += "file " + dir.path() + "/" + f.name + "\n";
    for (const auto& [k, v] : f.metadata) spec += "meta " + Hex(k) + " " + Hex(v) + "\n";
    for (const PyTensor& t : f.tensors) {
      spec += "tensor " + Hex(t.name) + " " + t.py_dtype + " " + std::to_string(t.bytes());
      for (int64_t d : t.shape) spec += " " + std::to_string(d);
      spec += "\n";
    }
  }
  RunPython(dir, kWriterScript, dir.Write("spec.txt", spec));
  for (const PyFile& f : files) CheckPythonFile(f, dir.path() + "/" + f.name);
}

TEST(Safetensors, PythonReadsBuiltHeader) {
  TempDir dir;
  std::string data;
  for (int i = 0; i < 11; ++i) data.push_back(static_cast<char>(i));
  std::string path = dir.Write("built.safetensors",
                               BuildSafetensorsHeader({{"a.weight", DType::kBF16, {2, 2}, 0, 8},
                                                       {"b", DType::kU8, {3}, 8, 11},
                                                       {"c", DType::kF32, {0}, 11, 11}},
                                                      {{"format", "pt"}}) +
                                   data);
  EXPECT_EQ(RunPython(dir, kReaderScript, path),
            "meta [('format', 'pt')]\n"
            "a.weight BF16 [2, 2]\n"
            "b U8 [3]\n"
            "c F32 [0]\n"
            "b [8, 9, 10]\n");
}

}  // namespace
}  // namespace dte
