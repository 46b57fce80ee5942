#include "sync/internal/push_wire.h"

#include <cstring>

namespace dte::push_internal {

using transport_internal::GetU64;
using transport_internal::PutU64;

namespace {

uint32_t GetU32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

bool KnownType(uint32_t t) {
  return t >= static_cast<uint32_t>(Msg::kHello) && t <= static_cast<uint32_t>(Msg::kError);
}

}  // namespace

const char* MsgName(Msg m) {
  switch (m) {
    case Msg::kHello:
      return "hello";
    case Msg::kWelcome:
      return "welcome";
    case Msg::kCounts:
      return "counts";
    case Msg::kData:
      return "data";
    case Msg::kReceived:
      return "received";
    case Msg::kApplied:
      return "applied";
    case Msg::kBehind:
      return "behind";
    case Msg::kHeld:
      return "held";
    case Msg::kError:
      return "error";
  }
  return "unknown";
}

std::string Frame(Msg type, std::string_view body) {
  std::string out(kHeaderBytes, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  PutU32(p, kMagic);
  PutU32(p + 4, static_cast<uint32_t>(type));
  PutU64(p + 8, body.size());
  out.append(body);
  return out;
}

Result<std::optional<Parsed>> FrameReader::Next(uint64_t max_body, const std::string& who) {
  if (buf_.size() < kHeaderBytes) return std::optional<Parsed>();
  const auto* p = reinterpret_cast<const uint8_t*>(buf_.data());
  if (GetU32(p) != kMagic) return Corruption(who + " sent a frame without the push magic");
  const uint32_t type = GetU32(p + 4);
  if (!KnownType(type))
    return Corruption(who + " sent unknown message type " + std::to_string(type));
  const uint64_t len = GetU64(p + 8);
  if (len > max_body) {
    return Corruption(who + " sent a " + MsgName(static_cast<Msg>(type)) + " of " +
                      std::to_string(len) + " bytes (at most " + std::to_string(max_body) + ")");
  }
  if (buf_.size() - kHeaderBytes < len) return std::optional<Parsed>();
  Parsed out{static_cast<Msg>(type), buf_.substr(kHeaderBytes, len)};
  buf_.erase(0, kHeaderBytes + len);
  return std::optional<Parsed>(std::move(out));
}

std::string EncodeCounts(const CountsMsg& m) {
  std::string out(24 + m.count.size() * 12, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  PutU64(p, m.version);
  PutU64(p + 8, m.parent);
  PutU64(p + 16, m.count.size());
  p += 24;
  for (size_t i = 0; i < m.count.size(); ++i, p += 12) {
    PutU32(p, m.tensor[i]);
    PutU64(p + 4, m.count[i]);
  }
  return out;
}

Result<CountsMsg> DecodeCounts(std::string_view body, const std::string& who) {
  const auto* p = reinterpret_cast<const uint8_t*>(body.data());
  if (body.size() < 24) return Corruption(who + " sent a truncated counts message");
  CountsMsg m;
  m.version = GetU64(p);
  m.parent = GetU64(p + 8);
  const uint64_t n = GetU64(p + 16);
  if (n > (body.size() - 24) / 12 || body.size() != 24 + n * 12) {
    return Corruption(who + " sent a counts message of " + std::to_string(body.size()) +
                      " bytes for " + std::to_string(n) + " ops");
  }
  m.tensor.resize(n);
  m.count.resize(n);
  p += 24;
  for (uint64_t i = 0; i < n; ++i, p += 12) {
    m.tensor[i] = GetU32(p);
    m.count[i] = GetU64(p + 4);
  }
  return m;
}

Result<Parsed> RecvFrame(int fd, uint64_t max_body, const transport_internal::Deadline& deadline,
                         const std::string& who) {
  uint8_t header[kHeaderBytes];
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, header, sizeof header, deadline, who));
  if (GetU32(header) != kMagic) return Corruption(who + " sent a frame without the push magic");
  const uint32_t type = GetU32(header + 4);
  if (!KnownType(type))
    return Corruption(who + " sent unknown message type " + std::to_string(type));
  const uint64_t len = GetU64(header + 8);
  if (len > max_body) {
    return Corruption(who + " sent a " + MsgName(static_cast<Msg>(type)) + " of " +
                      std::to_string(len) + " bytes (at most " + std::to_string(max_body) + ")");
  }
  Parsed out{static_cast<Msg>(type), std::string(len, '\0')};
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, out.body.data(), len, deadline, who));
  return out;
}

}  // namespace dte::push_internal
