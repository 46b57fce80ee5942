// A push receiver's catch-up from the store (docs/push.md "Catch-up"): the
// boxes of the receiver rank's ops read a band of rows at a time and copied
// into its tensors, the FP8 ones quantized band by band.
//
// A band is rows [r, r + h) of a canonical tensor's outermost dimension
// (elements, for a 1-D tensor): one contiguous byte range of its file. An
// op reads only the rows its box covers (a row split its own rows, a column
// split every row, a band at a time), so the rows a rank reads are its own
// share of the model, and the copier holds one band in BF16 (band_bytes, at
// least one row) plus, for an FP8 op, the band's quantized columns. An FP8
// op's band is a whole number of block rows (its box starts on one, so a
// band's blocks are the tensor's and quantize to the same bytes and scales
// as the whole tensor).
//
// Thread-safety: a BandCopier is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/fp8.h"
#include "store/base/status.h"
#include "store/materialize.h"
#include "sync/transfer/fp8_plan.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::push_internal {

// Rows per band of rows of row_bytes each: band_bytes / row_bytes rounded
// down to a multiple of `align` rows, at least `align` (align >= 1).
uint64_t BandRows(uint64_t band_bytes, uint64_t row_bytes, uint64_t align);

// Copies the part of op's box within canonical rows [row0, row0 + rows)
// (outermost dimension) from src, which holds those rows whole, into the
// receiver tensor at dst: CopyOpBox (push_plan.h) restricted to the rows.
void CopyOpBoxRows(const TransferPlan& plan, const TransferOp& op, const void* src, uint64_t row0,
                   uint64_t rows, void* dst);

// Copies the part of a 2-D remap's source box within source rows [row0,
// row0 + rows) to its destination in dst; src holds those rows' columns
// [remap.lo[1], remap.hi[1]) only, row-major, `width` bytes each.
void CopyRemapRows(const kernels::RemapPlan& remap, const void* src, uint64_t row0, uint64_t rows,
                   int width, void* dst);

class BandCopier {
 public:
  // Reads canonical tensors of v (those of `plan`) through `reader`, which
  // must outlive the copier; `what` prefixes errors.
  BandCopier(Materializer& reader, std::shared_ptr<const Version> v, const TransferPlan& plan,
             uint64_t band_bytes, std::string what);

  // Copies op's box of its canonical tensor into the receiver tensor at dst
  // (host memory).
  Status CopyOp(const TransferOp& op, void* dst);
  // Quantizes op's box under `layout` (its canonical tensor's FP8 layout)
  // into the receiver's E4M3 bytes at dst and scales at scales (host
  // memory). InvalidArgument naming the tensor and block when a block holds
  // NaN or inf.
  Status CopyFp8Op(const Fp8ReceiverOp& op, const kernels::Fp8Layout& layout, void* dst,
                   void* scales);

 private:
  // Rows [row0, row0 + rows) of canonical tensor t into band_.
  Status ReadRows(const PlanTensor& t, uint64_t row0, uint64_t rows);

  Materializer& reader_;
  std::shared_ptr<const Version> v_;
  const TransferPlan& plan_;
  uint64_t band_bytes_;
  std::string what_;
  std::vector<uint8_t> band_, q_;
  std::vector<float> scales_;
};

}  // namespace dte::push_internal
