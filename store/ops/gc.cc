#include "store/ops/gc.h"

#include <algorithm>
#include <ctime>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "store/store.h"
#include "store/write/anchor_policy.h"
#include "store/write/rebase.h"

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
  // The manifest key of each kept version, once RebaseKept is done (a
  // rebased version's new revision): what every later step keeps.
  std::map<uint64_t, std::string> kept_keys;
};

// One plan from one listing; `damaged` says why the listing cannot be
// planned with (then there is no plan): it names a kept version whose
// manifest is gone when read, or lacks a kept delta's parent whose manifest
// exists (gc deletes a parent's manifest only after rebasing its children).
Result<GcPlan> PlanGcOnce(Store& store, const GcOptions& options, std::string* damaged) {
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
    auto v = store.GetVersionAt(k, versions[k]);
    if (!v.ok() && v.status().code() == Code::kNotFound) {
      ASSIGN_OR_RETURN(bool exists, store.ManifestExists(k, versions[k]));
      if (exists) return v.status().WithContext("gc: " + versions[k]);  // a blob is missing
      *damaged = "names " + versions[k] + ", which does not exist when read directly";
      return plan;
    }
    RETURN_IF_ERROR(v.status());
    plan.kept_keys[k] = (*v)->key;
    const auto& parent = (*v)->manifest.parent;
    if (parent && !plan.listed.count(*parent)) {
      ASSIGN_OR_RETURN(bool exists, store.ManifestExists(*parent, ManifestKey(*parent, 0)));
      if (exists) {
        *damaged = "lacks " + ManifestKey(*parent, 0) + ", the parent of " + VersionName(k) +
                   ", which exists when read directly";
        return plan;
      }
    }
    if (parent && !plan.keep.count(*parent)) plan.rebase.insert(k);
  }
  return plan;
}

// The newest keep_last listed versions and every multiple of keep_every.
// A listing PlanGcOnce finds damaged makes the plan start again from a
// fresh listing, a few times at most.
Result<GcPlan> PlanGc(Store& store, const GcOptions& options) {
  constexpr int kAttempts = 3;
  std::string damaged;
  for (int attempt = 1; attempt <= kAttempts; ++attempt) {
    damaged.clear();
    ASSIGN_OR_RETURN(GcPlan plan, PlanGcOnce(store, options, &damaged));
    if (damaged.empty()) return plan;
  }
  return IOError("gc: " + std::to_string(kAttempts) + " listings of the manifests of store " +
                 store.uri() + " in a row were damaged; the last " + damaged);
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
Status RebaseKept(Store& store, GcPlan& plan, const GcOptions& options, const Progress& progress,
                  GcResult* r) {
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
      plan.kept_keys[k] = v->key;
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
// ones (older than the revision gc keeps, plan.kept_keys), newest first,
// so a crash in between never leaves a listed version whose parent
// manifest is already gone (a parent is always older). Only versions
// listed at the start are removed: one committed since is newer than all
// of them. Returns the versions removed.
Result<std::set<uint64_t>> DeleteManifests(Store& store, const GcPlan& plan) {
  ASSIGN_OR_RETURN(auto keys, store.objects().ListStoreKeys("manifests/"));
  std::vector<std::pair<std::pair<uint64_t, uint32_t>, std::string>> parsed;
  for (const auto& key : keys) {
    if (auto p = ParseManifestKey(key)) parsed.emplace_back(*p, key);
  }
  std::sort(parsed.rbegin(), parsed.rend());
  std::set<uint64_t> removed;
  for (const auto& [p, key] : parsed) {
    const auto [v, revision] = p;
    const bool remove = plan.listed.count(v) && !plan.keep.count(v);
    auto kept = plan.kept_keys.find(v);
    const bool superseded =
        kept != plan.kept_keys.end() && revision < ParseManifestKey(kept->second)->second;
    if (remove || superseded) {
      RETURN_IF_ERROR(store.objects().Delete(key));
      store.Forget(v);
      if (remove) removed.insert(v);
    }
  }
  return removed;
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

// The versions whose manifests exist, for the sweep: a fresh listing,
// and every kept version it lacks (or lists at another revision than the
// one gc keeps) whose manifest exists when read directly. A kept version
// the listing lacks counts as gone only once its manifest is confirmed
// gone, so one damaged listing cannot make its blobs unreferenced.
// `other_revisions`: kept revisions that exist beside the one listed.
Result<std::map<uint64_t, std::string>> ExistingVersions(
    Store& store, const GcPlan& plan, std::map<uint64_t, std::string>* other_revisions) {
  ASSIGN_OR_RETURN(auto versions, store.ListVersions(/*fresh=*/true));
  for (const auto& [k, key] : plan.kept_keys) {
    auto it = versions.find(k);
    if (it != versions.end() && it->second == key) continue;
    ASSIGN_OR_RETURN(bool exists, store.ManifestExists(k, key));
    if (!exists) continue;
    if (it == versions.end()) {
      versions[k] = key;
    } else {
      (*other_revisions)[k] = key;
    }
  }
  return versions;
}

// Adds the blobs of `versions` to `live`, reading each manifest at its key.
// A listed manifest that is gone when read (removed meanwhile, or named by
// a damaged listing) reaches nothing; any other failure stops the sweep.
Status AddReachable(Store& store, const std::map<uint64_t, std::string>& versions,
                    std::set<std::string>* live) {
  for (const auto& [k, key] : versions) {
    auto v = store.GetVersionAt(k, key);
    if (!v.ok() && v.status().code() == Code::kNotFound) {
      ASSIGN_OR_RETURN(bool exists, store.ManifestExists(k, key));
      if (!exists) continue;
    }
    if (!v.ok()) return v.status().WithContext("gc: reading " + key);
    Reachable((*v)->manifest, live);
  }
  return Status::Ok();
}

// 3. Sweeps blobs no existing manifest or join table reaches, except young
// ones. The manifests are listed again after the blobs: a version that
// either listing shows keeps its blobs, so a version committed meanwhile,
// or one a single damaged listing lacks, loses nothing.
Status SweepBlobs(Store& store, const GcPlan& plan, int64_t grace_seconds, GcResult* r) {
  std::set<std::string> live;
  std::map<uint64_t, std::string> other_revisions;
  ASSIGN_OR_RETURN(auto versions, ExistingVersions(store, plan, &other_revisions));
  RETURN_IF_ERROR(AddReachable(store, versions, &live));
  RETURN_IF_ERROR(AddReachable(store, other_revisions, &live));
  RETURN_IF_ERROR(KeepJoinTables(store, versions, &live));
  ASSIGN_OR_RETURN(auto blobs, store.objects().ListStoreKeys("blobs/"));
  ASSIGN_OR_RETURN(auto again, store.ListVersions(/*fresh=*/true));
  for (auto it = again.begin(); it != again.end();) {
    it = versions.count(it->first) && versions[it->first] == it->second ? again.erase(it)
                                                                        : std::next(it);
  }
  RETURN_IF_ERROR(AddReachable(store, again, &live));
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
  ASSIGN_OR_RETURN(GcPlan plan, PlanGc(store, options));
  r.versions_kept = plan.keep.size();
  r.versions_removed = plan.listed.size() - plan.keep.size();
  r.versions_rebased = plan.rebase.size();
  if (options.dry_run) return r;
  r.versions_rebased = 0;
  RETURN_IF_ERROR(RebaseKept(store, plan, options, progress, &r));
  ASSIGN_OR_RETURN(auto removed, DeleteManifests(store, plan));
  r.versions_removed = removed.size();
  RETURN_IF_ERROR(SweepBlobs(store, plan, options.grace_seconds, &r));
  // 4. Spool files of commits that died before handing them over. A live
  // commit may leave its spool untouched for a long time (small deltas are
  // written in one piece at the end), so these get at least an hour.
  ASSIGN_OR_RETURN(r.temp_files_deleted, store.objects().RemoveStaleTemp(std::max<int64_t>(
                                             options.grace_seconds, kMinTempAgeSeconds)));
  // 5. Messages of distributed publishes that died (the store transport,
  // sync/transport/transport.h): a live one reads its messages within its timeout.
  {
    ASSIGN_OR_RETURN(auto keys, store.objects().ListStoreKeys("exchange/"));
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
