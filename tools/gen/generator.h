// Writes a sequence of checkpoints OUT/step-000000 ... OUT/step-N, each a
// complete Hugging Face model directory, from the simulated AdamW run of
// sim.h.
//
// Memory is bounded by threads x one block of rows (a few MiB), whatever the
// model size: each block of rows is carried through all steps before the
// next one starts, and its bytes for step t are written straight to step t's
// shard file at their final offset. No optimizer state is ever stored.
//
// Thread-safety: Generate() is a blocking call that runs its own threads.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "tools/gen/model_spec.h"
#include "tools/gen/sim.h"

namespace dte::gen {

struct GenOptions {
  std::string out_dir;
  ModelDims dims;
  bool dtype_mix = false;
  uint64_t steps = 3;       // checkpoints step-000000 .. step-<steps>
  uint64_t first_step = 0;  // earlier steps are simulated, not written
  uint64_t seed = 0;
  uint64_t max_shard_bytes = 5'000'000'000;  // Hugging Face's default "5GB"
  int threads = 1;
  AdamWConfig adamw;
  bool progress = true;  // shard progress on stderr
};

inline constexpr size_t kRoleCount = 6;  // TensorRole values

// Changed elements of one step versus the previous one.
struct StepStats {
  uint64_t bf16_changed = 0;
  uint64_t bf16_total = 0;
  uint64_t f32_changed = 0;
  uint64_t f32_total = 0;
  std::array<uint64_t, kRoleCount> role_changed{};  // BF16 tensors, by TensorRole
  std::array<uint64_t, kRoleCount> role_total{};
};

// Generates the checkpoints; returns stats for steps 0..steps (entry 0 is
// empty). Errors name the file that could not be written.
Result<std::vector<StepStats>> Generate(const GenOptions& options);

// "step-000042".
std::string StepDirName(uint64_t step);

}  // namespace dte::gen
