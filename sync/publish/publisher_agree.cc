// The Publisher's ranged publish: phases 1 (agreement) and 2 (ownership): every rank
// derives the same plan from every rank's header, or fails with the same
// error (sync/publish/publisher.h).
#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "kernels/adamw.h"
#include "store/store.h"
#include "sync/publish/internal/dist_header.h"
#include "sync/publish/internal/dist_plan.h"
#include "sync/publish/internal/dist_wire.h"
#include "sync/publish/publisher.h"

namespace dte {

using dist_internal::AllGather;
using dist_internal::DecodeHeader;
using dist_internal::EncodeHeader;
using dist_internal::Header;
using dist_internal::Plan;
using dist_internal::Reader;
using dist_internal::Writer;
using json = nlohmann::json;

namespace dist_internal {

kernels::AdamWParams ParamsOf(const AdamWStep& h, std::optional<double> lr,
                              std::optional<double> wd) {
  kernels::AdamWParams p{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, h.order};
  if (lr) p.lr = *lr;
  if (wd) p.weight_decay = *wd;
  return p;
}

}  // namespace dist_internal

namespace {

using dist_internal::ParamsOf;

// What every rank must agree on: the step, the hyper-parameters, the store
// and the layout.
json AgreedFields(const Plan& p, const std::string& store_id) {
  const AdamWStep& h = p.h;
  json fields = {{"step", h.step},
                 {"lr", h.lr},
                 {"beta1", h.beta1},
                 {"beta2", h.beta2},
                 {"eps", h.eps},
                 {"weight_decay", h.weight_decay},
                 {"amsgrad", h.amsgrad},
                 {"maximize", h.maximize},
                 {"order", static_cast<int>(h.order)},
                 {"store", store_id},
                 {"world_size", p.world},
                 {"anchor_budget", p.options.anchor_policy.budget},
                 {"anchor_every", p.options.anchor_policy.every},
                 {"converter", p.options.converter}};
  if (p.options.mcore) {
    const McoreConverter& c = *p.options.mcore;
    fields["mcore"] =
        json::array({c.spec.model_type, c.spec.num_layers, c.spec.hidden, c.layout.tp, c.layout.ep,
                     c.layout.expert_tp(), c.layout.vocab_divisible_by,
                     static_cast<int>(c.layout.norms), static_cast<int>(c.layout.experts)});
  }
  return fields;
}

// Why this rank cannot publish the step; "" when it can.
std::string StepError(const Plan& p, const std::optional<int64_t>& last_step) {
  const AdamWStep& h = p.h;
  if (h.amsgrad) return "AdamW amsgrad=True is not supported by the publisher";
  if (h.maximize) return "AdamW maximize=True is not supported by the publisher";
  if (std::string e = kernels::AdamWParamsError(ParamsOf(h, {}, {})); !e.empty()) return e;
  if (last_step && h.step != *last_step + 1 && h.step != *last_step) {
    return p.at_step + " does not follow step " + std::to_string(*last_step) +
           ", the last one this rank published";
  }
  return "";
}

// Every rank's header; the first rank's error, or the first field a rank
// disagrees with rank 0 on, fails every rank alike.
Result<std::vector<Header>> ExchangeHeaders(Transport& t, const Plan& p, const std::string& mine,
                                            DistPublishStats* stats) {
  ASSIGN_OR_RETURN(auto texts, AllGather(t, mine, p.at_step + ": agreeing on the publish", stats));
  std::vector<Header> all;
  for (int r = 0; r < p.world; ++r) {
    ASSIGN_OR_RETURN(Header hr, DecodeHeader(texts[r], r));
    all.push_back(std::move(hr));
  }
  for (int r = 0; r < p.world; ++r) {
    if (!all[r].error.empty()) {
      return InvalidArgument(p.at_step + ": rank " + std::to_string(r) + ": " + all[r].error);
    }
  }
  for (int r = 1; r < p.world; ++r) {
    for (const auto& [key, value] : all[0].fields.items()) {
      const json& other = all[r].fields.contains(key) ? all[r].fields.at(key) : json(nullptr);
      if (other != value) {
        return InvalidArgument(p.at_step + ": rank " + std::to_string(r) +
                               " disagrees with rank 0 on " + key + ": " + other.dump() +
                               " against " + value.dump());
      }
    }
  }
  return all;
}

// The result of `version`, which rank 0 committed for this step before.
Result<PublishResult> CommittedResult(Store& store, uint64_t version) {
  ASSIGN_OR_RETURN(auto v, store.GetVersion(version));
  PublishResult res;
  res.version = v->manifest.version;
  res.parent = v->manifest.parent.value_or(0);
  res.changed = v->manifest.stats.changed_elements;
  res.stored_bytes = v->manifest.stats.stored_bytes;
  res.full_table = v->manifest.full.has_value();
  return res;
}

// Sets p.latest, rank 0's: no other rank published this step, and none
// published a version other than it last.
Status CheckLatest(Plan& p) {
  for (int r = 1; r < p.world; ++r) {
    if (p.all[r].last_step && *p.all[r].last_step == p.h.step) {
      return InvalidArgument(p.at_step + ": rank " + std::to_string(r) + " published it already" +
                             ", but rank 0 did not: was rank 0 restarted?");
    }
  }
  p.latest = *p.all[0].latest;
  for (int r = 0; r < p.world; ++r) {
    if (p.all[r].last_version && *p.all[r].last_version != p.latest) {
      return AlreadyExists(p.at_step + ": the latest version of store " + p.store_uri + " is " +
                           VersionName(p.latest) + ", not " + VersionName(*p.all[r].last_version) +
                           " which rank " + std::to_string(r) +
                           " published last: another writer changed it");
    }
  }
  return Status::Ok();
}

void IndexParent(Plan& p) {
  const Manifest& pm = p.pm();
  for (size_t f = 0; f < pm.files.size(); ++f) {
    for (size_t i = 0; i < pm.files[f].tensors.size(); ++i) {
      p.ordinal[pm.files[f].tensors[i].name] = p.tensors.size();
      p.tensors.push_back({f, i, &pm.files[f].tensors[i], false, -1, {}, {}});
    }
  }
}

void MakeTargets(Plan& p) {
  if (p.mcore) {
    for (size_t u = 0; u < p.units.size(); ++u) {
      for (size_t k = 0; k < p.units[u].shards.size(); ++k) {
        const PlannedShard& ps = p.units[u].shards[k];
        p.shard_target[ps.key] = p.targets.size();
        p.targets.push_back(
            {"MCore shard " + ps.key.ToString(), ps.elements(), 0, u, k, false, {}, {}});
      }
    }
    return;
  }
  for (size_t ti = 0; ti < p.tensors.size(); ++ti) {
    const TensorEntry& te = *p.tensors[ti].entry;
    p.targets.push_back({"tensor " + te.name, te.elements(), ti, 0, 0, false, {}, {}});
  }
}

// The target a range names; a replica (a norm on every TP rank, a dense
// tensor on every EP rank) names the shard the plan takes from rank 0.
Result<size_t> TargetOf(const Plan& p, const Header::Range& x, const std::string& who) {
  if (!p.mcore) {
    auto it = p.ordinal.find(x.name);
    if (it == p.ordinal.end()) {
      return InvalidArgument(who + "tensor " + x.name + " is not in " + VersionName(p.latest) +
                             " of store " + p.store_uri);
    }
    const TensorEntry& te = *p.tensors[it->second].entry;
    if (te.dtype != DType::kBF16) {
      return InvalidArgument(who + "tensor " + x.name + " is " + DTypeName(te.dtype) +
                             " in the store; the publisher writes BF16 tensors only");
    }
    return it->second;
  }
  for (const ShardKey& key : {ShardKey{x.name, x.tp, x.ep}, ShardKey{x.name, 0, x.ep},
                              ShardKey{x.name, x.tp, 0}, ShardKey{x.name, 0, 0}}) {
    auto it = p.shard_target.find(key);
    if (it != p.shard_target.end()) return it->second;
  }
  const McoreConverter& c = *p.options.mcore;
  return InvalidArgument(who + "MCore shard " + ShardKey{x.name, x.tp, x.ep}.ToString() +
                         " is not part of the " + c.spec.model_type + " model with tp " +
                         std::to_string(c.layout.tp) + ", ep " + std::to_string(c.layout.ep));
}

Status CheckRange(const Plan& p, const Header::Range& x, const Plan::Target& tg,
                  const std::string& who) {
  if (x.begin > x.end || x.end > tg.elements) {
    return InvalidArgument(who + ": elements [" + std::to_string(x.begin) + ", " +
                           std::to_string(x.end) + ") are not a range of its " +
                           std::to_string(tg.elements) + " elements");
  }
  if (x.state_step && *x.state_step != p.h.step) {
    return InvalidArgument(who + ": optimizer state step " + std::to_string(*x.state_step) +
                           " does not match the published step " + std::to_string(p.h.step));
  }
  std::string e = kernels::AdamWParamsError(ParamsOf(p.h, x.lr, x.wd));
  if (!e.empty()) return InvalidArgument(who + ": " + e);
  return Status::Ok();
}

// A range of a rank's header.
struct Held {
  int rank;
  size_t index;  // into all[rank].ranges
};

// Every range of every rank, checked, by target.
Result<std::vector<std::vector<Held>>> HeldRanges(const Plan& p) {
  std::vector<std::vector<Held>> held(p.targets.size());
  for (int r = 0; r < p.world; ++r) {
    for (size_t k = 0; k < p.all[r].ranges.size(); ++k) {
      const Header::Range& x = p.all[r].ranges[k];
      const std::string rank_who = p.at_step + ": rank " + std::to_string(r) + ": ";
      ASSIGN_OR_RETURN(size_t ti, TargetOf(p, x, rank_who));
      RETURN_IF_ERROR(CheckRange(p, x, p.targets[ti], rank_who + p.targets[ti].what));
      held[ti].push_back({r, k});
    }
  }
  return held;
}

// Disjoint, sorted intervals of covered elements.
using Intervals = std::map<uint64_t, uint64_t>;  // begin -> end

// [begin, end) minus `covered`.
std::vector<FlatRange> Subtract(const Intervals& covered, uint64_t begin, uint64_t end) {
  std::vector<FlatRange> out;
  uint64_t at = begin;
  auto it = covered.upper_bound(begin);
  if (it != covered.begin()) --it;
  for (; it != covered.end() && it->first < end && at < end; ++it) {
    if (it->second <= at) continue;
    if (it->first > at) out.push_back({at, it->first});
    at = std::max(at, it->second);
  }
  if (at < end) out.push_back({at, end});
  return out;
}

void Cover(Intervals* covered, uint64_t begin, uint64_t end) {
  for (const FlatRange& piece : Subtract(*covered, begin, end)) {
    (*covered)[piece.begin] = piece.end;
  }
}

// Target ti's ranges: one param group, no rank giving an element twice,
// every element held; this rank's pieces are its ranges less what lower
// ranks hold (replicas go to their lowest holder).
Status CoverTarget(Plan& p, size_t ti, const std::vector<Held>& held) {
  Plan::Target& tg = p.targets[ti];
  tg.named = true;
  const Header::Range& first = p.all[held[0].rank].ranges[held[0].index];
  tg.lr = first.lr;
  tg.wd = first.wd;
  Intervals covered;
  int cur_rank = -1;
  Intervals rank_own;  // the current rank's ranges, which must not overlap
  Intervals below;     // covered by lower ranks
  const std::string who = p.at_step + ": " + tg.what;
  for (const Held& hd : held) {
    const Header::Range& x = p.all[hd.rank].ranges[hd.index];
    if (x.lr != tg.lr || x.wd != tg.wd) {
      return InvalidArgument(who + ": ranks " + std::to_string(held[0].rank) + " and " +
                             std::to_string(hd.rank) +
                             " give it different param-group lr or weight_decay");
    }
    if (hd.rank != cur_rank) {
      for (const auto& [b, e] : rank_own) Cover(&below, b, e);
      rank_own.clear();
      cur_rank = hd.rank;
    }
    if (x.begin == x.end) continue;
    auto fresh = Subtract(rank_own, x.begin, x.end);
    if (fresh.size() != 1 || fresh[0].begin != x.begin || fresh[0].end != x.end) {
      return InvalidArgument(who + ": rank " + std::to_string(hd.rank) +
                             " gives some of elements [" + std::to_string(x.begin) + ", " +
                             std::to_string(x.end) + ") twice");
    }
    rank_own[x.begin] = x.end;
    Cover(&covered, x.begin, x.end);
    if (hd.rank != p.rank) continue;
    for (const FlatRange& piece : Subtract(below, x.begin, x.end)) {
      p.pieces.push_back({ti, piece, &p.ranges[hd.index]});
    }
  }
  auto gaps = Subtract(covered, 0, tg.elements);
  if (!gaps.empty()) {
    return InvalidArgument(who + ": elements [" + std::to_string(gaps[0].begin) + ", " +
                           std::to_string(gaps[0].end) +
                           ") are held by no rank; the ranks' ranges must cover every tensor "
                           "they name");
  }
  return Status::Ok();
}

// The parent tensors of one MCore unit, named when its shards are, with
// the param group of the shards they come from.
Status NameUnit(Plan& p, const ConvertUnit& unit, size_t first) {
  const Plan::Target* given = nullptr;
  const Plan::Target* missing = nullptr;
  for (size_t k = 0; k < unit.shards.size(); ++k) {
    const Plan::Target& tg = p.targets[first + k];
    (tg.named ? given : missing) = &tg;
  }
  if (!given) return Status::Ok();
  if (missing) {
    return InvalidArgument(p.at_step + ": " + unit.label + ": " + missing->what +
                           " is held by no rank, but " + given->what +
                           " is; give all shards of a unit or none");
  }
  std::vector<const Plan::Target*> from(unit.tensors.size(), nullptr);
  for (const BlockCopy& c : unit.copies) {
    const Plan::Target& tg = p.targets[first + c.shard];
    const Plan::Target*& f = from[c.tensor];
    if (f == nullptr) {
      f = &tg;
    } else if (f->lr != tg.lr || f->wd != tg.wd) {
      return InvalidArgument(p.at_step + ": tensor " + unit.tensors[c.tensor].name + ": " +
                             f->what + " and " + tg.what +
                             " have different param-group lr or weight_decay");
    }
  }
  for (size_t k = 0; k < unit.tensors.size(); ++k) {
    const PlannedTensor& pt_plan = unit.tensors[k];
    auto it = p.ordinal.find(pt_plan.name);
    if (it == p.ordinal.end()) {
      return InvalidArgument(p.at_step + ": tensor " + pt_plan.name + " is not in " +
                             VersionName(p.latest) + " of store " + p.store_uri);
    }
    Plan::Tensor& pt = p.tensors[it->second];
    if (pt.entry->dtype != DType::kBF16 || pt.entry->shape != pt_plan.shape) {
      return InvalidArgument(p.at_step + ": tensor " + pt_plan.name + " is " +
                             DTypeName(pt.entry->dtype) + " " + ShapeString(pt.entry->shape) +
                             " in the store; the layout converts to BF16 " +
                             ShapeString(pt_plan.shape));
    }
    pt.named = true;
    if (from[k]) {
      pt.lr = from[k]->lr;
      pt.wd = from[k]->wd;
    }
  }
  return Status::Ok();
}

// The parent tensors published, and their param groups.
Status NameTensors(Plan& p) {
  if (!p.mcore) {
    for (const Plan::Target& tg : p.targets) {
      Plan::Tensor& pt = p.tensors[tg.tensor];
      pt.named = tg.named;
      pt.lr = tg.lr;
      pt.wd = tg.wd;
    }
    return Status::Ok();
  }
  size_t next = 0;  // targets are in plan order
  for (const ConvertUnit& unit : p.units) {
    RETURN_IF_ERROR(NameUnit(p, unit, next));
    next += unit.shards.size();
  }
  return Status::Ok();
}

// Every range, checked; coverage; this rank's pieces; the tensors named.
Status PlanRanges(Plan& p) {
  MakeTargets(p);
  ASSIGN_OR_RETURN(auto held, HeldRanges(p));
  for (size_t ti = 0; ti < p.targets.size(); ++ti) {
    if (!held[ti].empty()) RETURN_IF_ERROR(CoverTarget(p, ti, held[ti]));
  }
  RETURN_IF_ERROR(NameTensors(p));
  for (const Plan::Piece& pc : p.pieces) {
    const RangeState& s = *pc.state;
    if (s.end > s.begin && (!s.param || !s.exp_avg || !s.exp_avg_sq)) {
      return InvalidArgument(p.at_step + ": " + p.targets[pc.target].what + ": a range of " +
                             std::to_string(s.end - s.begin) + " elements without data");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string Publisher::OwnHeader(const Plan& p) {
  Header mine;
  mine.fields = AgreedFields(p, store_->store_id());
  mine.last_version = last_version_;
  mine.last_step = last_step_;
  if (push_) mine.push = push_->address();
  for (const auto& r : p.ranges) {
    mine.ranges.push_back(
        {r.name, r.tp_rank, r.ep_rank, r.begin, r.end, r.state_step, r.lr, r.weight_decay});
  }
  mine.error = StepError(p, last_step_);
  if (mine.error.empty() && p.rank == 0) {
    // A latest other than the one this rank committed is believed only once
    // the manifests confirm it (a damaged listing is listed again).
    auto latest = last_version_ ? store_->ConfirmedLatest(*last_version_) : store_->Latest();
    if (!latest.ok()) {
      mine.error = latest.status().message();
    } else if (!*latest) {
      mine.error = "store " + store_->uri() +
                   " has no version to publish a delta against; import the initial checkpoint "
                   "first";
    } else {
      mine.latest = **latest;
    }
  }
  return EncodeHeader(mine);
}

Result<std::optional<PublishResult>> Publisher::Agree(Transport& t, Plan& p) {
  ASSIGN_OR_RETURN(p.all, ExchangeHeaders(t, p, OwnHeader(p), &stats_));
  std::vector<std::string> senders;
  for (const Header& hr : p.all) senders.push_back(hr.push);
  RETURN_IF_ERROR(AgreePush(p.rank, senders, p.at_step + ": "));
  const Header& first = p.all[0];
  if (first.last_step && *first.last_step == p.h.step && first.last_version) {
    // Rank 0 committed this step, and the ranks that did not learn it (one
    // failed while the outcome was sent) retry: the version is there.
    ASSIGN_OR_RETURN(PublishResult res, CommittedResult(*store_, *first.last_version));
    committed_before_ = true;
    return std::optional<PublishResult>(std::move(res));
  }
  RETURN_IF_ERROR(CheckLatest(p));
  RETURN_IF_ERROR(LoadParent(t, p));
  IndexParent(p);
  RETURN_IF_ERROR(PlanRanges(p));
  p.tables = DecideTables(p.options.anchor_policy, p.parent_distance, p.join_distance,
                          p.pm().stats.dense_bytes);
  p.join = p.tables.join_table();
  p.full = p.tables.any_table();
  return std::optional<PublishResult>();
}

// The parent and its distance from the last full table, on every rank: one
// rank that cannot read them fails them all.
Status Publisher::LoadParent(Transport& t, Plan& p) {
  const Status loaded = ReadParent(p);
  Writer w;
  w.PutStatus(loaded);
  w.Put<uint64_t>(p.join_distance.versions);
  w.Put<uint64_t>(p.join_distance.bytes);
  ASSIGN_OR_RETURN(auto states, AllGather(t, w.out(), p.at_step + ": reading the parent", &stats_));
  for (int r = 0; r < p.world; ++r) {
    Reader rd(states[r]);
    Status s;
    AnchorDistance jd;
    if (!rd.GetStatus(&s) || !rd.Get(&jd.versions) || !rd.Get(&jd.bytes)) {
      return Corruption(p.at_step + ": rank " + std::to_string(r) + " sent a malformed status");
    }
    RETURN_IF_ERROR(s.WithContext(p.at_step + ": rank " + std::to_string(r)));
    // Whether this version gets a join table is rank 0's call, so every
    // rank plans the same full table.
    if (r == 0) p.join_distance = jd;
  }
  return Status::Ok();
}

Status Publisher::ReadParent(Plan& p) {
  // Ranges in device memory: the device and its buffers, checked here so
  // that a rank without them fails every rank before anything is routed.
  for (const RangeState& r : p.ranges) {
    if (r.device < 0 || r.end == r.begin) continue;
    if (!device_) device_ = std::make_unique<dist_internal::DeviceFinder>();
    RETURN_IF_ERROR(device_->Prepare(r.device, "tensor " + r.name + " (state on the GPU)"));
  }
  ASSIGN_OR_RETURN(p.parent, store_->GetVersion(p.latest));
  ASSIGN_OR_RETURN(p.parent_distance, DistanceOf(*store_, p.parent));
  if (p.rank == 0) {
    ASSIGN_OR_RETURN(p.join_distance, JoinDistanceOf(*store_, p.parent, p.parent_distance));
  }
  return Status::Ok();
}

// 2. Ownership: largest first, to the least loaded rank.
void Publisher::AssignOwners(Plan& p) const {
  std::vector<size_t> order;
  for (size_t ti = 0; ti < p.tensors.size(); ++ti) {
    if (p.tensors[ti].named || p.full) order.push_back(ti);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return p.tensors[a].entry->bytes() > p.tensors[b].entry->bytes();
  });
  std::vector<uint64_t> load(p.world, 0);
  for (size_t ti : order) {
    int best = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    p.tensors[ti].owner = best;
    load[best] += p.tensors[ti].entry->bytes() + 1;
  }
}

}  // namespace dte
