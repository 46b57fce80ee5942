// Counter-based random numbers for the checkpoint generator.
//
// Every random quantity is a pure function of (seed, tensor, stream, step,
// element index), never of a sequential generator's position. That is what
// makes the output identical for any chunking and any thread count: a chunk
// computes exactly the numbers for its own elements. Only integer arithmetic
// and exactly rounded float operations are used, so results do not depend on
// the C library or the CPU.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

namespace dte::gen {

// Streams separate the independent random quantities of one tensor.
enum class Stream : uint32_t {
  kInitWeight = 1,
  kInitDither,
  kDirection,  // per-element persistent gradient direction
  kMomentum,   // warm-start momentum noise
  kRowScale,
  kRowSignal,
  kColSignal,
  kStepNoise,  // per-step gradient noise
  kStepScale,  // per-step gradient magnitude
  kTokenSeen,  // per-step embedding rows present in the batch
};

// A 32-bit avalanche finalizer (bijective).
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// A 64-bit avalanche finalizer (bijective).
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// FNV-1a of a tensor name: identifies a tensor independently of its position.
inline uint64_t NameHash(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

// The key of one (tensor, stream, step) sequence.
inline uint32_t StreamKey(uint64_t seed, uint64_t tensor, Stream stream, uint64_t step) {
  uint64_t h = Mix64(seed ^ 0x9E3779B97F4A7C15ull);
  h = Mix64(h ^ tensor);
  h = Mix64(h ^ (static_cast<uint64_t>(stream) << 40) ^ step);
  return static_cast<uint32_t>(h >> 32);
}

// The i-th 32 random bits of the sequence `key`.
inline uint32_t Bits(uint32_t key, uint32_t i) { return Mix32(i * 0x9E3779B1u + key); }

// Uniform in [0, 1) with 24-bit resolution.
inline float Uniform(uint32_t bits) { return static_cast<float>(bits >> 8) * 0x1p-24f; }

// Approximately standard normal from 32 bits: the sum of four 8-bit uniforms
// (Irwin-Hall), scaled to unit variance. Coarse but cheap; used for gradient
// noise, whose fine structure Adam averages away.
inline float CoarseNormal(uint32_t bits) {
  int32_t sum = static_cast<int32_t>((bits & 0xFF) + ((bits >> 8) & 0xFF) + ((bits >> 16) & 0xFF) +
                                     (bits >> 24));
  // Each byte has variance (256^2 - 1) / 12; four of them 21845.
  constexpr float kInvStd = 0.0067658751f;  // 1 / sqrt(21845)
  return static_cast<float>(sum - 510) * kInvStd;
}

// Approximately standard normal with fine resolution: four 16-bit uniforms
// from `a` and `b` plus a 16-bit dither from `c` below their resolution, so
// small values are spread evenly (this matters for tiny weights whose BF16
// rounding position must be uniform).
inline float FineNormal(uint32_t a, uint32_t b, uint32_t c) {
  int32_t sum = static_cast<int32_t>((a & 0xFFFF) + (a >> 16) + (b & 0xFFFF) + (b >> 16));
  float dither = static_cast<float>(c & 0xFFFF) * 0x1p-16f - 0.5f;
  // Four 16-bit uniforms have variance 4 * (65536^2 - 1) / 12 ~ 65536^2 / 3.
  constexpr float kInvStd = 2.6428998e-05f;  // sqrt(3) / 65536
  return (static_cast<float>(sum - 131070) + dither) * kInvStd;
}

}  // namespace dte::gen
