// The bookkeeping of the two-round protocol (sync/transfer/p2p.h): which plan ops
// each pair of transport ranks carries, the sending side's packed messages
// and the receiving side's buffers.
//
// Thread-safety: pure functions over caller-owned values.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"
#include "sync/transfer/p2p.h"

namespace dte::p2p_internal {

struct Pairs {
  int sender = -1;                           // plan sender rank this transport rank plays, or -1
  int receiver = -1;                         // plan receiver rank it plays, or -1
  std::map<int, std::vector<uint32_t>> out;  // receiving transport rank -> op indices
  std::map<int, std::vector<uint32_t>> in;   // sending transport rank -> op indices
};

// Validates roles against the plan and the transport size, and pairs ops.
Result<Pairs> PairOps(const TransferPlan& plan, const P2PRoles& roles, int rank, int size);

// Checks update and shard counts and sizes, and that update indices are
// sorted, distinct and in range; errors name the tensor.
Status CheckBuffers(const TransferPlan& plan, const Pairs& pairs,
                    const std::vector<SparseUpdate>& updates,
                    const std::vector<ShardBuffer>& shards);

// What this rank sends one peer: round-1 counts (one per op of the pair, in
// plan order) and round-2 groups by dtype.
struct Outgoing {
  std::vector<uint64_t> counts;
  struct Group {
    std::vector<uint64_t> idx;  // receiver-local flat indices
    std::vector<uint8_t> vals;
  };
  std::map<DType, Group> groups;
};

// Remaps every op this rank sends and packs the results per peer.
Status PackOutgoing(const TransferPlan& plan, const Pairs& pairs,
                    const std::vector<SparseUpdate>& updates, std::map<int, Outgoing>* out);

// What this rank receives from one peer.
struct Incoming {
  std::vector<uint64_t> counts;
  struct Group {
    std::vector<uint64_t> idx;
    std::vector<uint8_t> vals;
  };
  std::map<DType, Group> groups;
};

// After round 1: checks every count against its op's box (Corruption naming
// the peer and tensor) and sizes the round-2 buffers.
Status SizeIncoming(const TransferPlan& plan, const Pairs& pairs, std::map<int, Incoming>* in);

}  // namespace dte::p2p_internal
