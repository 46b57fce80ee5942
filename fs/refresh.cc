// Filesystem: following the store's version set (full and incremental
// listings) and the state of polling.
#include <ctime>
#include <set>

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

Result<std::shared_ptr<const Version>> Filesystem::Merge(const VersionMap& listed,
                                                         const VersionMap& current,
                                                         VersionMap* next, bool* complete) {
  std::set<std::string> failed;
  {
    MutexLock lock(&mu_);
    failed = failed_keys_;
  }
  std::shared_ptr<const Version> newest;  // the newest version of *next, loaded
  // The first listing (a mount) checks only what `latest` needs; later ones
  // check what arrived since (the newest kMaxCheckedPerRefresh of it).
  const size_t limit = current.empty() ? 0 : kMaxCheckedPerRefresh;
  size_t checked = 0;
  // Newest first: the first that loads is `latest`.
  for (auto it = listed.rbegin(); it != listed.rend(); ++it) {
    const auto& [version, key] = *it;
    auto cur = current.find(version);
    const bool known = cur != current.end() && cur->second == key;
    if (known || (checked >= limit && newest)) {
      // Shown as it was, or an old version of a long listing (the first one
      // of a long run): loaded when used. A key that failed before stays out.
      if (known || !failed.count(key)) (*next)[version] = key;
      if (!newest) {
        auto v = Load(version, key);
        if (v.ok()) newest = *v;
      }
      continue;
    }
    checked++;
    auto v = Load(version, key);
    if (v.ok()) {
      (*next)[version] = key;
      if (!newest) newest = *v;
      continue;
    }
    if (WorthRetrying(v.status())) *complete = false;
    MutexLock lock(&mu_);
    if (failed_keys_.insert(key).second) {
      LogLine("dtefs: skipping " + VersionName(version) + ": " + v.status().message());
      if (v.status().code() == Code::kNotFound) PushErrorLocked(v.status().message());
    }
    if (cur != current.end()) (*next)[version] = cur->second;  // the revision shown before
  }
  return newest;
}

Status Filesystem::Refresh() {
  {
    MutexLock lock(&mu_);
    full_polls_++;
  }
  auto listed = store_->ListVersions(/*fresh=*/true);
  const Store::ListingDamage damage = store_->listing_damage();
  guard_.NoteDamagedListings(damage.count, damage.recent);
  if (!listed.ok()) return listed.status();
  return ApplyListing(std::move(listed).value());
}

Status Filesystem::ApplyListing(VersionMap listed) {
  const VersionMap current = Versions();
  // A version this listing lacks leaves only once its manifest is gone.
  listed = guard_.Complete(std::move(listed), current);
  VersionMap next;
  bool complete = true;
  ASSIGN_OR_RETURN(auto latest, Merge(listed, current, &next, &complete));
  {
    MutexLock lock(&mu_);
    newest_key_.clear();
    if (complete) {
      for (const auto& [version, key] : listed) newest_key_ = std::max(newest_key_, key);
    }
  }
  Install(std::move(next), std::move(latest));
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
  std::map<uint64_t, std::pair<uint32_t, std::string>> found;
  for (const std::string& key : page.keys) {
    auto parsed = ParseManifestKey(key);
    if (!parsed) continue;
    auto it = found.find(parsed->first);
    if (it == found.end() || it->second.first < parsed->second) {
      found[parsed->first] = {parsed->second, key};
    }
  }
  if (found.empty()) return Status::Ok();
  // Something was committed: the join tables may have moved too (one more
  // small listing per commit seen; a failure only costs reads the shortcut).
  store_->ListJoins().status().IgnoreError();
  const VersionMap current = Versions();
  VersionMap listed = current;
  for (const auto& [version, revision_key] : found) {
    auto it = current.find(version);
    // "v1.r10" sorts before "v1.r9": an older revision can come after.
    if (it != current.end()) {
      auto shown = ParseManifestKey(it->second);
      if (shown && shown->second >= revision_key.first) continue;
    }
    listed[version] = revision_key.second;
  }
  VersionMap next;
  bool complete = true;
  ASSIGN_OR_RETURN(auto latest, Merge(listed, current, &next, &complete));
  {
    MutexLock lock(&mu_);
    newest_key_ = complete ? std::max(newest_key_, page.keys.back()) : "";
  }
  Install(std::move(next), std::move(latest));
  return Status::Ok();
}

void Filesystem::Install(VersionMap next, std::shared_ptr<const Version> latest) {
  std::vector<uint64_t> removed;
  std::optional<uint64_t> first_live;
  {
    MutexLock lock(&mu_);
    for (const auto& [version, key] : versions_) {
      if (!next.count(version)) removed.push_back(version);
    }
    if (next != versions_) root_mtime_ = static_cast<int64_t>(std::time(nullptr));
    // The newest version shown, loaded before, stays `latest` when this
    // refresh could not load it again (a failed read): never an older one.
    if (latest_ && (!latest || latest->manifest.version < latest_->manifest.version)) {
      auto kept = next.find(latest_->manifest.version);
      if (kept != next.end() && kept->second == latest_->key) latest = latest_;
    }
    versions_ = std::move(next);
    if (!versions_.empty()) {
      max_shown_ = std::max(max_shown_.value_or(0), versions_.rbegin()->first);
    }
    latest_ = std::move(latest);
    // The first version seen becomes live: the one asked for at mount, else
    // the newest.
    if (!versions_.empty()) {
      auto it = initial_live_ ? versions_.find(*initial_live_) : std::prev(versions_.end());
      if (it != versions_.end()) first_live = it->first;
    }
  }
  if (first_live && !live_.View()) {
    auto v = VersionOf(*first_live);
    if (v.ok()) live_.InitIfUnset(*v);
  }
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
  return latest_;
}

}  // namespace dte::fs
