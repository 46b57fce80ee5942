#include "fs/listing_guard.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "fs/log.h"
#include "store/manifest.h"

namespace dte::fs {
namespace {

// The revision manifest `key` names (0 for one that does not parse).
uint32_t RevisionOf(const std::string& key) {
  auto parsed = ParseManifestKey(key);
  return parsed ? parsed->second : 0;
}

}  // namespace

ListingGuard::VersionMap ListingGuard::Complete(VersionMap listed, const VersionMap& shown) {
  if (shown.empty()) return listed;
  const uint64_t latest = shown.rbegin()->first;
  std::optional<uint64_t> listed_newest;
  if (!listed.empty()) listed_newest = listed.rbegin()->first;
  // Newest first: `latest` is the one that matters most.
  std::vector<std::pair<uint64_t, std::string>> lacking;
  for (auto it = shown.rbegin(); it != shown.rend(); ++it) {
    auto l = listed.find(it->first);
    if (l == listed.end() || RevisionOf(l->second) < RevisionOf(it->second)) {
      lacking.emplace_back(it->first, it->second);
    }
  }
  if (lacking.empty()) return listed;
  size_t deferred = 0;
  for (size_t i = 0; i < lacking.size(); ++i) {
    const auto& [version, key] = lacking[i];
    if (i >= kMaxChecksPerListing) {
      deferred++;
      listed[version] = key;
    } else if (Keep(version, key, latest, listed_newest)) {
      listed[version] = key;
    }
  }
  MutexLock lock(&mu_);
  stats_.lacking++;
  if (deferred > 0) {
    stats_.unchecked += deferred;
    Event("a listing of the store lacks " + std::to_string(deferred) +
          " more versions shown; they stay until a later listing checks them");
  }
  if ((!listed_newest || *listed_newest < latest) && listed.count(latest)) stats_.latest_held++;
  return listed;
}

bool ListingGuard::Keep(uint64_t version, const std::string& key, uint64_t latest,
                        std::optional<uint64_t> listed_newest) {
  Result<bool> there = check_(version, key);
  const std::string lacks =
      "a listing of the store lacks " + VersionName(version) + " (" + key + ")";
  MutexLock lock(&mu_);
  if (!there.ok()) {
    stats_.unchecked++;
    Event(lacks + " and its manifest cannot be read now: " + there.status().message() +
          "; kept until a later listing");
    return true;
  }
  if (*there) {
    stats_.kept++;
    std::string line = lacks + ", but its manifest is there: kept";
    if (version == latest && (!listed_newest || *listed_newest < version)) {
      line += "; latest stays " + VersionName(version);
    }
    Event(line);
    return true;
  }
  stats_.gone++;
  Event(VersionName(version) + " left the store: its manifest " + key + " is gone (read directly)" +
        (version == latest ? "; it was latest" : ""));
  return false;
}

void ListingGuard::NoteDamagedListings(uint64_t count, const std::vector<std::string>& recent) {
  MutexLock lock(&mu_);
  if (count <= stats_.damaged) return;
  const size_t fresh =
      static_cast<size_t>(std::min<uint64_t>(count - stats_.damaged, recent.size()));
  stats_.damaged = count;
  for (size_t i = recent.size() - fresh; i < recent.size(); ++i) {
    Event("the store listed its versions again: " + recent[i]);
  }
}

void ListingGuard::Event(const std::string& line) {
  LogLine("dtefs: " + line);
  stats_.events.push_back(line);
  if (stats_.events.size() > kMaxEvents) stats_.events.pop_front();
}

ListingGuardStats ListingGuard::Stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace dte::fs
