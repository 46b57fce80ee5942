// CachedStore: write-through of the blobs written through it (see
// "Write-through" in store/cached_store.h).
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>

#include "store/base/posix_file.h"
#include "store/cached_store.h"
#include "store/hash.h"
#include "store/internal/chunk_entry.h"

namespace dte {

bool CachedStore::WritesThrough(const std::string& key, uint64_t size) const {
  return size > 0 && size <= options_.capacity_bytes && IsBlobKey(key);
}

Status CachedStore::Put(const std::string& key, std::string_view data) {
  if (!WritesThrough(key, data.size())) return base_->Put(key, data);
  auto staged =
      Stage(key, data.size(),
            [data](uint64_t offset, uint64_t len, std::string*) -> Result<std::string_view> {
              return data.substr(offset, len);
            });
  Status written = base_->Put(key, data);
  Settle(key, data.size(), std::move(staged), written);
  return written;
}

Status CachedStore::PutFile(const std::string& key, const std::string& path) {
  if (!IsBlobKey(key) || options_.capacity_bytes == 0) return base_->PutFile(key, path);
  Result<std::vector<Staged>> staged = std::vector<Staged>();
  uint64_t size = 0;
  {
    // The wrapped store reports a file it cannot read; here it only means
    // nothing is kept.
    Result<ScopedFd> fd = OpenFile(path, O_RDONLY);
    struct stat st {};
    if (!fd.ok() || ::fstat(fd->get(), &st) != 0) return base_->PutFile(key, path);
    size = static_cast<uint64_t>(st.st_size);
    if (!WritesThrough(key, size)) return base_->PutFile(key, path);
    const int raw = fd->get();
    staged = Stage(
        key, size,
        [&](uint64_t offset, uint64_t len, std::string* scratch) -> Result<std::string_view> {
          scratch->resize(len);
          RETURN_IF_ERROR(PreadExact(raw, scratch->data(), len, offset, path, [&](uint64_t n) {
            return IOError("file " + path + " shrank to " + std::to_string(offset + n) +
                           " bytes while cached");
          }));
          return std::string_view(*scratch);
        });
  }
  Status written = base_->PutFile(key, path);  // which may consume the file
  Settle(key, size, std::move(staged), written);
  return written;
}

Result<std::vector<CachedStore::Staged>> CachedStore::Stage(const std::string& key, uint64_t size,
                                                            const BlobReader& read) {
  const std::optional<Hash128> name = Hash128::FromHex(key.substr(9));
  std::vector<Staged> staged;
  Hasher128 hasher;
  std::string scratch;
  Status s;
  for (uint64_t offset = 0; offset < size && s.ok(); offset += options_.chunk_bytes) {
    const uint64_t len = std::min(options_.chunk_bytes, size - offset);
    const ChunkId id{key, static_cast<uint32_t>(offset / options_.chunk_bytes)};
    Result<std::string_view> bytes = read(offset, len, &scratch);
    if (!bytes.ok() || bytes->size() != len) {
      s = bytes.ok() ? Internal("blob cache: short read of " + key) : bytes.status();
      break;
    }
    hasher.Update(bytes->data(), bytes->size());
    Result<uint64_t> generation = WriteChunkFile(id, *bytes);
    if (!generation.ok()) {
      s = generation.status();
      break;
    }
    staged.push_back(Staged{id, *generation, len,
                            std::make_shared<const std::vector<uint64_t>>(
                                internal::PageHashes(*bytes, kCachePageBytes))});
  }
  if (s.ok() && (!name || hasher.Finish() != *name)) {
    s = Corruption("blob " + key + " written to store " + Describe() +
                   " does not match its name; not cached");
  }
  if (s.ok()) return staged;
  std::vector<std::string> files;
  for (const Staged& c : staged) files.push_back(PathOf(c.id, c.generation));
  internal::RemoveFiles(files);
  return s;
}

void CachedStore::Settle(const std::string& key, uint64_t size, Result<std::vector<Staged>> staged,
                         const Status& written) {
  if (!staged.ok()) return NoteWriteError(staged.status());
  std::vector<std::string> unlink, deletes;
  if (!written.ok()) {
    for (const Staged& c : *staged) unlink.push_back(PathOf(c.id, c.generation));
    internal::RemoveFiles(unlink);
    return;
  }
  Status s;
  {
    MutexLock lock(&mu_);
    sizes_[key] = size;
    for (const Staged& c : *staged) {
      InsertLocked(c.id, Entry{size, c.length, c.generation, next_tick_++, c.pages, {}}, &unlink,
                   &deletes);
    }
    // The blob fits the capacity, so the evictions took older entries only.
    std::vector<std::pair<std::string, std::string>> puts;
    for (const Staged& c : *staged) {
      if (entries_.count(c.id)) puts.push_back(EntryRecordLocked(c.id));
    }
    s = index_->UpdateCacheEntries(puts, deletes);
    if (s.ok()) {
      stats_.written += staged->size();
      stats_.written_bytes += size;
    } else {
      // The index does not know the chunks: do not keep them either.
      std::vector<std::string> ignored;
      for (const Staged& c : *staged) {
        if (auto it = entries_.find(c.id); it != entries_.end()) {
          EraseLocked(it, &unlink, &ignored);
        }
      }
    }
  }
  internal::RemoveFiles(unlink);
  if (!s.ok()) NoteWriteError(s);
}

void CachedStore::NoteWriteError(const Status& s) {
  MutexLock lock(&mu_);
  stats_.write_errors++;
  stats_.last_error = s.message();
}

}  // namespace dte
