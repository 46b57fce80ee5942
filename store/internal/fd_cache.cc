#include "store/internal/fd_cache.h"

#include <utility>

namespace dte {

LocalStore::OpenFilePtr LocalStore::FdCache::Lookup(const std::string& path) {
  MutexLock lock(&mu_);
  auto it = index_.find(path);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->file;
}

uint64_t LocalStore::FdCache::Epoch() const {
  MutexLock lock(&mu_);
  return epoch_;
}

void LocalStore::FdCache::Insert(const std::string& path, OpenFilePtr file, uint64_t epoch) {
  OpenFilePtr dropped;  // destroyed after `lock`
  MutexLock lock(&mu_);
  if (capacity_ == 0 || epoch != epoch_ || index_.count(path) > 0) return;
  lru_.push_front(Entry{path, std::move(file)});
  index_[path] = lru_.begin();
  if (lru_.size() > capacity_) {
    dropped = std::move(lru_.back().file);
    index_.erase(lru_.back().path);
    lru_.pop_back();
  }
}

void LocalStore::FdCache::Evict(const std::string& path) {
  OpenFilePtr dropped;  // destroyed after `lock`
  MutexLock lock(&mu_);
  ++epoch_;
  auto it = index_.find(path);
  if (it == index_.end()) return;
  dropped = std::move(it->second->file);
  lru_.erase(it->second);
  index_.erase(it);
}

size_t LocalStore::FdCache::Count() const {
  MutexLock lock(&mu_);
  return lru_.size();
}

bool LocalStore::FdCache::Contains(const std::string& path) const {
  MutexLock lock(&mu_);
  return index_.count(path) > 0;
}

}  // namespace dte
