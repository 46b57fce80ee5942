#include "sync/transfer/internal/p2p_pairs.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace dte::p2p_internal {
namespace {

std::string RankName(int r) { return "rank " + std::to_string(r); }

// The index of `rank` in ranks, or -1; fails when it is out of range or
// appears twice.
Result<int> FindRole(const std::vector<int>& ranks, int rank, int size, const char* role) {
  int found = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size) {
      return InvalidArgument(std::string("two-round sync: ") + role + " " + std::to_string(i) +
                             " maps to transport rank " + std::to_string(ranks[i]) +
                             ", outside 0.." + std::to_string(size - 1));
    }
    if (std::count(ranks.begin(), ranks.end(), ranks[i]) > 1) {
      return InvalidArgument(std::string("two-round sync: transport rank ") +
                             std::to_string(ranks[i]) + " plays two " + role + "s");
    }
    if (ranks[i] == rank) found = static_cast<int>(i);
  }
  return found;
}

Status CheckUpdate(const PlanTensor& t, const SparseUpdate& u) {
  const uint64_t numel = ShapeElements(t.shape);
  if (u.count != 0 && (u.indices == nullptr || u.values == nullptr)) {
    return InvalidArgument("update of tensor '" + t.name + "' has no index or value buffer");
  }
  for (size_t k = 0; k < u.count; ++k) {
    if (u.indices[k] >= numel || (k > 0 && u.indices[k] <= u.indices[k - 1])) {
      return InvalidArgument("update of tensor '" + t.name + "': index " +
                             std::to_string(u.indices[k]) + " at position " + std::to_string(k) +
                             " is out of range or not ascending");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Pairs> PairOps(const TransferPlan& plan, const P2PRoles& roles, int rank, int size) {
  if (roles.sender_ranks.size() != plan.sender_tensors.size() ||
      roles.receiver_ranks.size() != plan.receiver_tensors.size()) {
    return InvalidArgument(
        "two-round sync: roles name " + std::to_string(roles.sender_ranks.size()) +
        " senders and " + std::to_string(roles.receiver_ranks.size()) +
        " receivers, the plan has " + std::to_string(plan.sender_tensors.size()) + " and " +
        std::to_string(plan.receiver_tensors.size()));
  }
  Pairs p;
  ASSIGN_OR_RETURN(p.sender, FindRole(roles.sender_ranks, rank, size, "sender"));
  ASSIGN_OR_RETURN(p.receiver, FindRole(roles.receiver_ranks, rank, size, "receiver"));
  for (uint32_t i = 0; i < plan.ops.size(); ++i) {
    const int a = roles.sender_ranks[plan.ops[i].sender];
    const int b = roles.receiver_ranks[plan.ops[i].receiver];
    if (a == rank) p.out[b].push_back(i);
    if (b == rank) p.in[a].push_back(i);
  }
  return p;
}

Status CheckBuffers(const TransferPlan& plan, const Pairs& pairs,
                    const std::vector<SparseUpdate>& updates,
                    const std::vector<ShardBuffer>& shards) {
  const size_t want_updates = pairs.sender < 0 ? 0 : plan.sender_tensors[pairs.sender].size();
  const size_t want_shards = pairs.receiver < 0 ? 0 : plan.receiver_tensors[pairs.receiver].size();
  if (updates.size() != want_updates || shards.size() != want_shards) {
    return InvalidArgument("got " + std::to_string(updates.size()) + " updates and " +
                           std::to_string(shards.size()) + " shards, the plan needs " +
                           std::to_string(want_updates) + " and " + std::to_string(want_shards));
  }
  for (size_t i = 0; i < updates.size(); ++i) {
    RETURN_IF_ERROR(CheckUpdate(plan.sender_tensors[pairs.sender][i], updates[i]));
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    const PlanTensor& t = plan.receiver_tensors[pairs.receiver][i];
    const uint64_t bytes = ShapeElements(t.shape) * DTypeWidth(t.dtype);
    if (shards[i].bytes != bytes || (bytes != 0 && shards[i].data == nullptr)) {
      return InvalidArgument("shard of tensor '" + t.name + "' has " +
                             std::to_string(shards[i].bytes) + " bytes, expected " +
                             std::to_string(bytes));
    }
  }
  return Status::Ok();
}

Status PackOutgoing(const TransferPlan& plan, const Pairs& pairs,
                    const std::vector<SparseUpdate>& updates, std::map<int, Outgoing>* out) {
  std::vector<uint64_t> dst, pos;
  for (const auto& [peer, ops] : pairs.out) {
    Outgoing& o = (*out)[peer];
    for (uint32_t i : ops) {
      const TransferOp& op = plan.ops[i];
      const SparseUpdate& u = updates[op.sender_tensor];
      const DType dtype = plan.sender_tensors[op.sender][op.sender_tensor].dtype;
      const int w = DTypeWidth(dtype);
      dst.resize(u.count);
      pos.resize(u.count);
      const size_t kept = RemapOpIndices(op, u.indices, u.count, dst.data(), pos.data());
      o.counts.push_back(kept);
      if (kept == 0) continue;
      Outgoing::Group& g = o.groups[dtype];
      g.idx.insert(g.idx.end(), dst.begin(), dst.begin() + kept);
      const size_t at = g.vals.size();
      g.vals.resize(at + kept * w);
      const auto* vals = static_cast<const uint8_t*>(u.values);
      for (size_t j = 0; j < kept; ++j) std::memcpy(&g.vals[at + j * w], vals + pos[j] * w, w);
    }
  }
  return Status::Ok();
}

Status SizeIncoming(const TransferPlan& plan, const Pairs& pairs, std::map<int, Incoming>* in) {
  for (auto& [peer, i] : *in) {
    const std::vector<uint32_t>& ops = pairs.in.at(peer);
    std::map<DType, uint64_t> totals;
    for (size_t k = 0; k < ops.size(); ++k) {
      const TransferOp& op = plan.ops[ops[k]];
      const PlanTensor& t = plan.receiver_tensors[op.receiver][op.receiver_tensor];
      if (i.counts[k] > op.elements) {
        return Corruption(RankName(peer) + " announced " + std::to_string(i.counts[k]) +
                          " changed elements of tensor '" + t.name + "' for an overlap of " +
                          std::to_string(op.elements) + " (plans differ between ranks?)");
      }
      totals[t.dtype] += i.counts[k];
    }
    for (const auto& [dtype, n] : totals) {
      if (n == 0) continue;
      i.groups[dtype].idx.resize(n);
      i.groups[dtype].vals.resize(n * DTypeWidth(dtype));
    }
  }
  return Status::Ok();
}

}  // namespace dte::p2p_internal
