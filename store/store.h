// Store: a dte store opened for reading and writing versions.
//
// Wraps the ObjectStore (where the bytes are), the optional host-local
// Index (a RocksDB cache of the catalog), and an in-memory cache of parsed
// versions. Every version it returns has been validated: its manifest parses,
// names its own version number, and its block table matches its hash and
// its manifest's tensors.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/index.h"
#include "store/manifest.h"
#include "store/object_store.h"
#include "store/status.h"
#include "store/thread_annotations.h"

namespace dte {

struct StoreOptions {
  std::string uri;        // local directory or s3://bucket/prefix
  std::string cache_dir;  // host-local index and caches; empty: no index
  bool create = false;    // create the store if it does not exist
  // If the index is held by another process, go on without it (true) or fail
  // with Busy (false).
  bool index_optional = false;
  // s3:// stores with an index: keep blob ranges read from the store, and
  // blobs written to it, on local disk in cache_dir/<store_id>/blobs, up to
  // this many bytes, in chunks of blob_chunk_bytes (store/cached_store.h);
  // 0: no blob cache.
  uint64_t blob_cache_bytes = 0;
  uint64_t blob_chunk_bytes = uint64_t{4} << 20;
  // Bring the index in line with the store's manifests on open (SyncIndex),
  // which loads every version it lacks; false: versions enter the index as
  // they are read (a reader of a few versions of a long history).
  bool sync_index = true;
};

// A validated, parsed version.
struct Version {
  std::string key;  // manifest object key
  std::string manifest_bytes;
  Manifest manifest;
  std::vector<BlockRecord> records;
  // The records of manifest.full's block table (only dense kinds); empty
  // without one.
  std::vector<BlockRecord> full_records;
};

class CachedStore;

class Store {
 public:
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  ~Store();

  ObjectStore& objects() { return *objects_; }
  const std::string& uri() const { return options_.uri; }
  const std::string& store_id() const { return store_id_; }
  Index* index() { return index_.get(); }  // null when running without one
  // The blob cache objects() reads through (StoreOptions::blob_cache_bytes);
  // null when there is none.
  CachedStore* blob_cache() { return blob_cache_; }

  // Committed versions (version -> key of its newest manifest revision),
  // listed fresh from the object store.
  Result<std::map<uint64_t, std::string>> ListVersions();
  Result<std::optional<uint64_t>> Latest();

  // A version, from memory, the index, or the object store (in that order).
  // NotFound naming the version if it is not committed.
  Result<std::shared_ptr<const Version>> GetVersion(uint64_t version);
  // Same, for a manifest key already listed.
  Result<std::shared_ptr<const Version>> GetVersionAt(uint64_t version, const std::string& key);

  // Brings the index in line with the store's manifests: drops versions
  // that are gone, adds the missing ones. With `rebuild`, clears it first.
  Status SyncIndex(bool rebuild);

  // Records a just-committed version in the index and memory cache.
  Status Remember(std::shared_ptr<const Version> v);
  // Forgets cached state of a version, in memory and in the index (after gc
  // removed or rebased it).
  void Forget(uint64_t version);

  // The cache subdirectory for this store (cache_dir/<store_id>), or "".
  std::string CachePath() const;

 private:
  explicit Store(StoreOptions options) : options_(std::move(options)) {}
  Status Init();
  Result<std::shared_ptr<const Version>> Load(uint64_t version, const std::string& key);
  Result<std::shared_ptr<const Version>> Parse(uint64_t version, const std::string& key,
                                               std::string manifest, std::string table,
                                               std::string full_table);
  Status OpenBlobCache();
  // Tells the blob cache the sizes of m's blobs (saves it a HEAD each).
  void NoteBlobSizes(const Manifest& m);

  StoreOptions options_;
  std::unique_ptr<ObjectStore> objects_;
  std::unique_ptr<Index> index_;
  CachedStore* blob_cache_ = nullptr;  // objects_ itself, when it is one
  std::string store_id_;
  Mutex mu_;
  std::map<uint64_t, std::shared_ptr<const Version>> cache_ GUARDED_BY(mu_);
};

// The store marker object, created on first import.
inline constexpr char kStoreMarkerKey[] = "dte-store.json";

// What the index records of a version.
Index::Entry IndexEntry(const Version& v);

// Validates a version's block table against its manifest.
Status CheckBlockTable(const Manifest& m, const std::vector<BlockRecord>& records,
                       const std::string& what);
// Validates the records of a version's full table (manifest.full): dense
// kinds only, pointing into full->blobs.
Status CheckFullTable(const Manifest& m, const std::vector<BlockRecord>& records,
                      const std::string& what);

}  // namespace dte
