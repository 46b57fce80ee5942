// Per-element FP8 (E4M3, `float8_e4m3fn`) math shared by the CPU and CUDA
// backends: the element conversion both ways and the block scale rules.
// kernels/fp8.h applies them to block-scaled 2-D tensors; docs/fp8.md gives
// the reasoning and the checkpoint conventions.
//
// E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; one
// NaN per sign (S.1111.111); largest finite 448 (0x7E), smallest normal 2^-6,
// subnormals m * 2^-9 for m in 1..7.
//
// Fp32ToE4m3Bits is saturating round-to-nearest-even, bit-identical to
// `clip(x, -448, 448)` followed by a round-to-nearest-even cast (numpy with
// ml_dtypes' float8_e4m3fn, torch's .to(torch.float8_e4m3fn)):
//   - ties round to the even mantissa, also between subnormals and to zero
//     (2^-10, half the smallest subnormal, becomes 0);
//   - finite |x| >= 448 and +-inf become +-448 (0x7E / 0xFE), never NaN;
//   - -0.0 stays 0x80, +0.0 stays 0x00; results that round to zero keep the
//     sign of x;
//   - every NaN, whatever its sign and payload, becomes 0x7F.
//
// Block scales (Fp8BlockScale) are FP32 and are what a checkpoint stores as
// `weight_scale_inv`, the dequantization multiplier: w ~= E4M3(q) * scale.
// An element quantizes as Fp32ToE4m3Bits(x / scale), one correctly rounded
// FP32 division (never x * (1 / scale), which rounds twice; under the
// power-of-two rule the two agree exactly).
//
// Only integer operations on bit patterns and correctly rounded FP32
// division and multiplication are used, so device fast-math and
// flush-to-zero settings cannot change results.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/bf16_math.h"
#include "kernels/hd.h"
#include "kernels/rn_math.h"

namespace dte::kernels {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3CanonicalNan = 0x7F;
inline constexpr uint8_t kE4m3MaxBits = 0x7E;

// How a block's FP32 scale follows from its absolute maximum amax.
enum class Fp8ScaleRule : uint8_t {
  // scale = fp32(amax / 448), correctly rounded: the scale of the public
  // block-scaled FP8 checkpoints (DeepSeek-V3 style, `weight_scale_inv`).
  kPlain = 0,
  // The plain scale rounded up to a power of two, kept within
  // [2^-126, 2^127] (UE8M0-style scales, as DeepGEMM's ceil_to_ue8m0).
  kPowerOfTwo = 1,
};

namespace fp8_internal {

// The magnitude bits (sign cleared) of a finite, non-NaN E4M3 result for
// 0 < |x| < 448 given as FP32 magnitude bits a.
DTE_HD uint32_t RoundMagnitude(uint32_t a) {
  constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  if (a >= kMinNormalBits) {
    // Drop 20 of FP32's 23 mantissa bits, ties to even; a carry moves into
    // the exponent as it should. E4M3's exponent bias is 127 - 120.
    const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    return r - (120u << 3);
  }
  // Subnormal range: the result is round(|x| * 2^9) in 0..8 (8 encodes the
  // smallest normal, 2^-6, exactly). |x| = m * 2^(e - 150) with the hidden
  // bit in m, so |x| * 2^9 = m >> (141 - e) rounded to nearest even.
  const uint32_t e = a >> 23;
  if (e == 0) return 0;  // FP32 zero or subnormal: far below 2^-10
  const uint32_t shift = 141u - e;
  if (shift >= 26u) return 0;  // m < 2^24, so |x| * 2^9 < 1/2
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return q + ((rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u);
}

}  // namespace fp8_internal

// FP32 -> E4M3 bits, saturating, round to nearest even (see the top).
DTE_HD uint8_t Fp32ToE4m3Bits(float x) {
  const uint32_t u = FloatBits(x);
  if (IsNanBits(u)) return kE4m3CanonicalNan;
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  constexpr uint32_t kMaxBits = 0x43E00000u;  // 448.0f
  const uint32_t mag = a >= kMaxBits ? kE4m3MaxBits : fp8_internal::RoundMagnitude(a);
  return static_cast<uint8_t>(sign | mag);
}

// BF16 bits -> E4M3 bits (every BF16 value is an FP32 value).
DTE_HD uint8_t Bf16ToE4m3Bits(uint16_t b) { return Fp32ToE4m3Bits(Bf16BitsToFp32(b)); }

// E4M3 bits -> FP32, exact. Both NaN encodings give FP32 quiet NaN with the
// same sign.
DTE_HD float E4m3BitsToFp32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if ((b & 0x7Fu) == 0x7Fu) return BitsToFloat(sign | 0x7FC00000u);
  if (exp == 0) {
    // m * 2^-9: an exact product, as m has 3 bits.
    const float v = rn::Mul(static_cast<float>(mant), 1.0f / 512.0f);
    return BitsToFloat(sign | FloatBits(v));
  }
  return BitsToFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// |b| as BF16 magnitude bits: for non-NaN values their integer order is the
// order of the magnitudes, so a block's amax is an integer maximum.
DTE_HD uint16_t Bf16AbsBits(uint16_t b) { return static_cast<uint16_t>(b & 0x7FFFu); }

// True when BF16 magnitude bits are +-inf or NaN.
DTE_HD bool Bf16AbsNonFinite(uint16_t abs_bits) { return abs_bits >= 0x7F80u; }

// The FP32 power of two at or above positive finite s, within [2^-126, 2^127].
DTE_HD float CeilPowerOfTwo(float s) {
  const uint32_t u = FloatBits(s);
  uint32_t e = (u >> 23) & 0xFFu;
  if ((u & 0x7FFFFFu) != 0) ++e;  // not already a power of two (or subnormal)
  if (e < 1u) e = 1u;
  if (e > 254u) e = 254u;
  return BitsToFloat(e << 23);
}

// The block scale for absolute maximum amax (a finite value >= 0):
//   - amax == 0 (an all-zero block, of either sign): 1.0 under both rules,
//     so every element quantizes to +-0 and dequantizes exactly;
//   - kPlain: fp32(amax / 448), raised to the smallest FP32 subnormal if
//     that division underflows (only for FP32 amax below 2^-141; no BF16
//     value is that small);
//   - kPowerOfTwo: CeilPowerOfTwo of the plain scale.
// A NaN or infinite amax gives NaN: callers refuse such blocks first.
DTE_HD float Fp8BlockScale(float amax, Fp8ScaleRule rule) {
  const uint32_t u = FloatBits(amax);
  if (!IsFiniteBits(u)) return BitsToFloat(0x7FC00000u);
  if ((u & 0x7FFFFFFFu) == 0) return 1.0f;
  float s = rn::Div(BitsToFloat(u & 0x7FFFFFFFu), kE4m3Max);
  if (FloatBits(s) == 0) s = BitsToFloat(1u);
  return rule == Fp8ScaleRule::kPowerOfTwo ? CeilPowerOfTwo(s) : s;
}

// One element of a block with scale `scale`: E4M3(x / scale).
DTE_HD uint8_t QuantizeE4m3(float x, float scale) { return Fp32ToE4m3Bits(rn::Div(x, scale)); }

// The dequantized value a loader computes: E4M3(q) * scale, in FP32.
DTE_HD float DequantizeE4m3(uint8_t q, float scale) { return rn::Mul(E4m3BitsToFp32(q), scale); }

}  // namespace dte::kernels
