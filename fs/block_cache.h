// BlockCache: a bounded LRU cache of materialized, verified content.
//
// Keys are (version, slot, revision): a slot is a block record index of the
// version's block table, or a per-file slot for a raw file or safetensors
// header (see fs/read_path.h). Values are immutable byte strings shared with
// readers, so an entry evicted while a reader copies from it stays alive
// until that reader drops it. Only content that passed its hash check is
// ever inserted.
//
// Thread-safety: all methods may be called concurrently. Loads are single
// flight: threads missing on a key that is being loaded wait for that load
// (the kernel sends 128 KiB reads of one 256 KiB block in parallel, and the
// block must be decoded once, not once per read).
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"

namespace dte::fs {

// An immutable byte string: either storage allocated without being
// zero-filled (a block is written once by its loader, and decoding costs
// enough without a memset first) or a string it adopts without a copy.
class Bytes {
 public:
  explicit Bytes(size_t size) : buffer_(new char[size]), data_(buffer_.get()), size_(size) {}
  explicit Bytes(std::string&& s)
      : owned_(std::move(s)), data_(owned_.data()), size_(owned_.size()) {}
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;
  char* mutable_data() { return data_; }
  const char* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::string_view view() const { return {data_, size_}; }
  friend bool operator==(const Bytes& a, std::string_view b) { return a.view() == b; }

 private:
  std::unique_ptr<char[]> buffer_;
  std::string owned_;
  char* data_;
  size_t size_;
};

// Revisions of a version (gc rebases) have the same content, but a load of
// one can fail where the other's succeeds (its blobs are gone), so loads
// and entries are per revision; DropVersion drops every revision.
struct CacheKey {
  uint64_t version = 0;
  uint64_t slot = 0;
  uint32_t revision = 0;
  bool operator==(const CacheKey& o) const {
    return version == o.version && slot == o.slot && revision == o.revision;
  }
};

struct CacheStats {
  uint64_t capacity_bytes = 0, bytes = 0, entries = 0;
  uint64_t hits = 0, misses = 0, evictions = 0;
};

class BlockCache {
 public:
  using Value = std::shared_ptr<const Bytes>;

  // capacity_bytes == 0 disables caching (every Get misses, Put drops).
  explicit BlockCache(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  using Loader = std::function<Result<Value>()>;

  // The cached value of `key`, or else the result of `load` (run by one of
  // the threads asking at the same time; the others wait and share it). A
  // loaded value is inserted, evicting least recently used entries beyond
  // the capacity; errors are returned to every waiter and not cached.
  Result<Value> GetOrLoad(const CacheKey& key, const Loader& load) EXCLUDES(mu_);
  // The cached value of `key`, or null; never loads, counts nothing and
  // leaves the LRU order alone.
  Value Peek(const CacheKey& key) const EXCLUDES(mu_);
  // Drops every entry of a version (it left the store).
  void DropVersion(uint64_t version) EXCLUDES(mu_);
  CacheStats Stats() const EXCLUDES(mu_);

 private:
  struct KeyHash {
    size_t operator()(const CacheKey& k) const {
      return std::hash<uint64_t>()((k.version * 0x9E3779B97F4A7C15ULL ^ k.slot) +
                                   (uint64_t{k.revision} << 40));
    }
  };
  struct Entry {
    CacheKey key;
    Value value;
  };
  using List = std::list<Entry>;

  using Pending = std::shared_future<Result<Value>>;

  void InsertLocked(const CacheKey& key, Value value) REQUIRES(mu_);
  void EraseLocked(List::iterator it) REQUIRES(mu_);

  const uint64_t capacity_;
  mutable Mutex mu_;
  List lru_ GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<CacheKey, List::iterator, KeyHash> index_ GUARDED_BY(mu_);
  std::unordered_map<CacheKey, Pending, KeyHash> loading_ GUARDED_BY(mu_);
  uint64_t bytes_ GUARDED_BY(mu_) = 0;
  uint64_t hits_ GUARDED_BY(mu_) = 0;
  uint64_t misses_ GUARDED_BY(mu_) = 0;
  uint64_t evictions_ GUARDED_BY(mu_) = 0;
};

}  // namespace dte::fs
