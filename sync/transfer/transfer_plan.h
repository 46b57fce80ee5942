// Transfer plans: which boxes of which canonical tensors move from which
// sender rank to which receiver rank, and where they land.
//
// Canonical tensors are the Hugging Face checkpoint's (model.layers.{l}.
// self_attn.q_proj.weight, ...). A layout says how ranks hold them:
//   - tensor parallelism of degree tp: column-parallel tensors (q/k/v,
//     gate/up) split rows by heads or rows, row-parallel ones (o_proj,
//     down_proj) split columns, vocab-parallel ones (embed_tokens, lm_head)
//     split rows into ceil(V / tp) per rank (the last shards padded), and
//     everything else (norms, biases of row-parallel layers) is replicated;
//   - K/V heads: with num_kv_heads >= tp each rank holds kv_heads / tp heads;
//     with fewer, each rank holds the one head rank * kv_heads / tp;
//   - optional fusion as vLLM and SGLang do it: `qkv_proj` holds the rank's
//     q rows, then k rows, then v rows; `gate_up_proj` holds [gate; up].
// Every canonical element has exactly one owning sender; replicated data is
// sent by one holder (receiver rank r picks holder r mod holders), so the
// plan never ships an element twice to one receiver tensor.
//
// An op is the overlap of one sender box and one receiver box of one
// canonical tensor: a hyperrectangle given in canonical, sender-local and
// receiver-local coordinates, plus the kernels' RemapPlan from the sender
// tensor into the receiver tensor. Ops are in plan order: canonical tensor,
// then receiver rank, then sender box. Every process that computes a plan
// from the same inputs gets the same ops in the same order; the two-round
// protocol (sync/transfer/p2p.h) relies on it. docs/transfer.md has the math.
//
// Thread-safety: plans are immutable values once made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/remap_math.h"
#include "store/base/status.h"
#include "store/dtype.h"

namespace dte {

// A tensor by name, dtype and row-major shape.
struct PlanTensor {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
};

// The attention geometry needed to split projections by head.
struct AttentionGeometry {
  uint64_t num_heads = 0;
  uint64_t num_kv_heads = 0;
  uint64_t head_dim = 0;
};

// How one side (the trainer's senders, the rollout receivers) holds tensors.
struct ShardLayout {
  int tp = 1;                 // tensor-parallel degree: ranks 0 .. tp-1
  bool fuse_qkv = false;      // q/k/v projections as one qkv_proj
  bool fuse_gate_up = false;  // gate/up projections as one gate_up_proj
};

// The receiver layout of vLLM and SGLang: fused qkv_proj and gate_up_proj.
inline ShardLayout FusedReceiverLayout(int tp) { return {tp, true, true}; }

// "tp=2 rank 1, fused qkv_proj, fused gate_up_proj", for messages.
std::string LayoutText(const ShardLayout& layout, int rank);

struct TransferOp {
  uint32_t canonical = 0;           // index into TransferPlan::canonical
  int sender = 0;                   // sender rank
  uint32_t sender_tensor = 0;       // index into TransferPlan::sender_tensors[sender]
  int receiver = 0;                 // receiver rank
  uint32_t receiver_tensor = 0;     // index into TransferPlan::receiver_tensors[receiver]
  std::vector<uint64_t> box_start;  // canonical coordinates
  std::vector<uint64_t> extent;     // box size, every extent >= 1
  std::vector<uint64_t> src_start;  // the box's start in the sender tensor
  std::vector<uint64_t> dst_start;  // the box's start in the receiver tensor
  kernels::RemapPlan remap;         // sender tensor -> receiver tensor
  uint64_t elements = 0;            // product of extent
};

struct TransferPlan {
  std::vector<PlanTensor> canonical;
  std::vector<std::vector<PlanTensor>> sender_tensors;    // [sender rank]
  std::vector<std::vector<PlanTensor>> receiver_tensors;  // [receiver rank]
  std::vector<TransferOp> ops;                            // plan order
};

// Builds the plan. Fails with InvalidArgument naming the tensor when a name
// has no layout rule, a shape does not match the geometry, a split is not
// even (heads % tp, rows % tp, tp % kv_heads), fused parts are missing or
// disagree in dtype or trailing shape, or a degree is < 1.
Result<TransferPlan> MakeTransferPlan(const std::vector<PlanTensor>& canonical,
                                      const AttentionGeometry& geometry, const ShardLayout& sender,
                                      const ShardLayout& receiver);

// The receiver-local flat indices of the changed elements that fall in op's
// box. src_idx[0 .. n) are sorted, distinct flat indices into the op's sender
// tensor (canonical indices when the sender holds canonical tensors). Writes
// the j-th kept index to dst_idx_out[j] and its position k in src_idx to
// pos_out[j] (when not null); both need room for n entries. Returns j.
size_t RemapOpIndices(const TransferOp& op, const uint64_t* src_idx, size_t n,
                      uint64_t* dst_idx_out, uint64_t* pos_out);

uint64_t ShapeElements(const std::vector<uint64_t>& shape);

}  // namespace dte
