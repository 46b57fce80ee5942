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

#include "store/object_store.h"

namespace dte::test {

class ListingDamageStore final : public ObjectStore {
 public:
  using Damage = std::function<void(std::vector<std::string>*)>;

  ListingDamageStore(std::unique_ptr<ObjectStore> base, std::string prefix)
      : base_(std::move(base)), prefix_(std::move(prefix)) {}

  ObjectStore& base() { return *base_; }
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

  std::string Describe() const override { return base_->Describe(); }
  Status Put(const std::string& k, std::string_view d) override { return base_->Put(k, d); }
  Status PutFile(const std::string& k, const std::string& p) override {
    return base_->PutFile(k, p);
  }
  Status CreateExclusive(const std::string& k, std::string_view d) override {
    return base_->CreateExclusive(k, d);
  }
  Result<std::string> Get(const std::string& k) override { return base_->Get(k); }
  Result<std::string> GetRange(const std::string& k, uint64_t o, uint64_t n) override {
    return base_->GetRange(k, o, n);
  }
  Status ReadRange(const std::string& k, uint64_t o, uint64_t n, void* dst) override {
    return base_->ReadRange(k, o, n, dst);
  }
  Result<std::optional<uint64_t>> Size(const std::string& k) override { return base_->Size(k); }
  Result<std::vector<std::string>> List(const std::string& prefix) override {
    ASSIGN_OR_RETURN(auto keys, base_->List(prefix));
    if (prefix != prefix_) return keys;
    auto it = damages_.find(listings_++);
    if (it != damages_.end()) it->second(&keys);
    return keys;
  }
  Status Delete(const std::string& k) override { return base_->Delete(k); }
  Result<int64_t> ModifiedTime(const std::string& k) override { return base_->ModifiedTime(k); }
  Status Touch(const std::string& k) override { return base_->Touch(k); }
  Result<std::string> NewTempPath() override { return base_->NewTempPath(); }
  Result<uint64_t> RemoveStaleTemp(int64_t age) override { return base_->RemoveStaleTemp(age); }

 private:
  std::unique_ptr<ObjectStore> base_;
  const std::string prefix_;
  std::map<int, Damage> damages_;
  int listings_ = 0;
};

}  // namespace dte::test
