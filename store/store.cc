#include "store/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "store/cached_store.h"
#include "store/internal/s3_retry.h"
#include "store/s3_store.h"

namespace dte {
namespace {

std::string RandomId() {
  unsigned char buf[16] = {};
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (::read(fd, buf, sizeof(buf)) != static_cast<ssize_t>(sizeof(buf))) buf[0] ^= 1;
    ::close(fd);
  }
  std::string out;
  for (unsigned char c : buf) {
    static const char* kHex = "0123456789abcdef";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

Result<std::string> ParseMarker(const std::string& bytes, const std::string& what) {
  auto j = nlohmann::json::parse(bytes, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != "dte-store") {
    return Corruption(what + ": not a dte store marker");
  }
  std::string id = j.value("store_id", "");
  if (id.size() != 32 || id.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return Corruption(what + ": bad store_id");
  }
  return id;
}

}  // namespace

namespace {

// Checks `records` (a block table of m) against m's tensors and `blobs`.
// `dense_only`: null, or why only dense records are allowed (an anchor's
// table, or a full table).
Status CheckRecords(const Manifest& m, const std::vector<BlobRef>& blobs,
                    const std::vector<BlockRecord>& records, const char* dense_only,
                    const std::string& what) {
  size_t r = 0;
  for (const auto& f : m.files) {
    for (const auto& t : f.tensors) {
      for (uint32_t b = 0; b < t.blocks; ++b, ++r) {
        if (r >= records.size()) return Corruption(what + ": block table is too short");
        const BlockRecord& rec = records[r];
        uint64_t len = std::min<uint64_t>(m.block_bytes, t.bytes() - uint64_t{b} * m.block_bytes);
        std::string where =
            what + ": " + f.name + " tensor \"" + t.name + "\" block " + std::to_string(b);
        if (dense_only && (rec.kind == BlockKind::kSame || rec.kind == BlockKind::kSparse)) {
          return Corruption(where + " refers to a parent, but " + dense_only);
        }
        if (rec.kind == BlockKind::kSame) continue;
        if (rec.blob >= blobs.size() || rec.offset > blobs[rec.blob].size ||
            rec.length > blobs[rec.blob].size - rec.offset) {
          return Corruption(where + " points outside its blob");
        }
        if (rec.kind == BlockKind::kDenseRaw && rec.length != len) {
          return Corruption(where + " has the wrong length");
        }
        // The encoder never writes a payload larger than its block (it
        // would have stored the block raw); bound what a reader allocates.
        if (rec.length > 2 * len + 1024) return Corruption(where + " has an oversized payload");
      }
    }
  }
  if (r != records.size()) return Corruption(what + ": block table is too long");
  return Status::Ok();
}

}  // namespace

Status CheckBlockTable(const Manifest& m, const std::vector<BlockRecord>& records,
                       const std::string& what) {
  return CheckRecords(m, m.blobs, records, m.anchor() ? "the version is an anchor" : nullptr, what);
}

Status CheckFullTable(const Manifest& m, const std::vector<BlockRecord>& records,
                      const std::string& what) {
  if (!m.full) return Corruption(what + ": has no full table");
  return CheckRecords(m, m.full->blobs, records, "a full table stands alone", what + " full table");
}

Status CheckJoinTable(const Manifest& m, const std::vector<BlockRecord>& m_records,
                      const FullTable& join, const std::vector<BlockRecord>& records,
                      const std::string& what) {
  RETURN_IF_ERROR(CheckRecords(m, join.blobs, records, "a join table stands alone", what));
  for (size_t r = 0; r < records.size(); ++r) {
    if (records[r].offset < kJoinBlobHeaderBytes) {
      return Corruption(what + ": record " + std::to_string(r) + " overlaps its blob's header");
    }
    if (r >= m_records.size() || records[r].hash != m_records[r].hash) {
      return Corruption(what + ": record " + std::to_string(r) +
                        " does not hold the version's block hash");
    }
  }
  return Status::Ok();
}

Result<std::map<uint64_t, ListedJoin>> ReadJoinTables(Store& store) {
  ASSIGN_OR_RETURN(auto joins, store.ListJoins());
  std::map<uint64_t, ListedJoin> out;
  for (const auto& [v, key] : joins) {
    auto text = store.objects().Get(key);
    if (!text.ok() && text.status().code() == Code::kNotFound) continue;  // pruned meanwhile
    RETURN_IF_ERROR(text.status());
    auto jt = DecodeJoin(*text, store.uri() + "/" + key);
    ListedJoin& l = out[v];
    l.key = key;
    if (jt.ok()) l.table = std::move(*jt);
  }
  return out;
}

bool JoinIsCurrent(uint64_t version, const JoinTable& join,
                   const std::map<uint64_t, std::string>& versions) {
  if (versions.empty() || version > versions.rbegin()->first) return true;
  auto it = versions.find(version);
  return it != versions.end() && it->second == join.manifest_key;
}

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  std::unique_ptr<Store> store(new Store(options));
  RETURN_IF_ERROR(store->Init());
  return store;
}

Result<std::unique_ptr<Store>> Store::OpenOver(std::unique_ptr<ObjectStore> objects,
                                               const StoreOptions& options) {
  std::unique_ptr<Store> store(new Store(options));
  store->objects_ = std::move(objects);
  RETURN_IF_ERROR(store->Init());
  return store;
}

Store::~Store() {
  objects_.reset();  // a blob cache writes its use order to the index
  if (index_) index_->Close().IgnoreError();
}

Status Store::Init() {
  if (!objects_) {
    ASSIGN_OR_RETURN(objects_, OpenObjectStore(options_.uri, options_.create));
  }
  auto marker = objects_->Get(kStoreMarkerKey);
  if (!marker.ok() && marker.status().code() == Code::kNotFound) {
    if (!options_.create) {
      // A missing marker, or a missing place (an S3 bucket that does not
      // exist answers every key with NotFound): one listing tells them
      // apart, and its error names the bucket.
      RETURN_IF_ERROR(objects_->List(kStoreMarkerKey).status());
      return NotFound("store " + options_.uri + " is not a dte store (no " + kStoreMarkerKey +
                      "; create one with dtectl import)");
    }
    nlohmann::json j{{"format", "dte-store"},
                     {"format_version", 1},
                     {"store_id", RandomId()},
                     {"created", NowRfc3339()}};
    Status s = objects_->CreateExclusive(kStoreMarkerKey, j.dump(1) + "\n");
    if (!s.ok() && s.code() != Code::kAlreadyExists) return s;
    marker = objects_->Get(kStoreMarkerKey);
  }
  if (!marker.ok()) return marker.status();
  ASSIGN_OR_RETURN(store_id_, ParseMarker(*marker, options_.uri + "/" + kStoreMarkerKey));
  if (options_.cache_dir.empty()) return Status::Ok();
  std::error_code ec;
  std::filesystem::create_directories(CachePath(), ec);
  if (ec) return IOError("cannot create cache directory " + CachePath() + ": " + ec.message());
  auto index = Index::Open(CachePath() + "/index");
  if (!index.ok()) {
    if (index.status().code() == Code::kUnavailable && options_.index_optional) return Status::Ok();
    return index.status();
  }
  index_ = std::move(index).value();
  RETURN_IF_ERROR(OpenBlobCache());
  // Only drops what is stale: versions are loaded when asked for, so
  // opening a store with thousands of versions on a new host costs one
  // listing, not a manifest read per version.
  return SyncIndex(false, /*load_missing=*/false);
}

Status Store::OpenBlobCache() {
  if (options_.blob_cache_bytes == 0 || !options_.uri.starts_with("s3://")) return Status::Ok();
  CachedStoreOptions o;
  o.dir = CachePath() + "/blobs";
  o.capacity_bytes = options_.blob_cache_bytes;
  o.chunk_bytes = options_.blob_chunk_bytes;
  ASSIGN_OR_RETURN(auto cached, CachedStore::Open(std::move(objects_), index_.get(), o));
  blob_cache_ = cached.get();
  objects_ = std::move(cached);
  return Status::Ok();
}

Index::Entry IndexEntry(const Version& v) {
  return Index::Entry{v.key, v.manifest_bytes, EncodeBlockTable(v.records),
                      v.manifest.full ? EncodeBlockTable(v.full_records) : std::string()};
}

void Store::NoteBlobSizes(const Manifest& m) {
  if (!blob_cache_) return;
  blob_cache_->NoteSize(BlobKey(m.block_table.hash), m.block_table.size);
  for (const BlobRef& b : m.blobs) blob_cache_->NoteSize(BlobKey(b.hash), b.size);
  if (m.full) {
    blob_cache_->NoteSize(BlobKey(m.full->block_table.hash), m.full->block_table.size);
    for (const BlobRef& b : m.full->blobs) blob_cache_->NoteSize(BlobKey(b.hash), b.size);
  }
  for (const auto& f : m.files) {
    if (f.safetensors) {
      blob_cache_->NoteSize(BlobKey(f.header_blob), f.header_size);
    } else {
      blob_cache_->NoteSize(BlobKey(f.blob), f.size);
    }
  }
}

std::string Store::CachePath() const {
  if (options_.cache_dir.empty()) return "";
  return options_.cache_dir + "/" + store_id_;
}

namespace {

constexpr char kManifestPrefix[] = "manifests/";
// Index cache entries of the listing kept for s3:// stores: the time of the
// last full listing and the greatest manifest key seen, then one entry per
// version.
constexpr char kListingMeta[] = "listing";
constexpr char kListedPrefix[] = "listed/";
// Pages of new manifests an incremental listing reads before it gives up
// for a full one.
constexpr int kMaxIncrementalPages = 4;

// Adds manifest `key` to `out` if it is the newest revision of its version.
void AddNewest(const std::string& key, std::map<uint64_t, std::pair<uint32_t, std::string>>* out) {
  auto parsed = ParseManifestKey(key);
  if (!parsed) return;
  auto it = out->find(parsed->first);
  if (it == out->end() || it->second.first < parsed->second) {
    (*out)[parsed->first] = {parsed->second, key};
  }
}

int64_t NowSeconds() { return static_cast<int64_t>(std::time(nullptr)); }

}  // namespace

Result<std::map<uint64_t, std::string>> Store::ListJoins() {
  ASSIGN_OR_RETURN(auto keys, objects_->ListStoreKeys(kJoinPrefix));
  std::map<uint64_t, std::string> out;
  for (const auto& key : keys) {
    if (auto v = ParseJoinKey(key)) out[*v] = key;
  }
  MutexLock lock(&mu_);
  for (auto it = joins_.begin(); it != joins_.end();) {
    it = out.count(it->first) ? std::next(it) : joins_.erase(it);
  }
  join_keys_ = out;
  return out;
}

std::shared_ptr<const LoadedJoin> Store::JoinOf(const Version& v) {
  const uint64_t version = v.manifest.version;
  std::string key;
  {
    MutexLock lock(&mu_);
    auto it = join_keys_.find(version);
    if (it == join_keys_.end()) return nullptr;
    auto loaded = joins_.find(version);
    if (loaded != joins_.end()) {
      if (loaded->second->join.manifest_key == v.key) return loaded->second;
      return nullptr;  // a join of another revision of v: not this one's
    }
    key = it->second;
  }
  // Loaded outside the lock; concurrent first uses may load it twice.
  const std::string what = options_.uri + "/" + key;
  auto load = [&]() -> Result<std::shared_ptr<const LoadedJoin>> {
    ASSIGN_OR_RETURN(std::string text, objects_->Get(key));
    auto j = std::make_shared<LoadedJoin>();
    ASSIGN_OR_RETURN(j->join, DecodeJoin(text, what));
    if (j->join.version != version) {
      return Corruption(what + ": names version " + std::to_string(j->join.version));
    }
    const BlobRef& bt = j->join.table.block_table;
    ASSIGN_OR_RETURN(std::string table, objects_->Get(BlobKey(bt.hash)));
    if (table.size() != bt.size || HashBytes(table.data(), table.size()) != bt.hash) {
      return Corruption(what + ": block table blob " + bt.hash.Hex() + " does not match its hash");
    }
    ASSIGN_OR_RETURN(std::string_view body, JoinTableBody(table, version, what));
    ASSIGN_OR_RETURN(j->records, DecodeBlockTable(body, what + " block table"));
    return std::shared_ptr<const LoadedJoin>(std::move(j));
  };
  auto j = load();
  MutexLock lock(&mu_);
  if (!j.ok()) {
    join_keys_.erase(version);  // retried when a listing shows it again
    return nullptr;
  }
  if ((*j)->join.manifest_key != v.key) {
    joins_[version] = *j;  // it matches another revision of v
    return nullptr;
  }
  if (!CheckJoinTable(v.manifest, v.records, (*j)->join.table, (*j)->records, what).ok()) {
    join_keys_.erase(version);
    return nullptr;
  }
  joins_[version] = *j;
  return *j;
}

void Store::DropJoin(uint64_t version) {
  MutexLock lock(&mu_);
  join_keys_.erase(version);
  joins_.erase(version);
}

Result<std::map<uint64_t, std::string>> Store::ListVersions(bool fresh) {
  const auto start = std::chrono::steady_clock::now();
  // A damaged listing (Corruption) is always made again; an unreachable
  // store (a transient code, or IOError) only while patient listing is on.
  auto retried = [this](const Result<std::map<uint64_t, std::string>>& r) {
    if (r.ok()) return false;
    if (r.status().code() == Code::kCorruption) NoteListingDamage(r.status().message());
    return r.status().code() == Code::kCorruption ||
           (patient_listing_ && (r.status().transient() || r.status().code() == Code::kIOError));
  };
  auto listed = ListVersionsOnce(fresh);
  if (!retried(listed)) return listed;
  // The store's retry policy, read only once a listing has failed.
  S3RetryPolicy policy;
  if (auto env = S3OptionsFromEnvironment(); env.ok()) policy = env->retry;
  const int attempts = std::max(1, policy.max_attempts);
  std::mt19937_64 random(std::random_device{}());
  int attempt = 1;
  for (; attempt < attempts; ++attempt) {
    std::this_thread::sleep_for(internal::BackoffDelay(attempt, policy, random()));
    listed = ListVersionsOnce(fresh);
    if (!retried(listed)) return listed;
  }
  if (attempt == 1) return listed;
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", took.count());
  return listed.status().WithContext("listing the versions of store " + options_.uri + " failed " +
                                     std::to_string(attempt) + " times over " + seconds +
                                     " s; the last attempt");
}

void Store::NoteListingDamage(const std::string& why) {
  MutexLock lock(&mu_);
  listing_damage_.count++;
  auto& recent = listing_damage_.recent;
  recent.push_back(why);
  if (recent.size() > kListingDamageKept) recent.erase(recent.begin());
}

Store::ListingDamage Store::listing_damage() {
  MutexLock lock(&mu_);
  return listing_damage_;
}

Result<std::map<uint64_t, std::string>> Store::ListVersionsOnce(bool fresh) {
  // The join tables with every listing: a few keys, one more request.
  RETURN_IF_ERROR(ListJoins().status());
  if (!fresh) {
    ASSIGN_OR_RETURN(auto incremental, IncrementalListing());
    if (incremental) {
      MutexLock lock(&mu_);
      listed_ = *incremental;
      listed_at_ = std::chrono::steady_clock::now();
      return std::move(*incremental);
    }
  }
  ASSIGN_OR_RETURN(auto keys, objects_->ListStoreKeys(kManifestPrefix));
  std::map<uint64_t, std::pair<uint32_t, std::string>> best;
  for (const auto& key : keys) AddNewest(key, &best);
  std::map<uint64_t, std::string> out;
  for (auto& [v, p] : best) out[v] = p.second;
  RETURN_IF_ERROR(CrossCheckListing(out));
  // The index is a cache: failing to keep the listing costs a full one later.
  SaveListing(out).IgnoreError();
  MutexLock lock(&mu_);
  listed_ = out;
  listed_at_ = std::chrono::steady_clock::now();
  return out;
}

Result<std::optional<std::map<uint64_t, std::string>>> Store::IncrementalListing() {
  using Listing = std::optional<std::map<uint64_t, std::string>>;
  auto* lister = dynamic_cast<PagedLister*>(objects_.get());
  if (!lister || !index_) return Listing();
  ASSIGN_OR_RETURN(auto meta, index_->GetCacheEntry(kListingMeta));
  if (!meta) return Listing();
  const size_t space = meta->find(' ');
  if (space == std::string::npos) return Listing();
  const int64_t at = std::strtoll(meta->c_str(), nullptr, 10);
  std::string after = meta->substr(space + 1);
  if (at <= 0 || NowSeconds() - at > kListingTtlSeconds || NowSeconds() < at) return Listing();
  ASSIGN_OR_RETURN(auto entries, index_->ListCacheEntries(kListedPrefix));
  std::map<uint64_t, std::pair<uint32_t, std::string>> best;
  for (const auto& [name, key] : entries) AddNewest(key, &best);
  std::vector<std::pair<std::string, std::string>> puts;
  for (int page = 0;; ++page) {
    if (page == kMaxIncrementalPages) return Listing();
    ASSIGN_OR_RETURN(KeyPage keys, lister->ListAfter(kManifestPrefix, after, 1000));
    for (const std::string& key : keys.keys) {
      AddNewest(key, &best);
      auto parsed = ParseManifestKey(key);
      if (parsed) puts.emplace_back(kListedPrefix + VersionName(parsed->first), key);
    }
    if (!keys.keys.empty()) after = std::max(after, keys.keys.back());
    if (!keys.truncated) break;
  }
  if (!puts.empty()) {
    puts.emplace_back(kListingMeta, std::to_string(at) + " " + after);
    index_->UpdateCacheEntries(puts, {}).IgnoreError();
  }
  std::map<uint64_t, std::string> out;
  for (auto& [v, p] : best) out[v] = p.second;
  return Listing(std::move(out));
}

Status Store::SaveListing(const std::map<uint64_t, std::string>& listed) {
  if (!index_ || !dynamic_cast<PagedLister*>(objects_.get())) return Status::Ok();
  ASSIGN_OR_RETURN(auto entries, index_->ListCacheEntries(kListedPrefix));
  std::vector<std::pair<std::string, std::string>> puts;
  std::vector<std::string> deletes;
  std::string greatest;
  std::set<std::string> names;
  for (const auto& [version, key] : listed) {
    puts.emplace_back(kListedPrefix + VersionName(version), key);
    names.insert(puts.back().first);
    greatest = std::max(greatest, key);
  }
  for (const auto& [name, key] : entries) {
    if (!names.count(name)) deletes.push_back(name);
  }
  puts.emplace_back(kListingMeta, std::to_string(NowSeconds()) + " " + greatest);
  return index_->UpdateCacheEntries(puts, deletes);
}

Result<std::optional<uint64_t>> Store::LatestListed() {
  {
    MutexLock lock(&mu_);
    const std::chrono::duration<double> age = std::chrono::steady_clock::now() - listed_at_;
    if (listed_at_ != std::chrono::steady_clock::time_point() &&
        age.count() < kListingReuseSeconds) {
      if (listed_.empty()) return std::optional<uint64_t>();
      return std::optional<uint64_t>(listed_.rbegin()->first);
    }
  }
  return Latest();
}

Result<std::map<uint64_t, std::string>> Store::ListCommitted() {
  ASSIGN_OR_RETURN(auto versions, ListVersions());
  ASSIGN_OR_RETURN(NewestRead newest, NewestThatExists(versions));
  if (newest.skipped) {
    // The listing named a version that is not there: a key changed in
    // transit into another, or gc since. One fresh listing more decides.
    ASSIGN_OR_RETURN(versions, ListVersions(/*fresh=*/true));
    ASSIGN_OR_RETURN(newest, NewestThatExists(versions));
  }
  versions.erase(newest.version ? versions.upper_bound(*newest.version) : versions.begin(),
                 versions.end());
  return versions;
}

Result<std::optional<uint64_t>> Store::Latest() {
  ASSIGN_OR_RETURN(auto versions, ListCommitted());
  if (versions.empty()) return std::optional<uint64_t>();
  return std::optional<uint64_t>(versions.rbegin()->first);
}

Result<Store::NewestRead> Store::NewestThatExists(const std::map<uint64_t, std::string>& versions) {
  NewestRead out;
  for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
    {
      MutexLock lock(&mu_);
      if (latest_read_ && latest_read_->first == it->first && latest_read_->second == it->second) {
        out.version = it->first;
        return out;
      }
    }
    ASSIGN_OR_RETURN(bool exists, ManifestExists(it->first, it->second));
    if (!exists) {
      out.skipped = true;
      continue;
    }
    MutexLock lock(&mu_);
    latest_read_.emplace(it->first, it->second);
    out.version = it->first;
    return out;
  }
  return out;
}

namespace {

// What a parsed version holds in memory, roughly: its tables, the manifest
// text, and the parsed manifest (entries, names, shapes, allocator slack).
uint64_t TableBytes(const Version& v) {
  uint64_t bytes = (v.records.size() + v.full_records.size()) * sizeof(BlockRecord) +
                   v.manifest_bytes.size() + sizeof(Version) + 512;
  for (const FileEntry& f : v.manifest.files) {
    bytes += sizeof(FileEntry) + f.name.size() + 64;
    for (const TensorEntry& t : f.tensors) {
      bytes += sizeof(TensorEntry) + t.name.size() + t.shape.size() * sizeof(int64_t) + 96;
    }
  }
  return bytes;
}

}  // namespace

std::shared_ptr<const Version> Store::CacheFind(uint64_t version) {
  auto it = cache_.find(version);
  if (it == cache_.end()) return nullptr;
  by_use_.erase(it->second.used);
  it->second.used = ++use_clock_;
  by_use_[it->second.used] = version;
  return it->second.version;
}

void Store::CachePut(std::shared_ptr<const Version> v) {
  const uint64_t version = v->manifest.version;
  CacheErase(version);
  Cached c{v, TableBytes(*v), ++use_clock_};
  cache_bytes_ += c.bytes;
  by_use_[c.used] = version;
  cache_[version] = std::move(c);
  while ((cache_bytes_ > options_.version_cache_bytes ||
          cache_.size() > options_.version_cache_count) &&
         cache_.size() > 1) {
    CacheErase(by_use_.begin()->second);
  }
}

void Store::CacheErase(uint64_t version) {
  auto it = cache_.find(version);
  if (it == cache_.end()) return;
  by_use_.erase(it->second.used);
  cache_bytes_ -= it->second.bytes;
  cache_.erase(it);
}

size_t Store::cached_versions() {
  MutexLock lock(&mu_);
  return cache_.size();
}

uint64_t Store::cached_version_bytes() {
  MutexLock lock(&mu_);
  return cache_bytes_;
}

Result<std::shared_ptr<const Version>> Store::FromIndex(uint64_t version,
                                                        const std::optional<std::string>& key) {
  if (!index_) return std::shared_ptr<const Version>();
  ASSIGN_OR_RETURN(auto entry, index_->GetVersion(version));
  if (!entry || (key && entry->manifest_key != *key)) return std::shared_ptr<const Version>();
  auto v = Parse(version, entry->manifest_key, std::move(entry->manifest),
                 std::move(entry->block_table), std::move(entry->full_table));
  // A bad index entry is only a stale cache: the caller goes to the store.
  if (!v.ok()) return std::shared_ptr<const Version>();
  NoteBlobSizes((*v)->manifest);
  MutexLock lock(&mu_);
  CachePut(*v);
  return v;
}

Result<std::shared_ptr<const Version>> Store::GetVersion(uint64_t version) {
  std::optional<std::string> listed_key;
  {
    MutexLock lock(&mu_);
    if (auto v = CacheFind(version)) return v;
    auto it = listed_.find(version);
    if (it != listed_.end()) listed_key = it->second;
  }
  ASSIGN_OR_RETURN(auto indexed, FromIndex(version, std::nullopt));
  if (indexed) return indexed;
  // Its manifest key from ever fresher listings: this process's last one
  // (no request), then a listing (kept in the index for s3:// stores), then
  // a full one. A key that is gone means the listing is behind gc; after
  // one, only a full listing is trusted. A version one listing lacks is
  // looked for in a full listing before it is called not committed (that
  // listing may have lost its key in transit).
  std::optional<std::string> tried;
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::optional<std::string> key = attempt == 0 ? listed_key : std::nullopt;
    if (attempt > 0) {
      ASSIGN_OR_RETURN(auto versions, ListVersions(/*fresh=*/attempt == 2 || tried.has_value()));
      auto it = versions.find(version);
      if (it == versions.end() && attempt == 1) continue;
      if (it == versions.end()) {
        return NotFound("version " + std::to_string(version) + " (" + VersionName(version) +
                        ") is not committed in store " + options_.uri);
      }
      key = it->second;
    }
    if (!key || key == tried) continue;
    tried = key;
    auto v = GetVersionAt(version, *key);
    if (v.ok() || v.status().code() != Code::kNotFound) return v;
    // NotFound may name a blob the manifest refers to: then that is what
    // is missing, and a fresher listing would not help.
    ASSIGN_OR_RETURN(bool manifest_exists, ManifestExists(version, *key));
    if (manifest_exists) {
      return v.status().WithContext("version " + std::to_string(version) + " (" +
                                    VersionName(version) + "): its manifest " + *key +
                                    " exists, but an object it refers to is missing");
    }
  }
  return NotFound("version " + std::to_string(version) + " (" + VersionName(version) +
                  "): its manifest " + *tried + " is gone from store " + options_.uri);
}

Result<std::shared_ptr<const Version>> Store::GetVersionAt(uint64_t version,
                                                           const std::string& key) {
  {
    MutexLock lock(&mu_);
    auto v = CacheFind(version);
    if (v && v->key == key) return v;
  }
  ASSIGN_OR_RETURN(auto indexed, FromIndex(version, key));
  if (indexed) return indexed;
  ASSIGN_OR_RETURN(auto v, Load(version, key));
  if (index_) {
    RETURN_IF_ERROR(index_->PutVersion(v->manifest, IndexEntry(*v)));
  }
  MutexLock lock(&mu_);
  CachePut(v);
  return v;
}

Result<std::shared_ptr<const Version>> Store::Load(uint64_t version, const std::string& key) {
  ASSIGN_OR_RETURN(std::string manifest, objects_->Get(key));
  ASSIGN_OR_RETURN(Manifest m, DecodeManifest(manifest, options_.uri + "/" + key));
  NoteBlobSizes(m);
  std::string table_key = BlobKey(m.block_table.hash);
  ASSIGN_OR_RETURN(std::string table, objects_->Get(table_key));
  std::string full_table;
  if (m.full) {
    ASSIGN_OR_RETURN(full_table, objects_->Get(BlobKey(m.full->block_table.hash)));
  }
  return Parse(version, key, std::move(manifest), std::move(table), std::move(full_table),
               std::move(m));
}

Result<std::shared_ptr<const Version>> Store::Parse(uint64_t version, const std::string& key,
                                                    std::string manifest, std::string table,
                                                    std::string full_table,
                                                    std::optional<Manifest> decoded) {
  std::string what = options_.uri + "/" + key;
  auto v = std::make_shared<Version>();
  v->key = key;
  if (decoded) {
    v->manifest = std::move(*decoded);
  } else {
    ASSIGN_OR_RETURN(v->manifest, DecodeManifest(manifest, what));
  }
  auto parsed = ParseManifestKey(key);
  if (!parsed || parsed->first != version || v->manifest.version != version ||
      v->manifest.revision != parsed->second) {
    return Corruption(what + ": manifest names version " + std::to_string(v->manifest.version) +
                      " revision " + std::to_string(v->manifest.revision) +
                      ", not what its key says");
  }
  const BlobRef& bt = v->manifest.block_table;
  if (HashBytes(table.data(), table.size()) != bt.hash || table.size() != bt.size) {
    return Corruption(what + ": block table blob " + bt.hash.Hex() +
                      " does not match its hash (flipped or truncated)");
  }
  ASSIGN_OR_RETURN(v->records, DecodeBlockTable(table, what + " block table"));
  RETURN_IF_ERROR(CheckBlockTable(v->manifest, v->records, what));
  if (const auto& full = v->manifest.full) {
    if (HashBytes(full_table.data(), full_table.size()) != full->block_table.hash ||
        full_table.size() != full->block_table.size) {
      return Corruption(what + ": full block table blob " + full->block_table.hash.Hex() +
                        " does not match its hash (flipped or truncated)");
    }
    ASSIGN_OR_RETURN(v->full_records, DecodeBlockTable(full_table, what + " full block table"));
    RETURN_IF_ERROR(CheckFullTable(v->manifest, v->full_records, what));
  }
  v->manifest_bytes = std::move(manifest);
  return std::shared_ptr<const Version>(std::move(v));
}

Status Store::SyncIndex(bool rebuild, bool load_missing) {
  if (!index_) return Status::Ok();
  if (rebuild) {
    RETURN_IF_ERROR(index_->Clear());
    MutexLock lock(&mu_);
    cache_.clear();
    by_use_.clear();
    cache_bytes_ = 0;
    load_missing = true;
  }
  ASSIGN_OR_RETURN(auto in_store, ListVersions(/*fresh=*/rebuild));
  ASSIGN_OR_RETURN(auto in_index, index_->ListVersions());
  for (const auto& [v, key] : in_index) {
    auto it = in_store.find(v);
    if (it == in_store.end() || it->second != key) {
      RETURN_IF_ERROR(index_->DeleteVersion(v));
      Forget(v);
    }
  }
  if (!load_missing) return Status::Ok();
  for (const auto& [v, key] : in_store) {
    auto it = in_index.find(v);
    if (it != in_index.end() && it->second == key) continue;
    auto loaded = GetVersionAt(v, key);
    // A corrupt version stays out of the index; reading it reports the error.
    if (!loaded.ok() && loaded.status().code() != Code::kCorruption &&
        loaded.status().code() != Code::kNotFound) {
      return loaded.status();
    }
  }
  return Status::Ok();
}

Status Store::Remember(std::shared_ptr<const Version> v) {
  if (index_) {
    RETURN_IF_ERROR(index_->PutVersion(v->manifest, IndexEntry(*v)));
  }
  MutexLock lock(&mu_);
  listed_[v->manifest.version] = v->key;
  CachePut(std::move(v));
  return Status::Ok();
}

void Store::Forget(uint64_t version) {
  {
    MutexLock lock(&mu_);
    CacheErase(version);
    listed_.erase(version);
  }
  // The index is a cache: a failure here only costs a reload later.
  if (index_) index_->DeleteVersion(version).IgnoreError();
}

}  // namespace dte
