// Transfer plans: layouts per side (sync/transfer/internal/transfer_layout.h), then
// the pairwise box overlaps in plan order.
#include "sync/transfer/transfer_plan.h"

#include <algorithm>
#include <map>

#include "kernels/remap.h"
#include "sync/transfer/internal/transfer_layout.h"

namespace dte {
namespace {

using transfer_internal::Classified;
using transfer_internal::Piece;

// Every rank's pieces of every canonical tensor under one layout, with the
// local tensor tables they index.
struct Side {
  std::vector<std::vector<PlanTensor>> tensors;  // [rank]
  std::vector<std::vector<Piece>> pieces;        // [canonical][rank]
  std::vector<std::vector<uint32_t>> local;      // [canonical][rank] -> tensors[rank] index
};

Result<Side> LayOut(const std::vector<PlanTensor>& canonical,
                    const std::vector<Classified>& classes, const AttentionGeometry& g,
                    const ShardLayout& layout) {
  Side side;
  side.tensors.resize(layout.tp);
  side.pieces.resize(canonical.size());
  side.local.resize(canonical.size());
  std::vector<std::map<std::string, uint32_t>> by_name(layout.tp);
  for (size_t i = 0; i < canonical.size(); ++i) {
    for (int r = 0; r < layout.tp; ++r) {
      Piece p = transfer_internal::LocalPiece(canonical[i], classes[i], g, layout, r);
      auto [it, added] = by_name[r].emplace(p.local.name, side.tensors[r].size());
      if (added) {
        side.tensors[r].push_back(p.local);
      } else {
        const PlanTensor& have = side.tensors[r][it->second];
        if (have.shape != p.local.shape || have.dtype != p.local.dtype) {
          return InvalidArgument("transfer plan: tensor '" + canonical[i].name +
                                 "' lands in local tensor '" + p.local.name +
                                 "' whose shape or dtype another tensor fixed differently");
        }
      }
      side.local[i].push_back(it->second);
      side.pieces[i].push_back(std::move(p));
    }
  }
  return side;
}

bool Empty(const Piece& p) {
  return std::any_of(p.extent.begin(), p.extent.end(), [](uint64_t e) { return e == 0; });
}

// Distinct non-empty sender boxes of one canonical tensor, each with the
// ranks holding it. Boxes of different groups must be disjoint and together
// cover the tensor exactly once.
struct Holders {
  const Piece* box;
  std::vector<int> ranks;
};

Result<std::vector<Holders>> SenderGroups(const PlanTensor& t, const std::vector<Piece>& pieces) {
  std::vector<Holders> groups;
  for (int s = 0; s < static_cast<int>(pieces.size()); ++s) {
    const Piece& p = pieces[s];
    if (Empty(p)) continue;
    auto same = [&](const Holders& h) {
      return h.box->box_start == p.box_start && h.box->extent == p.extent;
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({&p, {s}});
    } else {
      it->ranks.push_back(s);
    }
  }
  uint64_t covered = 0;
  for (const Holders& h : groups) covered += ShapeElements(h.box->extent);
  if (covered != ShapeElements(t.shape)) {
    return Internal("transfer plan: tensor '" + t.name + "': sender boxes cover " +
                    std::to_string(covered) + " of " + std::to_string(ShapeElements(t.shape)) +
                    " elements");
  }
  return groups;
}

// The overlap of a and b; false when empty.
bool Intersect(const Piece& a, const Piece& b, std::vector<uint64_t>* start,
               std::vector<uint64_t>* extent) {
  const size_t nd = a.box_start.size();
  start->resize(nd);
  extent->resize(nd);
  for (size_t d = 0; d < nd; ++d) {
    const uint64_t lo = std::max(a.box_start[d], b.box_start[d]);
    const uint64_t hi = std::min(a.box_start[d] + a.extent[d], b.box_start[d] + b.extent[d]);
    if (hi <= lo) return false;
    (*start)[d] = lo;
    (*extent)[d] = hi - lo;
  }
  return true;
}

// Coordinates of canonical point `at` inside piece p's local tensor.
std::vector<uint64_t> ToLocal(const Piece& p, const std::vector<uint64_t>& at) {
  std::vector<uint64_t> out(at.size());
  for (size_t d = 0; d < at.size(); ++d) out[d] = at[d] - p.box_start[d] + p.local_start[d];
  return out;
}

Status AddOps(uint32_t i, const PlanTensor& t, const Side& send, const Side& recv,
              std::vector<TransferOp>* ops) {
  ASSIGN_OR_RETURN(std::vector<Holders> groups, SenderGroups(t, send.pieces[i]));
  for (int r = 0; r < static_cast<int>(recv.pieces[i].size()); ++r) {
    const Piece& rp = recv.pieces[i][r];
    if (Empty(rp)) continue;
    for (const Holders& h : groups) {
      TransferOp op;
      if (!Intersect(*h.box, rp, &op.box_start, &op.extent)) continue;
      // Replicated data: receivers take turns among its holders.
      op.sender = h.ranks[r % h.ranks.size()];
      const Piece& sp = send.pieces[i][op.sender];
      op.canonical = i;
      op.sender_tensor = send.local[i][op.sender];
      op.receiver = r;
      op.receiver_tensor = recv.local[i][r];
      op.src_start = ToLocal(sp, op.box_start);
      op.dst_start = ToLocal(rp, op.box_start);
      op.elements = ShapeElements(op.extent);
      const kernels::RemapSpec spec{sp.local.shape, op.src_start, op.extent, rp.local.shape,
                                    op.dst_start};
      if (std::string err = kernels::MakeRemapPlan(spec, &op.remap); !err.empty()) {
        return Internal("transfer plan: tensor '" + t.name + "' to receiver rank " +
                        std::to_string(r) + ": " + err);
      }
      ops->push_back(std::move(op));
    }
  }
  return Status::Ok();
}

}  // namespace

uint64_t ShapeElements(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t s : shape) n *= s;
  return n;
}

Result<TransferPlan> MakeTransferPlan(const std::vector<PlanTensor>& canonical,
                                      const AttentionGeometry& geometry, const ShardLayout& sender,
                                      const ShardLayout& receiver) {
  if (sender.tp < 1 || receiver.tp < 1) {
    return InvalidArgument("transfer plan: tensor-parallel degrees must be >= 1 (sender " +
                           std::to_string(sender.tp) + ", receiver " + std::to_string(receiver.tp) +
                           ")");
  }
  std::vector<Classified> classes;
  std::map<std::string, size_t> seen;
  for (const PlanTensor& t : canonical) {
    if (!seen.emplace(t.name, classes.size()).second) {
      return InvalidArgument("transfer plan: tensor '" + t.name + "' is listed twice");
    }
    ASSIGN_OR_RETURN(Classified c, transfer_internal::Classify(t));
    classes.push_back(std::move(c));
  }
  RETURN_IF_ERROR(transfer_internal::ValidateLayout(canonical, classes, geometry, sender)
                      .WithContext("sender layout"));
  RETURN_IF_ERROR(transfer_internal::ValidateLayout(canonical, classes, geometry, receiver)
                      .WithContext("receiver layout"));
  ASSIGN_OR_RETURN(Side send, LayOut(canonical, classes, geometry, sender));
  ASSIGN_OR_RETURN(Side recv, LayOut(canonical, classes, geometry, receiver));
  TransferPlan plan;
  plan.canonical = canonical;
  for (uint32_t i = 0; i < canonical.size(); ++i) {
    RETURN_IF_ERROR(AddOps(i, canonical[i], send, recv, &plan.ops));
  }
  plan.sender_tensors = std::move(send.tensors);
  plan.receiver_tensors = std::move(recv.tensors);
  return plan;
}

size_t RemapOpIndices(const TransferOp& op, const uint64_t* src_idx, size_t n,
                      uint64_t* dst_idx_out, uint64_t* pos_out) {
  return kernels::RemapIndices(op.remap, src_idx, n, dst_idx_out, pos_out);
}

std::string LayoutText(const ShardLayout& l, int rank) {
  return "tp=" + std::to_string(l.tp) + " rank " + std::to_string(rank) +
         (l.fuse_qkv ? ", fused qkv_proj" : "") + (l.fuse_gate_up ? ", fused gate_up_proj" : "");
}

}  // namespace dte
