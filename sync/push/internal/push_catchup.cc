#include "sync/push/internal/push_catchup.h"

#include <algorithm>
#include <cstring>

#include "store/dtype.h"
#include "store/store.h"
#include "sync/push/internal/push_plan.h"

namespace dte::push_internal {

namespace {

// Bytes of one row of t's outermost dimension (the whole of a 0-D tensor).
uint64_t RowBytes(const PlanTensor& t) {
  const uint64_t bytes = ShapeElements(t.shape) * DTypeWidth(t.dtype);
  return t.shape.empty() || t.shape[0] == 0 ? bytes : bytes / t.shape[0];
}

// The box of a 2-D remap starts on a block boundary and ends on one or at
// the source's edge, in both dimensions (what the FP8 plan checks).
bool BlockAligned(const kernels::RemapPlan& r, uint64_t block_rows, uint64_t block_cols) {
  const uint64_t block[2] = {block_rows, block_cols};
  for (int d = 0; d < 2; ++d) {
    if (r.lo[d] % block[d] != 0) return false;
    if (r.hi[d] % block[d] != 0 && r.hi[d] != r.src_shape[d]) return false;
  }
  return true;
}

// Gives *v n elements, freeing what it held before it grows rather than
// copying it over (the caller overwrites them): memory stays one band.
template <typename T>
T* Room(std::vector<T>* v, uint64_t n) {
  if (v->capacity() < n) std::vector<T>().swap(*v);
  v->resize(n);
  return v->data();
}

}  // namespace

uint64_t BandRows(uint64_t band_bytes, uint64_t row_bytes, uint64_t align) {
  const uint64_t rows = row_bytes == 0 ? align : band_bytes / row_bytes;
  return std::max(align, rows / align * align);
}

void CopyOpBoxRows(const TransferPlan& plan, const TransferOp& op, const void* src, uint64_t row0,
                   uint64_t rows, void* dst) {
  if (op.extent.empty()) return;
  const uint64_t lo = std::max(op.box_start[0], row0);
  const uint64_t hi = std::min(op.box_start[0] + op.extent[0], row0 + rows);
  if (lo >= hi) return;
  // The box cut to the rows, its start counted from row0 (the outermost
  // size enters no stride, so src is a tensor of `rows` rows to CopyOpBox).
  TransferOp part = op;
  part.box_start[0] = lo - row0;
  part.extent[0] = hi - lo;
  part.dst_start[0] += lo - op.box_start[0];
  CopyOpBox(plan, part, src, dst);
}

void CopyRemapRows(const kernels::RemapPlan& remap, const void* src, uint64_t row0, uint64_t rows,
                   int width, void* dst) {
  if (remap.ndim != 2 || remap.lo[1] >= remap.hi[1]) return;
  const uint64_t cols = remap.src_shape[1];
  const uint64_t held = remap.hi[1] - remap.lo[1];
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  const uint64_t hi = std::min(remap.hi[0], row0 + rows);
  for (uint64_t r = std::max(remap.lo[0], row0); r < hi; ++r) {
    uint64_t to = 0;
    if (!kernels::RemapElement(remap, r * cols + remap.lo[1], &to)) continue;
    std::memcpy(d + to * width, s + (r - row0) * held * width, held * width);
  }
}

BandCopier::BandCopier(Materializer& reader, std::shared_ptr<const Version> v,
                       const TransferPlan& plan, uint64_t band_bytes, std::string what)
    : reader_(reader),
      v_(std::move(v)),
      plan_(plan),
      band_bytes_(band_bytes),
      what_(std::move(what)) {}

Status BandCopier::ReadRows(const PlanTensor& t, uint64_t row0, uint64_t rows) {
  ASSIGN_OR_RETURN(const TensorBytes at,
                   LocateTensor(*v_, t.name, ShapeElements(t.shape) * DTypeWidth(t.dtype), what_));
  const uint64_t row_bytes = RowBytes(t);
  return reader_
      .ReadFile(v_, *at.file, at.offset + row0 * row_bytes, rows * row_bytes,
                Room(&band_, rows * row_bytes))
      .WithContext(what_);
}

Status BandCopier::CopyOp(const TransferOp& op, void* dst) {
  if (op.extent.empty()) return Status::Ok();
  const PlanTensor& t = plan_.canonical[op.canonical];
  const uint64_t h = BandRows(band_bytes_, RowBytes(t), 1);
  const uint64_t end = op.box_start[0] + op.extent[0];
  for (uint64_t r = op.box_start[0]; r < end; r += h) {
    const uint64_t n = std::min(h, end - r);
    RETURN_IF_ERROR(ReadRows(t, r, n));
    CopyOpBoxRows(plan_, op, band_.data(), r, n, dst);
  }
  return Status::Ok();
}

Status BandCopier::CopyFp8Op(const Fp8ReceiverOp& op, const kernels::Fp8Layout& layout, void* dst,
                             void* scales) {
  const PlanTensor& t = plan_.canonical[op.canonical];
  const kernels::RemapPlan& b = op.bytes;
  if (b.ndim != 2 || b.lo[0] >= b.hi[0] || b.lo[1] >= b.hi[1]) return Status::Ok();
  const uint64_t cols = b.hi[1] - b.lo[1];
  const uint64_t grid_cols = (cols + layout.block_cols - 1) / layout.block_cols;
  if (!BlockAligned(b, layout.block_rows, layout.block_cols) || op.scales.ndim != 2 ||
      op.scales.hi[1] - op.scales.lo[1] != grid_cols) {
    return Internal(what_ + ": the FP8 op of tensor " + t.name + " is not block-aligned");
  }
  const uint64_t h = BandRows(band_bytes_, layout.cols * 2, layout.block_rows);
  for (uint64_t r = b.lo[0]; r < b.hi[0]; r += h) {
    const uint64_t n = std::min(h, b.hi[0] - r);
    const uint64_t block_rows = (n + layout.block_rows - 1) / layout.block_rows;
    RETURN_IF_ERROR(ReadRows(t, r, n));
    const std::string bad = kernels::Fp8QuantizeRegion(
        layout, reinterpret_cast<const uint16_t*>(band_.data()), r, n, b.lo[1], b.hi[1],
        Room(&q_, n * cols), Room(&scales_, block_rows * grid_cols), t.name);
    if (!bad.empty()) return InvalidArgument(what_ + ": " + bad);
    CopyRemapRows(b, q_.data(), r, n, 1, dst);
    CopyRemapRows(op.scales, scales_.data(), r / layout.block_rows, block_rows, 4, scales);
  }
  return Status::Ok();
}

}  // namespace dte::push_internal
