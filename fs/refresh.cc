// Filesystem: following the store's version set (full and incremental
// listings) and the state of polling.
#include <ctime>

#include "fs/filesystem.h"
#include "fs/log.h"
#include "store/s3_store.h"

namespace dte::fs {
namespace {

constexpr char kManifestPrefix[] = "manifests/";
// New manifest keys one incremental listing takes; more means a full one.
constexpr int kMaxNewKeys = 1000;

bool WorthRetrying(const Status& s) {
  return s.code() != Code::kCorruption && s.code() != Code::kNotFound;
}

}  // namespace

bool Filesystem::LoadInto(uint64_t version, const std::string& key, const VersionMap& current,
                          VersionMap* next) {
  auto it = current.find(version);
  if (it != current.end() && it->second->key == key) {
    (*next)[version] = it->second;
    return true;
  }
  auto v = store_->GetVersionAt(version, key);
  if (v.ok()) {
    (*next)[version] = *v;
    return true;
  }
  if (it != current.end()) (*next)[version] = it->second;
  MutexLock lock(&mu_);
  if (failed_keys_.insert(key).second) {
    LogLine("dtefs: skipping " + VersionName(version) + ": " + v.status().message());
    PushErrorLocked(v.status().message());
  }
  return !WorthRetrying(v.status());
}

Status Filesystem::Refresh() {
  {
    MutexLock lock(&mu_);
    full_polls_++;
  }
  ASSIGN_OR_RETURN(auto listed, store_->ListVersions());
  const VersionMap current = Versions();
  VersionMap next;
  bool complete = true;
  std::string newest;
  for (const auto& [version, key] : listed) {
    complete = LoadInto(version, key, current, &next) && complete;
    newest = std::max(newest, key);
  }
  {
    MutexLock lock(&mu_);
    newest_key_ = complete ? newest : "";
  }
  Install(std::move(next));
  return Status::Ok();
}

Status Filesystem::RefreshNew() {
  auto* lister = dynamic_cast<PagedLister*>(&store_->objects());
  std::string after;
  {
    MutexLock lock(&mu_);
    after = newest_key_;
  }
  if (!lister || after.empty()) return Refresh();
  ASSIGN_OR_RETURN(KeyPage page, lister->ListAfter(kManifestPrefix, after, kMaxNewKeys));
  if (page.truncated) return Refresh();
  // The newest revision of each version listed.
  std::map<uint64_t, std::pair<uint32_t, std::string>> listed;
  for (const std::string& key : page.keys) {
    auto parsed = ParseManifestKey(key);
    if (!parsed) continue;
    auto it = listed.find(parsed->first);
    if (it == listed.end() || it->second.first < parsed->second) {
      listed[parsed->first] = {parsed->second, key};
    }
  }
  if (listed.empty()) return Status::Ok();
  const VersionMap current = Versions();
  VersionMap next = current;
  bool complete = true;
  for (const auto& [version, revision_key] : listed) {
    auto it = current.find(version);
    // "v1.r10" sorts before "v1.r9": an older revision can come after.
    if (it != current.end() && it->second->manifest.revision >= revision_key.first) continue;
    complete = LoadInto(version, revision_key.second, current, &next) && complete;
  }
  {
    MutexLock lock(&mu_);
    newest_key_ = complete ? std::max(newest_key_, page.keys.back()) : "";
  }
  Install(std::move(next));
  return Status::Ok();
}

void Filesystem::Install(VersionMap next) {
  std::vector<uint64_t> removed;
  std::shared_ptr<const Version> first_live;
  {
    MutexLock lock(&mu_);
    for (const auto& [version, v] : versions_) {
      if (!next.count(version)) removed.push_back(version);
    }
    bool changed = !removed.empty() || next.size() != versions_.size();
    for (const auto& [version, v] : next) {
      auto it = versions_.find(version);
      changed = changed || it == versions_.end() || it->second != v;
    }
    if (changed) root_mtime_ = static_cast<int64_t>(std::time(nullptr));
    versions_ = std::move(next);
    // The first version seen becomes live: the one asked for at mount, else
    // the newest.
    if (!versions_.empty()) {
      auto it = initial_live_ ? versions_.find(*initial_live_) : std::prev(versions_.end());
      if (it != versions_.end()) first_live = it->second;
    }
  }
  if (first_live && !live_.View()) live_.InitIfUnset(first_live);
  for (uint64_t version : removed) {
    // Open files keep their Version alive; the parsed copy and the cached
    // blocks of a version that left the store are not needed by anyone new.
    store_->Forget(version);
    reader_.cache().DropVersion(version);
  }
}

void Filesystem::NotePoll(const Status& s) {
  MutexLock lock(&mu_);
  polls_++;
  const auto now = static_cast<int64_t>(std::time(nullptr));
  if (s.ok()) {
    if (failing_since_ != 0) {
      LogLine("dtefs: the store answers again after " + std::to_string(now - failing_since_) +
              " s; following new versions");
    }
    failing_since_ = 0;
    return;
  }
  failed_polls_++;
  poll_error_ = s.message();
  if (failing_since_ != 0) return;  // reported when it started
  failing_since_ = now;
  const std::string message =
      "cannot list the store (will keep trying; what is loaded and "
      "cached stays readable): " +
      s.message();
  LogLine("dtefs: " + message);
  PushErrorLocked(message);
}

bool Filesystem::StoreFailing() {
  MutexLock lock(&mu_);
  return failing_since_ != 0;
}

uint64_t Filesystem::PollCount() {
  MutexLock lock(&mu_);
  return polls_;
}

std::shared_ptr<const Version> Filesystem::Latest() {
  MutexLock lock(&mu_);
  return versions_.empty() ? nullptr : versions_.rbegin()->second;
}

}  // namespace dte::fs
