#include "fs/snapshotter.h"

#include <algorithm>
#include <chrono>

#include "fs/internal/thread_priority.h"

namespace dte::fs {

SnapshotPlan PlanSnapshots(const std::map<uint64_t, std::optional<uint64_t>>& parents,
                           const std::set<uint64_t>& have, const SnapshotPolicy& policy) {
  std::vector<uint64_t> marked;  // versions that have or should get a snapshot, ascending
  std::map<uint64_t, uint64_t> distance;
  for (const auto& [version, parent] : parents) {
    uint64_t d = 0;
    if (parent) {
      auto it = distance.find(*parent);
      if (it != distance.end()) d = it->second + 1;
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
  for (uint64_t v : kept) {
    if (!have.count(v)) plan.build.push_back(v);
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
  if (s.code() != Code::kIOError) return false;
  // Wait for a poll that started after the failure (two more finish) to say
  // whether the store answers.
  const uint64_t polls = fs_->PollCount();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!stop_ && fs_->PollCount() < polls + 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return fs_->StoreFailing();
}

bool Snapshotter::Pass() {
  const std::map<uint64_t, std::shared_ptr<const Version>> versions = fs_->Versions();
  const std::set<uint64_t> have = set_->Retain(versions);
  std::map<uint64_t, std::optional<uint64_t>> parents;
  for (const auto& [number, v] : versions) parents[number] = v->manifest.parent;
  const SnapshotPlan plan = PlanSnapshots(parents, have, policy_);
  for (uint64_t version : plan.drop) set_->Remove(version);
  // While the store does not answer, a build would fail on the first block
  // that is not cached; the next poll that succeeds wakes us again.
  if (fs_->StoreFailing()) return false;
  for (uint64_t version : plan.build) {
    const std::shared_ptr<const Version>& v = versions.at(version);
    if (failed_.count(v->key)) continue;
    Status s = set_->Build(v, &reader_, stop_);
    if (!s.ok() && !stop_ && StoreWentAway(s)) return false;  // retried after the outage
    if (!s.ok() && !stop_) {
      failed_.insert(v->key);
      // A version gc removed or rewrote meanwhile is no failure worth a report.
      auto now = fs_->Versions();
      auto it = now.find(version);
      if (it != now.end() && it->second->key == v->key) {
        fs_->ReportError(s.message() + " (not retried)");
      }
    }
    return true;
  }
  return false;
}

}  // namespace dte::fs
