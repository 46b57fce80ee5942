#include "store/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "store/cached_store.h"

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

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  std::unique_ptr<Store> store(new Store(options));
  RETURN_IF_ERROR(store->Init());
  return store;
}

Store::~Store() {
  objects_.reset();  // a blob cache writes its use order to the index
  if (index_) index_->Close().IgnoreError();
}

Status Store::Init() {
  ASSIGN_OR_RETURN(objects_, OpenObjectStore(options_.uri, options_.create));
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
    if (index.status().code() == Code::kBusy && options_.index_optional) return Status::Ok();
    return index.status();
  }
  index_ = std::move(index).value();
  RETURN_IF_ERROR(OpenBlobCache());
  return options_.sync_index ? SyncIndex(false) : Status::Ok();
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

Result<std::map<uint64_t, std::string>> Store::ListVersions() {
  ASSIGN_OR_RETURN(auto keys, objects_->List("manifests/"));
  std::map<uint64_t, std::pair<uint32_t, std::string>> best;
  for (const auto& key : keys) {
    auto parsed = ParseManifestKey(key);
    if (!parsed) continue;
    auto it = best.find(parsed->first);
    if (it == best.end() || it->second.first < parsed->second) {
      best[parsed->first] = {parsed->second, key};
    }
  }
  std::map<uint64_t, std::string> out;
  for (auto& [v, p] : best) out[v] = p.second;
  return out;
}

Result<std::optional<uint64_t>> Store::Latest() {
  ASSIGN_OR_RETURN(auto versions, ListVersions());
  if (versions.empty()) return std::optional<uint64_t>();
  return std::optional<uint64_t>(versions.rbegin()->first);
}

Result<std::shared_ptr<const Version>> Store::GetVersion(uint64_t version) {
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(version);
    if (it != cache_.end()) return it->second;
  }
  if (index_) {
    ASSIGN_OR_RETURN(auto entry, index_->GetVersion(version));
    if (entry) {
      auto v = Parse(version, entry->manifest_key, std::move(entry->manifest),
                     std::move(entry->block_table), std::move(entry->full_table));
      if (v.ok()) {
        NoteBlobSizes((*v)->manifest);
        MutexLock lock(&mu_);
        cache_[version] = *v;
        return v;
      }
      // A bad index entry is only a stale cache: fall through to the store.
    }
  }
  ASSIGN_OR_RETURN(auto versions, ListVersions());
  auto it = versions.find(version);
  if (it == versions.end()) {
    return NotFound("version " + std::to_string(version) + " (" + VersionName(version) +
                    ") is not committed in store " + options_.uri);
  }
  return GetVersionAt(version, it->second);
}

Result<std::shared_ptr<const Version>> Store::GetVersionAt(uint64_t version,
                                                           const std::string& key) {
  {
    MutexLock lock(&mu_);
    auto it = cache_.find(version);
    if (it != cache_.end() && it->second->key == key) return it->second;
  }
  ASSIGN_OR_RETURN(auto v, Load(version, key));
  if (index_) {
    RETURN_IF_ERROR(index_->PutVersion(v->manifest, IndexEntry(*v)));
  }
  MutexLock lock(&mu_);
  cache_[version] = v;
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
  return Parse(version, key, std::move(manifest), std::move(table), std::move(full_table));
}

Result<std::shared_ptr<const Version>> Store::Parse(uint64_t version, const std::string& key,
                                                    std::string manifest, std::string table,
                                                    std::string full_table) {
  std::string what = options_.uri + "/" + key;
  auto v = std::make_shared<Version>();
  v->key = key;
  ASSIGN_OR_RETURN(v->manifest, DecodeManifest(manifest, what));
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

Status Store::SyncIndex(bool rebuild) {
  if (!index_) return Status::Ok();
  if (rebuild) {
    RETURN_IF_ERROR(index_->Clear());
    MutexLock lock(&mu_);
    cache_.clear();
  }
  ASSIGN_OR_RETURN(auto in_store, ListVersions());
  ASSIGN_OR_RETURN(auto in_index, index_->ListVersions());
  for (const auto& [v, key] : in_index) {
    auto it = in_store.find(v);
    if (it == in_store.end() || it->second != key) {
      RETURN_IF_ERROR(index_->DeleteVersion(v));
      Forget(v);
    }
  }
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
  cache_[v->manifest.version] = std::move(v);
  return Status::Ok();
}

void Store::Forget(uint64_t version) {
  {
    MutexLock lock(&mu_);
    cache_.erase(version);
  }
  // The index is a cache: a failure here only costs a reload later.
  if (index_) index_->DeleteVersion(version).IgnoreError();
}

}  // namespace dte
