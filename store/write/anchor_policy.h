// The anchor policy: which versions of an unchanged layout are written as
// policy anchors, so that reading any version (a host that joins late, an
// export, a restart with an empty cache) costs a bounded number of records
// per block however long the run is.
//
// A policy anchor is a delta version (its sparse records against its parent
// stay, so a follower that holds the parent still reads one record per
// block) that also carries a full table: every block again, dense and
// zstd-compressed (manifest "full", docs/formats/manifest.md). Chain walks
// stop there (store/materialize.h). Every manifest records its distance
// from the nearest self-contained version (`since_full`: versions, and the
// bytes their deltas added), so deciding costs one manifest read.
//
// Thread-safety: plain functions and values.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "store/base/status.h"
#include "store/manifest.h"

namespace dte {

class Store;
struct Version;

struct AnchorPolicy {
  // A policy anchor once the deltas since the last self-contained version
  // have added this many times the version's dense bytes to the store; 0:
  // never. 1.0 keeps a store at most about twice the size of one that holds
  // deltas only (docs/architecture.md, "Anchor policy").
  double budget = 1.0;
  // ...or once this many versions have passed since it; 0: never.
  uint64_t every = 0;
  // A join table (store/manifest.h, JoinTable) on a version that is not a
  // policy anchor once the deltas since the nearest self-contained version
  // or join table have added this many times its dense bytes; 0: never.
  // Only the newest kJoinTablesKept join tables stay in the store, so a
  // host that joins late decodes at most about this much of deltas after a
  // dense read, while the store holds at most that many extra full tables
  // whatever the run's length (docs/architecture.md, "Join tables").
  double join_budget = 0.125;
};

// Join tables a writer keeps: the newest two, so a reader that started from
// the older one has a whole join interval to finish before it is deleted
// (and one that is slower falls back to the deltas, store/materialize.h).
inline constexpr size_t kJoinTablesKept = 2;

// InvalidArgument naming the option for a budget that is negative or not a
// number.
Status CheckAnchorPolicy(const AnchorPolicy& policy);

// v's distance from its nearest self-contained ancestor: from its manifest,
// or (a manifest older than format 2) by walking its parents' manifests.
Result<AnchorDistance> DistanceOf(Store& store, const std::shared_ptr<const Version>& v);

// Why the next version after `parent` (at distance `parent_distance`, the
// new version holding `dense_bytes` of tensor data) must be a policy anchor;
// "" when it need not.
std::string PolicyAnchorReason(const AnchorPolicy& policy, const AnchorDistance& parent_distance,
                               uint64_t dense_bytes);

// v's distance from the nearest self-contained version or join table on its
// chain: `v_distance` (DistanceOf(v)) less that of the newest listed join
// table at or below v, when that join is of a version after v's nearest
// self-contained one. Lists the store's join tables (one small listing).
Result<AnchorDistance> JoinDistanceOf(Store& store, const std::shared_ptr<const Version>& v,
                                      const AnchorDistance& v_distance);

// Why the next version after `parent` (at `parent_join_distance` from the
// nearest self-contained version or join table) gets a join table; "" when
// it need not. Asked only of versions that are not policy anchors.
std::string JoinTableReason(const AnchorPolicy& policy, const AnchorDistance& parent_join_distance,
                            uint64_t dense_bytes);

// What the version after a parent gets besides its delta records: the one
// decision commit and the Publisher (of any world) share. A policy
// anchor is asked first; only a version that is not one may get a join
// table.
struct TableDecision {
  AnchorDistance parent_distance;  // DistanceOf(parent)
  std::string anchor_reason;       // PolicyAnchorReason; "": not a policy anchor
  std::string join_reason;         // JoinTableReason; "": no join table
  // A full table, as a policy anchor (full table) or as a join table: both
  // hold every block (store/write/version_writer.h, FullTableBuilder).
  bool policy_anchor() const { return !anchor_reason.empty(); }
  bool join_table() const { return !join_reason.empty(); }
  bool any_table() const { return policy_anchor() || join_table(); }
};

// The decision for the version after `parent`, its new manifest holding
// `dense_bytes` of tensor data: reads the parent's distance, and its join
// distance (one listing, JoinDistanceOf) only when it is not a policy
// anchor.
Result<TableDecision> DecideTables(Store& store, const AnchorPolicy& policy,
                                   const std::shared_ptr<const Version>& parent,
                                   uint64_t dense_bytes);

// The same decision from distances already known (a distributed writer's
// rank 0 reads the join distance and sends it to the other ranks).
TableDecision DecideTables(const AnchorPolicy& policy, const AnchorDistance& parent_distance,
                           const AnchorDistance& parent_join_distance, uint64_t dense_bytes);

// The distance of a new version: 0 if it is self-contained, else one more
// version and `stored_bytes` more bytes than its parent's.
AnchorDistance NextDistance(const AnchorDistance& parent_distance, bool self_contained,
                            uint64_t stored_bytes);

}  // namespace dte
