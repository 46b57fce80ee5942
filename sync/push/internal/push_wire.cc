#include "sync/push/internal/push_wire.h"

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
  return t >= static_cast<uint32_t>(Msg::kHello) && t <= static_cast<uint32_t>(Msg::kServer);
}

// A frame header's type and body length, checked.
Result<std::pair<Msg, uint64_t>> ParseHeader(const uint8_t* p, uint64_t max_body,
                                             const std::string& who) {
  if (GetU32(p) != kMagic) return Corruption(who + " sent a frame without the push magic");
  const uint32_t type = GetU32(p + 4);
  if (!KnownType(type)) {
    return Corruption(who + " sent unknown message type " + std::to_string(type));
  }
  const uint64_t len = GetU64(p + 8);
  if (len > max_body) {
    return Corruption(who + " sent a " + MsgName(static_cast<Msg>(type)) + " of " +
                      std::to_string(len) + " bytes (at most " + std::to_string(max_body) + ")");
  }
  return std::make_pair(static_cast<Msg>(type), len);
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
    case Msg::kDataEnd:
      return "data end";
    case Msg::kCountsFp8:
      return "FP8 counts";
    case Msg::kServer:
      return "server";
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
  ASSIGN_OR_RETURN(auto header,
                   ParseHeader(reinterpret_cast<const uint8_t*>(buf_.data()), max_body, who));
  const auto [type, len] = header;
  if (buf_.size() - kHeaderBytes < len) return std::optional<Parsed>();
  Parsed out{type, buf_.substr(kHeaderBytes, len)};
  buf_.erase(0, kHeaderBytes + len);
  return std::optional<Parsed>(std::move(out));
}

std::string EncodeCounts(const CountsMsg& m) {
  const bool fp8 = !m.kind.empty();
  const size_t entry = fp8 ? 24 : 16;
  std::string out(32 + m.count.size() * entry, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  PutU64(p, m.version);
  PutU64(p + 8, m.parent);
  PutU32(p + 16, m.part);
  PutU32(p + 20, m.parts);
  PutU64(p + 24, m.count.size());
  p += 32;
  for (size_t i = 0; i < m.count.size(); ++i, p += entry) {
    PutU32(p, m.op[i]);
    PutU32(p + 4, m.tensor[i]);
    PutU64(p + 8, m.count[i]);
    if (fp8) PutU32(p + 16, static_cast<uint32_t>(m.kind[i]));
  }
  return out;
}

namespace {

// Entry i of a counts message at p (entry bytes each), checked against the
// entry before it.
Status DecodeCountsEntry(const uint8_t* p, bool fp8, size_t i, const std::string& who,
                         CountsMsg* m) {
  m->op[i] = GetU32(p);
  m->tensor[i] = GetU32(p + 4);
  m->count[i] = GetU64(p + 8);
  uint32_t kind = 0;
  if (fp8) {
    kind = GetU32(p + 16);
    if (kind > static_cast<uint32_t>(EntryKind::kFp8Scales) || GetU32(p + 20) != 0) {
      return Corruption(who + " sent FP8 counts with an entry of unknown kind " +
                        std::to_string(kind));
    }
    m->kind[i] = static_cast<EntryKind>(kind);
  }
  if (i == 0) return Status::Ok();
  const bool ordered = m->op[i] > m->op[i - 1] || (fp8 && m->op[i] == m->op[i - 1] &&
                                                   kind > static_cast<uint32_t>(m->kind[i - 1]));
  if (!ordered) return Corruption(who + " sent counts whose ops are not in increasing order");
  return Status::Ok();
}

}  // namespace

Result<CountsMsg> DecodeCounts(Msg type, std::string_view body, const std::string& who) {
  const bool fp8 = type == Msg::kCountsFp8;
  const size_t entry = fp8 ? 24 : 16;
  const auto* p = reinterpret_cast<const uint8_t*>(body.data());
  if (body.size() < 32) return Corruption(who + " sent a truncated counts message");
  CountsMsg m;
  m.version = GetU64(p);
  m.parent = GetU64(p + 8);
  m.part = GetU32(p + 16);
  m.parts = GetU32(p + 20);
  const uint64_t n = GetU64(p + 24);
  if (n > (body.size() - 32) / entry || body.size() != 32 + n * entry) {
    return Corruption(who + " sent a counts message of " + std::to_string(body.size()) +
                      " bytes for " + std::to_string(n) + " ops");
  }
  if (m.parts == 0 || m.part >= m.parts) {
    return Corruption(who + " sent the counts of part " + std::to_string(m.part) + " of " +
                      std::to_string(m.parts));
  }
  m.op.resize(n);
  m.tensor.resize(n);
  m.count.resize(n);
  if (fp8) m.kind.resize(n);
  p += 32;
  for (uint64_t i = 0; i < n; ++i, p += entry)
    RETURN_IF_ERROR(DecodeCountsEntry(p, fp8, i, who, &m));
  return m;
}

namespace {

constexpr uint64_t kMaxSegmentSpan = uint64_t{1} << 31;
constexpr size_t kSegmentHeader = 24;

template <typename T>
void ApplyTyped(const OpEntries& e, void* tensor) {
  auto* t = static_cast<T*>(tensor);
  const auto* v = reinterpret_cast<const T*>(e.vals.data());
  if (e.sets.empty()) {
    for (size_t k = 0; k < e.idx.size(); ++k) t[e.idx[k]] = static_cast<T>(t[e.idx[k]] + v[k]);
    return;
  }
  for (size_t k = 0; k < e.idx.size(); ++k) {
    t[e.idx[k]] = e.sets[k] ? v[k] : static_cast<T>(t[e.idx[k]] + v[k]);
  }
}

}  // namespace

void AppendOpSegments(const uint64_t* dst, const uint64_t* pos, size_t n, int width,
                      const uint8_t* new_values, const uint8_t* old_values, const uint8_t* known,
                      std::string* out) {
  thread_local CodecScratch scratch;
  std::vector<uint32_t> idx;
  std::vector<uint8_t> nv, ov, kn;
  for (size_t s = 0; s < n;) {
    const uint64_t base = dst[s];
    size_t e = s;
    while (e < n && dst[e] - base < kMaxSegmentSpan) ++e;
    const size_t count = e - s;
    idx.resize(count);
    nv.resize(count * width);
    ov.assign(count * width, 0);
    kn.assign(count, 0);
    for (size_t k = 0; k < count; ++k) {
      idx[k] = static_cast<uint32_t>(dst[s + k] - base);
      const uint8_t* now = new_values + pos[s + k] * width;
      std::memcpy(&nv[k * width], now, width);
      if (old_values && (!known || known[pos[s + k]])) {
        const uint8_t* was = old_values + pos[s + k] * width;
        // A difference needs the old element to differ; otherwise store it whole.
        if (std::memcmp(was, now, width) != 0) {
          std::memcpy(&ov[k * width], was, width);
          kn[k] = 1;
        }
      }
    }
    const std::string payload = EncodeSparseEntries(idx.data(), nv.data(), ov.data(), kn.data(),
                                                    static_cast<uint32_t>(count), width, &scratch);
    std::string header(kSegmentHeader, '\0');
    auto* h = reinterpret_cast<uint8_t*>(header.data());
    PutU64(h, base);
    PutU64(h + 8, dst[e - 1] - base + 1);
    PutU32(h + 16, static_cast<uint32_t>(count));
    PutU32(h + 20, static_cast<uint32_t>(payload.size()));
    out->append(header);
    out->append(payload);
    s = e;
  }
}

Status SplitOpSegments(std::string_view* in, uint64_t count, const std::string& what,
                       std::vector<SegmentBytes>* segments) {
  uint64_t got = 0;
  while (got < count) {
    if (in->size() < kSegmentHeader) {
      return Corruption(what + ": data ends inside a segment header");
    }
    const auto* h = reinterpret_cast<const uint8_t*>(in->data());
    const uint32_t n = GetU32(h + 16), bytes = GetU32(h + 20);
    if (n == 0 || n > count - got || bytes > in->size() - kSegmentHeader) {
      return Corruption(what + ": a segment of " + std::to_string(n) + " entries and " +
                        std::to_string(bytes) + " bytes does not fit the op or the data");
    }
    segments->push_back({in->substr(0, kSegmentHeader + bytes), n});
    in->remove_prefix(kSegmentHeader + bytes);
    got += n;
  }
  return Status::Ok();
}

Status ReadOpSegments(std::string_view* in, uint64_t count, uint64_t numel, int width,
                      const std::string& what, OpEntries* out) {
  thread_local CodecScratch scratch;
  thread_local std::vector<uint32_t> idx;
  thread_local std::vector<uint8_t> vals, sets;
  out->idx.clear();
  out->vals.clear();
  out->sets.clear();
  uint64_t got = 0;
  bool any_sets = false;
  while (got < count) {
    if (in->size() < kSegmentHeader)
      return Corruption(what + ": data ends inside a segment header");
    const auto* h = reinterpret_cast<const uint8_t*>(in->data());
    const uint64_t base = GetU64(h), span = GetU64(h + 8);
    const uint32_t n = GetU32(h + 16), bytes = GetU32(h + 20);
    in->remove_prefix(kSegmentHeader);
    if (span == 0 || span > kMaxSegmentSpan || base >= numel || span > numel - base || n == 0 ||
        n > count - got || bytes > in->size()) {
      return Corruption(what + ": segment at element " + std::to_string(base) + " spanning " +
                        std::to_string(span) + " with " + std::to_string(n) +
                        " entries does not fit the tensor of " + std::to_string(numel) +
                        " elements or the data");
    }
    RETURN_IF_ERROR(DecodeSparseEntries(in->substr(0, bytes), span * width, width, &idx, &vals,
                                        &sets, &scratch, what));
    in->remove_prefix(bytes);
    if (idx.size() != n) {
      return Corruption(what + ": a segment decodes to " + std::to_string(idx.size()) +
                        " entries, its header says " + std::to_string(n));
    }
    if (!out->idx.empty() && base + idx[0] <= out->idx.back()) {
      return Corruption(what + ": segments overlap or are out of order");
    }
    if (!sets.empty() && !any_sets) {
      out->sets.assign(out->idx.size(), 0);
      any_sets = true;
    }
    for (uint32_t k = 0; k < n; ++k) out->idx.push_back(base + idx[k]);
    out->vals.insert(out->vals.end(), vals.begin(), vals.begin() + size_t{n} * width);
    if (any_sets) {
      if (sets.empty()) {
        out->sets.insert(out->sets.end(), n, 0);
      } else {
        out->sets.insert(out->sets.end(), sets.begin(), sets.begin() + n);
      }
    }
    got += n;
  }
  return Status::Ok();
}

void ApplyOpEntries(const OpEntries& e, int width, void* tensor) {
  switch (width) {
    case 1:
      return ApplyTyped<uint8_t>(e, tensor);
    case 2:
      return ApplyTyped<uint16_t>(e, tensor);
    case 4:
      return ApplyTyped<uint32_t>(e, tensor);
    default:
      return ApplyTyped<uint64_t>(e, tensor);
  }
}

Result<Parsed> RecvFrame(int fd, uint64_t max_body, const transport_internal::Deadline& deadline,
                         const std::string& who) {
  uint8_t header[kHeaderBytes];
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, header, sizeof header, deadline, who));
  ASSIGN_OR_RETURN(auto parsed, ParseHeader(header, max_body, who));
  const auto [type, len] = parsed;
  Parsed out{type, std::string(len, '\0')};
  RETURN_IF_ERROR(transport_internal::RecvAll(fd, out.body.data(), len, deadline, who));
  return out;
}

}  // namespace dte::push_internal
