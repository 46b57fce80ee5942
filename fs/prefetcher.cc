#include "fs/prefetcher.h"

#include <chrono>
#include <set>

#include "fs/internal/thread_priority.h"
#include "store/base/units.h"

namespace dte::fs {
namespace {

// v and its ancestors (chain[i + 1] is the parent of chain[i]) as far as the
// records of v's blocks can reach: back to the anchor, or to the first
// version with a full table (a policy anchor) or a join table, however long
// the run.
Result<VersionChain> ChainOf(Store* store, const std::shared_ptr<const Version>& v) {
  VersionChain chain{v};
  while (chain.back()->manifest.parent && !chain.back()->manifest.full &&
         !store->JoinOf(*chain.back())) {
    ASSIGN_OR_RETURN(auto parent, store->GetVersion(*chain.back()->manifest.parent));
    if (parent->records.size() != v->records.size()) break;  // the reader reports it
    chain.push_back(std::move(parent));
  }
  return chain;
}

Status AddRange(CachedStore* cache, const Hash128& blob, uint64_t offset, uint64_t len,
                std::set<ChunkId>* out) {
  ASSIGN_OR_RETURN(std::vector<ChunkId> chunks, cache->ChunksOf(BlobKey(blob), offset, len));
  out->insert(chunks.begin(), chunks.end());
  return Status::Ok();
}

}  // namespace

Result<std::vector<ChunkId>> PlanPrefetch(Store* store, CachedStore* cache, SnapshotSet* snapshots,
                                          const std::shared_ptr<const Version>& v) {
  std::set<ChunkId> chunks;
  const Manifest& m = v->manifest;
  RETURN_IF_ERROR(AddRange(cache, m.block_table.hash, 0, m.block_table.size, &chunks));
  for (const FileEntry& f : m.files) {
    RETURN_IF_ERROR(f.safetensors ? AddRange(cache, f.header_blob, 0, f.header_size, &chunks)
                                  : AddRange(cache, f.blob, 0, f.size, &chunks));
  }
  ASSIGN_OR_RETURN(VersionChain chain, ChainOf(store, v));
  std::vector<bool> snapshotted;
  for (const auto& link : chain) snapshotted.push_back(snapshots && snapshots->Has(*link));
  for (size_t r = 0; r < v->records.size(); ++r) {
    for (size_t depth = 0; depth < chain.size() && !snapshotted[depth]; ++depth) {
      const Version& cur = *chain[depth];
      if (cur.manifest.full && depth + 1 == chain.size()) {
        // The walk ends at the full table's record (dense).
        const BlockRecord& full = cur.full_records[r];
        RETURN_IF_ERROR(AddRange(cache, cur.manifest.full->blobs[full.blob].hash, full.offset,
                                 full.length, &chunks));
        break;
      }
      if (depth + 1 == chain.size() && cur.manifest.parent && !cur.manifest.full) {
        if (auto join = store->JoinOf(cur)) {  // ...or a join table's
          const BlockRecord& rec = join->records[r];
          RETURN_IF_ERROR(AddRange(cache, join->join.table.blobs[rec.blob].hash, rec.offset,
                                   rec.length, &chunks));
          break;
        }
      }
      const BlockRecord& rec = cur.records[r];
      if (rec.kind == BlockKind::kSame) continue;
      RETURN_IF_ERROR(
          AddRange(cache, cur.manifest.blobs[rec.blob].hash, rec.offset, rec.length, &chunks));
      if (rec.kind == BlockKind::kDenseRaw || rec.kind == BlockKind::kDenseZstd) break;
    }
  }
  return std::vector<ChunkId>(chunks.begin(), chunks.end());
}

Prefetcher::Prefetcher(Store* store, Filesystem* fs, CachedStore* cache, SnapshotSet* snapshots)
    : store_(store), fs_(fs), cache_(cache), snapshots_(snapshots), thread_([this] { Run(); }) {}

Prefetcher::~Prefetcher() {
  stop_ = true;
  thread_.join();
}

PrefetchStats Prefetcher::Stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void Prefetcher::Run() {
  LowerThreadPriority();
  std::string done;  // manifest key of the version known to be cached
  while (!stop_) {
    if (!wake_.exchange(false)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    std::shared_ptr<const Version> v = fs_->Latest();
    if (!v || v->key == done || fs_->StoreFailing()) continue;
    Status s = Prefetch(v);
    if (s.ok()) {
      done = v->key;
    } else if (s.code() == Code::kAborted) {
      wake_ = true;  // `latest` moved: start over with it at once
    } else if (!stop_) {
      Fail(v, s);
      if (s.code() == Code::kInvalidArgument) done = v->key;  // too large: no retry
    }
  }
}

bool Prefetcher::Superseded(const std::string& key) {
  if (stop_) return true;
  std::shared_ptr<const Version> latest = fs_->Latest();
  return latest && latest->key != key;
}

Status Prefetcher::Prefetch(const std::shared_ptr<const Version>& v) {
  {
    MutexLock lock(&mu_);
    stats_.version = v->manifest.version;
    stats_.chunks = stats_.bytes = stats_.chunks_done = stats_.bytes_done = 0;
    stats_.done = false;
  }
  ASSIGN_OR_RETURN(std::vector<ChunkId> plan, PlanPrefetch(store_, cache_, snapshots_, v));
  std::vector<ChunkId> missing;
  uint64_t total = 0, bytes = 0;
  for (ChunkId& id : plan) {
    const uint64_t len = cache_->ChunkLength(id);
    total += len;
    if (cache_->Contains(id)) continue;
    bytes += len;
    missing.push_back(std::move(id));
  }
  const uint64_t capacity = cache_->Stats().capacity_bytes;
  if (total > capacity) {
    return InvalidArgument("not prefetching " + VersionName(v->manifest.version) + ": it needs " +
                           FormatByteSize(total) + " of blob ranges, more than the blob cache's " +
                           FormatByteSize(capacity) + " (--blob-cache-size)");
  }
  {
    MutexLock lock(&mu_);
    stats_.chunks = missing.size();
    stats_.bytes = bytes;
  }
  RETURN_IF_ERROR(FetchAll(missing, v->key));
  MutexLock lock(&mu_);
  stats_.done = true;
  stats_.versions_done++;
  return Status::Ok();
}

Status Prefetcher::FetchAll(const std::vector<ChunkId>& chunks, const std::string& key) {
  std::atomic<size_t> next{0};
  std::atomic<bool> superseded{false};
  Mutex error_mu;
  Status error;
  auto work = [&] {
    LowerThreadPriority();
    for (size_t i; !superseded && (i = next++) < chunks.size();) {
      if (Superseded(key)) {
        superseded = true;
        break;
      }
      Result<uint64_t> fetched = cache_->Prefetch(chunks[i]);
      if (!fetched.ok()) {
        MutexLock lock(&error_mu);
        if (error.ok()) error = fetched.status();
        superseded = true;  // stop the others too
        break;
      }
      MutexLock lock(&mu_);
      stats_.chunks_done++;
      stats_.bytes_done += cache_->ChunkLength(chunks[i]);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < kParallelFetches; ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  MutexLock lock(&error_mu);
  if (!error.ok()) return error;
  if (superseded) return Aborted("prefetch of " + key + " superseded");
  return Status::Ok();
}

void Prefetcher::Fail(const std::shared_ptr<const Version>& v, const Status& s) {
  {
    MutexLock lock(&mu_);
    stats_.last_error = s.message();
  }
  if (reported_ == v->key || fs_->StoreFailing()) return;  // the poller reports outages
  reported_ = v->key;
  fs_->ReportError("prefetch of " + VersionName(v->manifest.version) + ": " + s.message());
}

}  // namespace dte::fs
