#include "sync/gc.h"

#include <algorithm>
#include <ctime>
#include <map>
#include <memory>
#include <set>

#include "store/store.h"
#include "sync/anchor_policy.h"
#include "sync/internal/rebase.h"

namespace dte {
namespace {

using Progress = std::function<void(uint64_t, uint64_t)>;

void Reachable(const Manifest& m, std::set<std::string>* keys) {
  keys->insert(BlobKey(m.block_table.hash));
  for (const auto& b : m.blobs) keys->insert(BlobKey(b.hash));
  if (m.full) {
    keys->insert(BlobKey(m.full->block_table.hash));
    for (const auto& b : m.full->blobs) keys->insert(BlobKey(b.hash));
  }
  for (const auto& f : m.files) keys->insert(BlobKey(f.safetensors ? f.header_blob : f.blob));
}

// What gc does to the versions it listed at its start.
struct GcPlan {
  std::set<uint64_t> listed;
  std::set<uint64_t> keep;
  std::set<uint64_t> rebase;  // kept versions whose parent is not kept
};

// The newest keep_last listed versions and every multiple of keep_every.
Result<GcPlan> PlanGc(Store& store, const GcOptions& options) {
  GcPlan plan;
  ASSIGN_OR_RETURN(auto versions, store.ListVersions(/*fresh=*/true));
  for (const auto& [v, key] : versions) {
    plan.listed.insert(v);
    if (options.keep_every > 0 && v % options.keep_every == 0) plan.keep.insert(v);
  }
  auto it = plan.listed.rbegin();
  for (uint64_t n = 0; it != plan.listed.rend() && n < options.keep_last; ++it, ++n) {
    plan.keep.insert(*it);
  }
  for (uint64_t k : plan.keep) {
    ASSIGN_OR_RETURN(auto v, store.GetVersionAt(k, versions[k]));
    const auto& parent = v->manifest.parent;
    if (parent && !plan.keep.count(*parent)) plan.rebase.insert(k);
  }
  return plan;
}

// The kept version below `v` that v becomes a delta of, or null: v becomes
// an anchor if it carries a full table (its dense records are stored
// already), or if no older version is kept, or if that one's layout differs.
std::shared_ptr<const Version> RebaseTarget(const std::shared_ptr<const Version>& v,
                                            const std::shared_ptr<const Version>& previous) {
  const Manifest& m = v->manifest;
  if (m.full || !previous) return nullptr;
  if (!SameTensorLayout(previous->manifest, m.files, m.block_bytes)) return nullptr;
  return previous;
}

// 1. Makes every kept version's chain stay inside the kept set. Oldest
// first, so a version is rebased onto the previous kept one in its final
// form, and every kept version's distance from its nearest self-contained
// one is known along the new chains.
Status RebaseKept(Store& store, const GcPlan& plan, const GcOptions& options,
                  const Progress& progress, GcResult* r) {
  std::map<uint64_t, AnchorDistance> distance;
  std::shared_ptr<const Version> previous;
  for (uint64_t k : plan.keep) {
    ASSIGN_OR_RETURN(auto v, store.GetVersion(k));
    if (plan.rebase.count(k)) {
      auto onto = RebaseTarget(v, previous);
      const AnchorDistance onto_distance =
          onto ? distance[onto->manifest.version] : AnchorDistance{};
      AnchorPolicy policy;
      policy.budget = options.anchor_budget;
      auto d = internal::RebaseVersion(store, v, onto, onto_distance, policy, progress);
      if (!d.ok()) return d.status().WithContext("rebasing " + VersionName(k));
      distance[k] = *d;
      store.Forget(k);
      r->versions_rebased++;
      ASSIGN_OR_RETURN(v, store.GetVersion(k));
    } else if (v->manifest.self_contained()) {
      distance[k] = AnchorDistance{};
    } else if (auto p = distance.find(*v->manifest.parent); p != distance.end()) {
      distance[k] = NextDistance(p->second, false, v->manifest.stats.stored_bytes);
    } else {
      ASSIGN_OR_RETURN(distance[k], DistanceOf(store, v));
    }
    previous = v;
  }
  return Status::Ok();
}

// 2. Drops manifests of removed versions and superseded revisions of kept
// ones, newest first, so a crash in between never leaves a listed version
// whose parent manifest is already gone (a parent is always older). Only
// versions listed at the start are removed: one committed since is newer
// than all of them. Returns how many versions were removed.
Result<uint64_t> DeleteManifests(Store& store, const GcPlan& plan) {
  ASSIGN_OR_RETURN(auto keys, store.objects().List("manifests/"));
  ASSIGN_OR_RETURN(auto versions, store.ListVersions(/*fresh=*/true));
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
    const bool remove = plan.listed.count(v) && !plan.keep.count(v);
    const bool superseded = plan.keep.count(v) && versions.count(v) && versions[v] != key;
    if (remove || superseded) {
      RETURN_IF_ERROR(store.objects().Delete(key));
      store.Forget(v);
      if (remove) removed.insert(v);
    }
  }
  return removed.size();
}

// Join tables (store/manifest.h, JoinTable) of versions still at the
// revision they were built for, or newer than `versions` (committed since
// it was listed), keep their blobs; the others are deleted (their blobs
// are swept with the rest).
Status KeepJoinTables(Store& store, const std::map<uint64_t, std::string>& versions,
                      std::set<std::string>* live) {
  ASSIGN_OR_RETURN(auto joins, ReadJoinTables(store));
  for (const auto& [v, l] : joins) {
    if (!l.table || !JoinIsCurrent(v, *l.table, versions)) {
      RETURN_IF_ERROR(store.objects().Delete(l.key));
      store.DropJoin(v);
      continue;
    }
    live->insert(BlobKey(l.table->table.block_table.hash));
    for (const auto& b : l.table->table.blobs) live->insert(BlobKey(b.hash));
  }
  return Status::Ok();
}

// 3. Sweeps blobs no listed version or join table reaches, except young ones.
Status SweepBlobs(Store& store, int64_t grace_seconds, GcResult* r) {
  std::set<std::string> live;
  ASSIGN_OR_RETURN(auto versions, store.ListVersions(/*fresh=*/true));
  for (const auto& [k, key] : versions) {
    ASSIGN_OR_RETURN(auto v, store.GetVersionAt(k, key));
    Reachable(v->manifest, &live);
  }
  RETURN_IF_ERROR(KeepJoinTables(store, versions, &live));
  ASSIGN_OR_RETURN(auto blobs, store.objects().List("blobs/"));
  const int64_t cutoff = static_cast<int64_t>(std::time(nullptr)) - grace_seconds;
  for (const auto& key : blobs) {
    if (live.count(key)) continue;
    ASSIGN_OR_RETURN(int64_t mtime, store.objects().ModifiedTime(key));
    if (mtime > cutoff) continue;
    ASSIGN_OR_RETURN(auto size, store.objects().Size(key));
    RETURN_IF_ERROR(store.objects().Delete(key));
    r->blobs_deleted++;
    r->bytes_freed += size.value_or(0);
  }
  return Status::Ok();
}

}  // namespace

Status CheckGcOptions(const GcOptions& options) {
  if (options.keep_last == 0) return InvalidArgument("--keep-last must be at least 1");
  AnchorPolicy policy;
  policy.budget = options.anchor_budget;
  return CheckAnchorPolicy(policy);
}

Result<GcResult> CollectGarbage(Store& store, const GcOptions& options, const Progress& progress) {
  RETURN_IF_ERROR(CheckGcOptions(options));
  GcResult r;
  ASSIGN_OR_RETURN(const GcPlan plan, PlanGc(store, options));
  r.versions_kept = plan.keep.size();
  r.versions_removed = plan.listed.size() - plan.keep.size();
  r.versions_rebased = plan.rebase.size();
  if (options.dry_run) return r;
  r.versions_rebased = 0;
  RETURN_IF_ERROR(RebaseKept(store, plan, options, progress, &r));
  ASSIGN_OR_RETURN(r.versions_removed, DeleteManifests(store, plan));
  RETURN_IF_ERROR(SweepBlobs(store, options.grace_seconds, &r));
  // 4. Spool files of commits that died before handing them over. A live
  // commit may leave its spool untouched for a long time (small deltas are
  // written in one piece at the end), so these get at least an hour.
  ASSIGN_OR_RETURN(r.temp_files_deleted, store.objects().RemoveStaleTemp(std::max<int64_t>(
                                             options.grace_seconds, kMinTempAgeSeconds)));
  // 5. Messages of distributed publishes that died (the store transport,
  // sync/transport.h): a live one reads its messages within its timeout.
  {
    ASSIGN_OR_RETURN(auto keys, store.objects().List("exchange/"));
    const int64_t cutoff = static_cast<int64_t>(std::time(nullptr)) - options.grace_seconds;
    for (const std::string& key : keys) {
      auto mtime = store.objects().ModifiedTime(key);
      if (!mtime.ok()) {
        if (mtime.status().code() == Code::kNotFound) continue;  // read meanwhile
        return mtime.status();
      }
      if (*mtime > cutoff) continue;
      Status s = store.objects().Delete(key);
      if (!s.ok() && s.code() != Code::kNotFound) return s;
      r.exchange_objects_deleted++;
    }
  }
  RETURN_IF_ERROR(store.SyncIndex(false));
  return r;
}

}  // namespace dte
