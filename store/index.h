// Index: the host-local RocksDB cache of a store's catalog.
//
// Maps versions to their manifests, files, tensors and block tables (the
// "delta blocks": where every block's bytes are), plus local cache entries.
// It is only a cache: Store rebuilds it from the manifests at any time, and
// deleting the cache directory loses nothing. Every logical update (adding
// or dropping one version) is one WriteBatch.
//
// Only one process may hold an index open: a second opener fails fast with
// Busy naming the directory.
//
// Thread-safety: all methods may be called concurrently (RocksDB is).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/base/status.h"
#include "store/manifest.h"

namespace dte {

class Index {
 public:
  struct Entry {
    std::string manifest_key;  // e.g. "manifests/v00000003.json"
    std::string manifest;      // its bytes
    std::string block_table;   // the block table blob's bytes
    std::string full_table;    // the full block table's bytes; "" without one
  };

  // Opens (creating) the index in `dir`.
  static Result<std::unique_ptr<Index>> Open(const std::string& dir);
  virtual ~Index() = default;

  // Records a version: manifest, block table, and per-file and per-tensor
  // entries, in one WriteBatch.
  virtual Status PutVersion(const Manifest& m, const Entry& entry) = 0;
  virtual Status DeleteVersion(uint64_t version) = 0;
  virtual Result<std::optional<Entry>> GetVersion(uint64_t version) = 0;
  // version -> manifest key, for every indexed version.
  virtual Result<std::map<uint64_t, std::string>> ListVersions() = 0;
  // Where tensor `tensor` of `file` at `version` lives: its first record and
  // count in the block table.
  virtual Result<std::optional<std::pair<uint32_t, uint32_t>>> FindTensor(
      uint64_t version, const std::string& file, const std::string& tensor) = 0;

  // Local cache entries (key -> small value), e.g. cached blob ranges.
  virtual Status PutCacheEntry(std::string_view key, std::string_view value) = 0;
  virtual Result<std::optional<std::string>> GetCacheEntry(std::string_view key) = 0;
  // Every cache entry whose key starts with `prefix`, in key order, read
  // under one snapshot.
  virtual Result<std::vector<std::pair<std::string, std::string>>> ListCacheEntries(
      std::string_view prefix) = 0;
  // Puts `puts` and removes `deletes` (missing keys are fine) in one
  // WriteBatch: a reader sees all of them or none.
  virtual Status UpdateCacheEntries(const std::vector<std::pair<std::string, std::string>>& puts,
                                    const std::vector<std::string>& deletes) = 0;

  // Drops everything (reindex).
  virtual Status Clear() = 0;
  // Flushes and closes; the destructor closes too but cannot report errors.
  virtual Status Close() = 0;
};

}  // namespace dte
