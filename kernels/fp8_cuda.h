// CUDA form of block-scaled FP8 quantization (kernels/fp8.h).
//
// Same conventions as kernels/cuda.h (d_ device pointers, stream as void*,
// enqueue only); like it, this header includes nothing from CUDA. Built
// without CUDA, every call returns kCudaNotBuilt.
//
// Thread-safety: as kernels/cuda.h.
#pragma once

#include <cstdint>

#include "kernels/cuda.h"
#include "kernels/fp8.h"

namespace dte::kernels {

// Writes what Fp8Quantize writes for the same layout, bit for bit: E4M3
// bytes to d_q_out and one FP32 scale per block to d_scale_out. It does not
// refuse: a block holding NaN or +-inf gets a NaN scale, which the caller
// checks after copying the scales back (as Fp8Quantize would have refused).
// The layout must be usable (Fp8LayoutError empty); otherwise the call
// returns kCudaBadArgument.
CudaStatus CudaFp8Quantize(const Fp8Layout& layout, const uint16_t* d_bf16, uint8_t* d_q_out,
                           float* d_scale_out, void* stream);

// As Fp8Dequantize: d_out[i] = E4M3(d_q[i]) * its block's scale, in FP32.
CudaStatus CudaFp8Dequantize(const Fp8Layout& layout, const uint8_t* d_q, const float* d_scale,
                             float* d_out, void* stream);

}  // namespace dte::kernels
