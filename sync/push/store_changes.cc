// A version's changes read back from the store as a push reads them
// (sync/push/changes.h), through the store's one reader of a version's
// changes (store/changes.h).
#include "store/changes.h"
#include "sync/push/changes.h"

namespace dte {
namespace {

class StoreChangesSource : public ChangesSource {
 public:
  explicit StoreChangesSource(std::unique_ptr<VersionChangesReader> reader)
      : reader_(std::move(reader)) {}
  bool MayChange(const std::string& name) const override { return reader_->MayChange(name); }
  Result<const TensorChanges*> Read(const std::string& name) override {
    return reader_->Read(name);
  }

 private:
  std::unique_ptr<VersionChangesReader> reader_;
};

}  // namespace

Result<std::unique_ptr<ChangesSource>> StoreChanges(Store& store,
                                                    const std::shared_ptr<const Version>& v) {
  ASSIGN_OR_RETURN(auto reader, VersionChangesReader::Open(store, v));
  return std::unique_ptr<ChangesSource>(new StoreChangesSource(std::move(reader)));
}

Result<std::vector<TensorChanges>> ChangesFromStore(Store& store,
                                                    const std::shared_ptr<const Version>& v) {
  return ReadVersionChanges(store, v);
}

}  // namespace dte
