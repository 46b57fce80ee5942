// A push receiver's moves from the store (sync/push/internal/push_receiver_impl.h):
// the elements each version between two versions of one chain changed,
// read from the store's deltas, remapped to this rank's tensors and staged
// as pushes are, so a move forward (a staged catch-up) or back (a
// rollback) is applied the way a push is: together with the server's other
// ranks, writing only the elements that differ.
#include <algorithm>
#include <cstring>

#include "kernels/width.h"
#include "store/changes.h"
#include "store/materialize.h"
#include "store/store.h"
#include "sync/push/internal/push_fp8.h"
#include "sync/push/internal/push_plan.h"
#include "sync/push/internal/push_receiver_impl.h"
#include "sync/transfer/plan_inputs.h"

namespace dte {

using push_internal::Msg;
using push_internal::OpEntries;
using push_internal::Pending;

namespace {

// The wrapping difference a - b of `width`-byte elements (what ApplyOpEntries
// adds to an element holding b to make it a).
void Difference(const uint8_t* a, const uint8_t* b, int width, uint8_t* out) {
  kernels::DispatchWidth(width, [&](auto w) {
    using U = typename kernels::ElementBits<decltype(w)::value>::type;
    U x, y;
    std::memcpy(&x, a, sizeof(U));
    std::memcpy(&y, b, sizeof(U));
    const U d = static_cast<U>(x - y);
    std::memcpy(out, &d, sizeof(U));
  });
}

// The versions from `from` to `to` along parent links, `to` first when
// `to` descends from `from`; empty when it does not.
Result<std::vector<std::shared_ptr<const Version>>> Descent(Store& store, uint64_t from,
                                                            uint64_t to) {
  std::vector<std::shared_ptr<const Version>> chain;
  ASSIGN_OR_RETURN(auto v, store.GetVersion(to));
  for (;;) {
    chain.push_back(v);
    if (v->manifest.version == from) return chain;
    if (!v->manifest.parent || *v->manifest.parent < from)
      return std::vector<std::shared_ptr<const Version>>{};
    ASSIGN_OR_RETURN(v, store.GetVersion(*v->manifest.parent));
  }
}

}  // namespace

Status PushReceiver::Impl::MoveTo(Store& store, uint64_t version) {
  const std::string what =
      "move of push receiver rank " + std::to_string(options_.rank) + " to " + VersionName(version);
  std::optional<uint64_t> tail;
  {
    std::lock_guard lock(mu_);
    const std::vector<uint64_t> path = PathLocked();
    if (path.empty()) {
      return FailedPrecondition(what + ": the version it holds is unknown (catch up whole)");
    }
    tail = path.back();
  }
  ASSIGN_OR_RETURN(std::vector<Pending> steps, StepsFromStore(store, *tail, version));
  {
    std::lock_guard lock(mu_);
    RETURN_IF_ERROR(QueueStepsLocked(tail, std::move(steps)));
    if (behind_ && version >= *behind_) behind_.reset();
  }
  SendAll(Msg::kHeld, {{"version", version}});
  cv_.notify_all();
  return Status::Ok();
}

Status PushReceiver::Impl::QueueStepsLocked(std::optional<uint64_t> tail,
                                            std::vector<Pending> steps) {
  const std::vector<uint64_t> path = PathLocked();
  if (path.empty() || path.back() != tail || path.size() != pending_.size() + 1) {
    return Aborted("a push or catch-up came in while the move from " + VersionName(*tail) +
                   " was read from the store: move again");
  }
  uint64_t bytes = 0;
  for (const Pending& p : steps) bytes += p.Staged();
  if (staged_bytes_ + bytes > options_.stage_bytes) {
    return FailedPrecondition("staging the move from " + VersionName(*tail) + " (" +
                              std::to_string(bytes) + " bytes) beside the " +
                              std::to_string(staged_bytes_) + " staged would pass stage_bytes " +
                              std::to_string(options_.stage_bytes) + ": apply them first");
  }
  staged_bytes_ += bytes;
  for (Pending& p : steps) {
    expected_parent_ = p.version;
    pending_.push_back(std::move(p));
  }
  return Status::Ok();
}

Result<std::vector<Pending>> PushReceiver::Impl::StepsFromStore(Store& store, uint64_t from,
                                                                uint64_t to) {
  std::vector<Pending> steps;
  if (from == to) return steps;
  const bool forward = to > from;
  ASSIGN_OR_RETURN(auto chain, forward ? Descent(store, from, to) : Descent(store, to, from));
  if (chain.empty()) {
    return FailedPrecondition("move of push receiver rank " + std::to_string(options_.rank) +
                              " from " + VersionName(from) + " to " + VersionName(to) +
                              ": they are not on one chain of the store (catch up whole)");
  }
  // chain: the newer version first, down to the older.
  if (forward) std::reverse(chain.begin(), chain.end());
  for (size_t k = 1; k < chain.size(); ++k) {
    ASSIGN_OR_RETURN(Pending p, StepFromStore(store, chain[k - 1], chain[k]));
    steps.push_back(std::move(p));
  }
  return steps;
}

// The step between a version and its child, either way: the child's changes
// (VersionChangesReader) remapped to this rank's ops; going forward the
// differences (or whole values) it records, going back the differences
// negated and, for elements it set whole, the parent's values.
Result<Pending> PushReceiver::Impl::StepFromStore(Store& store,
                                                  const std::shared_ptr<const Version>& from,
                                                  const std::shared_ptr<const Version>& to) {
  const bool forward = to->manifest.parent == from->manifest.version;
  const std::shared_ptr<const Version>& child = forward ? to : from;
  const std::shared_ptr<const Version>& parent = forward ? from : to;
  const std::string what = "move of push receiver rank " + std::to_string(options_.rank) +
                           " from " + VersionName(from->manifest.version) + " to " +
                           VersionName(to->manifest.version);
  ASSIGN_OR_RETURN(RankPlan rp, PlanOf(store, *child, what));
  const TransferPlan& plan = rp.plan;
  const std::optional<Fp8ReceiverPlan>& fp8 = rp.fp8;
  const std::vector<uint32_t>& own = rp.own;
  ASSIGN_OR_RETURN(auto reader, VersionChangesReader::Open(store, child));
  Materializer parents(&store);
  Pending step;
  step.parent = from->manifest.version;
  step.version = to->manifest.version;
  std::vector<uint64_t> dst, pos;
  std::vector<uint8_t> parent_tensor, parent_values;
  for (size_t c = 0; c < plan.canonical.size(); ++c) {
    const PlanTensor& ct = plan.canonical[c];
    if (!reader->MayChange(ct.name)) continue;
    ASSIGN_OR_RETURN(const TensorChanges* tc, reader->Read(ct.name));
    const size_t n = tc->indices.size();
    if (n == 0) continue;
    if (fp8 && fp8->canonical_fp8[c]) {
      RETURN_IF_ERROR(StageFp8Tensor(parents, parent, forward, *fp8, c, ct, *tc, own, &step, what));
      continue;
    }
    const int width = DTypeWidth(ct.dtype);
    const bool has_old = !tc->old_values.empty();
    auto known = [&](size_t k) { return has_old && (tc->known.empty() || tc->known[k] != 0); };
    // Going back over an element the child set whole: the parent's value.
    // Going back over elements the child set whole: the parent's values,
    // read element by element when they are few (a block each), else the
    // tensor whole.
    std::vector<size_t> unknown;
    for (size_t k = 0; k < n && !forward; ++k) {
      if (!known(k)) unknown.push_back(k);
    }
    const uint64_t numel = ShapeElements(ct.shape);
    const bool whole = unknown.size() * (uint64_t{256} << 10) > numel * width;
    parent_values.assign(unknown.size() * width, 0);
    if (whole) {
      parent_tensor.resize(numel * width);
      RETURN_IF_ERROR(push_internal::ReadTensorInto(parents, parent, ct.name, parent_tensor.data(),
                                                    parent_tensor.size(), what));
    }
    if (!unknown.empty()) {
      ASSIGN_OR_RETURN(const push_internal::TensorBytes at,
                       push_internal::LocateTensor(*parent, ct.name, numel * width, what));
      for (size_t u = 0; u < unknown.size(); ++u) {
        const uint64_t i = tc->indices[unknown[u]];
        uint8_t* dst = parent_values.data() + u * width;
        if (whole) {
          std::memcpy(dst, parent_tensor.data() + i * width, width);
        } else {
          RETURN_IF_ERROR(parents.ReadFile(parent, *at.file, at.offset + i * width, width, dst)
                              .WithContext(what));
        }
      }
    }
    for (size_t o = 0; o < plan.ops.size(); ++o) {
      const TransferOp& op = plan.ops[o];
      if (op.receiver != options_.rank || op.canonical != c) continue;
      dst.resize(n);
      pos.resize(n);
      const size_t j = RemapOpIndices(op, tc->indices.data(), n, dst.data(), pos.data());
      if (j == 0) continue;
      Pending::Segment seg{own[op.receiver_tensor], o * 3, {}};
      OpEntries& e = seg.entries;
      e.idx.assign(dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(j));
      e.vals.resize(j * width);
      bool any_set = false;
      for (size_t q = 0; q < j; ++q) {
        const size_t k = pos[q];
        const uint8_t* nv = tc->values.data() + k * width;
        const uint8_t* ov = has_old ? tc->old_values.data() + k * width : nullptr;
        uint8_t* out = e.vals.data() + q * width;
        if (known(k)) {
          forward ? Difference(nv, ov, width, out) : Difference(ov, nv, width, out);
          continue;
        }
        if (e.sets.empty()) e.sets.assign(j, 0);
        e.sets[q] = 1;
        any_set = true;
        if (forward) {
          std::memcpy(out, nv, width);
        } else {
          const size_t u = static_cast<size_t>(std::lower_bound(unknown.begin(), unknown.end(), k) -
                                               unknown.begin());
          std::memcpy(out, parent_values.data() + u * width, width);
        }
      }
      if (!any_set) e.sets.clear();
      step.elements += j;
      step.bytes += j * width;
      step.segments.push_back(std::move(seg));
    }
  }
  return step;
}

// An FP8 tensor's step: its BF16 elements in the parent (read whole) and
// the child (the parent with the child's changes), the FP8 change set from
// the version moved from to the one moved to over the changed elements'
// blocks, and, per FP8 op of this rank, the E4M3 bytes and scales that
// differ, as whole values.
Status PushReceiver::Impl::StageFp8Tensor(Materializer& reader,
                                          const std::shared_ptr<const Version>& parent,
                                          bool forward, const Fp8ReceiverPlan& fp8, size_t c,
                                          const PlanTensor& ct, const TensorChanges& tc,
                                          const std::vector<uint32_t>& own, Pending* step,
                                          const std::string& what) {
  push_internal::Fp8Versions v;
  RETURN_IF_ERROR(push_internal::ReadFp8Versions(reader, parent, ct, tc, what, &v));
  if (!forward) std::swap(v.parent, v.child);  // from the child back to its parent
  push_internal::Fp8Changes changes;
  RETURN_IF_ERROR(push_internal::ComputeFp8ChangesAt(fp8.canonical_layout[c], v, tc.indices.data(),
                                                     tc.indices.size(), ct.name, &changes));
  const size_t n = own.size() / 2;  // the plan's receiver tensors (own has 2n slots)
  Fp8OpIndices at;
  for (uint32_t k : fp8.ops_by_canonical[c]) {
    const Fp8ReceiverOp& op = fp8.ops[k];
    RemapFp8Changes(op, changes.set, &at);
    if (!at.byte_index.empty()) {
      Pending::Segment seg{own[op.receiver_tensor], size_t{op.op} * 3 + 1, {}};
      seg.entries.idx = at.byte_index;
      seg.entries.vals.resize(at.byte_index.size());
      for (size_t q = 0; q < at.byte_pos.size(); ++q) {
        seg.entries.vals[q] = changes.set.byte_value[at.byte_pos[q]];
      }
      seg.entries.sets.assign(at.byte_index.size(), 1);
      step->elements += at.byte_index.size();
      step->bytes += at.byte_index.size();
      step->segments.push_back(std::move(seg));
    }
    if (!at.scale_index.empty()) {
      Pending::Segment seg{own[n + op.receiver_tensor], size_t{op.op} * 3 + 2, {}};
      seg.entries.idx = at.scale_index;
      seg.entries.vals.resize(at.scale_index.size() * 4);
      for (size_t q = 0; q < at.scale_pos.size(); ++q) {
        std::memcpy(seg.entries.vals.data() + q * 4, &changes.set.scale_value[at.scale_pos[q]], 4);
      }
      seg.entries.sets.assign(at.scale_index.size(), 1);
      step->elements += at.scale_index.size();
      step->bytes += at.scale_index.size() * 4;
      step->segments.push_back(std::move(seg));
    }
  }
  return Status::Ok();
}

}  // namespace dte
