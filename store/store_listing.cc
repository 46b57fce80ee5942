// Store: the checks that make a listing trusted only once the manifests
// agree with it (store/store.h, ListVersions; docs/s3.md, "Listings").
#include <algorithm>
#include <random>
#include <set>
#include <thread>

#include "store/internal/s3_retry.h"
#include "store/s3_store.h"
#include "store/store.h"

namespace dte {
namespace {

constexpr char kManifestPrefix[] = "manifests/";

std::string Damaged(const std::string& uri, const std::string& why) {
  return "the listing of " + std::string(kManifestPrefix) + " in store " + uri +
         " is damaged: " + why;
}

S3RetryPolicy ListingRetryPolicy() {
  S3RetryPolicy policy;
  if (auto env = S3OptionsFromEnvironment(); env.ok()) policy = env->retry;
  return policy;
}

}  // namespace

Result<bool> Store::ManifestExists(uint64_t version, const std::string& key) {
  auto parsed = ParseManifestKey(key);
  if (!parsed || parsed->first != version) {
    return InvalidArgument("\"" + key + "\" is not a manifest key of " + VersionName(version));
  }
  ASSIGN_OR_RETURN(auto size, objects_->Size(key));
  return size.has_value();
}

Status Store::ConfirmMissing(std::vector<std::pair<uint64_t, std::string>> missing) {
  // The newest ones, those a reader's latest depends on, by their keys.
  std::sort(missing.rbegin(), missing.rend());
  const size_t direct = std::min(missing.size(), kMaxDirectChecks);
  for (size_t i = 0; i < direct; ++i) {
    const auto& [v, key] = missing[i];
    ASSIGN_OR_RETURN(bool exists, ManifestExists(v, key));
    if (exists) {
      return Corruption(Damaged(options_.uri, "it lacks " + key + " (" + VersionName(v) +
                                                  "), which exists when read directly"));
    }
  }
  if (direct == missing.size()) return Status::Ok();
  // Many gone at once (gc on another host): a second listing must agree
  // that the rest are gone, one request per 1000 manifests instead of one
  // per version.
  ASSIGN_OR_RETURN(auto keys, objects_->ListStoreKeys(kManifestPrefix));
  std::set<std::string> again(keys.begin(), keys.end());
  for (size_t i = direct; i < missing.size(); ++i) {
    if (again.count(missing[i].second)) {
      return Corruption(Damaged(options_.uri, "it lacks " + missing[i].second + " (" +
                                                  VersionName(missing[i].first) +
                                                  "), which the next listing shows"));
    }
  }
  return Status::Ok();
}

Status Store::CrossCheckListing(const std::map<uint64_t, std::string>& listed) {
  // What this object knew before the listing: its last listing, the
  // versions it holds parsed (and their parents), the index.
  std::map<uint64_t, std::string> known;
  std::map<uint64_t, uint64_t> parents;  // listed delta -> its parent
  {
    MutexLock lock(&mu_);
    known = listed_;
    for (const auto& [v, c] : cache_) {
      known.emplace(v, c.version->key);
      auto it = listed.find(v);
      const auto& parent = c.version->manifest.parent;
      if (it != listed.end() && it->second == c.version->key && parent) parents[v] = *parent;
    }
  }
  if (index_) {
    ASSIGN_OR_RETURN(auto indexed, index_->ListVersions());
    known.insert(indexed.begin(), indexed.end());
  }
  std::vector<std::pair<uint64_t, std::string>> missing;
  for (const auto& [v, key] : known) {
    if (!listed.count(v)) missing.emplace_back(v, key);
  }
  RETURN_IF_ERROR(ConfirmMissing(missing));
  // gc rebases a kept version before it deletes its parent's manifest, so
  // a listed delta without its parent is a listing that lost the parent.
  for (const auto& [v, parent] : parents) {
    if (listed.count(parent)) continue;
    const std::string key = ManifestKey(parent, 0);
    ASSIGN_OR_RETURN(bool exists, ManifestExists(parent, key));
    if (exists) {
      return Corruption(Damaged(options_.uri, "it lists " + VersionName(v) +
                                                  " but not its parent, whose manifest " + key +
                                                  " exists when read directly"));
    }
  }
  return Status::Ok();
}

Result<std::string> Store::LatestDisagreement(const std::map<uint64_t, std::string>& listed,
                                              uint64_t expected) {
  if (!listed.empty() && listed.rbegin()->first > expected) {
    const auto& [latest, key] = *listed.rbegin();
    ASSIGN_OR_RETURN(bool exists, ManifestExists(latest, key));
    if (exists) return std::string();
    return "it names " + key + " as the latest version, which does not exist when read directly";
  }
  if (listed.count(expected)) return std::string();
  // The expected version is not listed: confirmed gone only if neither its
  // first revision nor a listing of its revisions alone shows it.
  const std::string key = ManifestKey(expected, 0);
  ASSIGN_OR_RETURN(bool exists, ManifestExists(expected, key));
  if (!exists) {
    ASSIGN_OR_RETURN(auto revisions,
                     objects_->ListStoreKeys(kManifestPrefix + VersionName(expected) + "."));
    exists = std::any_of(revisions.begin(), revisions.end(), [&](const std::string& k) {
      auto parsed = ParseManifestKey(k);
      return parsed && parsed->first == expected;
    });
  }
  if (!exists) return std::string();
  return "it lacks " + VersionName(expected) + ", whose manifest exists when read directly";
}

Result<std::optional<uint64_t>> Store::ConfirmedLatest(uint64_t expected) {
  const S3RetryPolicy policy = ListingRetryPolicy();
  const int attempts = std::max(1, policy.max_attempts);
  std::mt19937_64 random(std::random_device{}());
  std::string why;
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    if (attempt > 1)
      std::this_thread::sleep_for(internal::BackoffDelay(attempt - 1, policy, random()));
    // The usual answer, the expected latest, costs what Latest() does.
    ASSIGN_OR_RETURN(auto listed, ListVersions(/*fresh=*/attempt > 1));
    ASSIGN_OR_RETURN(why, LatestDisagreement(listed, expected));
    if (why.empty()) {
      if (listed.empty()) return std::optional<uint64_t>();
      return std::optional<uint64_t>(listed.rbegin()->first);
    }
  }
  return IOError(Damaged(options_.uri, why) + " (in " + std::to_string(attempts) +
                 " listings in a row; retry the step)");
}

}  // namespace dte
