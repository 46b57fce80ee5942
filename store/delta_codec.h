// The delta block codec: how one block of a tensor is stored at a version.
//
// A tensor's data is cut into blocks of a fixed number of bytes (the last
// one shorter); each block of each version is stored as one record of a
// BlockKind. The grammar of the payloads is documented in
// docs/formats/delta-block.md and at the top of delta_codec.cc.
//
//   kSame       no payload: the block equals the parent version's block.
//   kDenseRaw   payload is the block's bytes.
//   kDenseZstd  payload is one zstd frame of the block's bytes.
//   kSparse     payload encodes (element index, new value) for every element
//               whose bits differ from the parent's block; values are stored
//               as the wrapping integer difference from the parent element,
//               indices as gaps: one token byte per element (gap class and
//               difference class, zstd-compressed) plus a bit stream with the
//               gaps' low bits and the rare large differences.
//               Decoding applies it onto the parent block's bytes. A payload
//               may also carry "set" elements whose new value is stored
//               whole, for writers that do not know the parent's element
//               (the AdamW-inverting publisher, sync/publish/publisher.h).
//
// Thread-safety: pure functions; scratch objects are per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"

namespace dte {

inline constexpr uint32_t kDeltaFormatVersion = 1;

enum class BlockKind : uint8_t { kSame = 0, kDenseRaw = 1, kDenseZstd = 2, kSparse = 3 };

const char* BlockKindName(BlockKind kind);

struct EncodedBlock {
  BlockKind kind = BlockKind::kSame;
  std::string payload;
  uint32_t changed = 0;  // elements whose bits differ from the parent
};

// Reusable buffers so the hot path does not allocate per block. The codec
// functions accept a null scratch and then use one owned by the calling
// thread. zstd contexts are per thread inside the codec.
struct CodecScratch {
  std::vector<uint32_t> idx;
  std::vector<uint8_t> vals;
  std::string a, b;
  std::vector<uint8_t> old_vals;  // parent elements at the changed indices
  std::string frame;              // a zstd frame being built
  std::vector<uint8_t> sets;      // per entry: 1 = a set element (value stored whole)
};

// Encodes the block `new_data` (len bytes, a multiple of width) against the
// parent block `old_data` (same length). Picks the smallest of kSame (no
// change), kSparse, kDenseZstd and kDenseRaw. With old_data == nullptr
// (no parent) the result is dense. Two rules trade size for speed: kDenseZstd
// must be at least 1/8 smaller than the raw block (its decode costs far more
// than a copy), and it is not tried at all while the sparse payload is at
// most 1/8 of the block (such a payload is the common case and compressing
// the whole block would dominate the encode time).
// width must be 1, 2, 4 or 8 and len / width < 2^32; other inputs are stored
// dense (valid, but never sparse).
EncodedBlock EncodeBlock(const uint8_t* old_data, const uint8_t* new_data, size_t len, int width,
                         CodecScratch* scratch);

// The block `data` as kDenseRaw, whatever zstd would save: what
// EncodeBlock(nullptr, ...) gives for a block that does not compress.
EncodedBlock EncodeRawBlock(const uint8_t* data, size_t len, int width);

// Encodes a kSparse payload from a list of changed elements of a block,
// without the parent block: for entry i, element idx[i]
// (block-relative, strictly increasing) becomes new_vals[i] (width bytes).
// Where known == nullptr or known[i] != 0, old_vals[i] is the parent's
// element and must differ from new_vals[i]; the entry is then stored as a
// difference. Otherwise the value is stored whole (a "set" element, about
// 8 * width + 10 bits). 1 <= count <= elements of the block; width 1, 2, 4
// or 8.
// old_vals may be null when known is non-null and all its entries are 0.
std::string EncodeSparseEntries(const uint32_t* idx, const uint8_t* new_vals,
                                const uint8_t* old_vals, const uint8_t* known, uint32_t count,
                                int width, CodecScratch* scratch);

// Applies a record to dst (len bytes). For kSparse, dst must hold the parent
// block and is patched in place; for dense kinds it is overwritten; kSame is
// a no-op. Never reads or writes outside dst and payload: a malformed payload
// (bad varint, index out of range or not increasing, wrong sizes, zstd error)
// returns Corruption naming `what` (the caller's description of the block).
// `changed_out`, if not null, receives the number of elements the record sets
// (all of them for dense kinds). On error a kSame or kSparse record has not
// modified dst; a dense one may have overwritten part of it.
Status DecodeBlock(BlockKind kind, std::string_view payload, int width, uint8_t* dst, size_t len,
                   CodecScratch* scratch, const std::string& what, uint32_t* changed_out = nullptr);

// Decodes a kSparse record's entries without applying them: block-relative
// indices (increasing) into *idx_out, and for entry i, vals_out[i * width ..]
// holds its wrapping difference from the parent element, or its whole value
// where the record marks it a set element: then (*sets_out)[i] = 1.
// *sets_out is left empty when the record has no set elements. Validates
// the payload as DecodeBlock does.
Status DecodeSparseEntries(std::string_view payload, size_t len, int width,
                           std::vector<uint32_t>* idx_out, std::vector<uint8_t>* vals_out,
                           std::vector<uint8_t>* sets_out, CodecScratch* scratch,
                           const std::string& what);

}  // namespace dte
