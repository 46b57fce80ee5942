// The two-round protocol of sync/transfer/p2p.h: pair the plan's ops, remap and pack
// on the sending side, exchange counts, then indices and values by dtype,
// then scatter on the receiving side.
#include "sync/transfer/p2p.h"

#include <cstring>
#include <map>
#include <string>

#include "kernels/change_detect.h"
#include "sync/transfer/internal/p2p_pairs.h"

namespace dte {
namespace {

using p2p_internal::Incoming;
using p2p_internal::Outgoing;
using p2p_internal::Pairs;

std::string RankName(int r) { return "rank " + std::to_string(r); }

// Round 1: one message of counts per pair with ops, in both directions.
Status ExchangeCounts(Transport& t, const Pairs& pairs, std::map<int, Outgoing>& out,
                      std::map<int, Incoming>& in, P2PStats* stats) {
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (auto& [peer, o] : out) {
    sends.push_back({peer, o.counts.data(), o.counts.size() * sizeof(uint64_t)});
    stats->bytes_sent += sends.back().bytes;
  }
  for (const auto& [peer, ops] : pairs.in) {
    Incoming& i = in[peer];
    i.counts.assign(ops.size(), 0);
    recvs.push_back({peer, i.counts.data(), i.counts.size() * sizeof(uint64_t)});
    stats->bytes_received += recvs.back().bytes;
  }
  return t.Exchange(sends, recvs);
}

// Round 2: per pair and dtype (DType order) with a non-zero total, the
// indices then the values.
Status ExchangeData(Transport& t, std::map<int, Outgoing>& out, std::map<int, Incoming>& in,
                    P2PStats* stats) {
  std::vector<SendBuffer> sends;
  std::vector<RecvBuffer> recvs;
  for (auto& [peer, o] : out) {
    for (auto& [dtype, g] : o.groups) {
      if (g.idx.empty()) continue;
      sends.push_back({peer, g.idx.data(), g.idx.size() * sizeof(uint64_t)});
      sends.push_back({peer, g.vals.data(), g.vals.size()});
      stats->elements_sent += g.idx.size();
      stats->bytes_sent += sends[sends.size() - 2].bytes + g.vals.size();
    }
  }
  for (auto& [peer, i] : in) {
    for (auto& [dtype, g] : i.groups) {
      if (g.idx.empty()) continue;
      recvs.push_back({peer, g.idx.data(), g.idx.size() * sizeof(uint64_t)});
      recvs.push_back({peer, g.vals.data(), g.vals.size()});
      stats->bytes_received += recvs[recvs.size() - 2].bytes + g.vals.size();
    }
  }
  return t.Exchange(sends, recvs);
}

// Scatters every op's slice of the received groups into the shards.
Status ScatterIncoming(const TransferPlan& plan, const Pairs& pairs, std::map<int, Incoming>& in,
                       const std::vector<ShardBuffer>& shards, P2PStats* stats) {
  for (auto& [peer, i] : in) {
    std::map<DType, size_t> cursor;
    const std::vector<uint32_t>& ops = pairs.in.at(peer);
    for (size_t k = 0; k < ops.size(); ++k) {
      const uint64_t count = i.counts[k];
      if (count == 0) continue;
      const TransferOp& op = plan.ops[ops[k]];
      const PlanTensor& t = plan.receiver_tensors[op.receiver][op.receiver_tensor];
      const int w = DTypeWidth(t.dtype);
      Incoming::Group& g = i.groups.at(t.dtype);
      size_t& at = cursor[t.dtype];
      const uint64_t* idx = g.idx.data() + at;
      const uint64_t numel = ShapeElements(t.shape);
      for (uint64_t j = 0; j < count; ++j) {
        if (idx[j] >= numel) {
          return Corruption(RankName(peer) + " sent index " + std::to_string(idx[j]) +
                            " for tensor '" + t.name + "' of " + std::to_string(numel) +
                            " elements");
        }
      }
      kernels::ScatterParallel(shards[op.receiver_tensor].data, w, idx, g.vals.data() + at * w,
                               count);
      at += count;
      stats->elements_received += count;
    }
  }
  return Status::Ok();
}

}  // namespace

Status RunTwoRoundSync(Transport& transport, const TransferPlan& plan, const P2PRoles& roles,
                       const std::vector<SparseUpdate>& updates,
                       const std::vector<ShardBuffer>& shards, const P2POptions& options,
                       P2PStats* stats) {
  P2PStats local_stats;
  if (stats == nullptr) stats = &local_stats;
  *stats = P2PStats{};
  const std::string me = "two-round sync on " + RankName(transport.rank());
  ASSIGN_OR_RETURN(Pairs pairs,
                   p2p_internal::PairOps(plan, roles, transport.rank(), transport.size()));
  RETURN_IF_ERROR(p2p_internal::CheckBuffers(plan, pairs, updates, shards).WithContext(me));
  std::map<int, Outgoing> out;
  RETURN_IF_ERROR(p2p_internal::PackOutgoing(plan, pairs, updates, &out));
  for (const auto& [peer, o] : out) {
    stats->ops_sent += o.counts.size();
    for (uint64_t c : o.counts) stats->nonzero_ops_sent += c != 0 ? 1 : 0;
  }
  std::map<int, Incoming> in;
  if (options.before_round) options.before_round(1);
  RETURN_IF_ERROR(ExchangeCounts(transport, pairs, out, in, stats).WithContext(me + ", round 1"));
  RETURN_IF_ERROR(p2p_internal::SizeIncoming(plan, pairs, &in).WithContext(me));
  if (options.before_round) options.before_round(2);
  RETURN_IF_ERROR(ExchangeData(transport, out, in, stats).WithContext(me + ", round 2"));
  return ScatterIncoming(plan, pairs, in, shards, stats).WithContext(me);
}

}  // namespace dte
