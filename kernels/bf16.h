// FP32 <-> BF16 conversion of arrays on the CPU backend (multi-threaded).
// The element rule, identical to PyTorch's scalar c10::BFloat16 conversion, is
// documented in kernels/bf16_math.h; BF16 values travel as raw uint16 bits.
//
// Thread-safety: pure functions over caller-owned buffers; concurrent calls on
// disjoint outputs are safe. Input and output must not overlap.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/bf16_math.h"

namespace dte::kernels {

// out[i] = round-to-nearest-even BF16 bits of in[i], for i in [0, n).
void CastFp32ToBf16(const float* in, uint16_t* out, size_t n);

// out[i] = the FP32 value of BF16 bits in[i] (exact), for i in [0, n).
void CastBf16ToFp32(const uint16_t* in, float* out, size_t n);

}  // namespace dte::kernels
