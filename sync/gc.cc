#include "sync/gc.h"

#include <algorithm>
#include <ctime>
#include <set>

#include "store/materialize.h"
#include "store/store.h"
#include "sync/internal/blob_sink.h"

namespace dte {
namespace {

void Reachable(const Manifest& m, std::set<std::string>* keys) {
  keys->insert(BlobKey(m.block_table.hash));
  for (const auto& b : m.blobs) keys->insert(BlobKey(b.hash));
  if (m.full) {
    keys->insert(BlobKey(m.full->block_table.hash));
    for (const auto& b : m.full->blobs) keys->insert(BlobKey(b.hash));
  }
  for (const auto& f : m.files) keys->insert(BlobKey(f.safetensors ? f.header_blob : f.blob));
}

// Writes version v again as an anchor, under the next manifest revision.
Status Rebase(Store& store, const std::shared_ptr<const Version>& v,
              const std::function<void(uint64_t, uint64_t)>& progress) {
  Manifest m = v->manifest;
  std::vector<BlockRecord> records = v->records;
  internal::BlobSink sink(&store.objects());
  Materializer reader(&store);
  m.parent.reset();
  m.revision++;
  m.blobs.clear();
  uint64_t total = 0, done = 0;
  for (const auto& f : m.files) total += f.size;
  Status s = [&]() -> Status {
    for (const auto& f : m.files) {
      if (!f.safetensors) continue;
      ASSIGN_OR_RETURN(auto spool, sink.NewSpool());
      RETURN_IF_ERROR(reader.StreamFile(v, f, [&](uint64_t off, const uint8_t* d, size_t n) {
        done += n;
        if (progress) progress(done, total);
        return off < f.header_size ? Status::Ok() : spool->Append(d, n);
      }));
      uint32_t blob = static_cast<uint32_t>(m.blobs.size());
      ASSIGN_OR_RETURN(BlobRef ref, sink.Finish(std::move(spool)));
      m.blobs.push_back(ref);
      for (const auto& t : f.tensors) {
        for (uint32_t b = 0; b < t.blocks; ++b) {
          BlockRecord& r = records[t.first_block + b];
          r.kind = BlockKind::kDenseRaw;
          r.blob = blob;
          r.offset = t.begin + uint64_t{b} * m.block_bytes;
          r.length = static_cast<uint32_t>(
              std::min<uint64_t>(m.block_bytes, t.bytes() - r.offset + t.begin));
          r.changed = 0;
        }
      }
    }
    // An anchor's every element is new, as for a first import.
    m.stats.changed_elements = m.stats.elements;
    for (auto& f : m.files) {
      for (auto& t : f.tensors) t.changed = t.elements();
    }
    ASSIGN_OR_RETURN(m.block_table, sink.PutBytes(EncodeBlockTable(records)));
    m.stats.stored_bytes = sink.added_bytes();
    return store.objects().CreateExclusive(ManifestKey(m.version, m.revision), EncodeManifest(m));
  }();
  return s;  // on failure, what it added is swept like any unreferenced blob
}

}  // namespace

Result<GcResult> CollectGarbage(Store& store, const GcOptions& options,
                                const std::function<void(uint64_t, uint64_t)>& progress) {
  if (options.keep_last == 0) return InvalidArgument("--keep-last must be at least 1");
  GcResult r;
  ASSIGN_OR_RETURN(auto versions, store.ListVersions(/*fresh=*/true));
  std::set<uint64_t> keep;
  for (auto it = versions.rbegin(); it != versions.rend() && keep.size() < options.keep_last;
       ++it) {
    keep.insert(it->first);
  }
  r.versions_kept = keep.size();
  r.versions_removed = versions.size() - keep.size();
  if (options.dry_run) return r;
  // Versions committed while gc runs are newer than every kept one; gc
  // neither removes nor sweeps anything of theirs.
  const uint64_t oldest_kept = *keep.begin();
  // 1. Make every kept version's chain stay inside the kept set.
  for (uint64_t k : keep) {
    ASSIGN_OR_RETURN(auto v, store.GetVersion(k));
    if (v->manifest.parent && !keep.count(*v->manifest.parent)) {
      RETURN_IF_ERROR(Rebase(store, v, progress).WithContext("rebasing " + VersionName(k)));
      store.Forget(k);
      r.versions_rebased++;
    }
  }
  // 2. Drop manifests of removed versions and superseded revisions, newest
  // first, so a crash in between never leaves a listed version whose parent
  // manifest is already gone.
  ASSIGN_OR_RETURN(auto keys, store.objects().List("manifests/"));
  ASSIGN_OR_RETURN(versions, store.ListVersions(/*fresh=*/true));
  std::sort(keys.begin(), keys.end(), [](const std::string& a, const std::string& b) {
    auto pa = ParseManifestKey(a), pb = ParseManifestKey(b);
    if (!pa || !pb) return a > b;
    return *pa > *pb;
  });
  std::set<uint64_t> removed;
  for (const auto& key : keys) {
    auto parsed = ParseManifestKey(key);
    if (!parsed) continue;
    const uint64_t v = parsed->first;
    bool superseded = keep.count(v) && versions.count(v) && versions[v] != key;
    if (v < oldest_kept || superseded) {
      RETURN_IF_ERROR(store.objects().Delete(key));
      store.Forget(v);
      if (v < oldest_kept) removed.insert(v);
    }
  }
  r.versions_removed = removed.size();
  // 3. Sweep blobs no kept version reaches.
  std::set<std::string> live;
  ASSIGN_OR_RETURN(versions, store.ListVersions(/*fresh=*/true));
  for (const auto& [k, key] : versions) {
    ASSIGN_OR_RETURN(auto v, store.GetVersionAt(k, key));
    Reachable(v->manifest, &live);
  }
  ASSIGN_OR_RETURN(auto blobs, store.objects().List("blobs/"));
  const int64_t cutoff = static_cast<int64_t>(std::time(nullptr)) - options.grace_seconds;
  for (const auto& key : blobs) {
    if (live.count(key)) continue;
    ASSIGN_OR_RETURN(int64_t mtime, store.objects().ModifiedTime(key));
    if (mtime > cutoff) continue;
    ASSIGN_OR_RETURN(auto size, store.objects().Size(key));
    RETURN_IF_ERROR(store.objects().Delete(key));
    r.blobs_deleted++;
    r.bytes_freed += size.value_or(0);
  }
  // 4. Spool files of commits that died before handing them over. A live
  // commit may leave its spool untouched for a long time (small deltas are
  // written in one piece at the end), so these get at least an hour.
  ASSIGN_OR_RETURN(r.temp_files_deleted, store.objects().RemoveStaleTemp(std::max<int64_t>(
                                             options.grace_seconds, kMinTempAgeSeconds)));
  RETURN_IF_ERROR(store.SyncIndex(false));
  return r;
}

}  // namespace dte
