// Fuzzes the delta block decoder (store/delta_codec.h) on arbitrary payloads
// and the encoder/decoder pair on fuzzer-shaped blocks.
//
// Input: a selector byte, a 3-byte little-endian size word, then bytes.
//   selector bits 0-1: element width 1, 2, 4 or 8
//   selector bit 5 clear (decode): bits 2-4 pick the kind (0-3 as is, 4-5
//     kSparse, 6 kDenseZstd, 7 an undefined kind); the bytes are the payload,
//     decoded onto a parent block.
//   selector bit 5 set (round trip): the bytes shape a new block (bit 7 set:
//     its contents; clear: 4-byte edits of the parent, a 3-byte position and
//     a value), which is encoded against the parent (bit 6 set: no parent)
//     and decoded back.
// The size word's top bit picks the block size range (set: up to kMaxBlock
// bytes; clear: up to kSmallBlock, so most inputs run fast); its other 23
// bits, modulo the range, give the element count.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "store/delta_codec.h"

namespace dte {
namespace {

constexpr size_t kMaxBlock = 256 * 1024;
constexpr size_t kSmallBlock = 4096;
constexpr char kWhat[] = "fuzz block 7 of tensor w";

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

std::vector<uint8_t> ParentBlock(size_t len) {
  std::vector<uint8_t> block(len);
  for (size_t i = 0; i < len; ++i) block[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  return block;
}

size_t DifferingElements(const uint8_t* old_data, const uint8_t* new_data, size_t len, int width,
                         std::vector<uint32_t>* changed) {
  for (size_t e = 0; e < len / width; ++e) {
    if (!std::equal(old_data + e * width, old_data + (e + 1) * width, new_data + e * width)) {
      changed->push_back(static_cast<uint32_t>(e));
    }
  }
  return changed->size();
}

// A successful sparse decode touched exactly the elements its indices name.
void CheckSparse(std::string_view payload, const std::vector<uint8_t>& parent,
                 const std::vector<uint8_t>& dst, int width, uint32_t changed,
                 CodecScratch* scratch) {
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals, sets;
  Status s = DecodeSparseEntries(payload, dst.size(), width, &idx, &vals, &sets, scratch, kWhat);
  Check(s.ok(), "indices decode when the block decodes");
  Check(idx.size() == changed, "index count equals changed count");
  Check(std::adjacent_find(idx.begin(), idx.end(), std::greater_equal<uint32_t>()) == idx.end(),
        "indices strictly increase");
  Check(idx.empty() || idx.back() < dst.size() / width, "indices lie in the block");
  std::vector<uint32_t> differ;
  DifferingElements(parent.data(), dst.data(), dst.size(), width, &differ);
  Check(std::includes(idx.begin(), idx.end(), differ.begin(), differ.end()),
        "only indexed elements change");
}

void Decode(uint8_t selector, std::string_view payload, int width, size_t len) {
  static constexpr uint8_t kKinds[] = {0, 1, 2, 3, 3, 3, 2, 0x7f};
  const auto kind = static_cast<BlockKind>(kKinds[(selector >> 2) & 7]);
  const std::vector<uint8_t> parent = ParentBlock(len);
  std::vector<uint8_t> dst = parent;
  CodecScratch scratch;
  uint32_t changed = 0;
  Status s = DecodeBlock(kind, payload, width, dst.data(), len, &scratch, kWhat, &changed);
  if (!s.ok()) {
    Check(s.code() == Code::kCorruption, "malformed payloads are Corruption");
    Check(s.message().find(kWhat) != std::string::npos, "errors name the block");
    return;
  }
  Check(changed <= len / width, "changed count fits the block");
  if (kind == BlockKind::kSame) Check(dst == parent, "kSame leaves the block alone");
  if (kind == BlockKind::kSparse) CheckSparse(payload, parent, dst, width, changed, &scratch);
}

void RoundTrip(uint8_t selector, std::string_view bytes, int width, size_t len) {
  const std::vector<uint8_t> parent = ParentBlock(len);
  std::vector<uint8_t> block = parent;
  if ((selector & 0x80) != 0) {
    for (size_t i = 0; i < len && !bytes.empty(); ++i) block[i] = bytes[i % bytes.size()];
  } else {
    for (size_t i = 0; i + 4 <= bytes.size() && len > 0; i += 4) {
      const auto b = [&](size_t k) { return static_cast<uint8_t>(bytes[i + k]); };
      block[(b(0) | b(1) << 8 | b(2) << 16) % len] = b(3);
    }
  }
  const bool has_parent = (selector & 0x40) == 0;
  CodecScratch scratch;
  EncodedBlock enc =
      EncodeBlock(has_parent ? parent.data() : nullptr, block.data(), len, width, &scratch);
  std::vector<uint32_t> differ;
  if (has_parent) {
    Check(enc.changed == DifferingElements(parent.data(), block.data(), len, width, &differ),
          "changed counts differing elements");
  } else {
    Check(enc.kind == BlockKind::kDenseRaw || enc.kind == BlockKind::kDenseZstd,
          "a block without parent is dense");
  }
  std::vector<uint8_t> dst = has_parent ? parent : std::vector<uint8_t>(len, 0xA5);
  Status s = DecodeBlock(enc.kind, enc.payload, width, dst.data(), len, &scratch, kWhat);
  Check(s.ok(), "an encoded block decodes");
  Check(dst == block, "decoding restores the block");
}

}  // namespace
}  // namespace dte

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dte;
  if (size < 4) return 0;
  const uint8_t selector = data[0];
  const int width = 1 << (selector & 3);
  const size_t word = data[1] | data[2] << 8 | data[3] << 16;
  const size_t limit = (word & 0x800000) != 0 ? kMaxBlock : kSmallBlock;
  const size_t len = (word & 0x7fffff) % (limit / width + 1) * width;
  std::string_view bytes(reinterpret_cast<const char*>(data) + 4, size - 4);
  if ((selector & 0x20) != 0) {
    RoundTrip(selector, bytes, width, len);
  } else {
    Decode(selector, bytes, width, len);
  }
  return 0;
}
