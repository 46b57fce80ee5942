// CachedStore: an ObjectStore decorator that keeps byte ranges of blobs on
// local disk, so a follower of a remote store (S3) fetches each blob range
// once and keeps reading what it has while the store is unreachable.
//
// What is cached: Get, GetRange and ReadRange of blob keys
// ("blobs/hh/<32 hex>", BlobKey). Blobs are named by their content and never
// change, so a cached range never goes stale. Everything else (manifests,
// the store marker, listings, sizes, writes) goes to the wrapped store every
// time.
//
// Chunks and readahead. A blob is cut into aligned chunks of `chunk_bytes`
// (the last one shorter). A read fetches each chunk it overlaps that is not
// cached with one range GET, so a small read brings in its whole chunk and a
// blob no larger than a chunk is fetched whole. The chunk is written to
// DIR/hh/<hash>.<chunk>.<generation> through a temporary file and a rename,
// then recorded in the Index (cache entry "blobchunk/<hash>/<chunk>"; the
// value's grammar is at the top of store/internal/chunk_entry.cc) with an
// XXH3-64 of every 64 KiB page.
//
// Checks. A chunk that is a whole blob is checked against the blob's hash
// before it is kept or returned; a chunk of a larger blob can only be checked
// by its reader (the Materializer's block hashes), so a reader that finds bad
// bytes calls Drop and reads again. Every read from disk checks the pages it
// touches: a page that does not match, or a missing or short file, drops the
// chunk and the read fetches it again. Wrong bytes are never returned from
// disk.
//
// Bound and order. Kept chunks total at most `capacity_bytes`; the least
// recently used go first. The use order reaches the index with the next
// inserts (64 entries at a time) and at Flush (and destruction), so after a
// crash it is approximate: it only decides which chunk goes first.
//
// Restart. Open takes in the chunks the index lists whose files exist with
// the right size, and deletes the rest: temporary files of a killed process,
// files without an entry, entries without a file. A crash at any moment
// leaves nothing trusted that was not completely written: the file is renamed
// into place before its entry is written, and its pages are checked on use.
//
// Write-through. Put and PutFile of a blob key (a publisher uploading what
// it committed) keep the blob's chunks as well: the bytes are read once more
// from memory or the spool file, checked against the blob's name, written
// to their chunk files, and entered in the index only after the wrapped
// store has accepted the blob (a failed upload leaves no entry and deletes
// the files). So the next commit reads its parent from local disk. Blobs
// larger than the capacity are not kept, and neither are they when the
// disk write fails: the write itself succeeds either way.
//
// Blob sizes. Cutting a blob into chunks needs its size: from NoteSize
// (callers that hold the manifest), a kept chunk's entry, or else one HEAD
// request (Size) per blob.
//
// Memory and requests: at most `max_fetches` chunk fetches run at once, each
// holding one chunk in memory; concurrent readers of one chunk share its
// fetch (single flight).
//
// Thread-safety: all methods may be called concurrently. One lock (mu_), held
// for in-memory bookkeeping and for the index writes that must agree with it
// (RocksDB writes without sync), never during a request to the wrapped store
// or a chunk file's reads and writes.
#pragma once

#include <atomic>
#include <compare>
#include <cstdint>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <semaphore>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"
#include "store/index.h"
#include "store/object_store.h"
#include "store/s3_store.h"

namespace dte {

struct CachedStoreOptions {
  std::string dir;                              // chunk files (created if missing)
  uint64_t capacity_bytes = uint64_t{4} << 30;  // 0: nothing is kept
  uint64_t chunk_bytes = uint64_t{4} << 20;     // a multiple of kCachePageBytes
  int max_fetches = 8;                          // chunk fetches in flight
};

inline constexpr uint64_t kCachePageBytes = 64 << 10;  // unit of the on-disk checks

struct BlobCacheStats {
  uint64_t capacity_bytes = 0, chunk_bytes = 0;
  uint64_t bytes = 0, chunks = 0;           // kept on disk
  uint64_t hits = 0;                        // chunk reads served from disk
  uint64_t misses = 0;                      // chunk reads that fetched (or joined a fetch)
  uint64_t fetches = 0, fetched_bytes = 0;  // range GETs sent and their bytes
  uint64_t evictions = 0;
  uint64_t dropped = 0;  // chunks that failed a check or that a reader reported bad
  uint64_t written = 0, written_bytes = 0;  // chunks kept from Put/PutFile (write-through)
  uint64_t write_errors = 0;                // fetched or written chunks that could not be kept
  std::string last_error;                   // of the latest drop or write error
};

// One chunk of one blob.
struct ChunkId {
  std::string key;  // the blob's object key
  uint32_t index = 0;
  auto operator<=>(const ChunkId&) const = default;
};

class CachedStore final : public ObjectStore, public PagedLister {
 public:
  // Wraps `base`, keeping chunks in options.dir and their entries in `index`
  // (not owned; it must stay open while the CachedStore exists). Cleans up
  // what an earlier process left (see Restart above). InvalidArgument for a
  // chunk size that is not a multiple of 64 KiB or above 1 GiB.
  static Result<std::unique_ptr<CachedStore>> Open(std::unique_ptr<ObjectStore> base, Index* index,
                                                   const CachedStoreOptions& options);
  // Writes the use order to the index (Flush), errors ignored.
  ~CachedStore() override;

  // True for keys this cache keeps ("blobs/hh/<32 lowercase hex>").
  static bool IsBlobKey(std::string_view key);

  // ObjectStore. Reads of blob keys go through the cache: a range already
  // kept needs no request, and a blob deleted from the store stays readable
  // for what is kept (Delete through this object drops it). Put and PutFile
  // of blob keys write through (see above).
  std::string Describe() const override { return base_->Describe(); }
  Status Put(const std::string& key, std::string_view data) override;
  Status PutFile(const std::string& key, const std::string& path) override;
  Status CreateExclusive(const std::string& key, std::string_view data) override;
  Result<std::string> Get(const std::string& key) override;
  Result<std::string> GetRange(const std::string& key, uint64_t offset, uint64_t len) override;
  Status ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) override;
  Result<std::optional<uint64_t>> Size(const std::string& key) override;
  Result<std::vector<std::string>> List(const std::string& prefix) override;
  Result<std::vector<std::string>> ListStoreKeys(const std::string& prefix) override;
  Status Delete(const std::string& key) override;
  Result<int64_t> ModifiedTime(const std::string& key) override;
  Status Touch(const std::string& key) override;
  Result<std::string> NewTempPath() override;
  Result<uint64_t> RemoveStaleTemp(int64_t min_age_seconds) override;

  // PagedLister: forwarded; Unimplemented when the wrapped store has none.
  Result<KeyPage> ListAfter(const std::string& prefix, const std::string& start_after,
                            int max_keys) override;

  // Tells the size of blob `key` (from a manifest), saving a HEAD request.
  void NoteSize(const std::string& key, uint64_t size) EXCLUDES(mu_);
  // The chunks overlapping [offset, offset + len) of blob `key`, in order.
  Result<std::vector<ChunkId>> ChunksOf(const std::string& key, uint64_t offset, uint64_t len)
      EXCLUDES(mu_);
  // The length of a chunk of a blob whose size is known (ChunksOf made it so).
  uint64_t ChunkLength(const ChunkId& id) EXCLUDES(mu_);
  // True if the chunk is kept on disk.
  bool Contains(const ChunkId& id) EXCLUDES(mu_);
  // Fetches and keeps the chunk unless it is kept already; returns the bytes
  // fetched (0 if it was kept, or another reader's fetch brought it).
  Result<uint64_t> Prefetch(const ChunkId& id) EXCLUDES(mu_);
  // Forgets the kept chunks overlapping [offset, offset + len) of `key` (a
  // reader found bad bytes there); the next read fetches them again.
  void Drop(const std::string& key, uint64_t offset, uint64_t len) EXCLUDES(mu_);
  // Writes the use order to the index.
  Status Flush() EXCLUDES(mu_);

  BlobCacheStats Stats() const EXCLUDES(mu_);
  const std::string& dir() const { return options_.dir; }
  ObjectStore& base() { return *base_; }

 private:
  using Bytes = std::shared_ptr<const std::string>;
  using Pending = std::shared_future<Result<Bytes>>;
  struct Entry {
    uint64_t blob_size = 0;
    uint64_t length = 0;
    uint64_t generation = 0;
    uint64_t tick = 0;                                   // last use
    std::shared_ptr<const std::vector<uint64_t>> pages;  // XXH3-64 per page
    std::list<ChunkId>::iterator lru;
  };
  struct Kept {  // what a reader needs of an entry, copied out under the lock
    std::string path;
    uint64_t generation = 0;
    uint64_t length = 0;
    std::shared_ptr<const std::vector<uint64_t>> pages;
  };
  // What a chunk read does, decided under the lock: read the kept file, join
  // a fetch under way, or fetch itself (and fulfil `fetch` for the others).
  struct Step {
    std::optional<Kept> kept;
    Pending join;
    std::shared_ptr<std::promise<Result<Bytes>>> fetch;
    uint64_t length = 0, blob_size = 0;
    Status error;  // none of the above: the blob's size is not known
  };

  // A chunk whose file is written but that is not entered yet
  // (write-through, before the wrapped store has the blob).
  struct Staged {
    ChunkId id;
    uint64_t generation = 0;
    uint64_t length = 0;
    std::shared_ptr<const std::vector<uint64_t>> pages;
  };
  // Fills bytes [offset, offset + len) of a blob being written: a view into
  // *scratch (room for a chunk) or into memory it already has.
  using BlobReader =
      std::function<Result<std::string_view>(uint64_t offset, uint64_t len, std::string* scratch)>;

  CachedStore(std::unique_ptr<ObjectStore> base, Index* index, CachedStoreOptions options);
  // True if a blob of this key and size is kept when written.
  bool WritesThrough(const std::string& key, uint64_t size) const;
  // Writes the chunk files of blob `key` (`size` bytes from `read`) and
  // checks the bytes against the blob's name; enters nothing. On failure
  // nothing is left on disk.
  Result<std::vector<Staged>> Stage(const std::string& key, uint64_t size, const BlobReader& read)
      EXCLUDES(mu_);
  // After the wrapped store's write: enters the staged chunks in memory and
  // the index as the most recently used if `written` is OK, else deletes
  // their files. A staging or index failure is only counted.
  void Settle(const std::string& key, uint64_t size, Result<std::vector<Staged>> staged,
              const Status& written) EXCLUDES(mu_);
  // Counts a chunk that could not be kept (the read or write went on).
  void NoteWriteError(const Status& s) EXCLUDES(mu_);
  Status Load() EXCLUDES(mu_);
  // Takes in one index entry if its file is there; false to delete it.
  bool LoadEntry(const std::string& key, const std::string& value) REQUIRES(mu_);
  // Deletes chunk files no entry names, and temporary files.
  void RemoveUnknownFiles() EXCLUDES(mu_);

  Result<uint64_t> BlobSize(const std::string& key) EXCLUDES(mu_);
  Status ReadCached(const std::string& key, uint64_t offset, uint64_t len, char* dst);
  // Copies [from, from + len) of the chunk into dst.
  Status ReadChunk(const ChunkId& id, uint64_t from, uint64_t len, char* dst) EXCLUDES(mu_);
  Step Begin(const ChunkId& id, bool use_disk) EXCLUDES(mu_);
  // Fetches for a Step that has `fetch`, keeps the chunk, and tells the
  // readers that joined.
  Result<Bytes> RunFetch(const ChunkId& id, const Step& step) EXCLUDES(mu_);
  Result<Bytes> Fetch(const ChunkId& id, uint64_t length, uint64_t blob_size) EXCLUDES(mu_);
  Status ReadKept(const Kept& kept, uint64_t from, uint64_t len, char* dst) const;
  // Keeps a fetched chunk: file, entry, index (evicting beyond the capacity).
  Status Keep(const ChunkId& id, uint64_t blob_size, std::string_view bytes) EXCLUDES(mu_);
  // Writes the chunk's file (a temporary file renamed into place); returns
  // the generation that names it.
  Result<uint64_t> WriteChunkFile(const ChunkId& id, std::string_view bytes) EXCLUDES(mu_);
  // Adds the entry as the most recently used, evicting the least recently
  // used beyond the capacity (never the new one).
  void InsertLocked(const ChunkId& id, Entry entry, std::vector<std::string>* unlink,
                    std::vector<std::string>* deletes) REQUIRES(mu_);
  // Removes the entry if it is still `generation`.
  void DropChunk(const ChunkId& id, uint64_t generation, const std::string& why) EXCLUDES(mu_);
  // Erases the entry from memory; its file goes on *unlink, its key on *deletes.
  void EraseLocked(std::map<ChunkId, Entry>::iterator it, std::vector<std::string>* unlink,
                   std::vector<std::string>* deletes) REQUIRES(mu_);
  // Marks the entry used now; its tick reaches the index later (unsaved_).
  void TouchLocked(const ChunkId& id, Entry* e) REQUIRES(mu_);
  // The index key and value of the entry of `id`.
  std::pair<std::string, std::string> EntryRecordLocked(const ChunkId& id) REQUIRES(mu_);
  std::string PathOf(const ChunkId& id, uint64_t generation) const;

  const std::unique_ptr<ObjectStore> base_;
  Index* const index_;
  const CachedStoreOptions options_;
  std::counting_semaphore<> fetch_slots_;
  std::atomic<uint64_t> temp_counter_{0};

  mutable Mutex mu_;
  std::map<ChunkId, Entry> entries_ GUARDED_BY(mu_);
  std::list<ChunkId> lru_ GUARDED_BY(mu_);     // most recently used first
  std::set<ChunkId> unsaved_ GUARDED_BY(mu_);  // entries whose tick the index lacks
  std::map<ChunkId, Pending> fetching_ GUARDED_BY(mu_);
  std::unordered_map<std::string, uint64_t> sizes_ GUARDED_BY(mu_);  // blob key -> size
  uint64_t bytes_ GUARDED_BY(mu_) = 0;
  uint64_t next_tick_ GUARDED_BY(mu_) = 1;
  uint64_t next_generation_ GUARDED_BY(mu_) = 1;
  BlobCacheStats stats_ GUARDED_BY(mu_);
};

}  // namespace dte
