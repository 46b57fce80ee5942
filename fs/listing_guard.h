// ListingGuard: a mount never goes back on one listing.
//
// A full listing of the store's manifests may lack a version the mount
// shows, or name an older revision of it, for three reasons: gc removed the
// version, its history was rewritten, or the answer was damaged on the way
// (a key dropped or changed in transit: docs/s3.md, "Bodies damaged in
// transit"). Only the first two are reasons to take it away, and only a
// read of the version's own manifest key tells them apart. Complete()
// puts back into a listing every shown version it lacks whose manifest is
// still there, or could not be checked now; so a version leaves the mount,
// and `latest` goes back, only once its manifest is confirmed gone. A
// newer revision of a version in the listing replaces the shown one as
// before (that is gc's rebase, not going back).
//
// The store makes a listing that lacks a version it knows again before
// returning it (Store::ListVersions); NoteDamagedListings reports those.
// Each event is one log line naming the version and its manifest key, is
// counted (Stats(); .dte/status "listings") and kept among the recent
// events.
//
// Thread-safety: Complete() is called by one thread at a time (the
// poller); Stats() may be called concurrently with it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/base/thread_annotations.h"

namespace dte::fs {

struct ListingGuardStats {
  uint64_t damaged = 0;            // listings the store found damaged and made again
  uint64_t lacking = 0;            // full listings that lacked a version shown (or its revision)
  uint64_t kept = 0;               // versions kept because their manifest was read and is there
  uint64_t unchecked = 0;          // versions kept because the check failed, or waits its turn
  uint64_t gone = 0;               // versions that left: their manifest was confirmed gone
  uint64_t latest_held = 0;        // listings whose newest was older than `latest`, which stayed
  std::deque<std::string> events;  // the most recent ones, oldest first
};

class ListingGuard {
 public:
  using VersionMap = std::map<uint64_t, std::string>;  // version -> manifest key
  // Reads manifest `key` of `version` itself (not a listing): true if it is
  // there, false if the store says it is gone, an error if it cannot tell.
  using ManifestCheck = std::function<Result<bool>(uint64_t version, const std::string& key)>;

  explicit ListingGuard(ManifestCheck check) : check_(std::move(check)) {}
  ListingGuard(const ListingGuard&) = delete;
  ListingGuard& operator=(const ListingGuard&) = delete;

  // `listed` (a full listing) with the versions of `shown` it lacks, or
  // lists at an older revision, put back at their shown key unless their
  // manifest is confirmed gone. At most kMaxChecksPerListing of them are
  // checked, newest first; the others are kept until a later listing.
  VersionMap Complete(VersionMap listed, const VersionMap& shown) EXCLUDES(mu_);
  // Reports the listings the store found damaged and made again since the
  // last call (one event each): `count` and `recent` are those of
  // Store::listing_damage().
  void NoteDamagedListings(uint64_t count, const std::vector<std::string>& recent) EXCLUDES(mu_);
  ListingGuardStats Stats() const EXCLUDES(mu_);

  // Manifest reads one listing may cost (after gc removed many versions,
  // the rest leave over the next listings).
  static constexpr size_t kMaxChecksPerListing = 64;
  static constexpr size_t kMaxEvents = 16;

 private:
  // Checks one shown version the listing lacks; true if it stays.
  bool Keep(uint64_t version, const std::string& key, uint64_t latest,
            std::optional<uint64_t> listed_newest) EXCLUDES(mu_);
  void Event(const std::string& line) REQUIRES(mu_);

  const ManifestCheck check_;
  mutable Mutex mu_;
  ListingGuardStats stats_ GUARDED_BY(mu_);
};

}  // namespace dte::fs
