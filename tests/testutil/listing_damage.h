// ListingDamageStore: an ObjectStore decorator whose listings of one prefix
// can be damaged, for tests of code that must not believe one listing (gc,
// publishers, followers). The n-th listing of the prefix from now (0: the
// next one) goes through a damage function: a key dropped, a key added.
//
// Thread-safety: as the decorated store; set damages before the calls.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/testutil/forwarding_store.h"

namespace dte::test {

class ListingDamageStore final : public ForwardingStore {
 public:
  using Damage = std::function<void(std::vector<std::string>*)>;

  ListingDamageStore(std::unique_ptr<ObjectStore> base, std::string prefix)
      : ForwardingStore(std::move(base)), prefix_(std::move(prefix)) {}

  // Damages the listing `n` listings of the prefix from now.
  void DamageListing(int n, Damage damage) { damages_[listings_ + n] = std::move(damage); }
  // Listings of the prefix so far.
  int listings() const { return listings_; }

  static Damage Dropping(std::string key) {
    return [key](std::vector<std::string>* keys) { std::erase(*keys, key); };
  }
  static Damage Adding(std::string key) {
    return [key](std::vector<std::string>* keys) {
      keys->push_back(key);
      std::sort(keys->begin(), keys->end());
    };
  }

  Result<std::vector<std::string>> List(const std::string& prefix) override {
    ASSIGN_OR_RETURN(auto keys, base().List(prefix));
    if (prefix != prefix_) return keys;
    auto it = damages_.find(listings_++);
    if (it != damages_.end()) it->second(&keys);
    return keys;
  }

 private:
  const std::string prefix_;
  std::map<int, Damage> damages_;
  int listings_ = 0;
};

}  // namespace dte::test
