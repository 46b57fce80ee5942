#include "store/cached_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "store/base/posix_file.h"
#include "store/hash.h"
#include "store/internal/chunk_entry.h"

namespace dte {
namespace {

using internal::ChunkEntry;

constexpr size_t kMaxTicksPerWrite = 64;  // use-order updates riding on one insert

// Holds one of the fetch slots for the scope.
class FetchSlot {
 public:
  explicit FetchSlot(std::counting_semaphore<>* slots) : slots_(slots) { slots_->acquire(); }
  ~FetchSlot() { slots_->release(); }
  FetchSlot(const FetchSlot&) = delete;
  FetchSlot& operator=(const FetchSlot&) = delete;

 private:
  std::counting_semaphore<>* const slots_;
};

}  // namespace

CachedStore::CachedStore(std::unique_ptr<ObjectStore> base, Index* index,
                         CachedStoreOptions options)
    : base_(std::move(base)),
      index_(index),
      options_(std::move(options)),
      fetch_slots_(std::max(1, options_.max_fetches)) {}

CachedStore::~CachedStore() { Flush().IgnoreError(); }

bool CachedStore::IsBlobKey(std::string_view key) {
  // "blobs/" hh "/" 32 lowercase hex digits starting with hh.
  if (key.size() != 6 + 3 + 32 || !key.starts_with("blobs/") || key[8] != '/') return false;
  for (char c : key.substr(9)) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return key.substr(6, 2) == key.substr(9, 2);
}

std::string CachedStore::PathOf(const ChunkId& id, uint64_t generation) const {
  return options_.dir + "/" + internal::ChunkFileName(id.key, id.index, generation);
}

// --- reads --------------------------------------------------------------------------

void CachedStore::NoteSize(const std::string& key, uint64_t size) {
  if (!IsBlobKey(key)) return;
  MutexLock lock(&mu_);
  sizes_[key] = size;
}

Result<uint64_t> CachedStore::BlobSize(const std::string& key) {
  {
    MutexLock lock(&mu_);
    if (auto it = sizes_.find(key); it != sizes_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::optional<uint64_t> size, base_->Size(key));
  if (!size) return NotFound("object " + key + " not found in store " + Describe());
  MutexLock lock(&mu_);
  sizes_[key] = *size;
  return *size;
}

Result<std::vector<ChunkId>> CachedStore::ChunksOf(const std::string& key, uint64_t offset,
                                                   uint64_t len) {
  ASSIGN_OR_RETURN(uint64_t size, BlobSize(key));
  if (offset > size || len > size - offset) {
    return Corruption("object " + key + " in store " + Describe() + " is " + std::to_string(size) +
                      " bytes, shorter than the requested range [" + std::to_string(offset) + ", " +
                      std::to_string(offset + len) + ")");
  }
  std::vector<ChunkId> out;
  if (len == 0) return out;
  for (uint64_t c = offset / options_.chunk_bytes; c * options_.chunk_bytes < offset + len; ++c) {
    out.push_back(ChunkId{key, static_cast<uint32_t>(c)});
  }
  return out;
}

uint64_t CachedStore::ChunkLength(const ChunkId& id) {
  MutexLock lock(&mu_);
  auto it = sizes_.find(id.key);
  const uint64_t start = uint64_t{id.index} * options_.chunk_bytes;
  if (it == sizes_.end() || start >= it->second) return 0;
  return std::min(options_.chunk_bytes, it->second - start);
}

bool CachedStore::Contains(const ChunkId& id) {
  MutexLock lock(&mu_);
  return entries_.count(id) > 0;
}

Status CachedStore::ReadCached(const std::string& key, uint64_t offset, uint64_t len, char* dst) {
  ASSIGN_OR_RETURN(std::vector<ChunkId> chunks, ChunksOf(key, offset, len));
  const uint64_t cb = options_.chunk_bytes;
  for (const ChunkId& id : chunks) {
    const uint64_t start = uint64_t{id.index} * cb;
    const uint64_t from = std::max(offset, start), to = std::min(offset + len, start + cb);
    RETURN_IF_ERROR(ReadChunk(id, from - start, to - from, dst + (from - offset)));
  }
  return Status::Ok();
}

CachedStore::Step CachedStore::Begin(const ChunkId& id, bool use_disk) {
  MutexLock lock(&mu_);
  Step step;
  if (auto it = entries_.find(id); it != entries_.end() && use_disk) {
    stats_.hits++;
    TouchLocked(it->first, &it->second);
    step.kept = Kept{PathOf(id, it->second.generation), it->second.generation, it->second.length,
                     it->second.pages};
    return step;
  }
  stats_.misses++;
  if (auto it = fetching_.find(id); it != fetching_.end()) {
    step.join = it->second;
    return step;
  }
  auto size_it = sizes_.find(id.key);  // ChunksOf and Prefetch learned it
  const uint64_t start = uint64_t{id.index} * options_.chunk_bytes;
  if (size_it == sizes_.end() || start >= size_it->second) {
    step.error = Internal("blob cache: chunk " + std::to_string(id.index) + " of " + id.key +
                          " is outside the blob's known size");
    return step;
  }
  step.blob_size = size_it->second;
  step.length = std::min(options_.chunk_bytes, step.blob_size - start);
  step.fetch = std::make_shared<std::promise<Result<Bytes>>>();
  fetching_.emplace(id, step.fetch->get_future().share());
  return step;
}

Result<CachedStore::Bytes> CachedStore::RunFetch(const ChunkId& id, const Step& step) {
  Result<Bytes> bytes = Fetch(id, step.length, step.blob_size);
  {
    MutexLock lock(&mu_);
    fetching_.erase(id);
  }
  step.fetch->set_value(bytes);
  return bytes;
}

Status CachedStore::ReadChunk(const ChunkId& id, uint64_t from, uint64_t len, char* dst) {
  for (bool use_disk : {true, false}) {
    Step step = Begin(id, use_disk);
    RETURN_IF_ERROR(step.error);
    if (step.kept) {
      Status s = ReadKept(*step.kept, from, len, dst);
      if (s.ok()) return s;
      DropChunk(id, step.kept->generation, s.message());
      continue;  // fetch it again
    }
    Result<Bytes> bytes = step.join.valid() ? step.join.get() : RunFetch(id, step);
    if (!bytes.ok()) return bytes.status();
    std::memcpy(dst, (*bytes)->data() + from, len);
    return Status::Ok();
  }
  return Internal("blob cache: chunk " + std::to_string(id.index) + " of " + id.key +
                  " was neither read nor fetched");
}

Status CachedStore::ReadKept(const Kept& kept, uint64_t from, uint64_t len, char* dst) const {
  const uint64_t first = from / kCachePageBytes;
  const uint64_t begin = first * kCachePageBytes;
  const uint64_t end =
      std::min(kept.length, (from + len + kCachePageBytes - 1) / kCachePageBytes * kCachePageBytes);
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(kept.path, O_RDONLY));
  std::string buf(end - begin, '\0');
  RETURN_IF_ERROR(PreadExact(fd.get(), buf.data(), buf.size(), begin, kept.path, [&](uint64_t n) {
    return Corruption("cached chunk " + kept.path + " is short (" + std::to_string(begin + n) +
                      " of " + std::to_string(kept.length) + " bytes)");
  }));
  for (uint64_t at = 0, page = first; at < buf.size(); at += kCachePageBytes, ++page) {
    const uint64_t n = std::min<uint64_t>(kCachePageBytes, buf.size() - at);
    if (HashBlock(buf.data() + at, n) != (*kept.pages)[page]) {
      return Corruption("cached chunk " + kept.path + ": page " + std::to_string(page) +
                        " does not match its checksum");
    }
  }
  std::memcpy(dst, buf.data() + (from - begin), len);
  return Status::Ok();
}

Result<CachedStore::Bytes> CachedStore::Fetch(const ChunkId& id, uint64_t length,
                                              uint64_t blob_size) {
  FetchSlot slot(&fetch_slots_);
  auto bytes = std::make_shared<std::string>(length, '\0');
  // A chunk that is the whole blob can be checked against the blob's name.
  const bool whole = id.index == 0 && length == blob_size;
  const std::optional<Hash128> hash = Hash128::FromHex(id.key.substr(9));
  for (int attempt = 1;; ++attempt) {
    RETURN_IF_ERROR(
        base_->ReadRange(id.key, uint64_t{id.index} * options_.chunk_bytes, length, bytes->data()));
    {
      MutexLock lock(&mu_);
      stats_.fetches++;
      stats_.fetched_bytes += length;
    }
    if (!whole || HashBytes(bytes->data(), bytes->size()) == hash) break;
    if (attempt == 2) {
      return Corruption("blob " + id.key + " read from store " + Describe() +
                        " does not match its hash (read twice)");
    }
  }
  Status kept = Keep(id, blob_size, *bytes);
  if (!kept.ok()) NoteWriteError(kept);
  return Bytes(std::move(bytes));
}

// --- keeping and dropping ------------------------------------------------------------

Result<uint64_t> CachedStore::WriteChunkFile(const ChunkId& id, std::string_view bytes) {
  const std::string tmp =
      options_.dir + "/tmp/" + std::to_string(::getpid()) + "-" + std::to_string(temp_counter_++);
  {
    ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    Status w = WriteAll(fd.get(), bytes.data(), bytes.size(), tmp);
    if (w.ok()) w = fd.Close(tmp);
    if (!w.ok()) {
      ::unlink(tmp.c_str());
      return w;
    }
  }
  uint64_t generation = 0;
  {
    MutexLock lock(&mu_);
    generation = next_generation_++;
  }
  const std::string path = PathOf(id, generation);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec || ::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = ErrnoStatus("rename " + tmp + " to " + path, ec ? ec.value() : errno);
    ::unlink(tmp.c_str());
    return s;
  }
  return generation;
}

Status CachedStore::Keep(const ChunkId& id, uint64_t blob_size, std::string_view bytes) {
  if (bytes.size() > options_.capacity_bytes) return Status::Ok();  // would evict everything
  auto pages =
      std::make_shared<const std::vector<uint64_t>>(internal::PageHashes(bytes, kCachePageBytes));
  ASSIGN_OR_RETURN(uint64_t generation, WriteChunkFile(id, bytes));
  std::vector<std::string> unlink, deletes;
  Status s;
  {
    MutexLock lock(&mu_);
    InsertLocked(id, Entry{blob_size, bytes.size(), generation, next_tick_++, std::move(pages), {}},
                 &unlink, &deletes);
    // The entry, and some use-order updates with it, in one batch with the
    // evictions.
    std::vector<std::pair<std::string, std::string>> puts = {EntryRecordLocked(id)};
    while (!unsaved_.empty() && puts.size() < kMaxTicksPerWrite) {
      puts.push_back(EntryRecordLocked(*unsaved_.begin()));
      unsaved_.erase(unsaved_.begin());
    }
    s = index_->UpdateCacheEntries(puts, deletes);
    if (!s.ok()) {
      // The index does not know the chunk: do not keep it either.
      std::vector<std::string> ignored;
      EraseLocked(entries_.find(id), &unlink, &ignored);
    }
  }
  internal::RemoveFiles(unlink);
  return s;
}

void CachedStore::InsertLocked(const ChunkId& id, Entry entry, std::vector<std::string>* unlink,
                               std::vector<std::string>* deletes) {
  if (auto old = entries_.find(id); old != entries_.end()) EraseLocked(old, unlink, deletes);
  bytes_ += entry.length;
  entry.lru = lru_.insert(lru_.begin(), id);
  entries_.emplace(id, std::move(entry));
  while (bytes_ > options_.capacity_bytes && lru_.size() > 1) {
    EraseLocked(entries_.find(lru_.back()), unlink, deletes);
    stats_.evictions++;
  }
}

void CachedStore::TouchLocked(const ChunkId& id, Entry* e) {
  lru_.splice(lru_.begin(), lru_, e->lru);
  e->tick = next_tick_++;
  unsaved_.insert(id);
}

std::pair<std::string, std::string> CachedStore::EntryRecordLocked(const ChunkId& id) {
  const Entry& e = entries_.at(id);
  const ChunkEntry record{options_.chunk_bytes, e.blob_size, e.generation, e.tick, *e.pages};
  return {internal::ChunkEntryKey(id.key, id.index), internal::EncodeChunkEntry(record)};
}

void CachedStore::EraseLocked(std::map<ChunkId, Entry>::iterator it,
                              std::vector<std::string>* unlink, std::vector<std::string>* deletes) {
  bytes_ -= it->second.length;
  lru_.erase(it->second.lru);
  unsaved_.erase(it->first);
  unlink->push_back(PathOf(it->first, it->second.generation));
  deletes->push_back(internal::ChunkEntryKey(it->first.key, it->first.index));
  entries_.erase(it);
}

void CachedStore::DropChunk(const ChunkId& id, uint64_t generation, const std::string& why) {
  std::vector<std::string> unlink, deletes;
  {
    MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.generation != generation) return;
    EraseLocked(it, &unlink, &deletes);
    stats_.dropped++;
    stats_.last_error = why;
    // If this fails, the entry outlives its file, and the next open drops it.
    index_->UpdateCacheEntries({}, deletes).IgnoreError();
  }
  internal::RemoveFiles(unlink);
}

void CachedStore::Drop(const std::string& key, uint64_t offset, uint64_t len) {
  const uint64_t end = len > UINT64_MAX - offset ? UINT64_MAX : offset + len;
  std::vector<std::string> unlink, deletes;
  {
    MutexLock lock(&mu_);
    for (auto it = entries_.lower_bound(ChunkId{key, 0});
         it != entries_.end() && it->first.key == key;) {
      const uint64_t start = uint64_t{it->first.index} * options_.chunk_bytes;
      const bool overlaps = start < end && offset < start + it->second.length;
      auto next = std::next(it);
      if (overlaps) {
        EraseLocked(it, &unlink, &deletes);
        stats_.dropped++;
        stats_.last_error = "chunks of " + key + " dropped: a reader found bad bytes";
      }
      it = next;
    }
    if (!deletes.empty()) index_->UpdateCacheEntries({}, deletes).IgnoreError();
  }
  internal::RemoveFiles(unlink);
}

Status CachedStore::Flush() {
  MutexLock lock(&mu_);
  std::vector<std::pair<std::string, std::string>> puts;
  for (const ChunkId& id : unsaved_) puts.push_back(EntryRecordLocked(id));
  unsaved_.clear();
  if (puts.empty()) return Status::Ok();
  return index_->UpdateCacheEntries(puts, {});
}

BlobCacheStats CachedStore::Stats() const {
  MutexLock lock(&mu_);
  BlobCacheStats s = stats_;
  s.capacity_bytes = options_.capacity_bytes;
  s.chunk_bytes = options_.chunk_bytes;
  s.bytes = bytes_;
  s.chunks = entries_.size();
  return s;
}

// --- ObjectStore ----------------------------------------------------------------------

Result<std::string> CachedStore::Get(const std::string& key) {
  if (!IsBlobKey(key)) return base_->Get(key);
  ASSIGN_OR_RETURN(uint64_t size, BlobSize(key));
  std::string out(size, '\0');
  RETURN_IF_ERROR(ReadCached(key, 0, size, out.data()));
  if (HashBytes(out.data(), out.size()) != Hash128::FromHex(key.substr(9))) {
    // A chunk of a large blob that came in damaged: fetch everything again
    // (the caller checks the result).
    Drop(key, 0, size);
    RETURN_IF_ERROR(ReadCached(key, 0, size, out.data()));
  }
  return out;
}

Result<std::string> CachedStore::GetRange(const std::string& key, uint64_t offset, uint64_t len) {
  if (!IsBlobKey(key) || len > UINT64_MAX - offset) return base_->GetRange(key, offset, len);
  RETURN_IF_ERROR(ChunksOf(key, offset, len).status());  // checks the range before allocating
  std::string out(len, '\0');
  RETURN_IF_ERROR(ReadCached(key, offset, len, out.data()));
  return out;
}

Status CachedStore::ReadRange(const std::string& key, uint64_t offset, uint64_t len, void* dst) {
  if (!IsBlobKey(key) || len > UINT64_MAX - offset) return base_->ReadRange(key, offset, len, dst);
  return ReadCached(key, offset, len, static_cast<char*>(dst));
}

Result<uint64_t> CachedStore::Prefetch(const ChunkId& id) {
  RETURN_IF_ERROR(BlobSize(id.key).status());
  if (ChunkLength(id) == 0) {
    return InvalidArgument("blob cache: " + id.key + " has no chunk " + std::to_string(id.index));
  }
  Step step = Begin(id, true);
  RETURN_IF_ERROR(step.error);
  if (step.kept) return uint64_t{0};
  if (step.join.valid()) {
    RETURN_IF_ERROR(step.join.get().status());
    return uint64_t{0};
  }
  ASSIGN_OR_RETURN(Bytes bytes, RunFetch(id, step));
  return uint64_t{bytes->size()};
}

Status CachedStore::CreateExclusive(const std::string& key, std::string_view data) {
  return base_->CreateExclusive(key, data);
}
Result<std::optional<uint64_t>> CachedStore::Size(const std::string& key) {
  return base_->Size(key);
}
Result<std::vector<std::string>> CachedStore::List(const std::string& prefix) {
  return base_->List(prefix);
}
Result<std::vector<std::string>> CachedStore::ListStoreKeys(const std::string& prefix) {
  return base_->ListStoreKeys(prefix);
}
Status CachedStore::Delete(const std::string& key) {
  RETURN_IF_ERROR(base_->Delete(key));
  if (IsBlobKey(key)) Drop(key, 0, UINT64_MAX);
  return Status::Ok();
}
Result<int64_t> CachedStore::ModifiedTime(const std::string& key) {
  return base_->ModifiedTime(key);
}
Status CachedStore::Touch(const std::string& key) { return base_->Touch(key); }
Result<std::string> CachedStore::NewTempPath() { return base_->NewTempPath(); }
Result<uint64_t> CachedStore::RemoveStaleTemp(int64_t min_age_seconds) {
  return base_->RemoveStaleTemp(min_age_seconds);
}

Result<KeyPage> CachedStore::ListAfter(const std::string& prefix, const std::string& start_after,
                                       int max_keys) {
  auto* lister = dynamic_cast<PagedLister*>(base_.get());
  if (!lister) return Unimplemented("store " + Describe() + " has no ListAfter");
  return lister->ListAfter(prefix, start_after, max_keys);
}

}  // namespace dte
