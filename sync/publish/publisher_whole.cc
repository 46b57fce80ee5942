// The Publisher's path in a world of one (sync/publish/publisher.h): whole
// tensors, or whole Megatron-Core converter units, checked, then encoded
// one at a time into a Draft of the new version, which Finish commits.
#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "kernels/adamw.h"
#include "store/dtype.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "store/write/blob_sink.h"
#include "store/write/version_writer.h"
#include "sync/publish/internal/engine_encoder.h"
#include "sync/publish/internal/publisher_draft.h"
#include "sync/publish/publisher.h"

namespace dte {
namespace {

// The kernel parameters of one tensor: the step's, with its group's lr and
// weight decay.
kernels::AdamWParams ParamsFor(const AdamWStep& h, const AdamWParamState* s) {
  kernels::AdamWParams p{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.order};
  if (s != nullptr && s->lr) p.lr = *s->lr;
  if (s != nullptr && s->weight_decay) p.weight_decay = *s->weight_decay;
  return p;
}

Status CheckHyper(const AdamWStep& h, const AdamWParamState* s) {
  if (h.amsgrad) return InvalidArgument("AdamW amsgrad=True is not supported by the publisher");
  if (h.maximize) return InvalidArgument("AdamW maximize=True is not supported by the publisher");
  std::string error = kernels::AdamWParamsError(ParamsFor(h, s));
  if (error.empty()) return Status::Ok();
  return InvalidArgument(s != nullptr ? "tensor " + s->name + ": " + error : error);
}

// One optimizer-state array of `what` for tensor `name` must be FP32 with
// the store tensor's shape.
Status CheckState(const std::string& name, const char* what, const TensorRef& r,
                  const TensorEntry& t) {
  if (r.dtype != DType::kF32) {
    return InvalidArgument("tensor " + name + ": " + what + " is " + DTypeName(r.dtype) +
                           "; the publisher needs FP32 master weights and moments");
  }
  if (r.shape != t.shape) {
    return InvalidArgument("tensor " + name + ": " + what + " has shape " + ShapeString(r.shape) +
                           " but the store's tensor has shape " + ShapeString(t.shape));
  }
  if (r.data == nullptr && t.elements() > 0) {
    return InvalidArgument("tensor " + name + ": " + what + " has no data");
  }
  return Status::Ok();
}

Status CheckParam(const AdamWParamState& s, const AdamWStep& h, const TensorEntry& t) {
  if (t.dtype != DType::kBF16) {
    return InvalidArgument("tensor " + s.name + " is " + DTypeName(t.dtype) +
                           " in the store; the publisher writes BF16 tensors only");
  }
  if (s.state_step && *s.state_step != h.step) {
    return InvalidArgument("tensor " + s.name + ": optimizer state step " +
                           std::to_string(*s.state_step) + " does not match the published step " +
                           std::to_string(h.step));
  }
  RETURN_IF_ERROR(CheckHyper(h, &s));
  RETURN_IF_ERROR(CheckState(s.name, "param", s.param, t));
  RETURN_IF_ERROR(CheckState(s.name, "exp_avg", s.exp_avg, t));
  return CheckState(s.name, "exp_avg_sq", s.exp_avg_sq, t);
}

// Views one of the three optimizer-state arrays of the caller's shards.
class ShardStateSource : public ShardSource {
 public:
  using Shards = std::map<ShardKey, const McoreAdamWShard*>;
  ShardStateSource(const Shards* shards, TensorRef McoreAdamWShard::*field)
      : shards_(shards), field_(field) {}

  Result<ShardView> Get(const ShardKey& key) override {
    auto it = shards_->find(key);
    if (it == shards_->end()) return NotFound("missing MCore shard " + key.ToString());
    const TensorRef& r = it->second->*field_;
    uint64_t n = 1;
    for (int64_t d : r.shape) n *= static_cast<uint64_t>(d);
    ShardView view;
    view.dtype = r.dtype;
    view.shape = r.shape;
    view.bytes = std::string_view(static_cast<const char*>(r.data), n * DTypeWidth(r.dtype));
    return view;
  }

 private:
  const Shards* shards_;
  TensorRef McoreAdamWShard::*field_;
};

// A shard's state must be FP32 arrays of the planned shape at step h.step.
Status CheckShard(const McoreAdamWShard& s, const PlannedShard& planned, const AdamWStep& h) {
  const std::string what = "MCore shard " + s.key.ToString();
  if (s.state_step && *s.state_step != h.step) {
    return InvalidArgument(what + ": optimizer state step " + std::to_string(*s.state_step) +
                           " does not match the published step " + std::to_string(h.step));
  }
  for (const auto& [name, r] : {std::pair<const char*, const TensorRef*>{"param", &s.param},
                                {"exp_avg", &s.exp_avg},
                                {"exp_avg_sq", &s.exp_avg_sq}}) {
    if (r->dtype != DType::kF32) {
      return InvalidArgument(what + ": " + name + " is " + DTypeName(r->dtype) +
                             "; the publisher needs FP32 master weights and moments");
    }
    if (r->shape != planned.shape) {
      return InvalidArgument(what + ": " + name + " has shape " + ShapeString(r->shape) +
                             " but the layout gives it shape " + ShapeString(planned.shape));
    }
    if (r->data == nullptr && planned.elements() > 0) {
      return InvalidArgument(what + ": " + name + " has no data");
    }
  }
  return Status::Ok();
}

// Whether the caller gave the unit's shards: all (true) or none (false).
Result<bool> UnitGiven(const ConvertUnit& unit, const ShardStateSource::Shards& given) {
  const PlannedShard* present = nullptr;
  const PlannedShard* missing = nullptr;
  for (const PlannedShard& s : unit.shards) (given.count(s.key) ? present : missing) = &s;
  if (present != nullptr && missing != nullptr) {
    return InvalidArgument(unit.label + ": MCore shard " + missing->key.ToString() +
                           " is missing, but " + present->key.ToString() +
                           " is given; give all shards of a unit or none");
  }
  return present != nullptr;
}

// Per HF tensor of the unit: its name and the param-group lr / weight decay
// all the shards it is converted from agree on.
Result<std::vector<AdamWParamState>> GroupsOf(const ConvertUnit& unit,
                                              const ShardStateSource::Shards& given) {
  std::vector<AdamWParamState> groups(unit.tensors.size());
  std::vector<const McoreAdamWShard*> from(unit.tensors.size(), nullptr);
  for (size_t t = 0; t < unit.tensors.size(); ++t) groups[t].name = unit.tensors[t].name;
  for (const BlockCopy& c : unit.copies) {
    const McoreAdamWShard* s = given.at(unit.shards[c.shard].key);
    const McoreAdamWShard*& first = from[c.tensor];
    if (first == nullptr) {
      first = s;
      groups[c.tensor].lr = s->lr;
      groups[c.tensor].weight_decay = s->weight_decay;
    } else if (first->lr != s->lr || first->weight_decay != s->weight_decay) {
      return InvalidArgument("tensor " + groups[c.tensor].name + ": MCore shards " +
                             first->key.ToString() + " and " + s->key.ToString() +
                             " have different param-group lr or weight_decay");
    }
  }
  return groups;
}

// The store's tensor must be BF16 with the planned shape.
Status CheckTarget(const PlannedTensor& p, const TensorEntry& t) {
  if (t.dtype != DType::kBF16) {
    return InvalidArgument("tensor " + p.name + " is " + DTypeName(t.dtype) +
                           " in the store; the publisher writes BF16 tensors only");
  }
  if (p.shape != t.shape) {
    return InvalidArgument("tensor " + p.name + " has shape " + ShapeString(p.shape) +
                           " after conversion but shape " + ShapeString(t.shape) + " in the store");
  }
  return Status::Ok();
}

}  // namespace

Status Publisher::Draft::Encode(TensorAt at, const AdamWStep& h, const AdamWParamState& s) {
  TensorEntry& t = m_.files[at.file].tensors[at.tensor];
  encoder_.SetParams(ParamsFor(h, &s));
  if (collect_changes_) {
    changes_.emplace_back();
    changes_.back().name = s.name;
    encoder_.SetChanges(&changes_.back());
  }
  RETURN_IF_ERROR(encoder_
                      .EncodeTensor(static_cast<const float*>(s.param.data),
                                    static_cast<const float*>(s.exp_avg.data),
                                    static_cast<const float*>(s.exp_avg_sq.data), &t,
                                    records_.data() + t.first_block, spool_.get(), 0, &counts_)
                      .WithContext("tensor " + s.name));
  encoder_.SetChanges(nullptr);
  r_.tensors++;
  r_.elements += t.elements();
  return Status::Ok();
}

Result<std::unique_ptr<Publisher::Draft>> Publisher::Begin(std::optional<int64_t> step) {
  if (step && last_step_ && *step != *last_step_ + 1) {
    return InvalidArgument("step " + std::to_string(*step) + " does not follow step " +
                           std::to_string(*last_step_) +
                           ", the last one published: the store's latest version must hold the "
                           "weights from right before this step");
  }
  // A latest other than the one this publisher committed is believed only
  // once the manifests confirm it (a damaged listing is listed again).
  ASSIGN_OR_RETURN(auto latest,
                   last_version_ ? store_->ConfirmedLatest(*last_version_) : store_->Latest());
  if (!latest) {
    return FailedPrecondition(
        "store " + store_->uri() +
        " has no version to publish a delta against; import the initial checkpoint "
        "first");
  }
  if (last_version_ && *latest != *last_version_) {
    return AlreadyExists("the latest version of store " + store_->uri() + " is " +
                         VersionName(*latest) + ", not " + VersionName(*last_version_) +
                         " which this publisher committed last: another writer changed it");
  }
  ASSIGN_OR_RETURN(auto parent, store_->GetVersion(*latest));
  auto d = std::make_unique<Draft>(options_, store_.get(), *latest, std::move(parent));
  d->collect_changes_ = push_ != nullptr;
  ASSIGN_OR_RETURN(d->spool_, d->sink_.NewSpool());
  ASSIGN_OR_RETURN(d->tables_, DecideTables(*store_, options_.anchor_policy, d->parent_,
                                            d->parent_->manifest.stats.dense_bytes));
  if (d->tables_.any_table()) {
    std::optional<uint64_t> join;
    if (d->tables_.join_table()) join = d->m_.version;
    ASSIGN_OR_RETURN(d->full_,
                     internal::FullTableBuilder::Start(&d->sink_, d->records_.size(), join));
    d->encoder_.SetFull(d->full_.get());
  }
  return d;
}

// A policy anchor's full table needs every block: those of tensors this
// publish did not name are the parent's, read back from the parent's
// snapshot on this host when there is one, else from the store (a walk
// back to the last full table at most).
Status Publisher::FillUnclaimedFull(Draft& d) {
  Materializer reader(store_.get());
  std::unique_ptr<SnapshotSet> snapshots = OpenStoreSnapshots(*store_);
  reader.SetBase(snapshots.get());
  std::vector<uint8_t> block(d.m_.block_bytes);
  const Manifest& pm = d.parent_->manifest;
  for (size_t f = 0; f < pm.files.size(); ++f) {
    for (size_t t = 0; t < pm.files[f].tensors.size(); ++t) {
      const TensorEntry& te = pm.files[f].tensors[t];
      if (d.claimed_.count(te.name)) continue;
      for (uint32_t b = 0; b < te.blocks; ++b) {
        const uint64_t len = std::min(pm.block_bytes, te.bytes() - uint64_t{b} * pm.block_bytes);
        RETURN_IF_ERROR(reader.ReadBlock(d.parent_, pm.files[f], te, b, block.data()));
        RETURN_IF_ERROR(d.full_->Append(
            te.first_block + b, d.full_->Encode(block.data(), len, DTypeWidth(te.dtype), nullptr)));
      }
    }
  }
  return d.full_->Finish(&d.sink_, d.records_, &d.m_);
}

Result<PublishResult> Publisher::Finish(std::optional<int64_t> step, Draft& d) {
  if (d.spool_->size() > 0) {
    ASSIGN_OR_RETURN(BlobRef delta, d.sink_.Finish(std::move(d.spool_)));
    d.m_.blobs.push_back(delta);
  }
  static const std::vector<BlockRecord> kNone;
  if (d.full_) RETURN_IF_ERROR(FillUnclaimedFull(d));
  internal::JoinOutcome join;
  RETURN_IF_ERROR(internal::PublishVersion(
      store_.get(), &d.sink_, &d.m_, d.records_, d.full_ ? d.full_->records() : kNone,
      d.tables_.parent_distance, d.latest_, d.full_ && d.full_->join(), &join));
  last_version_ = d.m_.version;
  last_step_ = step;
  PublishResult r = d.r_;
  r.version = d.m_.version;
  r.parent = d.latest_;
  r.changed = d.counts_.changed;
  r.flagged = d.counts_.flagged;
  r.false_positives = d.counts_.false_positives;
  r.uncertain = d.counts_.uncertain;
  r.stored_bytes = d.m_.stats.stored_bytes;
  if (d.weights_) {
    r.from_weights = true;
    r.parent_bytes = d.weights_->parent_bytes();
  } else {
    r.state_bytes = r.elements * 3 * sizeof(float);
  }
  r.full_table = d.full_ && !d.full_->join();
  r.full_bytes = r.full_table ? d.full_->payload_bytes() : 0;
  r.anchor_reason = d.tables_.anchor_reason;
  r.join_reason = d.tables_.join_reason;
  r.join_table = join.written;
  r.join_bytes = join.bytes;
  r.join_error = join.error;
  if (push_) internal::PushCommitted(*push_, *store_, d.m_.version, &d.changes_, &r);
  return r;
}

Result<PublishResult> Publisher::PublishHf(const AdamWStep& h,
                                           const std::vector<AdamWParamState>& params) {
  RETURN_IF_ERROR(CheckHyper(h, nullptr));
  ASSIGN_OR_RETURN(auto d, Begin(h.step));
  std::vector<std::pair<TensorAt, const AdamWParamState*>> work;
  for (const auto& s : params) {
    ASSIGN_OR_RETURN(TensorAt at, d->Claim(s.name));
    RETURN_IF_ERROR(CheckParam(s, h, d->Entry(at)));
    work.push_back({at, &s});
  }
  for (const auto& [at, s] : work) RETURN_IF_ERROR(d->Encode(at, h, *s));
  return Finish(h.step, *d);
}

// One unit to publish: the store tensors its HF tensors land in, and their
// param groups.
struct Publisher::McoreWork {
  const ConvertUnit* unit = nullptr;
  std::vector<TensorAt> at;
  std::vector<AdamWParamState> groups;
};

Result<PublishResult> Publisher::PublishMcore(const AdamWStep& h,
                                              const std::vector<McoreAdamWShard>& shards) {
  if (options_.converter != "mcore") {
    return InvalidArgument(
        "PublishAdamWMcore needs a publisher opened with converter \"mcore\", "
        "not \"" +
        options_.converter + "\"");
  }
  RETURN_IF_ERROR(CheckHyper(h, nullptr));
  ASSIGN_OR_RETURN(auto d, Begin(h.step));
  ShardStateSource::Shards given;
  for (const auto& s : shards) {
    if (!given.emplace(s.key, &s).second) {
      return InvalidArgument("MCore shard " + s.key.ToString() + " is given twice");
    }
  }
  ASSIGN_OR_RETURN(std::vector<McoreWork> work, PlanMcore(h, given, *d));
  ShardStateSource theta(&given, &McoreAdamWShard::param);
  ShardStateSource m(&given, &McoreAdamWShard::exp_avg);
  ShardStateSource v(&given, &McoreAdamWShard::exp_avg_sq);
  for (const McoreWork& w : work) {
    // One unit's HF tensors at a time: three FP32 copies of the unit.
    ASSIGN_OR_RETURN(auto theta_hf, RunUnit(*w.unit, theta));
    ASSIGN_OR_RETURN(auto m_hf, RunUnit(*w.unit, m));
    ASSIGN_OR_RETURN(auto v_hf, RunUnit(*w.unit, v));
    for (size_t t = 0; t < w.at.size(); ++t) {
      AdamWParamState s = w.groups[t];
      const auto& shape = w.unit->tensors[t].shape;
      s.param = {theta_hf[t].tensor.data.data(), theta_hf[t].tensor.dtype, shape};
      s.exp_avg = {m_hf[t].tensor.data.data(), m_hf[t].tensor.dtype, shape};
      s.exp_avg_sq = {v_hf[t].tensor.data.data(), v_hf[t].tensor.dtype, shape};
      RETURN_IF_ERROR(CheckParam(s, h, d->Entry(w.at[t])));
      RETURN_IF_ERROR(d->Encode(w.at[t], h, s));
    }
  }
  return Finish(h.step, *d);
}

// Validates the shards against the plan and the store (everything a publish
// can reject before writing) and lists the units given.
Result<std::vector<Publisher::McoreWork>> Publisher::PlanMcore(
    const AdamWStep& h, const std::map<ShardKey, const McoreAdamWShard*>& given, Draft& d) {
  std::vector<McoreWork> work;
  std::set<ShardKey> used;
  for (const ConvertUnit& unit : plan_) {
    ASSIGN_OR_RETURN(bool is_given, UnitGiven(unit, given));
    if (!is_given) continue;
    for (const PlannedShard& s : unit.shards) {
      RETURN_IF_ERROR(CheckShard(*given.at(s.key), s, h));
    }
    for (const PlannedShard& s : unit.shards) used.insert(s.key);
    McoreWork w{&unit, {}, {}};
    ASSIGN_OR_RETURN(w.groups, GroupsOf(unit, given));
    for (size_t t = 0; t < unit.tensors.size(); ++t) {
      RETURN_IF_ERROR(CheckHyper(h, &w.groups[t]));
      ASSIGN_OR_RETURN(TensorAt at, d.Claim(unit.tensors[t].name));
      RETURN_IF_ERROR(CheckTarget(unit.tensors[t], d.Entry(at)));
      w.at.push_back(at);
    }
    work.push_back(std::move(w));
  }
  if (used.size() != given.size()) {
    for (const auto& [key, s] : given) {
      if (!used.count(key)) {
        return InvalidArgument("MCore shard " + key.ToString() + " is not part of the " +
                               options_.mcore->spec.model_type + " model with tp " +
                               std::to_string(options_.mcore->layout.tp) + ", ep " +
                               std::to_string(options_.mcore->layout.ep));
      }
    }
  }
  return work;
}

}  // namespace dte
