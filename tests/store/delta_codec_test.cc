#include "store/delta_codec.h"

#include <gtest/gtest.h>
#include <zstd.h>  // only for the AReaL-DTE baseline size

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/change_detect.h"
#include "kernels/remap_math.h"

namespace dte {
namespace {

using Bytes = std::vector<uint8_t>;
constexpr size_t kBlock = 256 * 1024;
const std::string kWhat = "tensor w block 3";

Bytes RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// Changes `changes` distinct elements of `old`: by a small wrapping delta
// (mostly +-1) when small_deltas, else to random different bits.
Bytes Mutate(const Bytes& old, int width, size_t changes, bool small_deltas, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t n = old.size() / width;
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  Bytes out = old;
  for (size_t k = 0; k < changes; ++k) {
    uint8_t* e = out.data() + size_t{order[k]} * width;
    uint64_t v = 0, before;
    std::memcpy(&v, e, width);
    before = v;
    do {
      int64_t d = (rng() % 8 == 0) ? int64_t(rng() % 9) - 4 : (rng() % 2 ? 1 : -1);
      v = small_deltas ? v + static_cast<uint64_t>(d) : rng();
    } while (std::memcmp(&v, &before, width) == 0);
    std::memcpy(e, &v, width);
  }
  return out;
}

// A copy of a block with guard bytes on both sides, to catch stray writes.
class Guarded {
 public:
  explicit Guarded(const Bytes& init) : mem_(kGuard + init.size() + kGuard, kPattern) {
    std::copy(init.begin(), init.end(), mem_.begin() + kGuard);
  }
  uint8_t* data() { return mem_.data() + kGuard; }
  size_t size() const { return mem_.size() - 2 * kGuard; }
  Bytes contents() const { return Bytes(mem_.begin() + kGuard, mem_.end() - kGuard); }
  bool GuardsIntact() const {
    auto ok = [](uint8_t b) { return b == kPattern; };
    return std::all_of(mem_.begin(), mem_.begin() + kGuard, ok) &&
           std::all_of(mem_.end() - kGuard, mem_.end(), ok);
  }

 private:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kPattern = 0xA5;
  Bytes mem_;
};

Status Decode(const EncodedBlock& e, int width, Guarded* dst, uint32_t* changed = nullptr) {
  CodecScratch scratch;
  return DecodeBlock(e.kind, e.payload, width, dst->data(), dst->size(), &scratch, kWhat, changed);
}

void ExpectRoundTrip(const Bytes& old, const Bytes& now, int width) {
  CodecScratch scratch;
  EncodedBlock e = EncodeBlock(old.data(), now.data(), old.size(), width, &scratch);
  size_t n = old.size() / width;
  EXPECT_EQ(e.changed, kernels::CountChanges(old.data(), now.data(), n, width));
  Guarded dst(old);
  uint32_t changed = 0;
  ASSERT_TRUE(Decode(e, width, &dst, &changed).ok()) << BlockKindName(e.kind);
  EXPECT_TRUE(dst.GuardsIntact());
  EXPECT_TRUE(dst.contents() == now) << BlockKindName(e.kind);
  if (e.kind == BlockKind::kSparse || e.kind == BlockKind::kSame) {
    EXPECT_EQ(changed, e.changed);
  }
}

TEST(DeltaCodec, RoundTripsEveryWidthAndDensity) {
  for (int width : {1, 2, 4, 8}) {
    Bytes old = RandomBytes(kBlock, width);
    size_t n = kBlock / width;
    for (double density : {0.0, -1.0, 0.001, 0.015, 0.1, 0.5, 1.0}) {
      size_t changes = density < 0 ? 1 : static_cast<size_t>(density * n);
      for (bool small : {true, false}) {
        SCOPED_TRACE("width " + std::to_string(width) + " changes " + std::to_string(changes) +
                     (small ? " small" : " random"));
        ExpectRoundTrip(old, Mutate(old, width, changes, small, changes + width), width);
      }
    }
  }
}

TEST(DeltaCodec, SparseRoundTripWhenFewElementsChange) {
  Bytes old = RandomBytes(kBlock, 7);
  Bytes now = Mutate(old, 2, 1966, true, 8);  // 1.5% of a BF16 block
  EncodedBlock e = EncodeBlock(old.data(), now.data(), kBlock, 2, nullptr);
  EXPECT_EQ(e.kind, BlockKind::kSparse);
  EXPECT_EQ(e.changed, 1966u);
  EXPECT_LT(e.payload.size(), 1966u * 2);
  ExpectRoundTrip(old, now, 2);
}

TEST(DeltaCodec, NanPayloadsAndSignedZerosSurvive) {
  const std::vector<std::pair<uint16_t, uint16_t>> bf16 = {
      {0x0000, 0x8000}, {0x8000, 0x0000}, {0x7FC1, 0x7FC2}, {0xFFC0, 0x7FC0}, {0x7F80, 0xFF81}};
  Bytes old(64 * 2, 0), now;
  for (size_t i = 0; i < bf16.size(); ++i) std::memcpy(&old[i * 12], &bf16[i].first, 2);
  now = old;
  for (size_t i = 0; i < bf16.size(); ++i) std::memcpy(&now[i * 12], &bf16[i].second, 2);
  ExpectRoundTrip(old, now, 2);
  // F32: a quiet NaN whose payload changes, -0.0f <-> +0.0f.
  uint32_t f32_old[4] = {0x7FC00001, 0x80000000, 0x00000000, 0xFF800000};
  uint32_t f32_new[4] = {0x7FC00002, 0x00000000, 0x80000000, 0x7FC00000};
  Bytes o4(16), n4(16);
  std::memcpy(o4.data(), f32_old, 16);
  std::memcpy(n4.data(), f32_new, 16);
  ExpectRoundTrip(o4, n4, 4);
}

TEST(DeltaCodec, PartialLastBlockRoundTrips) {
  for (int width : {1, 2, 4, 8}) {
    for (size_t elements : {size_t{1}, size_t{3}, size_t{1000}, size_t{77777}}) {
      SCOPED_TRACE("width " + std::to_string(width) + " elements " + std::to_string(elements));
      Bytes old = RandomBytes(elements * width, elements);
      Bytes now = Mutate(old, width, (elements + 9) / 10, true, 5);
      std::memset(now.data() + now.size() - width, 0x5A, width);  // always touch the last
      ExpectRoundTrip(old, now, width);
    }
  }
}

TEST(DeltaCodec, ExtremeDeltasRoundTrip) {
  for (int width : {1, 2, 4, 8}) {
    Bytes old(16 * width, 0), now(16 * width, 0);
    std::memset(now.data(), 0xFF, width);                  // delta -1 from 0
    now[2 * width + width - 1] = 0x80;                     // delta = minimum signed
    std::memset(now.data() + 5 * width, 0xFF, width - 1);  // delta = 2^(w*8-8) - 1
    now[9 * width] = 2;                                    // delta +2
    std::memset(now.data() + 15 * width, 0x7F, 1);         // last element
    SCOPED_TRACE("width " + std::to_string(width));
    ExpectRoundTrip(old, now, width);
    ExpectRoundTrip(now, old, width);
  }
}

TEST(DeltaCodec, UnchangedBlockIsSameWithEmptyPayload) {
  Bytes old = RandomBytes(kBlock, 1);
  EncodedBlock e = EncodeBlock(old.data(), old.data(), kBlock, 2, nullptr);
  EXPECT_EQ(e.kind, BlockKind::kSame);
  EXPECT_TRUE(e.payload.empty());
  EXPECT_EQ(e.changed, 0u);
  ExpectRoundTrip(old, old, 2);
}

TEST(DeltaCodec, NoParentEncodesDense) {
  Bytes random = RandomBytes(kBlock, 2), zeros(kBlock, 0);
  EncodedBlock raw = EncodeBlock(nullptr, random.data(), kBlock, 2, nullptr);
  EXPECT_EQ(raw.kind, BlockKind::kDenseRaw);
  EXPECT_EQ(raw.payload.size(), kBlock);
  EncodedBlock z = EncodeBlock(nullptr, zeros.data(), kBlock, 2, nullptr);
  EXPECT_EQ(z.kind, BlockKind::kDenseZstd);
  EXPECT_LT(z.payload.size(), kBlock / 100);
  EXPECT_EQ(z.changed, kBlock / 2);
  for (const auto* e : {&raw, &z}) {
    Guarded dst(Bytes(kBlock, 0x33));
    uint32_t changed = 0;
    ASSERT_TRUE(Decode(*e, 2, &dst, &changed).ok());
    EXPECT_TRUE(dst.contents() == (e == &raw ? random : zeros));
    EXPECT_EQ(changed, kBlock / 2);
  }
}

TEST(DeltaCodec, KindFollowsSize) {
  Bytes old = RandomBytes(kBlock, 3);
  Bytes all_random = Mutate(old, 2, kBlock / 2, false, 4);
  EXPECT_EQ(EncodeBlock(old.data(), all_random.data(), kBlock, 2, nullptr).kind,
            BlockKind::kDenseRaw);
  Bytes zeros(kBlock, 0);  // every element changes, but the new block compresses
  EXPECT_EQ(EncodeBlock(old.data(), zeros.data(), kBlock, 2, nullptr).kind, BlockKind::kDenseZstd);
  Bytes zeros_with_noise = Mutate(zeros, 2, kBlock / 2 / 3, false, 6);  // sparse < raw here
  EncodedBlock cleared = EncodeBlock(zeros_with_noise.data(), zeros.data(), kBlock, 2, nullptr);
  EXPECT_EQ(cleared.kind, BlockKind::kDenseZstd);
  EXPECT_LT(cleared.payload.size(), kBlock / 100);
  Bytes all_small = Mutate(old, 2, kBlock / 2, true, 5);  // every element moves a few ULPs
  EncodedBlock e = EncodeBlock(old.data(), all_small.data(), kBlock, 2, nullptr);
  EXPECT_EQ(e.kind, BlockKind::kSparse);
  EXPECT_LT(e.payload.size(), kBlock / 4);
}

TEST(DeltaCodec, InvalidWidthEncodesDense) {
  Bytes old = RandomBytes(999, 1), now = Mutate(old, 1, 3, true, 2);
  EncodedBlock e = EncodeBlock(old.data(), now.data(), old.size(), 3, nullptr);
  EXPECT_EQ(e.kind, BlockKind::kDenseRaw);
  Guarded dst(old);
  ASSERT_TRUE(Decode(e, 3, &dst).ok());
  EXPECT_TRUE(dst.contents() == now);
  EXPECT_EQ(DecodeBlock(BlockKind::kSparse, "x", 3, dst.data(), dst.size(), nullptr, kWhat).code(),
            Code::kInvalidArgument);
}

// ---- the grammar, written out by hand (see docs/formats/delta-block.md)

std::string Varint(uint32_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s.push_back(static_cast<char>(v | 0x80));
  s.push_back(static_cast<char>(v));
  return s;
}

std::string Sparse(uint32_t count, const std::string& tokens, const std::string& bits,
                   uint8_t flags = 0, uint8_t esc_order = 0, uint8_t version = 1) {
  return std::string{static_cast<char>(version), static_cast<char>(flags)} + Varint(count) +
         static_cast<char>(esc_order) + Varint(tokens.size()) + Varint(bits.size()) + tokens + bits;
}

// Packs (value, bit count) fields, least significant bit first.
std::string Pack(std::initializer_list<std::pair<uint64_t, int>> fields) {
  std::string out;
  int used = 0;
  for (auto [value, bits] : fields) {
    for (int i = 0; i < bits; ++i, ++used) {
      if (used % 8 == 0) out.push_back(0);
      out.back() = static_cast<char>(out.back() | ((value >> i) & 1) << (used % 8));
    }
  }
  return out;
}

// 16 BF16 elements of 100; element 0 -> 99, 5 -> 101, 6 -> 107, 15 -> 98.
// Tokens (gap class << 2 | value class): step 1, -1; step 5 = class 3 with
// extra bit 1, +1; step 1, escape up (m = 5: q = 6, "00" "1" then q's low
// bits 2); step 9 = class 5 with extra bits 1, escape down (m = 0: "1").
const std::string kTokens = {0x00, 0x0D, 0x03, 0x16};
const std::string kBits = Pack({{1, 1}, {0, 2}, {1, 1}, {2, 2}, {1, 2}, {1, 1}});

TEST(DeltaCodec, PackedBitsMatchHandComputedBytes) { EXPECT_EQ(kBits, std::string({0x69, 0x01})); }

TEST(DeltaCodec, EncoderWritesTheDocumentedGrammar) {
  std::vector<uint16_t> old(16, 100), now = old;
  now[0] = 99;
  now[5] = 101;
  now[6] = 107;
  now[15] = 98;
  EncodedBlock e = EncodeBlock(reinterpret_cast<uint8_t*>(old.data()),
                               reinterpret_cast<uint8_t*>(now.data()), 32, 2, nullptr);
  ASSERT_EQ(e.kind, BlockKind::kSparse);
  EXPECT_EQ(e.payload, Sparse(4, kTokens, kBits));
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals, sets;
  ASSERT_TRUE(DecodeSparseEntries(e.payload, 32, 2, &idx, &vals, &sets, nullptr, kWhat).ok());
  EXPECT_EQ(idx, (std::vector<uint32_t>{0, 5, 6, 15}));
}

TEST(DeltaCodec, ZstdTokenSectionDecodes) {
  Bytes zeros(64, 0);  // 64 tokens "step 1, delta -1"
  EncodedBlock frame = EncodeBlock(nullptr, zeros.data(), zeros.size(), 1, nullptr);
  ASSERT_EQ(frame.kind, BlockKind::kDenseZstd);
  Guarded dst(Bytes(64 * 2, 7));
  uint32_t changed = 0;
  ASSERT_TRUE(
      Decode({BlockKind::kSparse, Sparse(64, frame.payload, "", 1), 0}, 2, &dst, &changed).ok());
  std::vector<uint16_t> got(64);
  std::memcpy(got.data(), dst.contents().data(), 128);
  EXPECT_EQ(got, std::vector<uint16_t>(64, 0x0706));
  EXPECT_EQ(changed, 64u);
  // The same frame where 65 or 63 tokens are expected.
  Guarded more(Bytes(65 * 2, 7));
  Status s = Decode({BlockKind::kSparse, Sparse(65, frame.payload, "", 1), 0}, 2, &more);
  EXPECT_EQ(s.code(), Code::kCorruption);
  EXPECT_NE(s.message().find("token section"), std::string::npos) << s.message();
  EXPECT_EQ(Decode({BlockKind::kSparse, Sparse(63, frame.payload, "", 1), 0}, 2, &more).code(),
            Code::kCorruption);
}

// Decoding `payload` as `kind` onto 16 BF16 elements fails with Corruption
// whose message names kWhat and mentions `needle`, leaving dst untouched.
void ExpectCorrupt(const std::string& payload, const std::string& needle,
                   BlockKind kind = BlockKind::kSparse, size_t len = 32) {
  Bytes init = RandomBytes(len, 11);
  Guarded dst(init);
  Status s = Decode({kind, payload, 0}, 2, &dst);
  EXPECT_EQ(s.code(), Code::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find(kWhat), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  EXPECT_TRUE(dst.GuardsIntact());
  if (kind == BlockKind::kSparse) {
    EXPECT_TRUE(dst.contents() == init);
  }
}

TEST(DeltaCodec, HandBuiltDefectsAreCorruption) {
  ExpectCorrupt(Sparse(4, kTokens, kBits, 0, 0, 2), "format version 2");
  ExpectCorrupt(Sparse(4, kTokens, kBits, 4), "unknown flags");
  ExpectCorrupt(Sparse(0, "", ""), "count 0");
  ExpectCorrupt(Sparse(17, std::string(17, 0), ""), "count 17");
  ExpectCorrupt(Sparse(0xFFFFFFFF, "", ""), "count 4294967295");
  ExpectCorrupt(Sparse(4, kTokens, kBits, 0, 15), "escape order 15");
  ExpectCorrupt(Sparse(4, kTokens.substr(0, 3), kBits), "raw token section holds 3");
  ExpectCorrupt(Sparse(4, kTokens, kBits) + '\0', "section sizes");
  ExpectCorrupt(Sparse(4, kTokens, kBits + '\0'), "after the last field");
  ExpectCorrupt(Sparse(4, kTokens, {0x69, 0x03}), "after the last field");  // padding bit set
  ExpectCorrupt(Sparse(4, kTokens, {0x69}), "escape truncated");
  ExpectCorrupt(Sparse(1, {static_cast<char>(63 << 2)}, ""), "gap class out of range");
  // Step 17 (class 7: 16 + extra 1) from index -1 lands on index 16 of 16.
  ExpectCorrupt(Sparse(1, {7 << 2}, Pack({{1, 3}})), "index beyond the block");
  // The fourth step made 10 instead of 9: index 16.
  std::string far = Pack({{1, 1}, {0, 2}, {1, 1}, {2, 2}, {2, 2}, {1, 1}});
  ExpectCorrupt(Sparse(4, kTokens, far), "index beyond the block");
}

// Escapes for 16-bit elements: with k = 14, m = (1 << 14) | low is "01", q's
// low bit 0, then low as 14 bits.
std::string Escape14(uint64_t m) { return Pack({{0, 1}, {1, 1}, {0, 1}, {m & 0x3FFF, 14}}); }

TEST(DeltaCodec, EscapeBeyondElementWidthIsCorruption) {
  Guarded ok(Bytes(2, 0));
  ASSERT_TRUE(Decode({BlockKind::kSparse, Sparse(1, {3}, Escape14(32765), 0, 14), 0}, 2, &ok).ok());
  EXPECT_TRUE(ok.contents() == Bytes({0xFF, 0x7F}));  // delta +32767
  ASSERT_TRUE(Decode({BlockKind::kSparse, Sparse(1, {2}, Escape14(32766), 0, 14), 0}, 2, &ok).ok());
  EXPECT_TRUE(ok.contents() == Bytes({0xFF, 0xFF}));                         // then -32768
  ExpectCorrupt(Sparse(1, {3}, Escape14(32766), 0, 14), "element width");    // +32768
  ExpectCorrupt(Sparse(1, {2}, Escape14(32767), 0, 14), "element width");    // -32769
  ExpectCorrupt(Sparse(1, {2}, Pack({{0, 63}, {1, 1}}), 0, 1), "too long");  // 63 zeros, k=1
  ExpectCorrupt("\x01", "header truncated");
  ExpectCorrupt(Sparse(1, {0x00}, "").substr(0, 3) + "\xFF\xFF\xFF\xFF\xFF", "header");
}

TEST(DeltaCodec, NonSparseKindDefectsAreCorruption) {
  ExpectCorrupt("x", "unchanged block carries 1", BlockKind::kSame);
  ExpectCorrupt(std::string(31, 'x'), "raw block holds 31", BlockKind::kDenseRaw);
  ExpectCorrupt("x", "unknown block kind 9", static_cast<BlockKind>(9));
  Bytes zeros(32, 0);
  EncodedBlock z = EncodeBlock(nullptr, zeros.data(), 32, 2, nullptr);
  ASSERT_EQ(z.kind, BlockKind::kDenseZstd);  // 32 zero bytes compress below 7/8
  ExpectCorrupt(z.payload + '\0', "span", BlockKind::kDenseZstd);
  ExpectCorrupt(z.payload + z.payload, "span", BlockKind::kDenseZstd);
  ExpectCorrupt(z.payload.substr(0, z.payload.size() - 1), "zstd block", BlockKind::kDenseZstd);
  ExpectCorrupt(z.payload, "declare", BlockKind::kDenseZstd, 34);
}

EncodedBlock RealisticSparse(int width, size_t len, uint64_t seed, Bytes* old) {
  *old = RandomBytes(len, seed);
  Bytes now = Mutate(*old, width, len / width / 50, true, seed + 1);
  EncodedBlock e = EncodeBlock(old->data(), now.data(), len, width, nullptr);
  EXPECT_EQ(e.kind, BlockKind::kSparse);
  return e;
}

TEST(DeltaCodec, TruncatedSparsePayloadIsCorruption) {
  Bytes old;
  EncodedBlock e = RealisticSparse(2, 8192, 21, &old);
  for (size_t cut = 0; cut < e.payload.size(); ++cut) {
    Guarded dst(old);
    Status s = Decode({BlockKind::kSparse, e.payload.substr(0, cut), 0}, 2, &dst);
    ASSERT_EQ(s.code(), Code::kCorruption) << "cut at " << cut;
    ASSERT_TRUE(dst.GuardsIntact() && dst.contents() == old) << "cut at " << cut;
  }
}

// Every single-byte corruption either fails with Corruption or decodes to a
// block of the right size; none writes outside dst, and any indices decoded
// are strictly increasing and inside the block.
TEST(DeltaCodec, FlippedBytesNeverTouchMemoryOutsideDst) {
  for (int width : {1, 2, 8}) {
    Bytes old;
    EncodedBlock e = RealisticSparse(width, 4096, 30 + width, &old);
    int corrupt = 0, total = 0;
    for (size_t pos = 0; pos < e.payload.size(); ++pos) {
      for (uint8_t mask : {0x01, 0x10, 0x80, 0xFF}) {
        std::string bad = e.payload;
        bad[pos] = static_cast<char>(bad[pos] ^ mask);
        Guarded dst(old);
        Status s = Decode({BlockKind::kSparse, bad, 0}, width, &dst);
        ASSERT_TRUE(s.ok() || s.code() == Code::kCorruption) << s.ToString();
        ASSERT_TRUE(dst.GuardsIntact()) << "byte " << pos;
        std::vector<uint32_t> idx;
        std::vector<uint8_t> vals, sets;
        if (DecodeSparseEntries(bad, 4096, width, &idx, &vals, &sets, nullptr, kWhat).ok()) {
          for (size_t i = 0; i < idx.size(); ++i) {
            ASSERT_LT(idx[i], 4096u / width);
            if (i > 0) {
              ASSERT_LT(idx[i - 1], idx[i]);
            }
          }
        }
        corrupt += !s.ok();
        ++total;
      }
    }
    EXPECT_GT(corrupt, total / 2) << "width " << width;  // most damage is detected
  }
}

TEST(DeltaCodec, DecodedIndicesAgreeWithDetectChanges) {
  for (int width : {1, 2, 4, 8}) {
    for (size_t changes : {1, 100, 3000, 20000}) {
      Bytes old = RandomBytes(kBlock, width * 7);
      Bytes now = Mutate(old, width, changes, width != 4, changes);
      EncodedBlock e = EncodeBlock(old.data(), now.data(), kBlock, width, nullptr);
      if (e.kind != BlockKind::kSparse) continue;
      size_t n = kBlock / width;
      std::vector<uint32_t> want(n), got;
      Bytes vals(kBlock);
      want.resize(
          kernels::DetectChanges(old.data(), now.data(), n, width, want.data(), vals.data()));
      std::vector<uint8_t> deltas, sets;
      ASSERT_TRUE(
          DecodeSparseEntries(e.payload, kBlock, width, &got, &deltas, &sets, nullptr, kWhat).ok());
      EXPECT_EQ(got, want) << "width " << width << " changes " << changes;
    }
  }
}

// The entries DecodeSparseEntries returns, applied in place with the
// shared per-element math (ApplyElement), turn the parent into the block:
// differences where the old value was known, whole values for set elements.
TEST(DeltaCodec, DecodedEntriesAppliedInPlaceGiveTheBlock) {
  for (int width : {1, 2, 4, 8}) {
    Bytes old = RandomBytes(kBlock, width * 11);
    Bytes now = Mutate(old, width, 500, true, 500);
    const size_t n = kBlock / width;
    std::vector<uint32_t> idx(n);
    Bytes new_vals(kBlock), old_vals(kBlock);
    idx.resize(
        kernels::DetectChanges(old.data(), now.data(), n, width, idx.data(), new_vals.data()));
    ASSERT_GT(idx.size(), 100u);
    kernels::Gather(old.data(), width, idx.data(), idx.size(), old_vals.data());
    for (bool with_sets : {false, true}) {
      std::vector<uint8_t> known(idx.size(), 1);
      if (with_sets) {
        for (size_t i = 0; i < known.size(); i += 3) known[i] = 0;  // a third are set elements
      }
      std::string payload =
          EncodeSparseEntries(idx.data(), new_vals.data(), old_vals.data(), known.data(),
                              static_cast<uint32_t>(idx.size()), width, nullptr);
      std::vector<uint32_t> got_idx;
      std::vector<uint8_t> vals, sets;
      ASSERT_TRUE(
          DecodeSparseEntries(payload, kBlock, width, &got_idx, &vals, &sets, nullptr, kWhat).ok());
      EXPECT_EQ(got_idx, idx);
      ASSERT_EQ(vals.size(), idx.size() * width);
      ASSERT_EQ(sets.size(), with_sets ? idx.size() : 0u) << "width " << width;
      Bytes patched = old;
      for (size_t i = 0; i < idx.size(); ++i) {
        const bool whole = with_sets && sets[i] != 0;
        if (with_sets) {
          EXPECT_EQ(whole, known[i] == 0) << i;
        }
        uint8_t* out = patched.data() + size_t{idx[i]} * width;
        const uint8_t* v = vals.data() + i * width;
        switch (width) {
          case 1:
            kernels::ApplyElement<1>(out, v, whole);
            break;
          case 2:
            kernels::ApplyElement<2>(out, v, whole);
            break;
          case 4:
            kernels::ApplyElement<4>(out, v, whole);
            break;
          default:
            kernels::ApplyElement<8>(out, v, whole);
            break;
        }
      }
      EXPECT_TRUE(patched == now) << "width " << width << " sets " << with_sets;
    }
  }
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals, sets;
  EXPECT_EQ(DecodeSparseEntries("\x01", kBlock, 2, &idx, &vals, &sets, nullptr, kWhat).code(),
            Code::kCorruption);
}

// ---- golden outputs: the encoders' exact bytes for fixed inputs

template <typename... Args>
std::string Cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

uint64_t SplitMix(uint64_t* state) {
  uint64_t x = *state += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Changed elements of a block of random `width`-byte elements, each element
// changing with probability 1 / every. The differences depend on `mode`:
// 0 mostly +-1, 1 random bits, 2 the extremes of the element width (both
// signs of the half range, +-2, +-3), 3 a mix of the three per element.
struct GoldenEntries {
  std::vector<uint32_t> idx;
  Bytes old_vals, new_vals;
};

GoldenEntries MakeGolden(int width, size_t elements, uint32_t every, int mode, uint64_t seed,
                         Bytes* old_block = nullptr, Bytes* new_block = nullptr) {
  const uint64_t mask = width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
  const uint64_t half = uint64_t{1} << (8 * width - 1);
  const uint64_t extremes[] = {half, half - 1, half + 1, 2, mask - 1, 3, mask - 2};
  GoldenEntries g;
  for (size_t i = 0; i < elements; ++i) {
    const uint64_t old = SplitMix(&seed) & mask;
    uint64_t now = old;
    if (SplitMix(&seed) % every == 0) {
      const uint64_t r = SplitMix(&seed);
      const int m = mode == 3 ? static_cast<int>(r % 3) : mode;
      if (m == 0) {
        const uint64_t d = r % 10 == 0 ? r / 10 % 2001 - 1000 : (r / 10 % 2 ? 1 : mask);
        now = (old + d) & mask;
      } else if (m == 1) {
        now = (r >> 8) & mask;
      } else {
        now = (old + extremes[r / 8 % 7]) & mask;
      }
    }
    if (old_block != nullptr) {
      old_block->insert(old_block->end(), reinterpret_cast<const uint8_t*>(&old),
                        reinterpret_cast<const uint8_t*>(&old) + width);
      new_block->insert(new_block->end(), reinterpret_cast<const uint8_t*>(&now),
                        reinterpret_cast<const uint8_t*>(&now) + width);
    }
    if (now == old) continue;
    g.idx.push_back(static_cast<uint32_t>(i));
    g.old_vals.insert(g.old_vals.end(), reinterpret_cast<const uint8_t*>(&old),
                      reinterpret_cast<const uint8_t*>(&old) + width);
    g.new_vals.insert(g.new_vals.end(), reinterpret_cast<const uint8_t*>(&now),
                      reinterpret_cast<const uint8_t*>(&now) + width);
  }
  return g;
}

bool TakeVarint(std::string_view* in, uint32_t* v) {
  *v = 0;
  for (int shift = 0; shift < 35 && !in->empty(); shift += 7) {
    const auto b = static_cast<uint8_t>(in->front());
    in->remove_prefix(1);
    *v |= uint32_t{b & 0x7Fu} << shift;
    if (b < 0x80) return true;
  }
  return false;
}

// "size digest" of a sparse payload rewritten with its token section raw, so
// that the pinned digests do not depend on the libzstd version. Checks that
// a zstd token section is exactly libzstd's level-1 frame of the tokens and
// that it is used exactly when it is smaller than the raw tokens.
std::string GoldenDigest(const std::string& payload) {
  std::string_view in = payload;
  uint32_t count = 0, tokens_size = 0, bits_size = 0;
  if (in.size() < 2) return "short header";
  const uint8_t version = static_cast<uint8_t>(in[0]), flags = static_cast<uint8_t>(in[1]);
  in.remove_prefix(2);
  if (!TakeVarint(&in, &count) || in.empty()) return "bad header";
  const uint8_t esc_order = static_cast<uint8_t>(in[0]);
  in.remove_prefix(1);
  if (!TakeVarint(&in, &tokens_size) || !TakeVarint(&in, &bits_size) ||
      in.size() != uint64_t{tokens_size} + bits_size) {
    return "bad header";
  }
  std::string tokens(in.substr(0, tokens_size));
  std::string frame(count > 0 ? count - 1 : 0, '\0');
  if (flags & 1) {
    std::string raw(count, '\0');
    if (ZSTD_decompress(raw.data(), raw.size(), tokens.data(), tokens.size()) != count) {
      return "bad token frame";
    }
    tokens.swap(raw);
  }
  const size_t n = ZSTD_compress(frame.data(), frame.size(), tokens.data(), tokens.size(), 1);
  if ((flags & 1) != 0 ? ZSTD_isError(n) || std::string_view(frame.data(), n) != in.substr(0, n)
                       : count > 1 && !ZSTD_isError(n)) {
    return "token section is not what zstd level 1 gives";
  }
  const std::string canonical =
      std::string{static_cast<char>(version), static_cast<char>(flags & ~1)} + Varint(count) +
      static_cast<char>(esc_order) + Varint(count) + Varint(bits_size) + tokens +
      std::string(in.substr(tokens_size));
  uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (char c : canonical) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  char out[40];
  std::snprintf(out, sizeof out, "%zu %016llx", canonical.size(),
                static_cast<unsigned long long>(h));
  return out;
}

// Pins the exact payloads of EncodeBlock and EncodeSparseEntries, so that
// encoder optimizations provably keep the format byte for byte.
TEST(DeltaCodec, EncodersReproduceGoldenPayloads) {
  std::vector<std::string> got;
  for (int width : {1, 2, 4, 8}) {
    for (int mode : {0, 1, 2}) {
      for (uint32_t every : {40u, 3000u}) {
        Bytes old, now;
        MakeGolden(width, 65536 / width, every, mode, width * 100 + mode * 10 + every, &old, &now);
        EncodedBlock e = EncodeBlock(old.data(), now.data(), old.size(), width, nullptr);
        got.push_back(Cat("block w", width, " mode ", mode, " every ", every, ": ",
                          BlockKindName(e.kind), " ", e.changed, " ", GoldenDigest(e.payload)));
      }
    }
  }
  for (int width : {1, 2, 4, 8}) {
    GoldenEntries g = MakeGolden(width, 65536 / width, 20, 3, width);
    const auto count = static_cast<uint32_t>(g.idx.size());
    std::vector<uint8_t> ones(count, 1), zeros(count, 0), mixed(count, 1);
    for (uint32_t i = 0; i < count; i += 3) mixed[i] = 0;
    struct Known {
      const char* name;
      const uint8_t* known;
      const uint8_t* old_vals;
    };
    for (const Known& k :
         {Known{"null", nullptr, g.old_vals.data()}, Known{"ones", ones.data(), g.old_vals.data()},
          Known{"mixed", mixed.data(), g.old_vals.data()}, Known{"zeros", zeros.data(), nullptr}}) {
      std::string payload = EncodeSparseEntries(g.idx.data(), g.new_vals.data(), k.old_vals,
                                                k.known, count, width, nullptr);
      got.push_back(
          Cat("entries w", width, " known ", k.name, ": ", count, " ", GoldenDigest(payload)));
    }
    // Gaps of up to 2^32 - 1 elements and a single entry.
    const std::vector<uint32_t> far = {0, 3, 1u << 20, (1u << 31) + 5, 0xFFFFFFFEu};
    const uint8_t far_known[] = {1, 0, 1, 0, 1};
    got.push_back(
        Cat("entries w", width, " far: ",
            GoldenDigest(EncodeSparseEntries(far.data(), g.new_vals.data(), g.old_vals.data(),
                                             far_known, 5, width, nullptr))));
    got.push_back(
        Cat("entries w", width, " one: ",
            GoldenDigest(EncodeSparseEntries(far.data() + 4, g.new_vals.data(), g.old_vals.data(),
                                             nullptr, 1, width, nullptr))));
  }
  // Produced by the encoder before its speed-ups (the per-byte BitWriter).
  const std::vector<std::string> want = {
      "block w1 mode 0 every 40: sparse 1675 2499 5e571be5f5679b5f",
      "block w1 mode 0 every 3000: sparse 30 69 e8593b84ed598de4",
      "block w1 mode 1 every 40: sparse 1579 3781 c8a788436d5e3194",
      "block w1 mode 1 every 3000: sparse 23 79 07675048029979c9",
      "block w1 mode 2 every 40: sparse 1560 3464 6f18071abd3f268a",
      "block w1 mode 2 every 3000: sparse 14 44 7ed8dabb74a55fcd",
      "block w2 mode 0 every 40: sparse 791 1229 ac6a6ad915cf3f27",
      "block w2 mode 0 every 3000: sparse 10 28 4531f1eb2396e9a5",
      "block w2 mode 1 every 40: sparse 810 2752 4f3acc4aecee58eb",
      "block w2 mode 1 every 3000: sparse 12 56 e0c377dbcdce9fbd",
      "block w2 mode 2 every 40: sparse 858 2696 7ba63d094d8fd7de",
      "block w2 mode 2 every 3000: sparse 13 56 b6e4126d1090affe",
      "block w4 mode 0 every 40: sparse 415 647 c4c00c652d5b4ea8",
      "block w4 mode 0 every 3000: sparse 9 26 325966cf96a57399",
      "block w4 mode 1 every 40: sparse 407 2202 dd95b51e589a9bd7",
      "block w4 mode 1 every 3000: sparse 8 56 0a46a65aa4bdeef3",
      "block w4 mode 2 every 40: sparse 404 1816 10512f3e8db03c9d",
      "block w4 mode 2 every 3000: sparse 3 21 9a0cce97a16ebf2d",
      "block w8 mode 0 every 40: sparse 197 313 52e70b56eeae1227",
      "block w8 mode 0 every 3000: sparse 6 19 d879f8d454072719",
      "block w8 mode 1 every 40: sparse 188 1779 fc28e5297053bf26",
      "block w8 mode 1 every 3000: sparse 1 16 c562fbed409a766a",
      "block w8 mode 2 every 40: sparse 211 1765 584752fc8e304cc4",
      "block w8 mode 2 every 3000: sparse 1 9 2b151b4c6d0f7c59",
      "entries w1 known null: 3201 6364 e99c2feff5725df7",
      "entries w1 known ones: 3201 6364 e99c2feff5725df7",
      "entries w1 known mixed: 3201 7481 516e139f370dbf65",
      "entries w1 known zeros: 3201 9740 6331d3f40a634d86",
      "entries w1 far: 26 ff911c4f4c28f6b9",
      "entries w1 one: 11 a407fd16ec8660aa",
      "entries w2 known null: 1616 4333 5e47e731ab99c6ad",
      "entries w2 known ones: 1616 4333 5e47e731ab99c6ad",
      "entries w2 known mixed: 1616 5071 134cc40ce1072874",
      "entries w2 known zeros: 1616 6531 76ea2661bd2eecf3",
      "entries w2 far: 31 672cba7c37b7b30a",
      "entries w2 one: 13 29bb5b01105dd407",
      "entries w4 known null: 823 3311 77b786ef683d8f27",
      "entries w4 known ones: 823 3311 77b786ef683d8f27",
      "entries w4 known mixed: 823 3877 cc23d5b013543ffa",
      "entries w4 known zeros: 823 4972 51f37db807c440be",
      "entries w4 far: 38 951517918eca6f23",
      "entries w4 one: 15 05a420be589eca18",
      "entries w8 known null: 420 2752 815450610fd6fc05",
      "entries w8 known ones: 420 2752 815450610fd6fc05",
      "entries w8 known mixed: 420 3226 57c4fc6e9f0b7d98",
      "entries w8 known zeros: 420 4223 369135662bb7ef8e",
      "entries w8 far: 39 517650775c338605",
      "entries w8 one: 11 da50a99d3a1fc607",
  };
  EXPECT_EQ(got, want);
}

// ---- size on a realistic BF16 optimizer step

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// FP32 master weights ~ N(0, 0.02) under AdamW-like steps: a persistent
// momentum direction, a per-row step scale (some rows move much more), and
// weight decay. About 1.5% of the BF16 weights change per step, most by one ULP.
struct SyntheticTraining {
  SyntheticTraining(size_t rows, size_t cols, float lr) : cols(cols), lr(lr), rng(42) {
    std::normal_distribution<float> weight(0, 0.02f), mom(0, 0.23f);
    std::lognormal_distribution<float> row(0, 0.7f);
    for (size_t i = 0; i < rows * cols; ++i) master.push_back(weight(rng));
    for (size_t i = 0; i < rows * cols; ++i) momentum.push_back(mom(rng));
    for (size_t r = 0; r < rows; ++r) row_scale.push_back(row(rng));
    bf16.resize(rows * cols);
    for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = ToBf16(master[i]);
  }
  void Step() {
    std::normal_distribution<float> noise(0, 1);
    for (size_t i = 0; i < master.size(); ++i) {
      momentum[i] = 0.9f * momentum[i] + 0.1f * noise(rng);
      master[i] -= lr * (row_scale[i / cols] * momentum[i] / 0.35f + 0.01f * master[i]);
      bf16[i] = ToBf16(master[i]);
    }
  }
  size_t cols;
  float lr;
  std::mt19937_64 rng;
  std::vector<float> master, momentum, row_scale;
  std::vector<uint16_t> bf16;
};

// int32 index + bf16 value per change, zstd level 3 over the concatenation.
size_t ArealBaselineBytes(const std::vector<uint16_t>& old, const std::vector<uint16_t>& now) {
  std::string idx, vals;
  for (size_t i = 0; i < old.size(); ++i) {
    if (old[i] == now[i]) continue;
    auto i32 = static_cast<uint32_t>(i);
    idx.append(reinterpret_cast<const char*>(&i32), 4);
    vals.append(reinterpret_cast<const char*>(&now[i]), 2);
  }
  std::string all = idx + vals, out(ZSTD_compressBound(all.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), all.data(), all.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  return n;
}

TEST(DeltaCodec, RealisticBf16StepCostsUnderOnePointSixBytesPerChange) {
  SyntheticTraining t(1024, 2048, 5e-7f);  // 4 MiB: 16 blocks
  CodecScratch scratch;
  size_t stored = 0, changed = 0, baseline = 0, steps = 5;
  for (size_t step = 0; step < steps; ++step) {
    std::vector<uint16_t> old = t.bf16;
    t.Step();
    baseline += ArealBaselineBytes(old, t.bf16);
    for (size_t off = 0; off < old.size() * 2; off += kBlock) {
      const auto* o = reinterpret_cast<const uint8_t*>(old.data()) + off;
      const auto* n = reinterpret_cast<const uint8_t*>(t.bf16.data()) + off;
      EncodedBlock e = EncodeBlock(o, n, kBlock, 2, &scratch);
      ASSERT_EQ(e.kind, BlockKind::kSparse);
      stored += e.payload.size();
      changed += e.changed;
      Bytes back(o, o + kBlock);
      ASSERT_TRUE(DecodeBlock(e.kind, e.payload, 2, back.data(), kBlock, &scratch, kWhat).ok());
      ASSERT_EQ(std::memcmp(back.data(), n, kBlock), 0);
    }
  }
  double density = double(changed) / (steps * t.bf16.size());
  double per_change = double(stored) / changed, base = double(baseline) / changed;
  std::printf("density %.2f%%: %.3f B/changed element; AReaL-DTE baseline %.3f B; %.2fx smaller\n",
              100 * density, per_change, base, base / per_change);
  EXPECT_GT(density, 0.01);
  EXPECT_LT(density, 0.02);
  EXPECT_LE(per_change, 1.6);
  EXPECT_GT(base / per_change, 3.0);
}

}  // namespace
}  // namespace dte
