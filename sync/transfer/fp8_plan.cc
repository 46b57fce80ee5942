// FP8 receiver plans: the policy per canonical tensor, then per receiver
// tensor, then the block alignment and the block-grid remap of every op.
#include "sync/transfer/fp8_plan.h"

#include "kernels/remap.h"

namespace dte {
namespace {

// The policy with the receiver's own block, on the canonical tensor: what
// a view of that block shows (so a receiver of another block than the
// mount's decides for its block).
Fp8Decision Decide(const Fp8ReceiverOptions& o, const PlanTensor& t) {
  std::vector<int64_t> shape(t.shape.begin(), t.shape.end());
  return DecideFp8(o.policy, {o.block_rows, o.block_cols}, t.name, t.dtype, shape);
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

std::string Range(uint64_t lo, uint64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

// Whether [lo, lo + extent) of a dimension of size n starts on a block
// boundary and ends on one or at the edge.
bool Aligned(uint64_t lo, uint64_t extent, uint64_t n, uint64_t block) {
  const uint64_t hi = lo + extent;
  return lo % block == 0 && (hi % block == 0 || hi == n);
}

Status CheckAligned(const TransferPlan& plan, const TransferOp& op, const Fp8ReceiverOptions& o) {
  const PlanTensor& c = plan.canonical[op.canonical];
  const PlanTensor& r = plan.receiver_tensors[op.receiver][op.receiver_tensor];
  const std::string where = "receiver rank " + std::to_string(op.receiver) +
                            " (tp=" + std::to_string(plan.receiver_tensors.size()) + ")";
  for (int d = 0; d < 2; ++d) {
    const uint64_t block = d == 0 ? o.block_rows : o.block_cols;
    const char* dim = d == 0 ? "rows" : "columns";
    const std::string tail = ", not on multiples of the FP8 block " + std::to_string(block) + " (" +
                             std::to_string(o.block_rows) + " x " + std::to_string(o.block_cols) +
                             ")";
    if (!Aligned(op.box_start[d], op.extent[d], c.shape[d], block)) {
      return InvalidArgument("FP8 receiver: tensor '" + c.name + "': " + where + " takes its " +
                             dim + " " + Range(op.box_start[d], op.box_start[d] + op.extent[d]) +
                             " of " + std::to_string(c.shape[d]) + " (from sender rank " +
                             std::to_string(op.sender) + ")" + tail);
    }
    if (!Aligned(op.dst_start[d], op.extent[d], r.shape[d], block)) {
      return InvalidArgument("FP8 receiver: tensor '" + c.name + "' lands in " + dim + " " +
                             Range(op.dst_start[d], op.dst_start[d] + op.extent[d]) + " of " +
                             std::to_string(r.shape[d]) + " of '" + r.name + "' on " + where +
                             tail);
    }
  }
  return Status::Ok();
}

// The op's box on the block grids: canonical grid -> receiver grid.
Status GridRemap(const TransferPlan& plan, const TransferOp& op, const Fp8ReceiverOptions& o,
                 Fp8ReceiverOp* out) {
  const PlanTensor& c = plan.canonical[op.canonical];
  const PlanTensor& r = plan.receiver_tensors[op.receiver][op.receiver_tensor];
  const uint64_t block[2] = {o.block_rows, o.block_cols};
  kernels::RemapSpec spec;
  for (int d = 0; d < 2; ++d) {
    const uint64_t lo = op.box_start[d] / block[d];
    spec.src_shape.push_back(CeilDiv(c.shape[d], block[d]));
    spec.rect_start.push_back(lo);
    spec.rect_extent.push_back(CeilDiv(op.box_start[d] + op.extent[d], block[d]) - lo);
    spec.dst_shape.push_back(CeilDiv(r.shape[d], block[d]));
    spec.dst_start.push_back(op.dst_start[d] / block[d]);
  }
  out->blocks = spec.rect_extent[0] * spec.rect_extent[1];
  if (std::string err = kernels::MakeRemapPlan(spec, &out->scales); !err.empty()) {
    return Internal("FP8 receiver: tensor '" + c.name + "' scales: " + err);
  }
  const kernels::RemapSpec bytes{c.shape, op.box_start, op.extent, r.shape, op.dst_start};
  if (std::string err = kernels::MakeRemapPlan(bytes, &out->bytes); !err.empty()) {
    return Internal("FP8 receiver: tensor '" + c.name + "': " + err);
  }
  return Status::Ok();
}

// Marks the rank's receiver tensors FP8 where every canonical source is
// quantized.
void DecideTensors(const TransferPlan& plan, int rank, Fp8ReceiverPlan* out) {
  const auto& tensors = plan.receiver_tensors[rank];
  out->tensors.assign(tensors.size(), Fp8ReceiverTensor{});
  std::vector<uint8_t> seen(tensors.size(), 0);
  for (const TransferOp& op : plan.ops) {
    if (op.receiver != rank) continue;
    Fp8ReceiverTensor& t = out->tensors[op.receiver_tensor];
    seen[op.receiver_tensor] = 1;
    if (t.decision == Fp8Decision::kQuantize && !out->canonical_fp8[op.canonical]) {
      t.decision = Decide(out->options, plan.canonical[op.canonical]);
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    Fp8ReceiverTensor& t = out->tensors[i];
    if (!seen[i] || t.decision != Fp8Decision::kQuantize) continue;
    t.fp8 = true;
    t.scale_name = Fp8ScaleName(tensors[i].name);
    t.scale_shape = {CeilDiv(tensors[i].shape[0], out->options.block_rows),
                     CeilDiv(tensors[i].shape[1], out->options.block_cols)};
  }
}

}  // namespace

std::string Fp8ScaleName(const std::string& weight_name) {
  static constexpr std::string_view kWeight = ".weight";
  std::string_view base = weight_name;
  if (base.size() >= kWeight.size() && base.substr(base.size() - kWeight.size()) == kWeight) {
    base.remove_suffix(kWeight.size());
  }
  return std::string(base) + ".weight_scale_inv";
}

std::string Fp8BlockError(const Fp8ReceiverOptions& o) {
  if (o.block_rows >= 1 && o.block_rows < kFp8MaxBlock && o.block_cols >= 1 &&
      o.block_cols < kFp8MaxBlock) {
    return {};
  }
  return "FP8 block " + std::to_string(o.block_rows) + " x " + std::to_string(o.block_cols) +
         ": each side must be in [1, 2^32)";
}

Result<Fp8ReceiverPlan> MakeFp8ReceiverPlan(const TransferPlan& plan, int receiver_rank,
                                            const Fp8ReceiverOptions& options) {
  if (std::string e = Fp8BlockError(options); !e.empty()) {
    return InvalidArgument("FP8 receiver: " + e);
  }
  if (receiver_rank < 0 || static_cast<size_t>(receiver_rank) >= plan.receiver_tensors.size()) {
    return InvalidArgument("FP8 receiver: rank " + std::to_string(receiver_rank) +
                           " is not in the plan's " + std::to_string(plan.receiver_tensors.size()) +
                           " receiver ranks");
  }
  Fp8ReceiverPlan out;
  out.rank = receiver_rank;
  out.options = options;
  const size_t n = plan.canonical.size();
  out.canonical_fp8.assign(n, 0);
  out.canonical_layout.resize(n);
  out.ops_by_canonical.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const PlanTensor& t = plan.canonical[i];
    if (Decide(options, t) != Fp8Decision::kQuantize) continue;
    out.canonical_fp8[i] = 1;
    out.canonical_layout[i] = {t.shape[0], t.shape[1], options.block_rows, options.block_cols,
                               options.rule};
  }
  DecideTensors(plan, receiver_rank, &out);
  for (uint32_t k = 0; k < plan.ops.size(); ++k) {
    const TransferOp& op = plan.ops[k];
    if (op.receiver != receiver_rank || !out.tensors[op.receiver_tensor].fp8) continue;
    RETURN_IF_ERROR(CheckAligned(plan, op, options));
    Fp8ReceiverOp f;
    f.op = k;
    f.canonical = op.canonical;
    f.receiver_tensor = op.receiver_tensor;
    RETURN_IF_ERROR(GridRemap(plan, op, options, &f));
    out.ops_by_canonical[op.canonical].push_back(static_cast<uint32_t>(out.ops.size()));
    out.ops.push_back(std::move(f));
  }
  return out;
}

void RemapFp8Changes(const Fp8ReceiverOp& op, const kernels::Fp8ChangeSet& changes,
                     Fp8OpIndices* out) {
  const size_t nb = changes.byte_index.size();
  out->byte_index.resize(nb);
  out->byte_pos.resize(nb);
  out->byte_index.resize(kernels::RemapIndices(op.bytes, changes.byte_index.data(), nb,
                                               out->byte_index.data(), out->byte_pos.data()));
  out->byte_pos.resize(out->byte_index.size());
  const size_t ns = changes.scale_index.size();
  out->scale_index.resize(ns);
  out->scale_pos.resize(ns);
  out->scale_index.resize(kernels::RemapIndices(op.scales, changes.scale_index.data(), ns,
                                                out->scale_index.data(), out->scale_pos.data()));
  out->scale_pos.resize(out->scale_index.size());
}

kernels::Fp8ChangeSet WholeFp8ChangeSet(const kernels::Fp8Layout& layout, const uint8_t* q,
                                        const float* scales) {
  kernels::Fp8ChangeSet cs;
  const uint64_t n = layout.num_elements(), b = layout.num_blocks();
  cs.byte_index.resize(n);
  for (uint64_t i = 0; i < n; ++i) cs.byte_index[i] = i;
  cs.byte_value.assign(q, q + n);
  cs.scale_index.resize(b);
  for (uint64_t i = 0; i < b; ++i) cs.scale_index[i] = i;
  cs.scale_value.assign(scales, scales + b);
  cs.blocks_touched = b;
  return cs;
}

}  // namespace dte
