// ForwardingStore: an ObjectStore that passes every call on to another one
// (owned or borrowed). A test derives from it to change one call (damage a
// listing, flip a byte of a read) and leaves the rest as they are.
// ListStoreKeys is not forwarded: the default one lists through List, so a
// damaged List reaches it.
//
// Thread-safety: as the store it forwards to.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "store/object_store.h"

namespace dte::test {

class ForwardingStore : public ObjectStore {
 public:
  explicit ForwardingStore(std::unique_ptr<ObjectStore> owned)
      : owned_(std::move(owned)), base_(owned_.get()) {}
  explicit ForwardingStore(ObjectStore* borrowed) : base_(borrowed) {}

  ObjectStore& base() { return *base_; }

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
  Result<std::vector<std::string>> List(const std::string& p) override { return base_->List(p); }
  Status Delete(const std::string& k) override { return base_->Delete(k); }
  Result<int64_t> ModifiedTime(const std::string& k) override { return base_->ModifiedTime(k); }
  Status Touch(const std::string& k) override { return base_->Touch(k); }
  Result<std::string> NewTempPath() override { return base_->NewTempPath(); }
  Result<uint64_t> RemoveStaleTemp(int64_t age) override { return base_->RemoveStaleTemp(age); }

 private:
  std::unique_ptr<ObjectStore> owned_;
  ObjectStore* const base_;
};

}  // namespace dte::test
