// Delta block codec. Record payloads, format version kDeltaFormatVersion (1);
// docs/formats/delta-block.md gives the reasoning and the measurements.
//
//   kSame        := (empty)
//   kDenseRaw    := byte[len]
//   kDenseZstd   := one zstd frame declaring content size len; nothing after it
//   kSparse      := header tokens bits
//   header       := version:u8          == kDeltaFormatVersion
//                   flags:u8            bit 0 set: tokens are a zstd frame; bit 1 set: set
//                                       tokens may occur; bits 2-7 zero
//                   count:varint32      changed elements, 1 <= count <= len / width
//                   esc_order:u8        exp-Golomb order k of escapes, k <= 8 * width - 2
//                   tokens_size:varint32
//                   bits_size:varint32  header + tokens_size + bits_size == payload size
//   tokens       := byte[tokens_size]   the count tokens, stored raw (tokens_size == count)
//                                       or as one zstd frame declaring content size count
//   token        := gap_class << 2 | value_class     one per changed element, in index order
//                 | 0xFC                only with flags bit 1: a set element
//   bits         := byte[bits_size]     per changed element in order: gap_extra, then escape
//                                       if value_class >= 2; for a set element set_fields
//                                       instead; least significant bit first,
//                                       zero-padded to a byte boundary, no further bytes
//   set_fields   := gap_class:6 bits, gap_extra, value:(8 * width) bits, the new element
//   step         := index - previous index, >= 1 (the first element's previous index is -1)
//   gap_class    := 0 if step == 1; else 2 * e - 1 + b, where e = floor(log2(step)) and
//                   b is bit e - 1 of step; gap_class <= 62
//   gap_extra    := the low e - 1 bits of step (nothing for gap_class 0)
//   delta        := new - old element bits as a wrapping signed (8 * width)-bit integer, != 0
//   value_class  := 0: delta == -1;  1: delta == +1;  2: delta <= -2;  3: delta >= +2
//   escape       := exp-Golomb code of order k of m = |delta| - 2: with q = (m >> k) + 1 and
//                   L = floor(log2(q)), L zero bits, a one bit, the low L bits of q, then
//                   the low k bits of m
//   varint32     := little-endian base-128, 7 bits a byte, high bit = more; at most 5 bytes
//
// An n-bit field in `bits` stores its value least significant bit first.

#include "store/delta_codec.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include "kernels/change_detect.h"
#include "kernels/width.h"
#include "store/internal/bit_io.h"

namespace dte {
namespace {

using internal::BitReader;
using internal::BitWriter;
using internal::GetByte;
using internal::GetVarint32;
using internal::PutVarint32;

constexpr uint8_t kFlagTokensZstd = 1;
constexpr uint8_t kFlagSets = 2;
constexpr uint8_t kSetToken = 0xFC;  // above every gap_class << 2 | value_class
constexpr int kMaxGapClass = 62;
constexpr int kZstdLevel = 1;  // higher levels gain nothing on tokens and little on blocks
constexpr size_t kMaxSparseHeader = 2 + 5 + 1 + 5 + 5;

// zstd contexts are reused by every call on a thread.
struct ZstdContexts {
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> cctx{ZSTD_createCCtx(), ZSTD_freeCCtx};
  std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> dctx{ZSTD_createDCtx(), ZSTD_freeDCtx};
};

ZstdContexts& ThreadZstd() {
  thread_local ZstdContexts contexts;
  return contexts;
}

CodecScratch& ScratchOrThread(CodecScratch* scratch) {
  thread_local CodecScratch own;
  return scratch != nullptr ? *scratch : own;
}

// Concatenates strings and numbers, for error messages.
template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  auto append = [&out](const auto& a) {
    if constexpr (std::is_arithmetic_v<std::decay_t<decltype(a)>>) {
      out += std::to_string(a);
    } else {
      out += a;
    }
  };
  (append(args), ...);
  return out;
}

int BitWidth(uint64_t v) { return static_cast<int>(std::bit_width(v)); }

bool ValidWidth(int width) { return width == 1 || width == 2 || width == 4 || width == 8; }

// Calls f(T{}) with T the unsigned integer type of `width` bytes.
template <typename F>
decltype(auto) WithElementType(int width, F&& f) {
  return kernels::DispatchWidth(
      width, [&](auto w) { return f(typename kernels::ElementBits<w.value>::type{}); });
}

// ---------------------------------------------------------------- encoding

// |delta| for a delta of the signed type matching T.
template <typename T>
uint64_t Magnitude(T delta) {
  auto s = static_cast<std::make_signed_t<T>>(delta);
  return s < 0 ? uint64_t{0} - static_cast<uint64_t>(static_cast<int64_t>(s))
               : static_cast<uint64_t>(s);
}

template <typename T>
int ValueClass(T delta) {
  auto s = static_cast<std::make_signed_t<T>>(delta);
  if (s == -1) return 0;
  if (s == 1) return 1;
  return s < 0 ? 2 : 3;
}

// Element i of an array of T at p, which need not be aligned for T.
template <typename T>
T Load(const uint8_t* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

// True where a delta needs an escape (value class 2 or 3): it is not +-1.
template <typename T>
bool NeedsEscape(T delta) {
  return static_cast<T>(delta + 1) > 2;
}

// The exp-Golomb order that (nearly) minimizes the escapes' total size, for
// the entries BuildStreams takes.
template <typename T, bool kSets>
int ChooseEscapeOrder(const uint8_t* nv, const uint8_t* ov, const uint8_t* known, size_t count) {
  size_t by_length[65] = {};  // escapes by bit length of |delta| - 2
  int max_length = -1;
  for (size_t i = 0; i < count; ++i) {
    if (kSets && !known[i]) continue;
    // Without a branch: whether an entry has an escape is unpredictable.
    const T delta = static_cast<T>(Load<T>(nv, i) - Load<T>(ov, i));
    const bool escaped = NeedsEscape(delta);
    const int length = escaped ? BitWidth(Magnitude(delta) - 2) : 0;
    by_length[length] += escaped;
    max_length = std::max(max_length, escaped ? length : -1);
  }
  // Orders above max_length cost one more bit per escape than max_length
  // itself, so they never win; nor do lengths without escapes add anything.
  constexpr int kMaxOrder = 8 * sizeof(T) - 2;
  int best = 0;
  uint64_t best_bits = std::numeric_limits<uint64_t>::max();
  for (int k = 0; k <= std::min(kMaxOrder, max_length); ++k) {
    uint64_t bits = 0;
    for (int len = 0; len <= max_length; ++len) {
      bits += by_length[len] * static_cast<uint64_t>(k + 1 + 2 * std::max(len - k, 0));
    }
    if (bits < best_bits) {
      best = k;
      best_bits = bits;
    }
  }
  return best;
}

// The gap_class of a step; *extra receives the number of its gap_extra
// bits. Without a branch for step 1: there e is 0, there are no extra bits,
// b reads as 1 and 2 * e - 1 + b is 0.
inline uint8_t GapClassOf(uint32_t step, int* extra) {
  const int e = BitWidth(step) - 1;
  *extra = std::max(e - 1, 0);
  return static_cast<uint8_t>(2 * e - 1 + ((step >> *extra) & 1));
}

// Puts the step's gap_extra; returns its gap_class.
inline uint8_t PutStep(uint32_t step, BitWriter* bits) {
  int extra = 0;
  const uint8_t gap_class = GapClassOf(step, &extra);
  bits->Put(step & ((uint32_t{1} << extra) - 1), extra);
  return gap_class;
}

struct EscapeField {
  uint64_t value;
  int bits;
};

// The escape of m at order k as one field, for elements of up to 32 bits:
// there m < 2^(8 * sizeof(T) - 1), so l <= 8 * sizeof(T) - 1 - k and the
// escape has 2 * l + 1 + k <= 63 bits. Returning the field rather than
// putting it lets the compiler keep the writer in registers in the loop.
inline EscapeField Escape(uint64_t m, int k) {
  const uint64_t q = (m >> k) + 1;
  const int l = BitWidth(q) - 1;
  const uint64_t q_low = q ^ (uint64_t{1} << l);
  const uint64_t m_low = m & ((uint64_t{1} << k) - 1);
  return {((2 * q_low + 1) << l) | (m_low << (2 * l + 1)), 2 * l + 1 + k};
}

// The same for escapes of any length, put field by field.
void PutEscape(uint64_t m, int k, BitWriter* bits) {
  const uint64_t q = (m >> k) + 1;
  const int l = BitWidth(q) - 1;
  bits->Put(0, l);
  bits->Put(((q ^ (uint64_t{1} << l)) << 1) | 1, l + 1);
  bits->Put(m & ((uint64_t{1} << k) - 1), k);
}

// Writes the tokens into scratch->a and the bit stream into scratch->b;
// returns the escape order. Entry i sets element idx[i] to new value i of
// nv; with kSets, entries with known[i] == 0 are set elements, and only the
// others' old values (ov) are read.
template <typename T, bool kSets>
int BuildStreams(const uint32_t* idx, const uint8_t* nv, const uint8_t* ov, const uint8_t* known,
                 size_t count, CodecScratch* s) {
  constexpr int kBits = 8 * sizeof(T);
  const int k = ChooseEscapeOrder<T, kSets>(nv, ov, known, count);
  s->a.resize(count);
  char* tokens = s->a.data();
  // An entry takes at most 30 gap bits plus an escape of at most
  // 2 * kBits - 1 bits, or a set element's 6 + 30 + kBits.
  BitWriter bits(&s->b, count * (32 + 2 * kBits));
  uint32_t next = 0;  // smallest index the next element may have
  for (size_t i = 0; i < count; ++i) {
    const uint32_t step = idx[i] - next + 1;
    next = idx[i] + 1;
    if (kSets && !known[i]) {
      int extra = 0;
      bits.Put(GapClassOf(step, &extra), 6);
      bits.Put(step & ((uint32_t{1} << extra) - 1), extra);
      bits.Put(Load<T>(nv, i), kBits);
      tokens[i] = static_cast<char>(kSetToken);
      continue;
    }
    const uint8_t gap_class = PutStep(step, &bits);
    const T delta = static_cast<T>(Load<T>(nv, i) - Load<T>(ov, i));
    if (NeedsEscape(delta)) {
      if constexpr (sizeof(T) <= 4) {
        const EscapeField escape = Escape(Magnitude(delta) - 2, k);
        bits.Put(escape.value, escape.bits);
      } else {
        PutEscape(Magnitude(delta) - 2, k, &bits);
      }
    }
    tokens[i] = static_cast<char>(gap_class << 2 | ValueClass(delta));
  }
  bits.Finish();
  return k;
}

// Compresses src into out if the frame is at most max_size bytes.
bool CompressAtMost(std::string_view src, size_t max_size, std::string* out) {
  ZSTD_CCtx* cctx = ThreadZstd().cctx.get();
  if (cctx == nullptr || max_size == 0) return false;
  out->resize(max_size);
  size_t n = ZSTD_compressCCtx(cctx, out->data(), max_size, src.data(), src.size(), kZstdLevel);
  if (ZSTD_isError(n)) return false;
  out->resize(n);
  return true;
}

std::string AssembleSparse(uint32_t count, int esc_order, bool sets, CodecScratch* s) {
  bool zstd = CompressAtMost(s->a, count - 1, &s->frame);
  const std::string& tokens = zstd ? s->frame : s->a;
  std::string out;
  out.reserve(kMaxSparseHeader + tokens.size() + s->b.size());
  out.push_back(static_cast<char>(kDeltaFormatVersion));
  out.push_back(static_cast<char>((zstd ? kFlagTokensZstd : 0) | (sets ? kFlagSets : 0)));
  PutVarint32(&out, count);
  out.push_back(static_cast<char>(esc_order));
  PutVarint32(&out, static_cast<uint32_t>(tokens.size()));
  PutVarint32(&out, static_cast<uint32_t>(s->b.size()));
  out += tokens;
  out += s->b;
  return out;
}

// kDenseZstd if its frame fits in max_zstd bytes, else kDenseRaw.
EncodedBlock EncodeDense(const uint8_t* data, size_t len, size_t max_zstd, uint32_t changed,
                         CodecScratch* s) {
  std::string_view block(reinterpret_cast<const char*>(data), len);
  if (CompressAtMost(block, max_zstd, &s->frame)) {
    return {BlockKind::kDenseZstd, s->frame, changed};
  }
  return {BlockKind::kDenseRaw, std::string(block), changed};
}

// ---------------------------------------------------------------- decoding

Status SparseCorruption(const std::string& what, const std::string& detail) {
  return Corruption(what + ": corrupt sparse delta: " + detail);
}

struct SparseHeader {
  uint8_t version = 0, flags = 0, esc_order = 0;
  uint32_t count = 0, tokens_size = 0, bits_size = 0;
  std::string_view tokens, bits;  // the sections
};

Status CheckSparseHeader(const SparseHeader& h, size_t elements, int width, size_t rest,
                         const std::string& what) {
  if (h.version != kDeltaFormatVersion) {
    return SparseCorruption(
        what, Cat("format version ", h.version, " is not the supported ", kDeltaFormatVersion));
  }
  if ((h.flags & ~(kFlagTokensZstd | kFlagSets)) != 0) {
    return SparseCorruption(what, Cat("unknown flags ", h.flags));
  }
  if (h.count == 0 || h.count > elements) {
    return SparseCorruption(what, Cat("count ", h.count, " not in [1, ", elements, "]"));
  }
  if (h.esc_order > 8 * width - 2) {
    return SparseCorruption(
        what, Cat("escape order ", h.esc_order, " too large for ", width, "-byte elements"));
  }
  if (uint64_t{h.tokens_size} + h.bits_size != rest) {
    return SparseCorruption(what, Cat("section sizes ", h.tokens_size, " + ", h.bits_size,
                                      " do not match the ", rest, " bytes after the header"));
  }
  if (!(h.flags & kFlagTokensZstd) && h.tokens_size != h.count) {
    return SparseCorruption(
        what, Cat("raw token section holds ", h.tokens_size, " bytes for ", h.count, " elements"));
  }
  return Status::Ok();
}

Status ParseSparseHeader(std::string_view in, size_t elements, int width, const std::string& what,
                         SparseHeader* h) {
  if (!GetByte(&in, &h->version) || !GetByte(&in, &h->flags) || !GetVarint32(&in, &h->count) ||
      !GetByte(&in, &h->esc_order) || !GetVarint32(&in, &h->tokens_size) ||
      !GetVarint32(&in, &h->bits_size)) {
    return SparseCorruption(what, "header truncated or malformed");
  }
  RETURN_IF_ERROR(CheckSparseHeader(*h, elements, width, in.size(), what));
  h->tokens = in.substr(0, h->tokens_size);
  h->bits = in.substr(h->tokens_size);
  return Status::Ok();
}

// Decompresses exactly one frame that must produce exactly `size` bytes.
Status DecompressExact(std::string_view frame, uint8_t* dst, size_t size, const char* section,
                       const std::string& what) {
  auto fail = [&](const std::string& detail) {
    return Corruption(what + ": corrupt zstd " + section + ": " + detail);
  };
  unsigned long long declared = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (declared != size) {
    return fail(Cat("frame does not declare the expected ", size, " bytes"));
  }
  size_t frame_size = ZSTD_findFrameCompressedSize(frame.data(), frame.size());
  if (ZSTD_isError(frame_size) || frame_size != frame.size()) {
    return fail("frame does not span the section exactly");
  }
  ZSTD_DCtx* dctx = ThreadZstd().dctx.get();
  if (dctx == nullptr) return Internal(what + ": cannot allocate a zstd context");
  size_t n = ZSTD_decompressDCtx(dctx, dst, size, frame.data(), frame.size());
  if (ZSTD_isError(n)) return fail(ZSTD_getErrorName(n));
  if (n != size) return fail(Cat("decoded ", n, " of ", size));
  return Status::Ok();
}

// Reads the step of one element; nullptr on success, else what is wrong.
inline const char* ReadStep(int gap_class, BitReader* bits, uint64_t* step) {
  if (gap_class == 0) {
    *step = 1;
    return nullptr;
  }
  if (gap_class > kMaxGapClass) return "gap class out of range";
  int e = (gap_class + 1) >> 1;
  uint64_t low = 0;
  if (!bits->Read(e - 1, &low)) return "bit stream ends inside a gap";
  *step = ((uint64_t{2} | ((gap_class + 1) & 1)) << (e - 1)) | low;
  return nullptr;
}

template <typename T>
const char* ReadDelta(int value_class, int k, BitReader* bits, T* delta) {
  if (value_class < 2) {
    *delta = value_class == 0 ? static_cast<T>(~T{0}) : T{1};
    return nullptr;
  }
  int l = 0;
  uint64_t q_low = 0, m_low = 0;
  if (!bits->ReadZeroRun(63 - k, &l) || !bits->Read(l, &q_low) || !bits->Read(k, &m_low)) {
    return "escape truncated or too long";
  }
  uint64_t m = (((uint64_t{1} << l) | q_low) - 1) << k | m_low;
  constexpr uint64_t kHalf = uint64_t{1} << (8 * sizeof(T) - 1);
  uint64_t max_magnitude = value_class == 2 ? kHalf : kHalf - 1;
  if (m > max_magnitude - 2) return "escape larger than the element width allows";
  *delta = value_class == 2 ? static_cast<T>(uint64_t{0} - (m + 2)) : static_cast<T>(m + 2);
  return nullptr;
}

// Reads a set element's fields (set_fields) into *step and *value.
template <typename T>
const char* ReadSet(BitReader* bits, uint64_t* step, T* value) {
  uint64_t gap_class = 0, v = 0;
  if (!bits->Read(6, &gap_class)) return "bit stream ends inside a set element";
  const char* error = ReadStep(static_cast<int>(gap_class), bits, step);
  if (error != nullptr) return error;
  if (!bits->Read(8 * static_cast<int>(sizeof(T)), &v)) return "bit stream ends inside a value";
  *value = static_cast<T>(v);
  return nullptr;
}

// Decodes indices into idx (count entries) and wrapping deltas into deltas;
// with kSets (flags bit 1), set elements store their value in deltas and get
// sets[i] = 1. The common entry (a gap of at most 30 low bits and a one-unit
// difference) is read inline; everything else, and every defect, goes
// through the checked readers.
template <typename T, bool kSets>
Status DecodeEntries(const SparseHeader& h, const uint8_t* tokens, size_t elements, uint32_t* idx,
                     T* deltas, uint8_t* sets, const std::string& what) {
  BitReader bits(reinterpret_cast<const uint8_t*>(h.bits.data()), h.bits.size());
  uint64_t next = 0;  // smallest index the next element may have
  for (uint32_t i = 0; i < h.count; ++i) {
    const uint8_t token = tokens[i];
    const bool set = kSets && token == kSetToken;
    const int gap_class = token >> 2;
    uint64_t step = 1;
    const char* error = nullptr;
    if (set) {
      error = ReadSet<T>(&bits, &step, &deltas[i]);
    } else if (gap_class != 0) {
      if (gap_class <= kMaxGapClass && bits.Ensure(30)) {
        const int low_bits = ((gap_class + 1) >> 1) - 1;  // <= 30
        step = ((uint64_t{2} | ((gap_class + 1) & 1)) << low_bits) | bits.Take(low_bits);
      } else {
        error = ReadStep(gap_class, &bits, &step);
      }
    }
    if (error == nullptr && next + step - 1 >= elements) error = "index beyond the block";
    if (error == nullptr && !set) {
      const int value_class = token & 3;
      if (value_class < 2) {
        deltas[i] = value_class == 0 ? static_cast<T>(~T{0}) : T{1};
      } else {
        error = ReadDelta(value_class, h.esc_order, &bits, &deltas[i]);
      }
    }
    if constexpr (kSets) sets[i] = set;
    if (error != nullptr) {
      return SparseCorruption(what, Cat(error, " at changed element ", i, " of ", h.count,
                                        " (block of ", elements, ")"));
    }
    idx[i] = static_cast<uint32_t>(next + step - 1);
    next += step;
  }
  if (!bits.AtCleanEnd()) return SparseCorruption(what, "bytes or set bits after the last field");
  return Status::Ok();
}

// Validates a kSparse payload and decodes it into *idx and scratch->vals.
Status DecodeSparse(std::string_view payload, size_t len, int width, std::vector<uint32_t>* idx,
                    CodecScratch* s, const std::string& what, uint32_t* count) {
  if (!ValidWidth(width) || len % width != 0 || len / width > UINT32_MAX) {
    return InvalidArgument(Cat(what, ": a sparse delta needs width 1, 2, 4 or 8 dividing len ", len,
                               " (width ", width, ")"));
  }
  size_t elements = len / width;
  SparseHeader h;
  RETURN_IF_ERROR(ParseSparseHeader(payload, elements, width, what, &h));
  const uint8_t* tokens = reinterpret_cast<const uint8_t*>(h.tokens.data());
  if (h.flags & kFlagTokensZstd) {
    s->a.resize(h.count);
    auto* out = reinterpret_cast<uint8_t*>(s->a.data());
    RETURN_IF_ERROR(DecompressExact(h.tokens, out, h.count, "token section", what));
    tokens = out;
  }
  idx->resize(h.count);
  s->vals.resize(size_t{h.count} * width);
  *count = h.count;
  if (h.flags & kFlagSets) {
    s->sets.assign(h.count, 0);
  } else {
    s->sets.clear();
  }
  uint8_t* sets = s->sets.empty() ? nullptr : s->sets.data();
  return WithElementType(width, [&](auto tag) {
    using T = decltype(tag);
    auto* deltas = reinterpret_cast<T*>(s->vals.data());
    return sets != nullptr
               ? DecodeEntries<T, true>(h, tokens, elements, idx->data(), deltas, sets, what)
               : DecodeEntries<T, false>(h, tokens, elements, idx->data(), deltas, nullptr, what);
  });
}

// dst[idx[i]] += deltas[i] (wrapping), or = for set elements, through the
// change-detect kernels.
void ApplyDeltas(uint8_t* dst, int width, uint32_t count, CodecScratch* s) {
  s->old_vals.resize(size_t{count} * width);
  kernels::Gather(dst, width, s->idx.data(), count, s->old_vals.data());
  const uint8_t* sets = s->sets.size() == count ? s->sets.data() : nullptr;
  WithElementType(width, [&](auto tag) {
    using T = decltype(tag);
    auto* vals = reinterpret_cast<T*>(s->old_vals.data());
    const auto* deltas = reinterpret_cast<const T*>(s->vals.data());
    if (sets == nullptr) {
      for (uint32_t i = 0; i < count; ++i) vals[i] = static_cast<T>(vals[i] + deltas[i]);
      return;
    }
    for (uint32_t i = 0; i < count; ++i) {
      vals[i] = sets[i] ? deltas[i] : static_cast<T>(vals[i] + deltas[i]);
    }
  });
  kernels::Scatter(dst, width, s->idx.data(), s->old_vals.data(), count);
}

Status DecodeDense(BlockKind kind, std::string_view payload, uint8_t* dst, size_t len,
                   const std::string& what) {
  if (kind == BlockKind::kDenseZstd) return DecompressExact(payload, dst, len, "block", what);
  if (payload.size() != len) {
    return Corruption(Cat(what, ": raw block holds ", payload.size(), " bytes, expected ", len));
  }
  if (len > 0) std::memcpy(dst, payload.data(), len);
  return Status::Ok();
}

}  // namespace

const char* BlockKindName(BlockKind kind) {
  switch (kind) {
    case BlockKind::kSame:
      return "same";
    case BlockKind::kDenseRaw:
      return "dense-raw";
    case BlockKind::kDenseZstd:
      return "dense-zstd";
    case BlockKind::kSparse:
      return "sparse";
  }
  return "unknown";
}

EncodedBlock EncodeRawBlock(const uint8_t* data, size_t len, int width) {
  const bool valid = ValidWidth(width) && len % width == 0;
  const size_t elements = valid ? len / width : len;
  return {BlockKind::kDenseRaw, std::string(reinterpret_cast<const char*>(data), len),
          static_cast<uint32_t>(std::min<size_t>(elements, UINT32_MAX))};
}

EncodedBlock EncodeBlock(const uint8_t* old_data, const uint8_t* new_data, size_t len, int width,
                         CodecScratch* scratch) {
  CodecScratch& s = ScratchOrThread(scratch);
  bool valid = ValidWidth(width) && len % width == 0 && len / width <= UINT32_MAX;
  size_t elements = valid ? len / width : len;
  size_t dense_margin = len - len / 8;
  if (old_data == nullptr || !valid) {
    auto all = static_cast<uint32_t>(std::min<size_t>(elements, UINT32_MAX));
    return EncodeDense(new_data, len, dense_margin, all, &s);
  }
  s.idx.resize(elements);
  s.vals.resize(len);
  auto count = static_cast<uint32_t>(
      kernels::DetectChanges(old_data, new_data, elements, width, s.idx.data(), s.vals.data()));
  if (count == 0) return {BlockKind::kSame, std::string(), 0};
  s.old_vals.resize(size_t{count} * width);
  kernels::Gather(old_data, width, s.idx.data(), count, s.old_vals.data());
  int esc_order = WithElementType(width, [&](auto tag) {
    return BuildStreams<decltype(tag), false>(s.idx.data(), s.vals.data(), s.old_vals.data(),
                                              nullptr, count, &s);
  });
  std::string sparse = AssembleSparse(count, esc_order, false, &s);
  if (sparse.size() <= len / 8) return {BlockKind::kSparse, std::move(sparse), count};
  EncodedBlock dense =
      EncodeDense(new_data, len, std::min(dense_margin, sparse.size() - 1), count, &s);
  if (dense.kind == BlockKind::kDenseRaw && sparse.size() < len) {
    return {BlockKind::kSparse, std::move(sparse), count};
  }
  return dense;
}

std::string EncodeSparseEntries(const uint32_t* idx, const uint8_t* new_vals,
                                const uint8_t* old_vals, const uint8_t* known, uint32_t count,
                                int width, CodecScratch* scratch) {
  CodecScratch& s = ScratchOrThread(scratch);
  const bool any_set = known != nullptr && std::find(known, known + count, 0) != known + count;
  int esc_order = WithElementType(width, [&](auto tag) {
    using T = decltype(tag);
    return any_set ? BuildStreams<T, true>(idx, new_vals, old_vals, known, count, &s)
                   : BuildStreams<T, false>(idx, new_vals, old_vals, nullptr, count, &s);
  });
  return AssembleSparse(count, esc_order, any_set, &s);
}

Status DecodeBlock(BlockKind kind, std::string_view payload, int width, uint8_t* dst, size_t len,
                   CodecScratch* scratch, const std::string& what, uint32_t* changed_out) {
  if (dst == nullptr && len > 0) return InvalidArgument(what + ": null destination");
  uint32_t changed = 0;
  switch (kind) {
    case BlockKind::kSame:
      if (!payload.empty()) {
        return Corruption(
            Cat(what, ": unchanged block carries ", payload.size(), " payload bytes"));
      }
      break;
    case BlockKind::kDenseRaw:
    case BlockKind::kDenseZstd:
      RETURN_IF_ERROR(DecodeDense(kind, payload, dst, len, what));
      changed = static_cast<uint32_t>(ValidWidth(width) ? len / width : len);
      break;
    case BlockKind::kSparse: {
      CodecScratch& s = ScratchOrThread(scratch);
      RETURN_IF_ERROR(DecodeSparse(payload, len, width, &s.idx, &s, what, &changed));
      ApplyDeltas(dst, width, changed, &s);
      break;
    }
    default:
      return Corruption(Cat(what, ": unknown block kind ", static_cast<int>(kind)));
  }
  if (changed_out != nullptr) *changed_out = changed;
  return Status::Ok();
}

Status DecodeSparseEntries(std::string_view payload, size_t len, int width,
                           std::vector<uint32_t>* idx_out, std::vector<uint8_t>* vals_out,
                           std::vector<uint8_t>* sets_out, CodecScratch* scratch,
                           const std::string& what) {
  CodecScratch& s = ScratchOrThread(scratch);
  uint32_t count = 0;
  RETURN_IF_ERROR(DecodeSparse(payload, len, width, idx_out, &s, what, &count));
  vals_out->swap(s.vals);
  sets_out->swap(s.sets);
  if (!sets_out->empty() &&
      std::find(sets_out->begin(), sets_out->end(), uint8_t{1}) == sets_out->end()) {
    sets_out->clear();
  }
  return Status::Ok();
}

}  // namespace dte
