#include "fs/snapshotter.h"

#include <algorithm>
#include <chrono>

#include "fs/internal/thread_priority.h"

namespace dte::fs {

SnapshotPlan PlanSnapshots(const std::map<uint64_t, std::optional<uint64_t>>& parents,
                           const std::set<uint64_t>& have, const SnapshotPolicy& policy,
                           const std::map<uint64_t, uint64_t>& start) {
  std::vector<uint64_t> marked;  // versions that have or should get a snapshot, ascending
  std::map<uint64_t, uint64_t> distance;
  for (const auto& [version, parent] : parents) {
    uint64_t d = 0;
    if (parent) {
      auto it = distance.find(*parent);
      if (it != distance.end()) {
        d = it->second + 1;
      } else if (auto s = start.find(version); s != start.end() && policy.every > 0) {
        d = s->second % policy.every;
      }
    }
    if (have.count(version) || (policy.every > 0 && d >= policy.every)) {
      marked.push_back(version);
      d = 0;
    }
    distance[version] = d;
  }
  const size_t keep_from = marked.size() - std::min<size_t>(marked.size(), policy.keep);
  const std::set<uint64_t> kept(marked.begin() + static_cast<ptrdiff_t>(keep_from), marked.end());
  SnapshotPlan plan;
  // The newest first when it has none (the version read most: latest, and
  // the live version that follows it), then the rest oldest first, each
  // built from the snapshot before it.
  if (!kept.empty() && !have.count(*kept.rbegin())) plan.build.push_back(*kept.rbegin());
  for (uint64_t v : kept) {
    if (!have.count(v) && v != *kept.rbegin()) plan.build.push_back(v);
  }
  for (uint64_t v : have) {
    if (!kept.count(v)) plan.drop.push_back(v);
  }
  return plan;
}

Snapshotter::Snapshotter(Store* store, Filesystem* fs, SnapshotSet* set, SnapshotPolicy policy)
    : fs_(fs), set_(set), policy_(policy), reader_(store) {
  reader_.SetBase(set_);
  thread_ = std::thread([this] { Run(); });
}

Snapshotter::~Snapshotter() {
  stop_ = true;
  thread_.join();
}

void Snapshotter::Run() {
  LowerThreadPriority();
  while (!stop_) {
    if (!wake_.exchange(false)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    while (!stop_ && Pass()) {
    }
  }
}

bool Snapshotter::StoreWentAway(const Status& s) {
  if (s.code() != Code::kIOError && !s.transient()) return false;
  // Wait for a poll that started after the failure (two more finish) to say
  // whether the store answers.
  const uint64_t polls = fs_->PollCount();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!stop_ && fs_->PollCount() < polls + 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return fs_->StoreFailing();
}

const Snapshotter::Info* Snapshotter::InfoOf(uint64_t version, const std::string& key) {
  auto it = known_.find(version);
  if (it != known_.end() && it->second.key == key) return &it->second;
  auto v = fs_->VersionOf(version);
  if (!v.ok() || (*v)->key != key) return nullptr;
  const Manifest& m = (*v)->manifest;
  Info info{key, m.full ? std::nullopt : m.parent, m.since_full ? m.since_full->versions : 0};
  return &(known_[version] = std::move(info));
}

bool Snapshotter::Pass() {
  const std::map<uint64_t, std::string> listed = fs_->Versions();
  // Only the newest versions can hold one of the newest `keep` snapshots:
  // plan over a window of (keep + 1) * every of them, so a pass costs the
  // same after ten thousand versions as after ten. A version whose parent
  // is outside the window starts at its distance from the last version
  // that stands alone (manifest since_full).
  const uint64_t window = (uint64_t{policy_.keep} + 1) * std::max<uint32_t>(policy_.every, 1);
  std::map<uint64_t, std::optional<uint64_t>> parents;
  std::map<uint64_t, uint64_t> start;
  std::map<uint64_t, std::shared_ptr<const Version>> with_snapshot;
  const std::vector<uint64_t> snapshotted = set_->Stats().versions;
  {
    auto it = listed.end();
    for (uint64_t n = 0; it != listed.begin() && n < window; ++n) {
      --it;
      const Info* info = InfoOf(it->first, it->second);
      if (!info) continue;  // reported by the load; not planned
      parents[it->first] = info->parent;
      start[it->first] = info->since_full;
    }
  }
  // Forget what left the window.
  for (auto it = known_.begin(); it != known_.end();) {
    it = parents.count(it->first) ? std::next(it) : known_.erase(it);
  }
  for (uint64_t version : snapshotted) {
    auto it = listed.find(version);
    if (it == listed.end()) continue;
    auto v = fs_->VersionOf(version);
    if (v.ok() && (*v)->key == it->second) with_snapshot[version] = *v;
  }
  const std::set<uint64_t> have = set_->Retain(with_snapshot);
  const SnapshotPlan plan = PlanSnapshots(parents, have, policy_, start);
  for (uint64_t version : plan.drop) set_->Remove(version);
  // While the store does not answer, a build would fail on the first block
  // that is not cached; the next poll that succeeds wakes us again.
  if (fs_->StoreFailing()) return false;
  for (uint64_t version : plan.build) {
    auto loaded = fs_->VersionOf(version);
    if (!loaded.ok()) continue;
    const std::shared_ptr<const Version>& v = *loaded;
    if (failed_.count(v->key)) continue;
    Status s = set_->Build(v, &reader_, stop_);
    if (!s.ok() && !stop_ && StoreWentAway(s)) return false;  // retried after the outage
    if (!s.ok() && !stop_) {
      failed_.insert(v->key);
      // A version gc removed or rewrote meanwhile is no failure worth a report.
      auto now = fs_->Versions();
      auto it = now.find(version);
      if (it != now.end() && it->second == v->key) {
        fs_->ReportError(s.message() + " (not retried)");
      }
    }
    return true;
  }
  return false;
}

}  // namespace dte::fs
