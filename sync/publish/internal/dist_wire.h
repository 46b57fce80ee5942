// The messages between the ranks of a distributed publish
// (sync/publish/publisher.h): little-endian fixed-width fields
// (Writer, Reader), the exchanges every rank makes together (AllToAll,
// AllGather), and the changed elements bound for one owner (EntryWriter).
//
// Thread-safety: Writer, Reader and EntryWriter are values for one thread;
// the exchanges use the transport as its contract says.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/base/status.h"
#include "store/hash.h"
#include "store/manifest.h"
#include "sync/publish/publisher.h"
#include "sync/transport/transport.h"

namespace dte::dist_internal {

inline uint64_t NanosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

// Little-endian fixed-width fields, for the messages between ranks.
class Writer {
 public:
  template <typename T>
  void Put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out_.append(b, sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint64_t>(s.size());
    out_ += s;
  }
  void PutHash(const Hash128& h) {
    Put(h.high);
    Put(h.low);
  }
  void PutStatus(const Status& s) {
    Put<uint8_t>(static_cast<uint8_t>(s.code()));
    PutString(s.ok() ? std::string() : s.message());
  }
  void PutRecord(const BlockRecord& r) {
    Put<uint8_t>(static_cast<uint8_t>(r.kind));
    Put(r.offset);
    Put(r.length);
    Put(r.changed);
    Put(r.hash);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() < sizeof(T)) return false;
    std::memcpy(v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetString(std::string* s) {
    uint64_t n = 0;
    if (!Get(&n) || in_.size() < n) return false;
    s->assign(in_.data(), n);
    in_.remove_prefix(n);
    return true;
  }
  bool GetHash(Hash128* h) { return Get(&h->high) && Get(&h->low); }
  bool GetStatus(Status* s) {
    uint8_t code = 0;
    std::string message;
    if (!Get(&code) || !GetString(&message)) return false;
    *s = code == 0 ? Status::Ok() : Status(static_cast<Code>(code), std::move(message));
    return true;
  }
  bool GetRecord(BlockRecord* r) {
    uint8_t kind = 0;
    if (!Get(&kind) || !Get(&r->offset) || !Get(&r->length) || !Get(&r->changed) ||
        !Get(&r->hash)) {
      return false;
    }
    r->kind = static_cast<BlockKind>(kind);
    return true;
  }
  bool Skip(size_t n) {
    if (in_.size() < n) return false;
    in_.remove_prefix(n);
    return true;
  }
  const char* data() const { return in_.data(); }
  bool done() const { return in_.empty(); }

 private:
  std::string_view in_;
};

// Every rank sends out[r] to rank r and gets in[r] from rank r: the sizes in
// one round, then the non-empty payloads in a second, so both ends always
// agree on every message's size. In a world of one nothing is exchanged:
// the one message is returned.
Result<std::vector<std::string>> AllToAll(Transport& t, const std::vector<std::string>& out,
                                          const std::string& what, DistPublishStats* stats);

// AllToAll for large payloads: this rank's message to itself is moved, not
// copied, and every outgoing message is freed once sent.
Result<std::vector<std::string>> AllToAllMove(Transport& t, std::vector<std::string> out,
                                              const std::string& what, DistPublishStats* stats);

// Every rank sends `mine` to every rank.
Result<std::vector<std::string>> AllGather(Transport& t, const std::string& mine,
                                           const std::string& what, DistPublishStats* stats);

// An entry of EntryWriter's groups: u32 offset from the group's base, u16
// bits.
inline constexpr size_t kEntryBytes = sizeof(uint32_t) + sizeof(uint16_t);

// Changed elements bound for one owner: groups (tensor u32, base u64, count
// u32) of entries of one tensor within 2^32 elements of the group's base.
class EntryWriter {
 public:
  void Add(uint32_t tensor, uint64_t index, uint16_t bits) {
    const uint64_t base = index & ~uint64_t{0xFFFFFFFF};
    if (count_at_ == std::string::npos || tensor != tensor_ || base != base_) {
      Close();
      tensor_ = tensor;
      base_ = base;
      w_.Put(tensor);
      w_.Put(base);
      count_at_ = w_.out().size();
      w_.Put<uint32_t>(0);
    }
    w_.Put(static_cast<uint32_t>(index - base));
    w_.Put(bits);
    count_++;
  }
  std::string Finish() {
    Close();
    return std::move(w_.out());
  }

 private:
  void Close() {
    if (count_at_ != std::string::npos) std::memcpy(&w_.out()[count_at_], &count_, 4);
    count_at_ = std::string::npos;
    count_ = 0;
  }
  Writer w_;
  uint32_t tensor_ = 0;
  uint64_t base_ = 0;
  size_t count_at_ = std::string::npos;
  uint32_t count_ = 0;
};

}  // namespace dte::dist_internal
