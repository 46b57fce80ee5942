// FP8 receivers' part of a push (sync/push/internal/push_round.h): the
// receivers of one set of FP8 options form a variant; for each changed
// canonical tensor that some variant quantizes, its FP8 change set is
// computed once per block shape and scale rule, then remapped into every
// FP8 op of every variant's layouts and ranks (sync/transfer/fp8_plan.h)
// and encoded as round 2 sends entries: the bytes that changed and, for a
// block whose scale changed, its scale (and every byte of it that changed,
// which the change set lists).
//
// A change set comes from the parent's block summaries kept from the last
// push (push_fp8_summary.h) and the changes' old values, with only the
// blocks the summaries do not decide read from the store; or, on a
// server's first push, after a version it did not push, or for changes
// without the parent's elements, from the tensor's parent read whole and
// the version's elements made from it (kernels::Fp8ChangesAt). Either way
// the version's summaries are staged, and kept once the push is complete.
// Memory: one canonical tensor's parent and version in BF16, its change
// sets, and every quantized tensor's summaries twice (parent and version).
#include <algorithm>
#include <map>
#include <tuple>

#include "kernels/parallel.h"
#include "sync/push/internal/push_round.h"

namespace dte {

using push_internal::EntryKind;

int PushServer::Impl::Round::Fp8VariantOf(const std::string& key) {
  for (size_t i = 0; i < fp8.size(); ++i) {
    if (fp8[i].key == key) return static_cast<int>(i) + 1;
  }
  fp8.push_back({key, {}, {}});
  return static_cast<int>(fp8.size());
}

const Fp8ReceiverPlan* PushServer::Impl::Round::Fp8PlanOf(int v, const LayoutKey& layout,
                                                          int rank) const {
  const auto& plans = fp8[v - 1].plans;
  auto it = plans.find({layout, rank});
  return it == plans.end() ? nullptr : it->second;
}

bool PushServer::Impl::Round::IsFp8Op(int v, const LayoutKey& layout, const TransferOp& op) const {
  const Fp8ReceiverPlan* p = Fp8PlanOf(v, layout, op.receiver);
  return p != nullptr && p->tensors[op.receiver_tensor].fp8;
}

bool PushServer::Impl::Round::NeedsElements(const LayoutKey& layout, const TransferOp& op) const {
  if (plain_layouts.count(layout)) return true;
  for (int v = 1; v <= static_cast<int>(fp8.size()); ++v) {
    if (Fp8PlanOf(v, layout, op.receiver) && !IsFp8Op(v, layout, op)) return true;
  }
  return false;
}

Status PushServer::Impl::Round::PackFp8(const Batch& batch, bool check,
                                        std::map<Fp8Key, Fp8OpOut>* out) {
  for (const auto& [c, tc] : batch) RETURN_IF_ERROR(PackFp8Tensor(c, *tc, check, out));
  return Status::Ok();
}

// The variants and layouts whose FP8 ops read canonical tensor c.
std::vector<PushServer::Impl::Round::Fp8Use> PushServer::Impl::Round::Fp8UsesOf(size_t c) const {
  std::vector<Fp8Use> uses;
  for (int v = 1; v <= static_cast<int>(fp8.size()); ++v) {
    if (!fp8[v - 1].failed.empty()) continue;
    for (const auto& [at, plan] : fp8[v - 1].plans) {
      if (!plan->ops_by_canonical[c].empty()) uses.push_back({v, at.first, plan});
    }
  }
  return uses;
}

Status PushServer::Impl::Round::OpenParent() {
  if (reader) return Status::Ok();
  ASSIGN_OR_RETURN(parent_version, store.GetVersion(parent));
  reader = std::make_unique<Materializer>(&store);
  return Status::Ok();
}

// Tensor c's parent from the store and its version in BF16, into fp8_versions.
Status PushServer::Impl::Round::ReadFp8Versions(size_t c, const TensorChanges& tc) {
  RETURN_IF_ERROR(OpenParent());
  report.fp8_parent_reads++;
  report.fp8_parent_bytes += ShapeElements(canonical[c].shape) * 2;
  return push_internal::ReadFp8Versions(*reader, parent_version, canonical[c], tc,
                                        "FP8 push of " + vname + ": tensor " + canonical[c].name,
                                        &fp8_versions);
}

// Each use's FP8 ops, with the change set of its block shape and rule
// (computed once per shape and rule, into *sets).
Status PushServer::Impl::Round::Fp8Jobs(size_t c, const TensorChanges& tc,
                                        const std::vector<Fp8Use>& uses,
                                        std::map<Fp8Shape, push_internal::Fp8Changes>* sets,
                                        std::vector<Fp8Job>* jobs) {
  Fp8Layouts layouts;
  for (const Fp8Use& u : uses) {
    const kernels::Fp8Layout& l = u.plan->canonical_layout[c];
    layouts.emplace(Fp8Shape{l.block_rows, l.block_cols, l.rule}, l);
  }
  RETURN_IF_ERROR(Fp8Sets(c, tc, layouts, sets));
  for (const Fp8Use& u : uses) {
    const kernels::Fp8Layout& l = u.plan->canonical_layout[c];
    const push_internal::Fp8Changes* set = &sets->at({l.block_rows, l.block_cols, l.rule});
    for (uint32_t k : u.plan->ops_by_canonical[c]) {
      jobs->push_back({u.variant, u.layout, &u.plan->ops[k], set});
    }
  }
  return Status::Ok();
}

push_internal::Fp8SummaryKey PushServer::Impl::Round::SummaryKey(size_t c,
                                                                 const Fp8Shape& shape) const {
  const auto& [rows, cols, rule] = shape;
  return {canonical[c].name, rows, cols, rule};
}

bool PushServer::Impl::Round::HoldFp8Summary(const push_internal::Fp8SummaryKey& key,
                                             const kernels::Fp8Layout& l) {
  if (fp8_next.count(key)) return true;
  const uint64_t bytes = push_internal::Fp8SummaryBytes(l);
  if (fp8_held > options.fp8_summary_bytes || bytes > options.fp8_summary_bytes - fp8_held) {
    return false;
  }
  fp8_held += bytes;
  return true;
}

namespace {

bool SameLayout(const kernels::Fp8Layout& a, const kernels::Fp8Layout& b) {
  return a.rows == b.rows && a.cols == b.cols && a.block_rows == b.block_rows &&
         a.block_cols == b.block_cols && a.rule == b.rule;
}

// Tensor `name`'s content hash at version v (zero when absent).
Hash128 TensorHash(const Version& v, const std::string& name) {
  auto at = v.manifest.FindTensor(name);
  return at ? at->tensor->hash : Hash128{};
}

}  // namespace

// A summary describes the parent when it was kept from the push of the
// parent and its tensor's hash is the parent's (a part of a distributed
// push keeps summaries only of the tensors it pushed).
Status PushServer::Impl::Round::Fp8Sets(size_t c, const TensorChanges& tc,
                                        const Fp8Layouts& layouts,
                                        std::map<Fp8Shape, push_internal::Fp8Changes>* sets) {
  RETURN_IF_ERROR(OpenParent());
  const bool usable = tc.old_exact && fp8_prev.version == parent;
  const Hash128 hash = TensorHash(*parent_version, canonical[c].name);
  std::vector<const push_internal::Fp8Summary*> prev;
  for (const auto& [shape, l] : layouts) {
    auto it = fp8_prev.of.find(SummaryKey(c, shape));
    if (!usable || it == fp8_prev.of.end() || !SameLayout(it->second.layout, l) ||
        it->second.hash != hash) {
      return Fp8SetsWhole(c, tc, layouts, sets);
    }
    prev.push_back(&it->second);
  }
  return Fp8SetsStepped(c, tc, layouts, prev, sets);
}

Status PushServer::Impl::Round::Fp8SetsWhole(size_t c, const TensorChanges& tc,
                                             const Fp8Layouts& layouts,
                                             std::map<Fp8Shape, push_internal::Fp8Changes>* sets) {
  RETURN_IF_ERROR(ReadFp8Versions(c, tc));
  for (const auto& [shape, l] : layouts) {
    RETURN_IF_ERROR(
        push_internal::ComputeFp8Changes(l, fp8_versions, tc, canonical[c].name, &(*sets)[shape]));
    if (push_internal::Fp8Summarizable(l) && HoldFp8Summary(SummaryKey(c, shape), l)) {
      push_internal::Fp8Summary& s = fp8_next[SummaryKey(c, shape)];
      s = push_internal::SummarizeFp8(l, fp8_versions.child.data());
      s.hash = TensorHash(*v, canonical[c].name);
    }
  }
  return Status::Ok();
}

Status PushServer::Impl::Round::Fp8SetsStepped(
    size_t c, const TensorChanges& tc, const Fp8Layouts& layouts,
    const std::vector<const push_internal::Fp8Summary*>& prev,
    std::map<Fp8Shape, push_internal::Fp8Changes>* sets) {
  const uint64_t rows = canonical[c].shape[0], cols = canonical[c].shape[1];
  std::vector<push_internal::Fp8StepPlan> steps(prev.size());
  fp8_rows.assign(rows, 0);
  for (size_t j = 0; j < prev.size(); ++j) {
    push_internal::PlanFp8Step(*prev[j], tc, &steps[j]);
    push_internal::MarkFp8Rows(prev[j]->layout, steps[j], &fp8_rows);
  }
  fp8_versions.parent.resize(rows * cols);
  fp8_versions.child.resize(rows * cols);
  if (std::find(fp8_rows.begin(), fp8_rows.end(), 1) != fp8_rows.end()) {
    RETURN_IF_ERROR(OpenParent());
    ASSIGN_OR_RETURN(uint64_t bytes, push_internal::Fp8ReadRows(
                                         *reader, parent_version, canonical[c].name, cols, fp8_rows,
                                         "FP8 push of " + vname + ": tensor " + canonical[c].name,
                                         &fp8_versions.parent));
    report.fp8_parent_bytes += bytes;
    push_internal::Fp8ChildRows(cols, fp8_rows, tc, &fp8_versions);
  }
  size_t j = 0;
  for (const auto& [shape, l] : layouts) {
    push_internal::Fp8Summary next;
    RETURN_IF_ERROR(push_internal::FinishFp8Step(*prev[j], steps[j], fp8_versions, tc,
                                                 canonical[c].name, &(*sets)[shape], &next));
    next.hash = TensorHash(*v, canonical[c].name);
    if (HoldFp8Summary(SummaryKey(c, shape), l)) fp8_next[SummaryKey(c, shape)] = std::move(next);
    ++j;
  }
  return Status::Ok();
}

push_internal::Fp8Summaries PushServer::Impl::Round::Fp8SummariesAfter(bool complete) {
  push_internal::Fp8Summaries out;
  if (!complete || fp8.empty()) return out;
  for (const Fp8Variant& f : fp8) {
    if (!f.failed.empty()) return out;
  }
  out.version = v->manifest.version;
  out.of = std::move(fp8_next);
  if (fp8_prev.version != parent) return out;
  // The tensors this version left as they were keep their summaries.
  for (auto& [key, s] : fp8_prev.of) {
    if (!fp8_changed.count(std::get<0>(key))) out.of.emplace(key, std::move(s));
  }
  return out;
}

Status PushServer::Impl::Round::PackFp8Tensor(size_t c, const TensorChanges& tc, bool check,
                                              std::map<Fp8Key, Fp8OpOut>* out) {
  if (!tc.indices.empty()) fp8_changed.insert(canonical[c].name);
  const std::vector<Fp8Use> uses = Fp8UsesOf(c);
  if (uses.empty() || tc.indices.empty()) return Status::Ok();
  std::map<Fp8Shape, push_internal::Fp8Changes> sets;
  std::vector<Fp8Job> jobs;
  const Status made = Fp8Jobs(c, tc, uses, &sets, &jobs);
  if (!made.ok()) {
    // This version cannot be quantized (or read): those variants' receivers
    // are dropped; the push goes on for the others.
    for (const Fp8Use& u : uses) fp8[u.variant - 1].failed = "FP8 receivers: " + made.message();
    return Status::Ok();
  }
  std::vector<Fp8OpOut> encoded(jobs.size());
  kernels::ParallelFor(jobs.size(), 1, [&](size_t lo, size_t hi) {
    std::string scales;
    for (size_t i = lo; i < hi; ++i) {
      scales.clear();
      push_internal::EncodeFp8Op(*jobs[i].op, *jobs[i].changes, &encoded[i].bytes, &encoded[i].data,
                                 &encoded[i].scales, &scales);
      encoded[i].data += scales;
    }
  });
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Fp8Key key{jobs[i].variant, jobs[i].layout, jobs[i].op->op};
    std::array<uint64_t, 2>& n = fp8_counts[key];
    if (check && (n[0] != encoded[i].bytes || n[1] != encoded[i].scales)) {
      return Internal("push of " + vname + ": tensor " + canonical[c].name +
                      " read differently in the second pass");
    }
    n = {encoded[i].bytes, encoded[i].scales};
    (*out)[key] = std::move(encoded[i]);
  }
  return Status::Ok();
}

void PushServer::Impl::Round::MakeFp8Counts(int v, const LayoutKey& layout, int rank,
                                            push_internal::CountsMsg* m, uint64_t* elements) const {
  const TransferPlan* plan = plans.at(layout);
  const Fp8ReceiverPlan* fp = Fp8PlanOf(v, layout, rank);
  const uint32_t n = static_cast<uint32_t>(plan->receiver_tensors[rank].size());
  auto add = [&](size_t k, uint32_t tensor, uint64_t count, EntryKind kind) {
    if (count == 0) return;
    m->op.push_back(static_cast<uint32_t>(k));
    m->tensor.push_back(tensor);
    m->count.push_back(count);
    m->kind.push_back(kind);
    *elements += count;
  };
  for (size_t k = 0; k < plan->ops.size(); ++k) {
    const TransferOp& op = plan->ops[k];
    if (op.receiver != rank) continue;
    if (!fp->tensors[op.receiver_tensor].fp8) {
      add(k, op.receiver_tensor, op_counts.at(layout)[k], EntryKind::kElements);
      continue;
    }
    auto it = fp8_counts.find({v, layout, k});
    if (it == fp8_counts.end()) continue;
    add(k, op.receiver_tensor, it->second[0], EntryKind::kFp8Bytes);
    add(k, n + op.receiver_tensor, it->second[1], EntryKind::kFp8Scales);
  }
}

}  // namespace dte
