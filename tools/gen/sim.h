// Simulated AdamW training of one tensor, a block of rows at a time.
//
// The model: FP32 master weights (N(0, 0.02), norms 1.0) trained by AdamW on
// synthetic gradients g = s_r * c_t * (mu_i + n_it), where
//   s_r   a per-row gradient scale,
//   c_t   a per-step, per-tensor magnitude (the loss landscape shifts),
//   mu_i  a persistent per-element component (so momentum matters), whose
//         strength varies by row and column (some rows learn, most drift),
//   n_it  fresh per-step noise.
// Embedding rows are zero in steps whose batch lacks their token, and the
// top 10% of token ids never appear at all (their rows never change). The
// optimizer starts warm: m and v begin at their stationary values and bias
// correction as if a long run preceded step 0, so every step behaves like
// the middle of an RL run rather than a fresh optimizer's first step.
//
// Every number is a pure function of (seed, tensor name, step, element), so
// a block's trajectory does not depend on how tensors are split into blocks
// or on threads. Floating-point ops are IEEE-exact (+, *, /, sqrt) in a
// fixed order; nothing comes from libm.
//
// Thread-safety: a ChunkSimulator is used by one thread at a time.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tools/gen/model_spec.h"

namespace dte::gen {

struct RowInit;

struct AdamWConfig {
  double lr = 1e-6;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

class ChunkSimulator {
 public:
  ChunkSimulator(uint64_t seed, const AdamWConfig& config);

  // Starts rows [row_begin, row_end) of `spec` at step 0 and encodes them.
  void Begin(const TensorSpec& spec, int64_t row_begin, int64_t row_end);

  // Runs step `step` (the previous step + 1, starting at 1), re-encodes and
  // returns how many elements' encoded bits changed.
  uint64_t Advance(uint64_t step);

  // The rows' current bytes in the tensor's dtype.
  std::span<const uint8_t> encoded() const;

 private:
  struct StepConstants;
  void InitRows();
  RowInit MakeRowInit(int64_t row);
  float TokenSeenProbability(int64_t row) const;
  StepConstants MakeStepConstants(uint64_t step) const;
  uint64_t Encode();

  const uint64_t seed_;
  const AdamWConfig config_;
  const TensorSpec* spec_ = nullptr;
  uint64_t tensor_hash_ = 0;
  int64_t row_begin_ = 0;
  int64_t row_end_ = 0;
  std::vector<float> w_, m_, v_, mu_;  // FP32 master weights, Adam moments, signal
  std::vector<float> scratch_;         // one row of temporaries
  std::vector<float> col_signal_;      // column factor of the persistent component
  std::vector<float> row_scale_;       // s_r
  std::vector<float> seen_p_;          // embedding rows: chance the token is in a batch
  std::vector<uint16_t> bf16_;         // encoding of BF16 tensors
  std::vector<uint32_t> f32_;          // encoding of F32 tensors (bits)
  std::vector<int64_t> i64_;           // encoding of I64 buffers
};

}  // namespace dte::gen
