#include "sync/publish/dist_publisher.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "kernels/adamw.h"
#include "store/store.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publish_metrics.h"

namespace dte {

using dist_internal::AllGather;
using dist_internal::NanosSince;

FlatRange RowRange(const std::vector<int64_t>& shape, uint64_t row_begin, uint64_t row_end) {
  uint64_t row = 1;
  for (size_t d = 1; d < shape.size(); ++d) row *= static_cast<uint64_t>(shape[d]);
  return {row_begin * row, row_end * row};
}

FlatRange ChunkRows(uint64_t rows, int rank, int world) {
  const uint64_t chunk = world > 0 ? (rows + world - 1) / world : rows;
  const uint64_t begin = std::min(rows, chunk * static_cast<uint64_t>(rank));
  return {begin, std::min(rows, begin + chunk)};
}

DistPublisher::DistPublisher(PublisherOptions options, std::unique_ptr<Store> store)
    : options_(std::move(options)),
      store_(std::move(store)),
      metrics_(std::make_unique<PublishMetrics>()) {}

DistPublisher::~DistPublisher() = default;

Result<std::unique_ptr<DistPublisher>> DistPublisher::Open(const PublisherOptions& options) {
  if (!options.screen) {
    return InvalidArgument("the distributed publisher finds changes with the screen (screen=true)");
  }
  RETURN_IF_ERROR(CheckAnchorPolicy(options.anchor_policy));
  ASSIGN_OR_RETURN(auto parts, internal::OpenPublisherParts(options));
  std::unique_ptr<DistPublisher> p(new DistPublisher(options, std::move(parts.store)));
  p->plan_ = std::move(parts.plan);
  return p;
}

Status DistPublisher::SetAnchorPolicy(const AnchorPolicy& policy) {
  RETURN_IF_ERROR(CheckAnchorPolicy(policy));
  options_.anchor_policy = policy;
  return Status::Ok();
}

Result<PublishResult> DistPublisher::PublishAdamW(Transport& transport, const AdamWStep& h,
                                                  const std::vector<RangeState>& ranges) {
  stats_ = DistPublishStats{};
  parts_sent_.reset();
  auto r = metrics_->Record(h.step, [&]() -> Result<PublishResult> {
    auto ran = Run(transport, h, ranges);
    if (parts_sent_) stats_.commit_ns = NanosSince(*parts_sent_);
    if (!ran.ok()) {
      push_changes_.clear();  // nothing committed: nothing to push
      return ran.status();
    }
    PublishResult out = std::move(ran).value();
    last_step_ = h.step;
    last_version_ = out.version;
    if (push_ && committed_before_) {
      // Pushed when it was committed (or missed: receivers catch up); this
      // attempt knows no owners, so it does not push again.
      out.push_error = "not pushed again: " + VersionName(out.version) +
                       " was committed by an earlier attempt of this step";
    } else if (push_ && push_owned_) {
      // Every rank pushes the tensors it owned (encoded) in this version:
      // the changes it kept while encoding, the rest read back.
      PushOwned(out);
    } else if (push_ && transport.rank() == 0) {
      internal::PushCommitted(*push_, *store_, out.version, /*changes=*/nullptr, &out);
    }
    return out;
  });
  metrics_->Routed(stats_);
  return r;
}

// Pushes: from rank 0 alone (it reads each version back), or from every
// rank, each the tensors it owns (receivers connect to all of them).
Status DistPublisher::AgreePush(int rank, const std::vector<std::string>& senders,
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

Status DistPublisher::SharePush(Transport& t) {
  ASSIGN_OR_RETURN(auto senders, AllGather(t, push_ ? push_->address() : std::string(),
                                           "sharing the push servers' addresses", &stats_));
  return AgreePush(t.rank(), senders, "");
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

void DistPublisher::PushOwned(PublishResult& out) {
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

Status DistPublisher::SetPush(PushServer* push) {
  push_ = push;
  return push_ ? internal::TellPushLatest(*push_, *store_) : Status::Ok();
}

Result<PublishResult> DistPublisher::Run(Transport& t, const AdamWStep& h,
                                         const std::vector<RangeState>& ranges) {
  owned_.clear();
  push_changes_.clear();
  push_owned_ = false;
  committed_before_ = false;
  dist_internal::Plan plan(h, ranges, options_, plan_, t.rank(), t.size());
  plan.store_uri = store_->uri();
  ASSIGN_OR_RETURN(std::optional<PublishResult> committed, Agree(t, plan));
  if (committed) return *std::move(committed);
  AssignOwners(plan);
  dist_internal::Detected detected = Detect(plan);
  ASSIGN_OR_RETURN(std::vector<std::string> routed, Route(t, plan, detected));
  dist_internal::Encoded encoded(&store_->objects());
  Encode(plan, detected, routed, encoded);
  return Commit(t, plan, detected, encoded);
}

}  // namespace dte
