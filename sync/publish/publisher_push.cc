// The Publisher's push after a publish (sync/publish/publisher.h, SetPush):
// a world of one pushes the changes it found; in a larger one rank 0 pushes
// every tensor, read back from the store, or every rank the tensors it
// owned in the version.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "store/store.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publisher.h"

namespace dte {

using dist_internal::AllGather;

Status Publisher::SetPush(PushServer* push) {
  push_ = push;
  return push_ ? internal::TellPushLatest(*push_, *store_) : Status::Ok();
}

// After a ranged publish committed `out`: the push of every rank's share,
// or rank 0's of everything.
void Publisher::PushRanges(Transport& t, PublishResult& out) {
  if (push_ && committed_before_) {
    // Pushed when it was committed (or missed: receivers catch up); this
    // attempt knows no owners, so it does not push again.
    out.push_error = "not pushed again: " + VersionName(out.version) +
                     " was committed by an earlier attempt of this step";
  } else if (push_ && push_owned_) {
    // Every rank pushes the tensors it owned (encoded) in this version:
    // the changes it kept while encoding, the rest read back.
    PushOwned(out);
  } else if (push_ && t.rank() == 0) {
    internal::PushCommitted(*push_, *store_, out.version, /*changes=*/nullptr, &out);
  }
}

// Pushes: from rank 0 alone (it reads each version back), or from every
// rank, each the tensors it owns (receivers connect to all of them).
Status Publisher::AgreePush(int rank, const std::vector<std::string>& senders,
                            const std::string& what) {
  const int world = static_cast<int>(senders.size());
  const auto with = std::count_if(senders.begin(), senders.end(),
                                  [](const std::string& a) { return !a.empty(); });
  if (with > 0 && senders[0].empty()) {
    const int r = static_cast<int>(
        std::find_if(senders.begin(), senders.end(), [](auto& a) { return !a.empty(); }) -
        senders.begin());
    return InvalidArgument(what + "rank " + std::to_string(r) +
                           " has a push group and rank 0 has none: give push= on every rank "
                           "(each pushes the tensors it owns) or on rank 0 only");
  }
  if (with > 1 && with < world) {
    const int r = static_cast<int>(std::find(senders.begin(), senders.end(), std::string()) -
                                   senders.begin());
    return InvalidArgument(what + "rank " + std::to_string(r) +
                           " has no push group and other ranks have one: give push= on every "
                           "rank (each pushes the tensors it owns) or on rank 0 only");
  }
  push_owned_ = false;
  if (!push_) return Status::Ok();
  push_owned_ = with == world && world > 1;
  RETURN_IF_ERROR(push_owned_ ? push_->SetGroup(rank, world) : push_->SetGroup(0, 1));
  if (push_owned_ && rank == 0) RETURN_IF_ERROR(push_->SetSenders(senders));
  return Status::Ok();
}

Status Publisher::SharePush() {
  ASSIGN_OR_RETURN(Transport * t, Exchange());
  ASSIGN_OR_RETURN(auto senders, AllGather(*t, push_ ? push_->address() : std::string(),
                                           "sharing the push servers' addresses", &stats_));
  return AgreePush(t->rank(), senders, "");
}

namespace {

// The changes of the tensors a rank owned: those it kept while encoding,
// the others read back from the store.
class OwnedChanges : public ChangesSource {
 public:
  OwnedChanges(const std::set<std::string>& owned, const std::map<std::string, TensorChanges>& kept,
               std::unique_ptr<ChangesSource> store)
      : owned_(owned), kept_(kept), store_(std::move(store)) {
    for (const std::string& name : owned_) {
      if (!kept_.count(name) && store_->MayChange(name)) stable_ = false;
    }
  }
  bool MayChange(const std::string& name) const override {
    if (!owned_.count(name)) return false;
    auto it = kept_.find(name);
    return it != kept_.end() ? !it->second.indices.empty() : store_->MayChange(name);
  }
  Result<const TensorChanges*> Read(const std::string& name) override {
    auto it = kept_.find(name);
    if (it != kept_.end()) return &it->second;
    return store_->Read(name);
  }
  bool Stable() const override { return stable_; }

 private:
  const std::set<std::string>& owned_;
  const std::map<std::string, TensorChanges>& kept_;
  std::unique_ptr<ChangesSource> store_;
  bool stable_ = true;
};

}  // namespace

void Publisher::PushOwned(PublishResult& out) {
  auto pushed = [&]() -> Result<PushReport> {
    ASSIGN_OR_RETURN(auto v, store_->GetVersion(out.version));
    ASSIGN_OR_RETURN(auto read_back, StoreChanges(*store_, v));
    for (const std::string& name : owned_) {
      auto it = push_changes_.find(name);
      if (it != push_changes_.end()) {
        stats_.push_tensors_kept += !it->second.indices.empty();
      } else {
        stats_.push_tensors_read_back += read_back->MayChange(name);
      }
    }
    OwnedChanges mine(owned_, push_changes_, std::move(read_back));
    return push_->Push(*store_, v, mine);
  }();
  if (pushed.ok()) {
    out.push = std::move(pushed).value();
  } else {
    out.push_error = pushed.status().message();
  }
  push_changes_.clear();
}

namespace internal {

Status TellPushLatest(PushServer& push, Store& store) {
  ASSIGN_OR_RETURN(auto latest, store.Latest());
  if (!latest) return Status::Ok();
  ASSIGN_OR_RETURN(auto v, store.GetVersion(*latest));
  return push.SetLatest(store, v);
}

void PushCommitted(PushServer& push, Store& store, uint64_t version,
                   const std::vector<TensorChanges>* changes, PublishResult* r) {
  auto pushed = [&]() -> Result<PushReport> {
    ASSIGN_OR_RETURN(auto v, store.GetVersion(version));
    if (changes) return push.Push(store, v, *changes);
    // Read back one tensor at a time: rank 0 of several ranks never holds
    // the whole version's changes.
    ASSIGN_OR_RETURN(auto read_back, StoreChanges(store, v));
    return push.Push(store, v, *read_back);
  }();
  if (pushed.ok()) {
    r->push = std::move(pushed).value();
  } else {
    r->push_error = pushed.status().message();
  }
}

}  // namespace internal
}  // namespace dte
