// Snapshotter: decides which versions get a materialized snapshot (see
// store/snapshot.h) and builds them on a background thread.
//
// Policy. A version's distance is the number of parent hops to its nearest
// ancestor that is an anchor or has a snapshot. Walking the versions in
// increasing order, every version whose distance reaches `every` gets a
// snapshot (and so distance 0), so reading any version costs at most
// `every - 1` sparse records plus one dense record or snapshot block per
// block. A version with a full table (a policy anchor) counts as an anchor.
// At most `keep` snapshots exist: of the versions that have or would get
// one, the newest `keep` are kept, the older ones deleted first; so are
// snapshots of versions that left the store. Only the newest
// (keep + 1) * every versions are planned over (their manifests' since_full
// gives the distance where the window starts), so a pass costs the same
// however long the run. The newest planned snapshot is built first (the
// versions read most: latest, and the live version that follows it), then
// the others oldest first, each through a Materializer that starts from the
// snapshots before it.
//
// The worker runs one pass after each Wake() (the poller calls it after
// every refresh; waking never blocks). It never runs on a FUSE request
// thread, runs at lowered CPU and I/O priority, and writes one block at a
// time. A build that fails is reported once and not retried for that
// manifest revision, unless the store stopped answering meanwhile
// (Filesystem::StoreFailing): then it is retried after the store is back.
//
// Thread-safety: Wake() may be called from any thread; construct and
// destroy from one thread. Destruction cancels a build under way (its
// temporary file is removed) and joins the worker.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "fs/filesystem.h"
#include "store/materialize.h"
#include "store/snapshot.h"

namespace dte::fs {

struct SnapshotPolicy {
  uint32_t every = 8;  // snapshot at this distance; 0: never
  uint32_t keep = 8;   // at most this many snapshots; 0: none
};

struct SnapshotPlan {
  std::vector<uint64_t> build;  // the newest first, then ascending
  std::vector<uint64_t> drop;
};

// The plan for `parents` (listed versions -> their parent, nullopt for a
// version that stands alone) given the versions that have a snapshot. A
// version whose parent is not listed starts at distance start[version]
// modulo `every` (0 if absent): its distance from the last version that
// stood alone.
SnapshotPlan PlanSnapshots(const std::map<uint64_t, std::optional<uint64_t>>& parents,
                           const std::set<uint64_t>& have, const SnapshotPolicy& policy,
                           const std::map<uint64_t, uint64_t>& start = {});

class Snapshotter {
 public:
  Snapshotter(Store* store, Filesystem* fs, SnapshotSet* set, SnapshotPolicy policy);
  ~Snapshotter();
  Snapshotter(const Snapshotter&) = delete;
  Snapshotter& operator=(const Snapshotter&) = delete;

  void Wake() { wake_ = true; }

 private:
  void Run();
  // Plans, drops, and builds at most one snapshot; true if it built (or
  // tried to build) one, so another pass may have more to do.
  bool Pass();
  // True if the build error `s` came from the store becoming unreachable
  // (waits for the poller to tell).
  bool StoreWentAway(const Status& s);
  // What planning needs of a version, remembered for the window.
  struct Info {
    std::string key;
    std::optional<uint64_t> parent;  // nullopt: stands alone
    uint64_t since_full = 0;         // manifest since_full.versions
  };
  // Info of `version` at `key` (loaded once); null if it does not load.
  const Info* InfoOf(uint64_t version, const std::string& key);

  Filesystem* const fs_;
  SnapshotSet* const set_;
  const SnapshotPolicy policy_;
  Materializer reader_;             // its own counters: building is not reading
  std::set<std::string> failed_;    // manifest keys whose build failed (worker thread only)
  std::map<uint64_t, Info> known_;  // the planning window (worker thread only)
  std::atomic<bool> wake_{true}, stop_{false};
  std::thread thread_;
};

}  // namespace dte::fs
