// Block-scaled FP8 (E4M3) quantization of 2-D BF16 tensors on the CPU
// backend (multi-threaded), its inverse, and the FP8 change set between two
// versions of a tensor. The per-element math and the scale rules are in
// kernels/fp8_math.h; the CUDA form is kernels/fp8_cuda.h; docs/fp8.md
// describes the format.
//
// A rows x cols row-major tensor is cut into block_rows x block_cols blocks
// (128 x 128 by default); the blocks of the last block row and column may be
// partial, and their scale comes from the elements they hold. Scales are
// stored row-major, one FP32 per block: grid_rows() x grid_cols(), the shape
// of a checkpoint's `weight_scale_inv`. Element (r, c) quantizes as
// QuantizeE4m3(x, scale[r / block_rows][c / block_cols]).
//
// NaN and +-inf weights are refused: a block holding one has no meaningful
// scale. The quantizer still writes every output (such a block's scale is
// NaN, its bytes follow the element rule), so the CPU and CUDA outputs agree
// bit for bit, and returns a message naming the tensor, the first such block
// in row-major block order and the element.
//
// Thread-safety: pure functions over caller-owned buffers; concurrent calls
// on disjoint outputs are safe. Inputs and outputs must not overlap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/fp8_math.h"

namespace dte::kernels {

inline constexpr uint64_t kFp8DefaultBlock = 128;

// The shape of one quantized tensor.
struct Fp8Layout {
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t block_rows = kFp8DefaultBlock;
  uint64_t block_cols = kFp8DefaultBlock;
  Fp8ScaleRule rule = Fp8ScaleRule::kPlain;

  uint64_t grid_rows() const { return (rows + block_rows - 1) / block_rows; }
  uint64_t grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  uint64_t num_elements() const { return rows * cols; }
  uint64_t num_blocks() const { return grid_rows() * grid_cols(); }
};

// Empty when `layout` is usable, else why not: block sizes must be at least
// 1 and rows * cols must not overflow. Zero rows or cols are allowed (an
// empty tensor has no blocks). Every function below requires a usable layout.
std::string Fp8LayoutError(const Fp8Layout& layout);

// Quantizes bf16 (num_elements() BF16 bit patterns) into q_out
// (num_elements() E4M3 bytes) and scale_out (num_blocks() floats). Returns an
// empty string, or the refusal described at the top, which names `tensor`.
std::string Fp8Quantize(const Fp8Layout& layout, const uint16_t* bf16, uint8_t* q_out,
                        float* scale_out, std::string_view tensor);

// Fp8Quantize over a region of a tensor of `layout`, for a reader that holds
// only some of its rows: bf16 holds rows [row0, row0 + rows) whole (rows x
// cols elements, row-major); the region is their columns [col0, col1).
// row0 and col0 lie on block boundaries; row0 + rows and col1 lie on one or
// at the tensor's edge. Writes the region's E4M3 bytes to q_out (rows x
// (col1 - col0), row-major) and its blocks' scales to scale_out (row-major
// over the region's blocks): exactly what Fp8Quantize of the whole tensor
// gives there. A refusal names the block and element as Fp8Quantize's does,
// in the whole tensor's coordinates.
std::string Fp8QuantizeRegion(const Fp8Layout& layout, const uint16_t* bf16, uint64_t row0,
                              uint64_t rows, uint64_t col0, uint64_t col1, uint8_t* q_out,
                              float* scale_out, std::string_view tensor);

// out[i] = DequantizeE4m3(q[i], its block's scale): what a loader computes.
void Fp8Dequantize(const Fp8Layout& layout, const uint8_t* q, const float* scale, float* out);

// What changes in the FP8 form of a tensor from one version to the next:
// the E4M3 bytes that differ (flat index and new byte, indices ascending)
// and the block scales that differ bitwise (block index, row-major over the
// grid, and new scale, ascending). A block whose scale changed may change
// any of its bytes, also where the BF16 element did not.
struct Fp8ChangeSet {
  std::vector<uint64_t> byte_index;
  std::vector<uint8_t> byte_value;
  std::vector<uint64_t> scale_index;
  std::vector<float> scale_value;
  // Blocks examined: those holding at least one changed BF16 element (for
  // Fp8ChangesAt, one of the given in-bounds indices).
  uint64_t blocks_touched = 0;
};

// The change set between parent and child (both num_elements() BF16 bit
// patterns). Refuses, like Fp8Quantize, a touched block of either version
// that holds NaN or +-inf, naming `tensor`; *out is then unspecified.
std::string Fp8Changes(const Fp8Layout& layout, const uint16_t* parent, const uint16_t* child,
                       std::string_view tensor, Fp8ChangeSet* out);

// The same when the caller already knows the changed BF16 elements:
// changed[0 .. n) are the flat indices where parent and child differ,
// ascending and in bounds (others are harmless but cost time). Only the
// blocks holding them are read.
std::string Fp8ChangesAt(const Fp8Layout& layout, const uint16_t* parent, const uint16_t* child,
                         const uint64_t* changed, size_t n, std::string_view tensor,
                         Fp8ChangeSet* out);

}  // namespace dte::kernels
