// FP8 receivers' part of a push (sync/push/internal/push_round.h): the
// receivers of one set of FP8 options form a variant; each changed
// canonical tensor that some variant quantizes is read from the store in
// its parent version, the version's BF16 elements made from it and the
// changes, and its FP8 change set computed once per block shape and scale
// rule (kernels::Fp8ChangesAt), then remapped into every FP8 op of every
// variant's layouts and ranks (sync/transfer/fp8_plan.h) and encoded as
// round 2 sends entries: the bytes that changed and, for a block whose
// scale changed, its scale (and every byte of it that changed, which the
// change set lists). Memory: one canonical tensor's parent and version in
// BF16, and its change sets.
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

// Tensor c's parent from the store and its version in BF16, into fp8_versions.
Status PushServer::Impl::Round::ReadFp8Versions(size_t c, const TensorChanges& tc) {
  if (!reader) {
    ASSIGN_OR_RETURN(parent_version, store.GetVersion(parent));
    reader = std::make_unique<Materializer>(&store);
  }
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
  for (const Fp8Use& u : uses) {
    const kernels::Fp8Layout& l = u.plan->canonical_layout[c];
    const Fp8Shape shape{l.block_rows, l.block_cols, l.rule};
    auto it = sets->find(shape);
    if (it == sets->end()) {
      it = sets->emplace(shape, push_internal::Fp8Changes{}).first;
      RETURN_IF_ERROR(
          push_internal::ComputeFp8Changes(l, fp8_versions, tc, canonical[c].name, &it->second));
    }
    for (uint32_t k : u.plan->ops_by_canonical[c]) {
      jobs->push_back({u.variant, u.layout, &u.plan->ops[k], &it->second});
    }
  }
  return Status::Ok();
}

Status PushServer::Impl::Round::PackFp8Tensor(size_t c, const TensorChanges& tc, bool check,
                                              std::map<Fp8Key, Fp8OpOut>* out) {
  const std::vector<Fp8Use> uses = Fp8UsesOf(c);
  if (uses.empty() || tc.indices.empty()) return Status::Ok();
  std::map<Fp8Shape, push_internal::Fp8Changes> sets;
  std::vector<Fp8Job> jobs;
  Status made = ReadFp8Versions(c, tc);
  if (made.ok()) made = Fp8Jobs(c, tc, uses, &sets, &jobs);
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
