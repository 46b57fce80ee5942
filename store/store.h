// Store: a dte store opened for reading and writing versions.
//
// Wraps the ObjectStore (where the bytes are), the optional host-local
// Index (a RocksDB cache of the catalog), and a bounded in-memory cache of
// parsed versions (the most recently used ones, up to
// StoreOptions::version_cache_bytes and version_cache_count), so a process that
// touches thousands of versions holds only the ones in use. Every version it
// returns has been validated: its manifest parses, names its own version
// number, and its block table matches its hash and its manifest's tensors.
// Versions are loaded on demand: opening a store lists its manifests once
// (dropping stale index entries) but loads none of them.
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/index.h"
#include "store/manifest.h"
#include "store/object_store.h"

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
  // Parsed versions kept in memory: the most recently used, while their
  // tables and parsed manifests add up to at most this many bytes (the
  // newest one used is always kept). Versions in use elsewhere (an open file's chain) stay
  // alive through their shared_ptr whatever this bound.
  uint64_t version_cache_bytes = uint64_t{32} << 20;
  // ...and at most this many of them.
  size_t version_cache_count = 256;
  // Start with patient listing on (Store::ListVersions).
  bool patient_listing = false;
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

// A join table (store/manifest.h) loaded and checked against its version:
// one dense record per block, with the version's own block hashes.
struct LoadedJoin {
  JoinTable join;
  std::vector<BlockRecord> records;
};

class CachedStore;

class Store {
 public:
  static Result<std::unique_ptr<Store>> Open(const StoreOptions& options);
  // Opens the store over `objects`, an ObjectStore already open at
  // options.uri (a fake in tests, a decorator of the real one).
  static Result<std::unique_ptr<Store>> OpenOver(std::unique_ptr<ObjectStore> objects,
                                                 const StoreOptions& options);
  ~Store();

  ObjectStore& objects() { return *objects_; }
  const std::string& uri() const { return options_.uri; }
  const std::string& store_id() const { return store_id_; }
  Index* index() { return index_.get(); }  // null when running without one
  // The blob cache objects() reads through (StoreOptions::blob_cache_bytes);
  // null when there is none.
  CachedStore* blob_cache() { return blob_cache_; }

  // Committed versions (version -> key of its newest manifest revision).
  // Local stores list their manifests directory. An s3:// store with an
  // index keeps its last full listing there (cache entries) and, while that
  // is younger than kListingTtlSeconds, lists only the manifests after the
  // greatest key it holds (one ListObjectsV2 request, not one per 1000
  // versions), so a command's cost does not grow with the run; versions
  // removed or rewritten by gc on another host are then seen at the next
  // full listing (gc's grace period keeps their blobs readable meanwhile).
  // `fresh` always lists everything (gc, reindex, dtefs's periodic full
  // listing). The listing is also remembered in memory: a version missing
  // from the index and the memory cache is looked up in it first.
  //
  // While patient listing is on (SetPatientListing; dtectl, and dtefs until
  // its first listing), a listing that fails with IOError (the store cannot
  // be reached: an error storm longer than one request's retries, resets,
  // a listing body that never parses) is made again, up to the store's
  // retry attempts in all, with the bounded backoff of its requests
  // (S3RetryPolicy: $DTE_S3_MAX_ATTEMPTS, $DTE_S3_RETRY_BASE_MS,
  // $DTE_S3_RETRY_MAX_MS). The error after the last one names the listing
  // and says how many attempts were made over how long.
  //
  // Listings are checked like bodies (docs/s3.md, "Listings"). An S3
  // store refuses a page with a key outside its prefix's grammar or a
  // broken chain of pages (store/listing_check.h); here a full listing is
  // damaged (Corruption naming the key) if it lacks a version this object
  // knows (its last listing, its memory cache, the index) whose manifest
  // exists when read directly (ManifestExists), or lists a delta this
  // object has loaded without its parent, whose manifest exists. A damaged
  // listing is made again whether or not patient listing is on, with the
  // same bounded backoff; it is never trimmed. The error after the last
  // attempt names the listing, the key and the number of attempts.
  Result<std::map<uint64_t, std::string>> ListVersions(bool fresh = false);
  void SetPatientListing(bool on) { patient_listing_ = on; }
  // Whether manifest `key` of `version` exists, read directly (a HEAD on an
  // S3 store, a stat on a local one), trusting no listing or cache: the
  // check a listing's absences are confirmed with before anything acts on
  // them.
  Result<bool> ManifestExists(uint64_t version, const std::string& key);
  // Versions a full listing lacks that ListVersions confirms one by one
  // with ManifestExists (the newest ones); beyond them, a second listing
  // must agree that the rest are gone (gc on another host removes many at
  // once).
  static constexpr size_t kMaxDirectChecks = 16;
  // Listings ListVersions found damaged (and made again) so far, and the
  // reasons of the most recent ones (kListingDamageKept), oldest first:
  // what a daemon reports (dtefs's .dte/status and log).
  struct ListingDamage {
    uint64_t count = 0;
    std::vector<std::string> recent;
  };
  ListingDamage listing_damage() EXCLUDES(mu_);
  static constexpr size_t kListingDamageKept = 16;
  // The latest version, for a writer that expects `expected` (the version
  // it committed last): when a full listing says otherwise, the listing is
  // confirmed against the manifests before it is believed (the expected
  // version's manifest is gone, or the newer latest's exists), and listed
  // again while it is not, with the store's retry policy. IOError naming the
  // listing and the attempts if no listing agrees with the manifests.
  Result<std::optional<uint64_t>> ConfirmedLatest(uint64_t expected);
  // The latest version of the last listing this object took (opening the
  // store with an index takes one), with the versions it committed since,
  // if that listing is under kListingReuseSeconds old; else Latest(). For a
  // caller that checks again before it acts (a commit plans on it, and
  // lists afresh just before it creates its manifest), so that one command
  // lists a long run once less.
  Result<std::optional<uint64_t>> LatestListed() EXCLUDES(mu_);
  static constexpr double kListingReuseSeconds = 1.0;
  static constexpr int64_t kListingTtlSeconds = 60;
  // The committed versions: a listing (ListVersions) whose newest version's
  // manifest exists when read directly. A key changed in transit can name a
  // version that does not exist; then one fresh listing more is taken, and
  // the versions it lists above the newest that exists are left out. One
  // read per new newest version (this object remembers the last one it
  // read). What dtectl log shows and the C ABI lists (dte_store_list_versions).
  Result<std::map<uint64_t, std::string>> ListCommitted() EXCLUDES(mu_);
  // The newest version of ListCommitted(), nullopt for an empty store.
  // Within one object the answer never goes back while that version's
  // manifest exists, as ListVersions lists again a full listing that lacks
  // a version it knows: the rule dtefs's `latest` follows too.
  Result<std::optional<uint64_t>> Latest() EXCLUDES(mu_);

  // Join tables (joins/), version -> key. ListVersions lists them too (one
  // more listing of a prefix that holds a few objects), and JoinOf uses
  // what the last listing showed.
  Result<std::map<uint64_t, std::string>> ListJoins();
  // v's join table, loaded on first use and checked against v (its manifest
  // revision and block hashes); null when the last listing showed none for
  // v, or it could not be read or did not match (then it is not tried again
  // until a later listing shows it).
  std::shared_ptr<const LoadedJoin> JoinOf(const Version& v) EXCLUDES(mu_);
  // Forgets v's join table until a later listing shows it (a reader found
  // one of its blobs gone: a writer pruned it).
  void DropJoin(uint64_t version) EXCLUDES(mu_);

  // A version, from memory, the index, or the object store (in that order).
  // NotFound naming the version if it is not committed.
  Result<std::shared_ptr<const Version>> GetVersion(uint64_t version);
  // Same, for a manifest key already listed (from memory or the index when
  // they hold that key, else from the object store).
  Result<std::shared_ptr<const Version>> GetVersionAt(uint64_t version, const std::string& key);

  // Brings the index in line with the store's manifests: drops versions
  // that are gone or rewritten and, with `load_missing`, adds the missing
  // ones (one manifest and block table read each). With `rebuild`, clears
  // it first (and loads every version).
  Status SyncIndex(bool rebuild, bool load_missing = true);

  // Parsed versions held in memory now, and the bytes of their tables.
  size_t cached_versions() EXCLUDES(mu_);
  uint64_t cached_version_bytes() EXCLUDES(mu_);

  // Records a just-committed version in the index and memory cache.
  Status Remember(std::shared_ptr<const Version> v);
  // Forgets cached state of a version, in memory and in the index (after gc
  // removed or rebased it).
  void Forget(uint64_t version);

  // The cache subdirectory for this store (cache_dir/<store_id>), or "".
  std::string CachePath() const;

 private:
  explicit Store(StoreOptions options)
      : options_(std::move(options)), patient_listing_(options_.patient_listing) {}
  Status Init();
  Result<std::shared_ptr<const Version>> Load(uint64_t version, const std::string& key);
  // Version `version` from the index (at manifest `key`, if given), parsed
  // and cached; null if the index has no good entry for it.
  Result<std::shared_ptr<const Version>> FromIndex(uint64_t version,
                                                   const std::optional<std::string>& key);
  // `decoded`: the manifest already decoded from `manifest`, if it was.
  Result<std::shared_ptr<const Version>> Parse(uint64_t version, const std::string& key,
                                               std::string manifest, std::string table,
                                               std::string full_table,
                                               std::optional<Manifest> decoded = std::nullopt);
  Status OpenBlobCache();
  // The listing kept in the index, brought up to date with the manifests
  // after its greatest key; nullopt when there is none to use (no index, not
  // an S3 store, older than kListingTtlSeconds, or too far behind).
  Result<std::optional<std::map<uint64_t, std::string>>> IncrementalListing();
  // Replaces the listing kept in the index with a full one.
  Status SaveListing(const std::map<uint64_t, std::string>& listed);
  // Tells the blob cache the sizes of m's blobs (saves it a HEAD each).
  void NoteBlobSizes(const Manifest& m);
  // The memory cache: find (and mark used), insert (evicting the least
  // recently used beyond version_cache_bytes or version_cache_count), erase.
  std::shared_ptr<const Version> CacheFind(uint64_t version) REQUIRES(mu_);
  void CachePut(std::shared_ptr<const Version> v) REQUIRES(mu_);
  void CacheErase(uint64_t version) REQUIRES(mu_);

  StoreOptions options_;
  std::unique_ptr<ObjectStore> objects_;
  std::unique_ptr<Index> index_;
  CachedStore* blob_cache_ = nullptr;  // objects_ itself, when it is one
  std::string store_id_;
  Result<std::map<uint64_t, std::string>> ListVersionsOnce(bool fresh);
  // Corruption if the full listing `listed` lacks a version this object
  // knows whose manifest exists, or lists a loaded delta without its
  // parent, whose manifest exists (ListVersions).
  Status CrossCheckListing(const std::map<uint64_t, std::string>& listed) EXCLUDES(mu_);
  // Corruption if one of the versions `missing` from a listing (version,
  // manifest key) still exists: the newest kMaxDirectChecks read directly,
  // the rest against a second listing.
  Status ConfirmMissing(std::vector<std::pair<uint64_t, std::string>> missing);
  // Why `listed`'s latest disagrees with the manifests, for a writer that
  // expects `expected` ("" when the listing is confirmed).
  Result<std::string> LatestDisagreement(const std::map<uint64_t, std::string>& listed,
                                         uint64_t expected);
  std::atomic<bool> patient_listing_{false};
  // Counts a damaged listing and keeps its reason (listing_damage()).
  void NoteListingDamage(const std::string& why) EXCLUDES(mu_);
  Mutex mu_;
  struct Cached {
    std::shared_ptr<const Version> version;
    uint64_t bytes = 0;
    uint64_t used = 0;  // use stamp: larger is more recent
  };
  std::map<uint64_t, Cached> cache_ GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> by_use_ GUARDED_BY(mu_);  // use stamp -> version
  uint64_t cache_bytes_ GUARDED_BY(mu_) = 0;
  uint64_t use_clock_ GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::string> listed_ GUARDED_BY(mu_);           // the last listing
  std::chrono::steady_clock::time_point listed_at_ GUARDED_BY(mu_);  // of listed_; 0: none
  std::map<uint64_t, std::string> join_keys_ GUARDED_BY(mu_);        // the last join listing
  ListingDamage listing_damage_ GUARDED_BY(mu_);
  // The version and manifest key Latest() last found by a read.
  std::optional<std::pair<uint64_t, std::string>> latest_read_ GUARDED_BY(mu_);
  // The newest of `versions` whose manifest exists (Latest), and whether a
  // newer one listed does not.
  struct NewestRead {
    std::optional<uint64_t> version;
    bool skipped = false;
  };
  Result<NewestRead> NewestThatExists(const std::map<uint64_t, std::string>& versions)
      EXCLUDES(mu_);
  std::map<uint64_t, std::shared_ptr<const LoadedJoin>> joins_ GUARDED_BY(mu_);
};

// The store marker object, created on first import.
inline constexpr char kStoreMarkerKey[] = "dte-store.json";

// What the index records of a version.
Index::Entry IndexEntry(const Version& v);

// Validates a version's block table against its manifest.
Status CheckBlockTable(const Manifest& m, const std::vector<BlockRecord>& records,
                       const std::string& what);
// Every join table listed now, its object read: `table` is nullopt when the
// object does not parse; objects deleted while listing are left out.
struct ListedJoin {
  std::string key;
  std::optional<JoinTable> table;
};
Result<std::map<uint64_t, ListedJoin>> ReadJoinTables(Store& store);
// True if `join` (of `version`) belongs to the version's current revision in
// `versions` (a listing), or to a version newer than all of them (committed
// since that listing): a join table gc and writers keep.
bool JoinIsCurrent(uint64_t version, const JoinTable& join,
                   const std::map<uint64_t, std::string>& versions);

// Validates the records of a version's full table (manifest.full): dense
// kinds only, pointing into full->blobs.
Status CheckFullTable(const Manifest& m, const std::vector<BlockRecord>& records,
                      const std::string& what);
// Same for a join table of m: dense records only, pointing into its blobs
// past their header, with m's block hashes.
Status CheckJoinTable(const Manifest& m, const std::vector<BlockRecord>& m_records,
                      const FullTable& join, const std::vector<BlockRecord>& records,
                      const std::string& what);

}  // namespace dte
