#include "fs/block_cache.h"

#include <utility>

namespace dte::fs {

Result<BlockCache::Value> BlockCache::GetOrLoad(const CacheKey& key, const Loader& load) {
  std::promise<Result<Value>> mine;
  Pending pending;
  {
    MutexLock lock(&mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      hits_++;
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->value;
    }
    if (auto it = loading_.find(key); it != loading_.end()) {
      hits_++;  // shares a load already under way
      pending = it->second;
    } else {
      misses_++;
      loading_.emplace(key, mine.get_future().share());
    }
  }
  if (pending.valid()) return pending.get();
  Result<Value> result = load();
  {
    MutexLock lock(&mu_);
    loading_.erase(key);
    if (result.ok()) InsertLocked(key, *result);
  }
  mine.set_value(result);
  return result;
}

void BlockCache::InsertLocked(const CacheKey& key, Value value) {
  if (!value || capacity_ == 0 || value->size() > capacity_) return;
  if (auto it = index_.find(key); it != index_.end()) EraseLocked(it->second);
  bytes_ += value->size();
  lru_.push_front(Entry{key, std::move(value)});
  index_[key] = lru_.begin();
  while (bytes_ > capacity_ && !lru_.empty()) {
    EraseLocked(std::prev(lru_.end()));
    evictions_++;
  }
}

BlockCache::Value BlockCache::Peek(const CacheKey& key) const {
  MutexLock lock(&mu_);
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : it->second->value;
}

void BlockCache::DropVersion(uint64_t version) {
  MutexLock lock(&mu_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (it->key.version == version) EraseLocked(it);
    it = next;
  }
}

CacheStats BlockCache::Stats() const {
  MutexLock lock(&mu_);
  CacheStats s;
  s.capacity_bytes = capacity_;
  s.bytes = bytes_;
  s.entries = index_.size();
  s.hits = hits_;
  s.misses = misses_;
  s.evictions = evictions_;
  return s;
}

void BlockCache::EraseLocked(List::iterator it) {
  bytes_ -= it->value->size();
  index_.erase(it->key);
  lru_.erase(it);
}

}  // namespace dte::fs
