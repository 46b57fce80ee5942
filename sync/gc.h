// Retention: keep the newest versions, reclaim the rest.
//
// gc keeps the last `keep_last` versions readable. If the oldest kept one is
// a delta, it is first rebased: written again as an anchor under a new
// manifest revision with identical content hashes (later kept versions stay
// deltas against it). Only then are older manifests deleted, and last the
// blobs no remaining manifest reaches. Each step leaves a valid store, so a
// crash at any point loses nothing that is kept.
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

#include "store/status.h"

namespace dte {

class Store;

// Spool files in a local store's tmp/ are removed once at least this old.
inline constexpr int64_t kMinTempAgeSeconds = 3600;

struct GcOptions {
  uint64_t keep_last = 8;
  int64_t grace_seconds = 600;
  bool dry_run = false;
};

struct GcResult {
  uint64_t versions_kept = 0;
  uint64_t versions_removed = 0;
  uint64_t versions_rebased = 0;
  uint64_t blobs_deleted = 0;
  uint64_t bytes_freed = 0;
  uint64_t temp_files_deleted = 0;  // stale spool files of dead commits
};

Result<GcResult> CollectGarbage(Store& store, const GcOptions& options,
                                const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace dte
