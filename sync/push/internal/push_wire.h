// The frames of the push protocol (sync/push/push_server.h, docs/push.md): a 16-byte
// header (magic "DPSH", message type, body length; little-endian) and a
// body, JSON for control messages and binary for the two rounds of a push.
//
// Thread-safety: pure functions; FrameReader is owned by one thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/delta_codec.h"
#include "sync/transport/socket.h"

namespace dte::push_internal {

enum class Msg : uint32_t {
  kHello = 1,     // receiver -> server, JSON: rank, layout, version, tensors
  kWelcome = 2,   // server -> receiver, JSON: {"latest": N|null} or {"error": "..."}
  kCounts = 3,    // server -> receiver, round 1 (binary, below)
  kData = 4,      // server -> receiver, round 2 (one or more): ops' entries, plan order
  kReceived = 5,  // receiver -> server, JSON {"version": N}: checked and queued
  kApplied = 6,   // receiver -> server, JSON {"version": N}: written into its tensors
  kBehind = 7,    // server -> receiver, JSON {"latest": N}: catch up from the store
  kHeld = 8,      // receiver -> server, JSON {"version": N}: after a catch-up
  kError = 9,     // either way, JSON {"error": "..."}: the sender closes next
  kDataEnd = 10,  // server -> receiver, empty: round 2 is complete
  // server -> receiver, round 1 for an FP8 receiver (wire 2): kCounts whose
  // entries also say what they write (EntryKind).
  kCountsFp8 = 11,
  // receiver -> server, JSON {"version": N|null, "inconsistent": bool,
  // "why": "..."}: the version its server's ranks agreed on and applied, or
  // that they hold none in common (docs/push.md "Servers").
  kServer = 12,
};

// What a counts entry writes into its receiver tensor. kCounts entries are
// all kElements.
enum class EntryKind : uint32_t {
  kElements = 0,   // the op's elements, in the version's dtype
  kFp8Bytes = 1,   // E4M3 bytes of the op's elements (an F8_E4M3 tensor)
  kFp8Scales = 2,  // block scales of the op's box (an F32 weight_scale_inv tensor)
};

inline constexpr uint32_t kMagic = 0x48535044;  // "DPSH"
inline constexpr size_t kHeaderBytes = 16;
// Control messages are small; a hello lists every tensor of a rank.
inline constexpr uint64_t kMaxControlBytes = uint64_t{64} << 20;

const char* MsgName(Msg m);

// Header + body as one string.
std::string Frame(Msg type, std::string_view body);

struct Parsed {
  Msg type;
  std::string body;
};

// Incremental parsing of a byte stream into frames.
class FrameReader {
 public:
  void Append(const char* data, size_t n) { buf_.append(data, n); }
  // The next whole frame, if there is one; Corruption naming `who` for a
  // bad magic, an unknown type or a body over max_body.
  Result<std::optional<Parsed>> Next(uint64_t max_body, const std::string& who);

 private:
  std::string buf_;
};

// Round 1 of a push to one receiver: the version, its parent, which part
// of the push this is (a push comes from `parts` senders, each sending the
// changes of the tensors it owns: sync/push/push_server.h) and, for each plan op of that
// receiver with changes in this part (increasing op index), the receiver
// tensor it lands in and its count of elements. Ops not listed have none.
//
// kCounts body: u64 version, u64 parent, u32 part, u32 parts, u64 n, then n
// entries of 16 bytes: u32 op, u32 tensor, u64 count. kCountsFp8 (an FP8
// receiver's; docs/push.md "FP8 receivers") has the same header and entries
// of 24 bytes: u32 op, u32 tensor, u64 count, u32 kind (EntryKind), u32 0;
// entries in increasing (op, kind), an op writing an FP8 tensor listed as
// its bytes and then its scales (each only when it has some).
struct CountsMsg {
  uint64_t version = 0, parent = 0;
  uint32_t part = 0, parts = 1;
  std::vector<uint32_t> op;
  std::vector<uint32_t> tensor;
  std::vector<uint64_t> count;
  std::vector<EntryKind> kind;  // empty: every entry kElements
};
// The body of a kCounts message, or of a kCountsFp8 one when m.kind is
// not empty.
std::string EncodeCounts(const CountsMsg& m);
// Decodes a kCounts or kCountsFp8 body (`type`); a kCountsFp8 message's
// kind is filled for every entry.
Result<CountsMsg> DecodeCounts(Msg type, std::string_view body, const std::string& who);

// Round 2 of a push to one receiver: for each op of round 1, in order, the op's entries in segments
// of at most 2^31 receiver-local elements: u64 base (the first entry's flat index in the receiver
// tensor), u64 span (elements from base to the last entry, inclusive),
// u32 count, u32 payload bytes, then a kSparse payload of the delta codec
// (store/delta_codec.h) over a "block" of `span` elements at `base`: the
// wrapping difference from the parent's element where the sender knew it,
// the whole new value otherwise (a "set" element). About 1.2 bytes per
// changed BF16 element at RL densities, against 10 for a u64 index and the
// value.
//
// Appends the segments of one op's `n` entries: receiver-local indices dst
// (increasing), and for entry k the sender's entry pos[k] of `changes`.
void AppendOpSegments(const uint64_t* dst, const uint64_t* pos, size_t n, int width,
                      const uint8_t* new_values, const uint8_t* old_values, const uint8_t* known,
                      std::string* out);

// One op's entries decoded: receiver-local indices, and per entry its
// wrapping difference or (sets[k] != 0) its whole value.
struct OpEntries {
  std::vector<uint64_t> idx;
  std::vector<uint8_t> vals;
  std::vector<uint8_t> sets;  // empty: no set elements
};
// Takes one op's segments (`count` entries in all) off the front of `in`:
// each segment's bytes and entry count, appended to *segments, checking
// only their headers' counts; Corruption naming `what` when they do not
// add up or the data ends.
struct SegmentBytes {
  std::string_view bytes;
  uint32_t count;
};
Status SplitOpSegments(std::string_view* in, uint64_t count, const std::string& what,
                       std::vector<SegmentBytes>* segments);
// Decodes one op's segments (as SplitOpSegments cut them) into *out,
// checking every index against `numel`; Corruption naming `what` otherwise.
Status ReadOpSegments(std::string_view* in, uint64_t count, uint64_t numel, int width,
                      const std::string& what, OpEntries* out);

// Writes entries into a tensor of `width`-byte elements: the difference
// is added (wrapping), a set element stored.
void ApplyOpEntries(const OpEntries& e, int width, void* tensor);

// Blocking reads of one frame over a non-blocking socket, bounded by the
// deadline.
Result<Parsed> RecvFrame(int fd, uint64_t max_body, const transport_internal::Deadline& deadline,
                         const std::string& who);

}  // namespace dte::push_internal
