// One synthetic AdamW step shared by the engine benchmarks: weights ~ N(0,
// 0.02), gradients ~ N(0, 1e-3), moments consistent with them, and a learning
// rate at which about 2% of the BF16 weights change.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "kernels/parallel.h"

namespace dte::bench {

inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A standard normal-ish value from hash bits (sum of four uniforms, scaled).
inline float Normal(uint64_t h) {
  float s = 0;
  for (int k = 0; k < 4; ++k) s += static_cast<float>((h >> (16 * k)) & 0xFFFF) / 65535.0f;
  return (s - 2.0f) * 1.7320508f;
}

inline kernels::AdamWParams SynthParams() {
  kernels::AdamWParams p;
  p.lr = 2e-6;
  p.beta1 = 0.9;
  p.beta2 = 0.999;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  p.step = 100;
  return p;
}

// theta (after the step), m, v of one AdamW step, elements [first, first + n)
// of a model seeded by `seed`. With prev_bf16, also the BF16 weights before
// the step.
inline void Synthesize(uint64_t seed, uint64_t first, size_t n, float* theta, float* m, float* v,
                       uint16_t* prev_bf16) {
  const auto p = SynthParams();
  kernels::ParallelFor(n, 1 << 16, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const uint64_t h = Mix(seed ^ Mix(first + i));
      const float w = 0.02f * Normal(h);
      const float g = 1e-3f * Normal(Mix(h));
      m[i] = g;
      v[i] = g * g * (0.2f + static_cast<float>(Mix(h + 1) & 0xFFFF) / 8192.0f) + 1e-14f;
      theta[i] = w;  // the previous weight, for now
      if (prev_bf16 != nullptr) prev_bf16[i] = kernels::Fp32ToBf16Bits(w);
    }
  });
  // One forward step, in place through a small buffer (outputs must not
  // overlap inputs).
  std::vector<float> out(1 << 20);
  for (size_t b = 0; b < n; b += out.size()) {
    const size_t len = std::min(out.size(), n - b);
    kernels::AdamWForward(theta + b, m + b, v + b, len, p, out.data());
    std::memcpy(theta + b, out.data(), len * 4);
  }
}

}  // namespace dte::bench
