// Publisher (sync/publish/publisher.h): opening it, its group of ranks, the
// calls every world takes, and the ranged publish's run through its phases
// (publisher_agree.cc, _detect.cc, _encode.cc, _commit.cc, _push.cc). The
// one-rank path of whole tensors is publisher_whole.cc; the weights path
// publisher_weights.cc.
#include "sync/publish/publisher.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "store/ops/commit.h"
#include "store/store.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/internal/publisher_draft.h"
#include "sync/publish/publish_metrics.h"

namespace dte {
namespace {

// The exchange of a world of one that was given none: rank 0 of 1, whose
// messages to itself are copied (the ranged publish's wire functions do
// not even call it for one rank, dist_wire.h).
class SoloExchange : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status Exchange(std::span<const SendBuffer> sends, std::span<const RecvBuffer> recvs) override {
    if (sends.size() != recvs.size()) {
      return Internal("a world of one posted " + std::to_string(sends.size()) + " sends and " +
                      std::to_string(recvs.size()) + " receives");
    }
    for (size_t i = 0; i < sends.size(); ++i) {
      if (sends[i].peer != 0 || recvs[i].peer != 0 || sends[i].bytes != recvs[i].bytes) {
        return Internal("a world of one exchanged with a peer other than itself");
      }
      if (sends[i].bytes > 0) std::memcpy(recvs[i].data, sends[i].data, sends[i].bytes);
    }
    return Status::Ok();
  }
};

Status CheckGroup(const PublishGroup& g, bool screen) {
  if (g.world < 1 || g.rank < 0 || g.rank >= g.world) {
    return InvalidArgument("publisher rank " + std::to_string(g.rank) + " of world " +
                           std::to_string(g.world) + ": need 0 <= rank < world");
  }
  if (g.exchange != nullptr && (g.exchange->rank() != g.rank || g.exchange->size() != g.world)) {
    return InvalidArgument("publisher rank " + std::to_string(g.rank) + " of " +
                           std::to_string(g.world) + " was given the exchange of rank " +
                           std::to_string(g.exchange->rank()) + " of " +
                           std::to_string(g.exchange->size()));
  }
  if (g.world > 1 && !screen) {
    return InvalidArgument("a publisher of " + std::to_string(g.world) +
                           " ranks finds changes with the screen (screen=true)");
  }
  return Status::Ok();
}

// A tensor given whole (as PublishAdamW takes it) as the range [0, n) a
// rank of several holds: FP32 arrays of one shape.
Result<RangeState> WholeRange(const std::string& what, const TensorRef& param,
                              const TensorRef& exp_avg, const TensorRef& exp_avg_sq) {
  uint64_t n = 1;
  for (int64_t d : param.shape) n *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
  for (const auto& [name, r] : {std::pair<const char*, const TensorRef*>{"param", &param},
                                {"exp_avg", &exp_avg},
                                {"exp_avg_sq", &exp_avg_sq}}) {
    if (r->dtype != DType::kF32) {
      return InvalidArgument(what + ": " + name + " is " + DTypeName(r->dtype) +
                             "; the publisher needs FP32 master weights and moments");
    }
    if (r->shape != param.shape) {
      return InvalidArgument(what + ": " + name + " has shape " + ShapeString(r->shape) +
                             " but param has shape " + ShapeString(param.shape));
    }
  }
  RangeState out;
  out.end = n;
  out.param = static_cast<const float*>(param.data);
  out.exp_avg = static_cast<const float*>(exp_avg.data);
  out.exp_avg_sq = static_cast<const float*>(exp_avg_sq.data);
  return out;
}

}  // namespace

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

Publisher::Publisher(PublisherOptions options, std::unique_ptr<Store> store)
    : options_(std::move(options)),
      store_(std::move(store)),
      metrics_(std::make_unique<PublishMetrics>()) {}

Publisher::~Publisher() = default;

Result<internal::OpenedPublisher> internal::OpenPublisherParts(const PublisherOptions& options) {
  OpenedPublisher out;
  if (options.converter == "mcore") {
    if (!options.mcore) {
      return InvalidArgument("converter \"mcore\" needs the model spec and parallel layout");
    }
    ASSIGN_OR_RETURN(out.plan, PlanConversion(options.mcore->spec, options.mcore->layout));
  } else if (options.converter != "hf") {
    return InvalidArgument("converter \"" + options.converter +
                           "\" is not supported by the publisher (supported: hf, mcore)");
  }
  StoreOptions o;
  o.uri = options.store;
  o.cache_dir = options.cache_dir;
  o.blob_cache_bytes = options.blob_cache_bytes;
  o.create = true;
  o.index_optional = true;  // as dtectl: work from the store if another process holds the index
  ASSIGN_OR_RETURN(out.store, Store::Open(o));
  return out;
}

Result<std::unique_ptr<Publisher>> Publisher::Open(const PublisherOptions& options) {
  RETURN_IF_ERROR(CheckGroup(options.group, options.screen));
  RETURN_IF_ERROR(CheckAnchorPolicy(options.anchor_policy));
  ASSIGN_OR_RETURN(auto parts, internal::OpenPublisherParts(options));
  std::unique_ptr<Publisher> p(new Publisher(options, std::move(parts.store)));
  p->plan_ = std::move(parts.plan);
  return p;
}

Status Publisher::SetGroup(const PublishGroup& group) {
  RETURN_IF_ERROR(CheckGroup(group, options_.screen));
  options_.group = group;
  return Status::Ok();
}

Status Publisher::NeedOneRank(const std::string& what, const std::string& instead) const {
  if (options_.group.world == 1) return Status::Ok();
  return InvalidArgument(what + " is for a world of one, and this publisher is rank " +
                         std::to_string(options_.group.rank) + " of " +
                         std::to_string(options_.group.world) + ": " + instead);
}

Status Publisher::SetAnchorPolicy(const AnchorPolicy& policy) {
  RETURN_IF_ERROR(CheckAnchorPolicy(policy));
  options_.anchor_policy = policy;
  return Status::Ok();
}

Result<CommitResult> Publisher::ImportCheckpoint(const std::string& dir) {
  RETURN_IF_ERROR(NeedOneRank("importing a checkpoint (" + dir + ")",
                              "import version 0 once, from one process (`dtectl import`), "
                              "before the ranks publish"));
  ASSIGN_OR_RETURN(CommitResult r, CommitDirectory(*store_, dir, CommitOptions{}));
  last_version_ = r.version;
  last_step_.reset();
  if (push_) {
    // Receivers are told of the new version; they catch up from the store.
    // The import is committed either way: a version the server cannot plan
    // for (no config.json, say) fails at the next publish's push, which
    // reports it in push_error.
    internal::TellPushLatest(*push_, *store_).IgnoreError();
  }
  return r;
}

Result<PublishResult> Publisher::PublishAdamW(const AdamWStep& h,
                                              const std::vector<AdamWParamState>& params) {
  if (options_.group.world == 1) {
    stats_ = DistPublishStats{};  // nothing ranged
    return metrics_->Record(h.step, [&] { return PublishHf(h, params); });
  }
  std::vector<RangeState> ranges;
  for (const AdamWParamState& s : params) {
    ASSIGN_OR_RETURN(RangeState r,
                     WholeRange("tensor " + s.name, s.param, s.exp_avg, s.exp_avg_sq));
    r.name = s.name;
    r.state_step = s.state_step;
    r.lr = s.lr;
    r.weight_decay = s.weight_decay;
    ranges.push_back(std::move(r));
  }
  return PublishRanges(h, ranges);
}

Result<PublishResult> Publisher::PublishAdamWMcore(const AdamWStep& h,
                                                   const std::vector<McoreAdamWShard>& shards) {
  if (options_.group.world == 1) {
    stats_ = DistPublishStats{};  // nothing ranged
    return metrics_->Record(h.step, [&] { return PublishMcore(h, shards); });
  }
  std::vector<RangeState> ranges;
  for (const McoreAdamWShard& s : shards) {
    ASSIGN_OR_RETURN(RangeState r, WholeRange("MCore shard " + s.key.ToString(), s.param, s.exp_avg,
                                              s.exp_avg_sq));
    r.name = s.key.name;
    r.tp_rank = s.key.tp_rank;
    r.ep_rank = s.key.ep_rank;
    r.state_step = s.state_step;
    r.lr = s.lr;
    r.weight_decay = s.weight_decay;
    ranges.push_back(std::move(r));
  }
  return PublishRanges(h, ranges);
}

Result<Transport*> Publisher::Exchange() {
  const PublishGroup& g = options_.group;
  if (g.exchange != nullptr) return g.exchange;
  if (g.world == 1) {
    if (!solo_) solo_ = std::make_unique<SoloExchange>();
    return solo_.get();
  }
  return InvalidArgument("publisher rank " + std::to_string(g.rank) + " of " +
                         std::to_string(g.world) +
                         " has no exchange to the other ranks: give the group one (SetGroup)");
}

Result<PublishResult> Publisher::PublishRanges(const AdamWStep& h,
                                               const std::vector<RangeState>& ranges) {
  stats_ = DistPublishStats{};
  parts_sent_.reset();
  auto r = metrics_->Record(h.step, [&]() -> Result<PublishResult> {
    if (!options_.screen) {
      return InvalidArgument("a publish of ranges finds changes with the screen (screen=true)");
    }
    ASSIGN_OR_RETURN(Transport * transport, Exchange());
    auto ran = Run(*transport, h, ranges);
    if (parts_sent_) stats_.commit_ns = dist_internal::NanosSince(*parts_sent_);
    if (!ran.ok()) {
      push_changes_.clear();  // nothing committed: nothing to push
      return ran.status();
    }
    PublishResult out = std::move(ran).value();
    last_step_ = h.step;
    last_version_ = out.version;
    PushRanges(*transport, out);
    return out;
  });
  metrics_->Routed(stats_);
  return r;
}

Result<PublishResult> Publisher::Run(Transport& t, const AdamWStep& h,
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
