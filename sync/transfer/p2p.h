// The same-cluster two-round point-to-point update over a Transport.
//
// Every rank of the transport holds the same TransferPlan and roles (which
// transport rank plays each plan sender and each plan receiver; one process
// may play both) and calls RunTwoRoundSync once per update. Per ordered
// pair of transport ranks (a, b), the pair's ops are the plan's ops whose
// sender maps to a and receiver to b, in plan order.
//   Round 1: for every pair with at least one op, a sends b one message of
//     u64 counts, one per op in plan order, zeros included.
//   Round 2: for every such pair and every dtype with a non-zero total, in
//     DType order, a sends b the receiver-local u64 indices, then the values,
//     of those ops concatenated in plan order. Empty groups are not sent.
//   Then each receiver scatters every op's slice straight into its shard.
// Invariants (docs/transfer.md): both ends derive every message size from
// the plan and round 1, so sizes always agree and messages cannot be
// misaligned; a count larger than its op's box, or an index outside its
// receiver tensor, is Corruption naming the sending rank and the tensor;
// every wait is bounded by the transport's timeout.
//
// Thread-safety: one call at a time per transport; buffers are borrowed for
// the call, shards are written only by this call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "store/base/status.h"
#include "sync/transfer/transfer_plan.h"
#include "sync/transport/transport.h"

namespace dte {

struct P2PRoles {
  std::vector<int> sender_ranks;    // [plan sender rank] -> transport rank
  std::vector<int> receiver_ranks;  // [plan receiver rank] -> transport rank
};

// The changed elements of one sender tensor: sorted, distinct flat indices
// into it and the new elements (DTypeWidth bytes each), `count` of each.
struct SparseUpdate {
  const uint64_t* indices = nullptr;
  const void* values = nullptr;
  size_t count = 0;
};

// A whole receiver tensor in host memory, row-major.
struct ShardBuffer {
  void* data = nullptr;
  size_t bytes = 0;
};

struct P2POptions {
  // Called before round 1 and before round 2 with the round number; for
  // progress reporting and fault-injection tests.
  std::function<void(int round)> before_round;
};

struct P2PStats {
  uint64_t ops_sent = 0;           // planned ops this rank sends (counts in round 1)
  uint64_t nonzero_ops_sent = 0;   // of those, with at least one element
  uint64_t elements_sent = 0;      // round 2
  uint64_t elements_received = 0;  // round 2, scattered into shards
  uint64_t bytes_sent = 0;         // both rounds, payload only
  uint64_t bytes_received = 0;
};

// `updates` has one entry per tensor of plan.sender_tensors[s] when this rank
// plays sender s (else empty); `shards` one per tensor of
// plan.receiver_tensors[r] when it plays receiver r (else empty). stats may
// be null.
Status RunTwoRoundSync(Transport& transport, const TransferPlan& plan, const P2PRoles& roles,
                       const std::vector<SparseUpdate>& updates,
                       const std::vector<ShardBuffer>& shards, const P2POptions& options,
                       P2PStats* stats);

}  // namespace dte
