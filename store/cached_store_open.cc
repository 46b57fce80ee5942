// CachedStore: opening, and taking in what an earlier process left behind.
#include <algorithm>
#include <filesystem>
#include <functional>

#include "store/cached_store.h"
#include "store/internal/chunk_entry.h"

namespace dte {

Result<std::unique_ptr<CachedStore>> CachedStore::Open(std::unique_ptr<ObjectStore> base,
                                                       Index* index,
                                                       const CachedStoreOptions& options) {
  if (options.chunk_bytes == 0 || options.chunk_bytes % kCachePageBytes != 0 ||
      options.chunk_bytes > (uint64_t{1} << 30)) {
    return InvalidArgument("blob cache " + options.dir + ": the chunk size " +
                           std::to_string(options.chunk_bytes) +
                           " must be a multiple of 64 KiB, at most 1 GiB");
  }
  std::unique_ptr<CachedStore> store(new CachedStore(std::move(base), index, options));
  RETURN_IF_ERROR(store->Load());
  return store;
}

Status CachedStore::Load() {
  std::error_code ec;
  std::filesystem::create_directories(options_.dir + "/tmp", ec);
  if (ec) {
    return IOError("cannot create blob cache directory " + options_.dir + ": " + ec.message());
  }
  ASSIGN_OR_RETURN(auto listed, index_->ListCacheEntries(internal::kChunkEntryPrefix));
  std::vector<std::string> deletes, unlink;
  Status s;
  {
    MutexLock lock(&mu_);
    for (const auto& [key, value] : listed) {
      if (!LoadEntry(key, value)) deletes.push_back(key);
    }
    // Most recently used first, as the entries' ticks say.
    std::vector<std::pair<uint64_t, ChunkId>> order;
    for (const auto& [id, e] : entries_) order.emplace_back(e.tick, id);
    std::sort(order.begin(), order.end(), std::greater<>());
    for (auto& [tick, id] : order) entries_.at(id).lru = lru_.insert(lru_.end(), id);
    while (bytes_ > options_.capacity_bytes && !lru_.empty()) {  // the capacity was lowered
      EraseLocked(entries_.find(lru_.back()), &unlink, &deletes);
      stats_.evictions++;
    }
    s = index_->UpdateCacheEntries({}, deletes);
  }
  internal::RemoveFiles(unlink);
  RETURN_IF_ERROR(s);
  RemoveUnknownFiles();
  return Status::Ok();
}

bool CachedStore::LoadEntry(const std::string& key, const std::string& value) {
  auto parsed = internal::ParseChunkEntryKey(key);
  auto e = internal::DecodeChunkEntry(value);
  if (!parsed || !e || e->chunk_bytes != options_.chunk_bytes) return false;
  ChunkId id{parsed->first, parsed->second};
  const uint64_t start = uint64_t{id.index} * options_.chunk_bytes;
  if (start >= e->blob_size) return false;
  const uint64_t length = std::min(options_.chunk_bytes, e->blob_size - start);
  if (e->pages.size() != (length + kCachePageBytes - 1) / kCachePageBytes) return false;
  std::error_code ec;
  const std::string path = PathOf(id, e->generation);
  if (!std::filesystem::is_regular_file(path, ec) ||
      std::filesystem::file_size(path, ec) != length || ec) {
    return false;  // gone, or cut short by a crash of the machine
  }
  Entry entry;
  entry.blob_size = e->blob_size;
  entry.length = length;
  entry.generation = e->generation;
  entry.tick = e->tick;
  entry.pages = std::make_shared<const std::vector<uint64_t>>(std::move(e->pages));
  sizes_[id.key] = e->blob_size;
  bytes_ += length;
  next_tick_ = std::max(next_tick_, e->tick + 1);
  next_generation_ = std::max(next_generation_, e->generation + 1);
  entries_.emplace(std::move(id), std::move(entry));
  return true;
}

void CachedStore::RemoveUnknownFiles() {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> unknown;
  for (const auto& sub : fs::directory_iterator(options_.dir, ec)) {
    const std::string name = sub.path().filename().string();
    std::error_code sub_ec;
    if (name == "tmp") {  // no other process uses this directory: we hold its index
      for (const auto& f : fs::directory_iterator(sub.path(), sub_ec)) {
        unknown.push_back(f.path().string());
      }
      continue;
    }
    if (!sub.is_directory(sub_ec)) continue;
    for (const auto& f : fs::directory_iterator(sub.path(), sub_ec)) {
      auto file = internal::ParseChunkFileName(name, f.path().filename().string());
      bool known = false;
      if (file) {
        MutexLock lock(&mu_);
        auto it = entries_.find(ChunkId{file->blob_key, file->chunk});
        known = it != entries_.end() && it->second.generation == file->generation;
      }
      if (!known) unknown.push_back(f.path().string());
    }
  }
  internal::RemoveFiles(unknown);
}

}  // namespace dte
