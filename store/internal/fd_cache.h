// LocalStore's open objects and its bounded LRU cache of them, which serves
// the read path's many small range reads of the same blob.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>

#include "store/base/posix_file.h"
#include "store/base/thread_annotations.h"
#include "store/local_store.h"

namespace dte {

// An open object: read-only descriptor plus its size, which never changes
// because objects are replaced by rename, not rewritten.
struct LocalStore::OpenFile {
  ScopedFd fd;
  uint64_t size = 0;
};

// A bounded LRU map from object path to open file. Entries are shared, so
// evicting one never closes a descriptor a reader is still using (its number
// cannot be reused under the reader). Eviction bumps an epoch; a file opened
// before an eviction is not inserted, since it may be the evicted object.
//
// Thread-safety: thread-safe. mu_ is a leaf lock held for map operations
// only; dropped entries are destroyed (closed) after it is released.
class LocalStore::FdCache {
 public:
  // A capacity of 0 caches nothing.
  explicit FdCache(size_t capacity) : capacity_(capacity) {}

  // The cached file for `path`, now the most recently used; nullptr if none.
  OpenFilePtr Lookup(const std::string& path) EXCLUDES(mu_);
  // The current epoch; read it before opening a file to Insert.
  uint64_t Epoch() const EXCLUDES(mu_);
  // Caches `file` unless `path` is cached already or something was evicted
  // since `epoch`; drops the least recently used entry when over capacity.
  void Insert(const std::string& path, OpenFilePtr file, uint64_t epoch) EXCLUDES(mu_);
  // Drops `path` if cached, and bumps the epoch either way.
  void Evict(const std::string& path) EXCLUDES(mu_);

  size_t Count() const EXCLUDES(mu_);
  bool Contains(const std::string& path) const EXCLUDES(mu_);

 private:
  struct Entry {
    std::string path;
    OpenFilePtr file;
  };

  const size_t capacity_;
  mutable Mutex mu_;
  std::list<Entry> lru_ GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_ GUARDED_BY(mu_);
  uint64_t epoch_ GUARDED_BY(mu_) = 0;
};

}  // namespace dte
