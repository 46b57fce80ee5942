// The block-level parts of the store's reader of a version's changes
// (store/changes.h); the reader itself is exercised against a real store
// by tests/sync/push_test.cc (ChangesReadBackFromTheStore...).
#include "store/changes.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace dte {
namespace {

// The brute-force answer: element by element, byte by byte.
std::vector<uint32_t> Naive(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b,
                            int width) {
  std::vector<uint32_t> out;
  const auto w = static_cast<size_t>(width);
  for (size_t i = 0; i < a.size() / w; ++i) {
    if (std::memcmp(&a[i * w], &b[i * w], w) != 0) out.push_back(static_cast<uint32_t>(i));
  }
  return out;
}

TEST(DifferingElements, MatchesAnElementByElementCompareForEveryWidth) {
  std::mt19937 rng(7);
  for (int width : {1, 2, 4, 8}) {
    // Whole 8-byte words and a tail of elements past the last one.
    const size_t len = 4096 - static_cast<size_t>(width);
    std::vector<uint8_t> a(len), b;
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    b = a;
    // One byte changed in scattered elements, the first and last included,
    // and a change in the last byte of an element (not only its first).
    for (size_t at : {size_t{0}, size_t{5}, size_t{777}, size_t{2048}, len - 1}) b[at] ^= 0x40;
    std::vector<uint32_t> got = {99};  // appended to, not replaced
    DifferingElements(a.data(), b.data(), a.size(), width, &got);
    std::vector<uint32_t> want = {99};
    for (uint32_t i : Naive(a, b, width)) want.push_back(i);
    EXPECT_EQ(got, want) << "width " << width;
    EXPECT_GE(got.size(), 5u);
  }
}

TEST(DifferingElements, NoneForEqualBlocksAndAPartialTailIsIgnored) {
  std::vector<uint8_t> a(10, 3), b(10, 3);
  std::vector<uint32_t> got;
  DifferingElements(a.data(), b.data(), a.size(), 4, &got);
  EXPECT_TRUE(got.empty());
  b[9] = 4;  // in the 2 bytes past the last whole 4-byte element
  DifferingElements(a.data(), b.data(), a.size(), 4, &got);
  EXPECT_TRUE(got.empty());
}

TEST(DecodeRecordEntries, DecodesTheRecordWhereItLiesInItsBlob) {
  const uint32_t idx[] = {1, 6};
  const uint16_t new_vals[] = {10, 700}, old_vals[] = {7, 0};
  const uint8_t known[] = {1, 0};  // the second is a whole value
  const std::string payload =
      EncodeSparseEntries(idx, reinterpret_cast<const uint8_t*>(new_vals),
                          reinterpret_cast<const uint8_t*>(old_vals), known, 2, 2, nullptr);
  const std::string blob = "prefix" + payload + "suffix";
  BlockRecord rec;
  rec.kind = BlockKind::kSparse;
  rec.offset = 6;
  rec.length = static_cast<uint32_t>(payload.size());
  BlockEntries e;
  ASSERT_TRUE(DecodeRecordEntries(blob, rec, 16, 2, &e, nullptr, "v1 block 0").ok());
  EXPECT_EQ(e.idx, (std::vector<uint32_t>{1, 6}));
  ASSERT_EQ(e.vals.size(), 4u);
  uint16_t v[2];
  std::memcpy(v, e.vals.data(), 4);
  EXPECT_EQ(v[0], 3);  // the difference 10 - 7
  EXPECT_EQ(v[1], 700);
  EXPECT_EQ(e.whole, (std::vector<uint8_t>{0, 1}));
}

TEST(DecodeRecordEntries, ARecordOutsideItsBlobIsCorruptionNamingTheBlock) {
  const std::string blob(32, '\0');
  BlockRecord rec;
  rec.kind = BlockKind::kSparse;
  BlockEntries e;
  for (auto [offset, length] : {std::pair<uint64_t, uint32_t>{30, 3}, {33, 0}, {0, 0xffffffffu}}) {
    rec.offset = offset;
    rec.length = length;
    Status s = DecodeRecordEntries(blob, rec, 16, 2, &e, nullptr, "v3/model.safetensors block 2");
    ASSERT_FALSE(s.ok()) << offset << "+" << length;
    EXPECT_EQ(s.code(), Code::kCorruption);
    EXPECT_NE(s.message().find("v3/model.safetensors block 2"), std::string::npos);
    EXPECT_NE(s.message().find("outside its blob"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace dte
