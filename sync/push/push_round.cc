// A push (sync/push/push_server.h), one method per phase, in order:
//  1. SelectTargets: install the version; the receivers that hold its
//     parent become targets, the others are told to catch up.
//  2. Round::CountChanges: a first pass over the changes in batches of
//     consecutive tensors; every op's count, and each batch packed whole
//     while what is kept fits options' cache_bytes.
//  3. SendCounts: round 1, each target's counts.
//  4. SendData: round 2 a batch at a time (kept, or read and packed again),
//     every target's queue drained below queue_bytes between batches.
//  5. EndData: the end of round 2 (or, when reading failed, every target
//     dropped).
//  6. AwaitConfirmations: the receipts, and the report.
#include "sync/push/internal/push_round.h"

#include <deque>
#include <utility>

#include "kernels/parallel.h"
#include "store/store.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_server_impl.h"

namespace dte {

using push_internal::Frame;
using push_internal::Msg;

namespace {

// Checks one tensor's changes against the version's tensor t.
Status CheckChanges(const TensorChanges& c, const PlanTensor& t, const std::string& what) {
  const uint64_t numel = ShapeElements(t.shape);
  if (c.values.size() != c.indices.size() * DTypeWidth(t.dtype)) {
    return InvalidArgument(what + ": " + std::to_string(c.values.size()) + " value bytes for " +
                           std::to_string(c.indices.size()) + " indices");
  }
  for (size_t k = 0; k < c.indices.size(); ++k) {
    if (c.indices[k] >= numel || (k > 0 && c.indices[k] <= c.indices[k - 1])) {
      return InvalidArgument(what + ": index " + std::to_string(c.indices[k]) +
                             " is out of range or out of order");
    }
  }
  if ((!c.old_values.empty() && c.old_values.size() != c.values.size()) ||
      (!c.known.empty() && c.known.size() != c.indices.size())) {
    return InvalidArgument(what + ": old values or known flags do not match the entries");
  }
  return Status::Ok();
}

// One op of a plan applied to one tensor's changes.
struct OpJob {
  const TransferPlan* plan;
  size_t op;  // index into plan->ops
  const TensorChanges* changes;
  bool encode = true;  // false: only counted (every receiver of it takes FP8 entries)
};

// An op's entries for its receiver rank: how many, and (in round 2) their
// encoding.
struct OpOut {
  uint64_t count = 0;
  std::string data;
};

// A run of at most kPieceEntries entries of one job.
struct Piece {
  size_t job, begin, end;
  uint64_t count = 0;
  std::string data;
};
constexpr size_t kPieceEntries = size_t{1} << 18;

void PackPiece(const OpJob& job, bool encode, Piece* pc, std::vector<uint64_t>* dst,
               std::vector<uint64_t>* pos) {
  const TransferOp& op = job.plan->ops[job.op];
  const TensorChanges& c = *job.changes;
  const size_t len = pc->end - pc->begin;
  dst->resize(len);
  pos->resize(len);
  const size_t j = RemapOpIndices(op, c.indices.data() + pc->begin, len, dst->data(), pos->data());
  pc->count = j;
  if (j == 0 || !encode || !job.encode) return;
  for (size_t q = 0; q < j; ++q) (*pos)[q] += pc->begin;
  push_internal::AppendOpSegments(
      dst->data(), pos->data(), j, DTypeWidth(job.plan->canonical[op.canonical].dtype),
      c.values.data(), c.old_values.empty() ? nullptr : c.old_values.data(),
      c.known.empty() ? nullptr : c.known.data(), &pc->data);
}

// Remaps each job's changes into its op and, when `encode`, encodes them
// (sync/push/internal/push_wire.h). Runs of an op's entries are independent
// (each becomes its own segments): pieces of every job run in parallel.
std::vector<OpOut> PackOps(const std::vector<OpJob>& jobs, bool encode) {
  std::vector<Piece> pieces;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const size_t n = jobs[k].changes->indices.size();
    for (size_t b = 0; b < n; b += kPieceEntries) {
      pieces.push_back({k, b, std::min(n, b + kPieceEntries), 0, {}});
    }
  }
  kernels::ParallelFor(pieces.size(), 1, [&](size_t lo, size_t hi) {
    std::vector<uint64_t> dst, pos;
    for (size_t i = lo; i < hi; ++i) PackPiece(jobs[pieces[i].job], encode, &pieces[i], &dst, &pos);
  });
  std::vector<OpOut> out(jobs.size());
  for (Piece& pc : pieces) {
    out[pc.job].count += pc.count;
    out[pc.job].data += pc.data;
    std::string().swap(pc.data);
  }
  return out;
}

double SecondsSince(push_internal::Clock::time_point t) {
  return std::chrono::duration<double>(push_internal::Clock::now() - t).count();
}

}  // namespace

void PushServer::Impl::Round::IndexOps() {
  for (const auto& [key, plan] : plans) {
    auto& by = ops_of[key];
    by.resize(canonical.size());
    for (size_t k = 0; k < plan->ops.size(); ++k) by[plan->ops[k].canonical].push_back(k);
    op_counts[key].assign(plan->ops.size(), 0);
  }
  if (plans.empty()) return;
  for (size_t c = 0; c < canonical.size(); ++c) {
    if (changes.MayChange(canonical[c].name)) changed.push_back(c);
  }
}

// Reads tensor c, checked; copied into `held` unless the source keeps it.
Result<const TensorChanges*> PushServer::Impl::Round::ReadTensor(size_t c,
                                                                 std::deque<TensorChanges>* held) {
  const std::string what = "push of " + vname + ": tensor " + canonical[c].name;
  ASSIGN_OR_RETURN(const TensorChanges* tc, changes.Read(canonical[c].name));
  RETURN_IF_ERROR(CheckChanges(*tc, canonical[c], what));
  if (changes.Stable()) return tc;
  held->push_back(*tc);
  return &held->back();
}

// Packs a batch: per op (plan order within each layout and rank) its count
// and, when `encode`, the ranks' data in op order; with `check`, the counts
// must be those of the first pass.
Status PushServer::Impl::Round::PackBatch(const Batch& batch, bool encode, bool check,
                                          std::map<RankKey, std::string>* data) {
  std::vector<OpJob> jobs;
  std::vector<LayoutKey> keys;
  for (const auto& [c, tc] : batch) {
    for (const auto& [key, plan] : plans) {
      for (size_t k : ops_of[key][c]) {
        jobs.push_back({plan, k, tc, NeedsElements(key, plan->ops[k])});
        keys.push_back(key);
      }
    }
  }
  std::vector<OpOut> out = PackOps(jobs, encode);
  std::map<Fp8Key, Fp8OpOut> fp8_out;
  if (!fp8.empty()) RETURN_IF_ERROR(PackFp8(batch, check, &fp8_out));
  for (size_t j = 0; j < jobs.size(); ++j) {
    const TransferOp& op = jobs[j].plan->ops[jobs[j].op];
    uint64_t& count = op_counts[keys[j]][jobs[j].op];
    if (check && out[j].count != count) {
      return Internal("push of " + vname + ": tensor " + canonical[op.canonical].name +
                      " read differently in the second pass");
    }
    count = out[j].count;
    if (!encode) continue;
    // Every variant with receivers of this layout and rank: the op's
    // elements, or its FP8 entries where it writes an FP8 tensor.
    if (plain_layouts.count(keys[j])) (*data)[{keys[j], op.receiver, 0}] += out[j].data;
    for (int v = 1; v <= static_cast<int>(fp8.size()); ++v) {
      if (!fp8[v - 1].failed.empty() || !fp8[v - 1].plans.count({keys[j], op.receiver})) continue;
      std::string& d = (*data)[{keys[j], op.receiver, v}];
      if (!IsFp8Op(v, keys[j], op)) {
        d += out[j].data;
      } else if (auto it = fp8_out.find({v, keys[j], jobs[j].op}); it != fp8_out.end()) {
        d += it->second.data;
      }
    }
    std::string().swap(out[j].data);
  }
  return Status::Ok();
}

Status PushServer::Impl::Round::FlushBatch(Batch* batch) {
  PackedBatch pb;
  for (const auto& item : *batch) pb.tensors.push_back(item.first);
  pb.encoded = cached < options.cache_bytes;
  RETURN_IF_ERROR(PackBatch(*batch, pb.encoded, false, &pb.data));
  for (const auto& [rk, bytes] : pb.data) cached += bytes.size();
  packed.push_back(std::move(pb));
  batch->clear();
  return Status::Ok();
}

// Round 1's pass: every op's count (and the batches kept packed).
Status PushServer::Impl::Round::CountChanges() {
  Batch batch;
  std::deque<TensorChanges> held;
  uint64_t entries = 0;
  for (size_t c : changed) {
    ASSIGN_OR_RETURN(const TensorChanges* tc, ReadTensor(c, &held));
    if (tc->indices.empty()) continue;
    batch.emplace_back(c, tc);
    entries += tc->indices.size();
    if (entries < options.batch_entries) continue;
    RETURN_IF_ERROR(FlushBatch(&batch));
    held.clear();
    entries = 0;
  }
  if (!batch.empty()) RETURN_IF_ERROR(FlushBatch(&batch));
  return Status::Ok();
}

// Each layout, rank and variant's counts message, and the elements it
// announces.
void PushServer::Impl::Round::MakeCounts(int part, int parts) {
  for (const Target& t : targets) {
    if (counts.count(t.key)) continue;
    const auto& [key, rank, variant] = t.key;
    push_internal::CountsMsg& m = counts[t.key];
    m.version = v->manifest.version;
    m.parent = parent;
    m.part = static_cast<uint32_t>(part);
    m.parts = static_cast<uint32_t>(parts);
    if (variant > 0) {
      MakeFp8Counts(variant, key, rank, &m, &elements[t.key]);
      continue;
    }
    const TransferPlan* plan = plans.at(key);
    for (size_t k = 0; k < plan->ops.size(); ++k) {
      const uint64_t n = op_counts[key][k];
      if (n == 0 || plan->ops[k].receiver != rank) continue;
      m.op.push_back(static_cast<uint32_t>(k));
      m.tensor.push_back(plan->ops[k].receiver_tensor);
      m.count.push_back(n);
      elements[t.key] += n;
    }
  }
}

// A batch round 1 only counted: read and packed again.
Status PushServer::Impl::Round::EncodeAgain(PackedBatch& pb, std::map<RankKey, std::string>* data) {
  Batch batch;
  std::deque<TensorChanges> held;
  for (size_t c : pb.tensors) {
    ASSIGN_OR_RETURN(const TensorChanges* tc, ReadTensor(c, &held));
    batch.emplace_back(c, tc);
  }
  return PackBatch(batch, true, true, data);
}

Result<PushReport> PushServer::Impl::Push(Store& store, const std::shared_ptr<const Version>& v,
                                          ChangesSource& changes) {
  Round r(store, v, changes, options_);
  r.fp8_prev = fp8_summaries_.Take();
  r.fp8_held = push_internal::Fp8SummaryBytes(r.fp8_prev);
  RETURN_IF_ERROR(SelectTargets(r));
  r.IndexOps();
  RETURN_IF_ERROR(r.CountChanges());
  const auto [part, parts] = group();
  r.MakeCounts(part, parts);
  r.pack = SecondsSince(r.t0);
  r.deadline = Clock::now() + options_.timeout;
  SendCounts(r);
  const Status streamed = SendData(r);
  EndData(r, streamed);
  fp8_summaries_.Put(r.Fp8SummariesAfter(streamed.ok()));
  if (!streamed.ok()) return streamed;
  r.report.pack_seconds = r.pack;
  AwaitConfirmations(r);
  r.report.missing =
      options_.receivers > r.report.pushed ? options_.receivers - r.report.pushed : 0;
  r.report.seconds = SecondsSince(r.t0);
  return r.report;
}

Status PushServer::Impl::SelectTargets(Round& r) {
  const Manifest& m = r.v->manifest;
  if (!m.parent) {
    return InvalidArgument("push of " + r.vname +
                           ": a version without a parent is not a change (receivers catch up)");
  }
  r.parent = *m.parent;
  ASSIGN_OR_RETURN(PlanInputs in, PlanInputsOf(r.store, *r.v));
  r.canonical = in.canonical;
  {
    MutexLock lock(&mu_);
    InstallLocked(r.v, std::move(in));
    for (auto& [id, cp] : conns_) {
      Conn& c = *cp;
      if (!c.hello_done || !c.drop.empty()) continue;
      if (c.info.version == r.parent && !c.info.behind) {
        TargetLocked(r, id, c);
      } else if (c.info.version != m.version) {
        c.info.behind = true;
        SendLocked(c, Frame(Msg::kBehind, push_internal::Json({{"latest", m.version}})));
        r.report.behind++;
      }
    }
  }
  Wake();
  return Status::Ok();
}

// A receiver that holds the parent: a target, once its layout has a plan
// and its tensors match it (else it is dropped).
void PushServer::Impl::TargetLocked(Round& r, uint64_t id, Conn& c) {
  auto plan = plans_.Plan(c.info.layout);
  if (!plan.ok()) return DropLocked(c, plan.status().message());
  if (c.plan_to_own.empty() && !(*plan)->receiver_tensors[c.info.rank].empty()) {
    Status match = MatchLocked(c, **plan, "receiver " + c.who + " against " + r.vname);
    if (!match.ok()) return DropLocked(c, match.message());
  }
  const LayoutKey key = push_internal::KeyOf(c.info.layout);
  r.plans[key] = *plan;
  int variant = 0;
  if (c.fp8) {
    auto fp8 = Fp8PlanLocked(c, **plan);
    if (!fp8.ok()) return DropLocked(c, fp8.status().message());
    variant = r.Fp8VariantOf(c.fp8_key);
    r.fp8[variant - 1].plans[{key, c.info.rank}] = *fp8;
  } else {
    r.plain_layouts.insert(key);
  }
  r.targets.push_back({id, {key, c.info.rank, variant}, c.plan_to_own});
}

// Round 1: each target's counts, in its own tensor numbering.
void PushServer::Impl::SendCounts(Round& r) {
  {
    MutexLock lock(&mu_);
    gone_.clear();
    confirmed_.clear();
    for (Round::Target& t : r.targets) {
      Conn* c = LiveLocked(t.id);
      if (!c) continue;
      const int variant = std::get<2>(t.key);
      if (variant > 0 && !r.fp8[variant - 1].failed.empty()) {
        DropLocked(*c, r.fp8[variant - 1].failed);
        r.report.dropped.push_back("receiver " + c->who + ": " + c->drop);
        continue;
      }
      push_internal::CountsMsg m = r.counts[t.key];
      for (uint32_t& tensor : m.tensor) tensor = t.plan_to_own[tensor];
      std::string f1 =
          Frame(variant > 0 ? Msg::kCountsFp8 : Msg::kCounts, push_internal::EncodeCounts(m));
      r.report.bytes += f1.size();
      c->info.bytes += f1.size();
      r.report.elements += r.elements[t.key];
      c->info.elements += r.elements[t.key];
      SendLocked(*c, std::move(f1));
      c->awaiting = r.v->manifest.version;
      r.sent.push_back(t.id);
    }
  }
  Wake();
}

void PushServer::Impl::SendAllLocked(Round& r, const RankKey* rk,
                                     const std::shared_ptr<const std::string>& frame) {
  for (Round::Target& t : r.targets) {
    if (rk && t.key != *rk) continue;
    Conn* c = LiveLocked(t.id);
    if (!c) continue;
    SendLocked(*c, frame);
    r.report.bytes += frame->size();
    c->info.bytes += frame->size();
  }
}

// Round 2, a batch at a time: each layout and rank's data of the batch
// (kept from round 1, or read and packed again), queued once for every
// receiver of that layout and rank.
Status PushServer::Impl::SendData(Round& r) {
  for (Round::PackedBatch& pb : r.packed) {
    if (r.sent.empty()) break;
    const auto p0 = Clock::now();
    std::map<RankKey, std::string> data = std::move(pb.data);
    if (!pb.encoded) RETURN_IF_ERROR(r.EncodeAgain(pb, &data));
    r.pack += SecondsSince(p0);
    MutexLock lock(&mu_);
    for (Round::Target& t : r.targets) {
      const int variant = std::get<2>(t.key);
      Conn* c = LiveLocked(t.id);
      if (c && variant > 0 && !r.fp8[variant - 1].failed.empty()) {
        DropLocked(*c, r.fp8[variant - 1].failed);
      }
    }
    for (auto& [rk, bytes] : data) {
      if (bytes.empty()) continue;
      SendAllLocked(r, &rk, std::make_shared<const std::string>(Frame(Msg::kData, bytes)));
    }
    Wake();
    WaitForQueuesLocked(r);
  }
  return Status::Ok();
}

// Before the next batch, every target's queue drains below options'
// queue_bytes; one that does not by the deadline is dropped.
void PushServer::Impl::WaitForQueuesLocked(Round& r) {
  auto over = [&](const Round::Target& t) REQUIRES(mu_) {
    auto it = conns_.find(t.id);
    return it != conns_.end() && QueuedBytes(*it->second) > options_.queue_bytes;
  };
  cv_.WaitUntil(&mu_, r.deadline, [&]() REQUIRES(mu_) {
    for (const Round::Target& t : r.targets) {
      if (over(t) && conns_.at(t.id)->drop.empty()) return false;
    }
    return true;
  });
  for (const Round::Target& t : r.targets) {
    if (!over(t)) continue;
    DropLocked(*conns_.at(t.id), "did not take " + r.vname + " within " +
                                     std::to_string(options_.timeout.count()) + " ms");
  }
}

void PushServer::Impl::EndData(Round& r, const Status& streamed) {
  {
    MutexLock lock(&mu_);
    if (streamed.ok()) {
      SendAllLocked(r, nullptr, std::make_shared<const std::string>(Frame(Msg::kDataEnd, {})));
    } else {
      // Receivers hold part of round 2 and never apply it: close them (they
      // reconnect and catch up from the store).
      for (uint64_t id : r.sent) {
        auto it = conns_.find(id);
        if (it != conns_.end()) DropLocked(*it->second, "push aborted: " + streamed.message());
      }
    }
  }
  Wake();
}

// Waits for every target's receipt up to the deadline; counts those that
// confirmed, drops and lists the rest.
void PushServer::Impl::AwaitConfirmations(Round& r) {
  {
    MutexLock lock(&mu_);
    auto pending = [&]() REQUIRES(mu_) {
      for (uint64_t id : r.sent) {
        auto it = conns_.find(id);
        if (it != conns_.end() && it->second->drop.empty() && it->second->awaiting) return true;
      }
      return false;
    };
    cv_.WaitUntil(&mu_, r.deadline, [&]() REQUIRES(mu_) { return !pending(); });
    for (uint64_t id : r.sent) ReportTargetLocked(r, id);
  }
  Wake();
}

void PushServer::Impl::ReportTargetLocked(Round& r, uint64_t id) {
  if (confirmed_.count(id)) {
    r.report.pushed++;  // also when it closed after confirming (a receiver that is done)
    return;
  }
  auto it = conns_.find(id);
  if (it == conns_.end()) {
    auto g = gone_.find(id);
    r.report.dropped.push_back(g != gone_.end() ? g->second
                                                : "receiver connection " + std::to_string(id) +
                                                      " closed during the push");
    return;
  }
  Conn& c = *it->second;
  if (c.drop.empty() && c.awaiting) {
    DropLocked(c, "did not confirm " + r.vname + " within " +
                      std::to_string(options_.timeout.count()) + " ms");
  }
  if (!c.drop.empty()) {
    r.report.dropped.push_back("receiver " + c.who + ": " + c.drop);
  } else {
    r.report.pushed++;
  }
}

}  // namespace dte
