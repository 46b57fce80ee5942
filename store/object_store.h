// ObjectStore: the flat key -> bytes namespace a dte store lives in.
//
// Implementations: a local directory (store/local_store.h, the default; also
// works on a shared filesystem) and an S3-compatible bucket prefix. Keys are
// relative paths made of [A-Za-z0-9._-] segments separated by '/', e.g.
// "blobs/3f/3f2a...", "manifests/v00000001.json".
//
// Durability contract: when Put, PutFile or CreateExclusive return OK the
// object is durable (fsynced, or acknowledged by the object store) and
// visible to every later Get/List on any host.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"

namespace dte {

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;

  // A human-readable location ("/data/store", "s3://bucket/prefix") for messages.
  virtual std::string Describe() const = 0;

  // Writes `data` under `key`, replacing any previous object atomically
  // (readers see the old or the new bytes, never a mix).
  virtual Status Put(const std::string& key, std::string_view data) = 0;

  // Moves or uploads the local file `path` (created with NewTempPath) to
  // `key`, atomically as Put. The local file is consumed.
  virtual Status PutFile(const std::string& key, const std::string& path) = 0;

  // Creates `key` only if it does not exist: AlreadyExists (naming the key)
  // if it does. Exactly one of several racing creators succeeds.
  virtual Status CreateExclusive(const std::string& key, std::string_view data) = 0;

  // Whole object; NotFound naming the key if missing.
  virtual Result<std::string> Get(const std::string& key) = 0;

  // Bytes [offset, offset+len); Corruption if the object is shorter.
  virtual Result<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t len) = 0;

  // Same, into caller memory (len bytes at dst).
  virtual Status ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) = 0;

  // Size in bytes, or nullopt if missing.
  virtual Result<std::optional<uint64_t>> Size(const std::string& key) = 0;

  // Keys starting with `prefix`, sorted.
  virtual Result<std::vector<std::string>> List(const std::string& prefix) = 0;

  // Keys starting with `prefix`, a prefix inside the dte store's own
  // (manifests/, joins/, blobs/, exchange/), sorted, each in its grammar
  // (store/listing_check.h). A key outside it is a listing damaged in
  // transit, not an object to skip: a store reached over a network asks for
  // the listing again (S3: as a body that does not parse) and fails naming
  // the key when it stays damaged. This default lists and fails at once
  // (Corruption naming the key); a local directory, whose listings cross
  // no network, skips foreign names as List does.
  virtual Result<std::vector<std::string>> ListStoreKeys(const std::string& prefix);

  // Removes `key`; OK if it is already gone.
  virtual Status Delete(const std::string& key) = 0;

  // Seconds since the epoch of the object's last write (or Touch).
  virtual Result<int64_t> ModifiedTime(const std::string& key) = 0;

  // Refreshes the modified time (keeps a reused blob safe from gc's grace
  // window).
  virtual Status Touch(const std::string& key) = 0;

  // A fresh local path where a large object can be spooled before PutFile
  // (inside the store for a local directory, so PutFile is a rename).
  virtual Result<std::string> NewTempPath() = 0;

  // Deletes spool and temp files older than `min_age_seconds` left behind by
  // writers that died. Returns how many were removed; stores without a temp
  // area return 0.
  virtual Result<uint64_t> RemoveStaleTemp(int64_t min_age_seconds) {
    (void)min_age_seconds;
    return uint64_t{0};
  }
};

// Opens the store at `uri`: a local directory path, or s3://bucket/prefix.
// With create=false, a missing local directory is NotFound naming it.
Result<std::unique_ptr<ObjectStore>> OpenObjectStore(const std::string& uri, bool create);

}  // namespace dte
