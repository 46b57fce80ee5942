#include "store/delta_codec.h"

#include <gtest/gtest.h>
#include <zstd.h>  // only for the AReaL-DTE baseline size

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
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
  ASSERT_TRUE(DecodeSparseIndices(e.payload, 32, 2, &idx, nullptr, kWhat).ok());
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
        if (DecodeSparseIndices(bad, 4096, width, &idx, nullptr, kWhat).ok()) {
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

TEST(DeltaCodec, DecodeSparseIndicesAgreesWithDetectChanges) {
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
      ASSERT_TRUE(DecodeSparseIndices(e.payload, kBlock, width, &got, nullptr, kWhat).ok());
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
