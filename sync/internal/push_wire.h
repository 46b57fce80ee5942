// The frames of the push protocol (sync/push.h, docs/push.md): a 16-byte
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

#include "store/status.h"
#include "sync/internal/transport_socket.h"

namespace dte::push_internal {

enum class Msg : uint32_t {
  kHello = 1,     // receiver -> server, JSON: rank, layout, version, tensors
  kWelcome = 2,   // server -> receiver, JSON: {"latest": N|null} or {"error": "..."}
  kCounts = 3,    // server -> receiver, round 1 (binary, below)
  kData = 4,      // server -> receiver, round 2: per dtype, indices then values
  kReceived = 5,  // receiver -> server, JSON {"version": N}: checked and queued
  kApplied = 6,   // receiver -> server, JSON {"version": N}: written into its tensors
  kBehind = 7,    // server -> receiver, JSON {"latest": N}: catch up from the store
  kHeld = 8,      // receiver -> server, JSON {"version": N}: after a catch-up
  kError = 9,     // either way, JSON {"error": "..."}: the sender closes next
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

// Round 1 of a push to one receiver: the version, its parent, and per plan
// op of that receiver (plan order) the receiver tensor it lands in and the
// count of elements.
struct CountsMsg {
  uint64_t version = 0, parent = 0;
  std::vector<uint32_t> tensor;
  std::vector<uint64_t> count;
};
std::string EncodeCounts(const CountsMsg& m);
Result<CountsMsg> DecodeCounts(std::string_view body, const std::string& who);

// Blocking reads of one frame over a non-blocking socket, bounded by the
// deadline.
Result<Parsed> RecvFrame(int fd, uint64_t max_body, const transport_internal::Deadline& deadline,
                         const std::string& who);

}  // namespace dte::push_internal
