// Retention: keep the newest versions and a thinned history, reclaim the rest.
//
// gc keeps the last `keep_last` versions readable and, with `keep_every` K,
// every older version whose number is a multiple of K (a long run keeps a
// sparse history for evaluation at little cost). Kept versions are
// processed oldest first; one whose parent is removed is first rebased:
// written again under a new manifest revision with identical content
// hashes, as a delta against the previous kept version (the same kind of
// records a commit would write), or as an anchor when no older kept version
// of the same tensor layout exists. A version that carries a full table
// (a policy anchor) becomes an anchor made of that table, writing no data.
// Only then are the manifests of removed versions (and the revisions of kept
// ones older than the revision gc keeps) deleted, newest first, and last the
// blobs no remaining manifest reaches. Each step leaves a valid store, so a
// crash at any point loses nothing that is kept. Versions committed while gc
// runs (newer than every version it listed) are never removed.
//
// No listing is trusted alone (store/store.h, ListVersions): a blob is
// deleted only when no manifest that exists reaches it. The sweep reaches
// from a fresh listing, from every kept version that listing lacks whose
// manifest exists when read directly (Store::ManifestExists), and from a
// second listing of the manifests taken after the blobs were listed; a
// listed manifest that cannot be read stops the sweep unless it is
// confirmed gone. The plan is made again from a fresh listing when its
// listing names a kept version whose manifest is gone, or lacks a kept
// delta's parent whose manifest exists.
//
// Blobs younger than `grace_seconds` are never deleted: a publisher writes
// blobs before its manifest, so a fresh unreferenced blob may belong to a
// commit in flight.
//
// Thread-safety: one gc per store at a time; safe against concurrent commits
// (grace window) and readers of kept versions.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "store/base/status.h"

namespace dte {

class Store;

// Spool files in a local store's tmp/ are removed once at least this old.
inline constexpr int64_t kMinTempAgeSeconds = 3600;

struct GcOptions {
  uint64_t keep_last = 8;  // at least 1
  // Also keep every older version whose number is a multiple of this; 0: off.
  uint64_t keep_every = 0;
  // A rebased delta also gets a full table when a commit onto its new
  // parent would (the anchor policy's byte budget), so reads of a thinned
  // history stay bounded; 0: never.
  double anchor_budget = 1.0;
  int64_t grace_seconds = 600;
  bool dry_run = false;  // only count what would be kept, removed and rebased
};

struct GcResult {
  uint64_t versions_kept = 0;
  uint64_t versions_removed = 0;
  uint64_t versions_rebased = 0;
  uint64_t blobs_deleted = 0;
  uint64_t bytes_freed = 0;
  uint64_t temp_files_deleted = 0;  // stale spool files of dead commits
  // Messages of distributed publishes left by dead ranks (exchange/).
  uint64_t exchange_objects_deleted = 0;
};

// InvalidArgument naming the option for a keep_last of 0.
Status CheckGcOptions(const GcOptions& options);

Result<GcResult> CollectGarbage(Store& store, const GcOptions& options,
                                const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace dte
