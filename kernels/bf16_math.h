// Per-element FP32 <-> BF16 conversion shared by the CPU and CUDA backends.
//
// Fp32ToBf16Bits is bit-identical to PyTorch's scalar conversion
// (c10::BFloat16's round-to-nearest-even): add 0x7FFF plus the lowest kept
// bit, then truncate. Consequences, all intended:
//   - ties round to the even BF16 mantissa;
//   - finite values at or above 0x7F7F8000 (halfway between the largest finite
//     BF16, 0x7F7F, and infinity) round to infinity, their negatives to -inf;
//   - subnormals round as integers do, never flushed to zero;
//   - -0.0 stays 0x8000, +0.0 stays 0x0000, +-inf keep their sign;
//   - every NaN, whatever its sign and payload, becomes 0x7FC0.
// The NaN rule matters: PyTorch's vectorized CPU path and CUDA's intrinsic
// conversion pick other NaN encodings (see docs/kernels.md); dte always
// produces 0x7FC0 so both backends agree bit for bit.
//
// Only integer operations on the bit pattern are used, so device fast-math
// and flush-to-zero settings cannot change results.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace dte::kernels {

inline constexpr uint16_t kBf16CanonicalNan = 0x7FC0;

DTE_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<uint32_t>(f);
#endif
}

DTE_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// True for NaN of either sign and any payload; exact on every target.
DTE_HD bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// True for every value except +-inf and NaN.
DTE_HD bool IsFiniteBits(uint32_t u) { return (u & 0x7F800000u) != 0x7F800000u; }

DTE_HD uint16_t Fp32ToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  // For non-NaN u the sum stays below 2^32: at most 0xFF800000 + 0x8000.
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return IsNanBits(u) ? kBf16CanonicalNan : static_cast<uint16_t>(rounded);
}

// Exact: every BF16 value is an FP32 value, NaN payloads included.
DTE_HD float Bf16BitsToFp32(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

}  // namespace dte::kernels
