// FP8 receivers: which of a receiver rank's tensors are held as
// block-scaled E4M3 (kernels/fp8.h, docs/fp8.md), and how a canonical
// tensor's FP8 change set lands in them. Live apply (sync/live/live*) and the push
// (sync/push) both use it; neither re-derives the block mapping.
//
// A receiver tensor is FP8 when every canonical tensor that lands in it is
// quantized by the policy (store/fp8_policy.h; a fused qkv_proj or
// gate_up_proj is FP8 when all its parts are). It is then held as
//   - "<module>.weight": dtype F8_E4M3, the rank-local shape of the BF16
//     tensor, and
//   - "<module>.weight_scale_inv": F32, ceil(rows / block_rows) x
//     ceil(cols / block_cols) of the rank-local tensor;
// every other receiver tensor stays BF16.
//
// Quantization is per canonical tensor (what MOUNT/fp8/vN shows). For a
// receiver to equal that quantization split by the layout, every op writing
// an FP8 receiver tensor must be block-aligned in the canonical and in the
// receiver tensor: each box starts on a block boundary and its extent is a
// multiple of the block size or reaches the tensor's edge (in both). Then a
// canonical block maps to exactly one receiver block with the same
// elements, so its scale and bytes are the receiver's, and the block grids
// remap like the elements (the op's box, divided by the block size).
//
// Thread-safety: plans are immutable values once made; the functions are
// pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/remap_math.h"
#include "store/base/status.h"
#include "store/fp8_policy.h"
#include "sync/transfer/transfer_plan.h"

namespace dte {

// How a receiver holds its FP8 tensors; declared once per receiver.
struct Fp8ReceiverOptions {
  uint64_t block_rows = kernels::kFp8DefaultBlock;
  uint64_t block_cols = kernels::kFp8DefaultBlock;
  kernels::Fp8ScaleRule rule = kernels::Fp8ScaleRule::kPlain;
  Fp8Policy policy;
};

// Block sides are in [1, kFp8MaxBlock) (the live ABI's fp8_block is 32-bit,
// and block grids are computed without overflow below it).
inline constexpr uint64_t kFp8MaxBlock = uint64_t{1} << 32;

// Empty when o's block sides are in range; else why, naming the block
// ("FP8 block R x C: ...").
std::string Fp8BlockError(const Fp8ReceiverOptions& o);

// "F8_E4M3", the safetensors dtype of an FP8 receiver tensor's bytes.
inline constexpr const char* kFp8DTypeName = "F8_E4M3";

// "model.layers.0.mlp.down_proj.weight" -> "...down_proj.weight_scale_inv".
std::string Fp8ScaleName(const std::string& weight_name);

// One tensor of the receiver rank (parallel to plan.receiver_tensors[rank]).
struct Fp8ReceiverTensor {
  bool fp8 = false;
  // Why not, when !fp8: the decision for the first canonical tensor landing
  // here that the policy does not quantize.
  Fp8Decision decision = Fp8Decision::kQuantize;
  std::string scale_name;             // when fp8
  std::vector<uint64_t> scale_shape;  // when fp8: {grid rows, grid cols}
};

// An op of the transfer plan that writes an FP8 receiver tensor, with the
// remaps from the canonical tensor (not the sender's: the push's senders
// may be sharded) into the receiver tensor, for bytes and for scales.
struct Fp8ReceiverOp {
  uint32_t op = 0;         // index into TransferPlan::ops
  uint32_t canonical = 0;  // TransferPlan::canonical index
  uint32_t receiver_tensor = 0;
  kernels::RemapPlan bytes;   // canonical elements -> receiver elements
  kernels::RemapPlan scales;  // canonical block grid -> receiver block grid
  uint64_t blocks = 0;        // canonical blocks in the op's box
};

struct Fp8ReceiverPlan {
  int rank = 0;
  Fp8ReceiverOptions options;
  std::vector<Fp8ReceiverTensor> tensors;               // [receiver tensor of rank]
  std::vector<uint8_t> canonical_fp8;                   // [canonical]: 1 when quantized
  std::vector<kernels::Fp8Layout> canonical_layout;     // [canonical]: valid when quantized
  std::vector<Fp8ReceiverOp> ops;                       // plan order
  std::vector<std::vector<uint32_t>> ops_by_canonical;  // [canonical] -> indices into ops
};

// Says which of receiver_rank's tensors are FP8 and checks the alignment
// described at the top. InvalidArgument, naming the tensor, the split
// (LayoutText) and the block size, when an op is not block-aligned ("tensor
// 'model.layers.0.mlp.down_proj.weight': tp=3 rank 1 splits its 1000
// columns at 333, not a multiple of the FP8 block 128"), when block sizes
// are 0, or when the rank is out of range.
Result<Fp8ReceiverPlan> MakeFp8ReceiverPlan(const TransferPlan& plan, int receiver_rank,
                                            const Fp8ReceiverOptions& options);

// Where one canonical tensor's FP8 changes land in one op's receiver
// tensor and its scale tensor.
struct Fp8OpIndices {
  std::vector<uint64_t> byte_index;   // receiver tensor flat indices, ascending
  std::vector<uint64_t> byte_pos;     // their positions in changes.byte_index
  std::vector<uint64_t> scale_index;  // receiver scale tensor flat indices, ascending
  std::vector<uint64_t> scale_pos;    // their positions in changes.scale_index
};

// changes is the FP8 change set of op.canonical (canonical flat element
// and block indices, ascending, as kernels::Fp8Changes gives them). Fills
// *out with the entries in op's box.
void RemapFp8Changes(const Fp8ReceiverOp& op, const kernels::Fp8ChangeSet& changes,
                     Fp8OpIndices* out);

// The change set that rewrites every byte and scale: a whole quantized
// tensor (q: num_elements() bytes, scales: num_blocks()) as a change set,
// for a receiver that is filled rather than updated.
kernels::Fp8ChangeSet WholeFp8ChangeSet(const kernels::Fp8Layout& layout, const uint8_t* q,
                                        const float* scales);

}  // namespace dte
