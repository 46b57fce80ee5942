// Which tensors of a version an FP8 view quantizes (docs/fp8.md).
//
// The default follows the published block-scaled FP8 checkpoints
// (DeepSeek-V3, Qwen3-FP8 and the like): the linear weights of attention,
// MLP and experts are quantized; embeddings, lm_head, norms, biases and MoE
// router gates stay in their stored dtype. A tensor is quantized when
//   - its dtype is BF16 and its shape is 2-D (norms and biases are 1-D),
//   - its name ends in ".weight",
//   - no dot-separated component of its module path (the name without
//     ".weight") equals one of skip_modules or contains one of
//     skip_substrings, and
//   - its rows are a multiple of the block's rows and its columns of the
//     block's columns (unless quantize_partial_blocks).
// Component matching keeps "mlp.gate" (a router) apart from
// "mlp.gate_proj" (a linear layer). The block is an input because the
// loaders' rule is: transformers' fine-grained FP8 refuses a weight whose
// shape is not a whole number of blocks ("Weight shape (344, 128) not
// divisible by scale grid (3, 1)"), so a view, a receiver and a count of
// the same block must leave the same tensors in BF16.
//
// Thread-safety: pure functions; an Fp8Policy is a value.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/fp8.h"
#include "store/dtype.h"

namespace dte {

struct Fp8Policy {
  // Module path components whose weights stay unquantized: the output head
  // and MoE routers (DeepSeek "gate", Mixtral/Qwen "gate", "router",
  // Qwen2-MoE "shared_expert_gate").
  std::vector<std::string> skip_modules = {"lm_head", "gate", "router", "shared_expert_gate"};
  // Substrings of components that mark embeddings and norms.
  std::vector<std::string> skip_substrings = {"embed", "norm"};
  // Also quantize weights that are not a whole number of blocks, their last
  // block row and column partial (the quantizer supports them: the scale of
  // a partial block comes from the elements it holds). Off by default, as
  // transformers refuses such a checkpoint; for consumers known to read
  // partial blocks.
  bool quantize_partial_blocks = false;
};

// The block a view, a receiver or a count quantizes with: rows x cols
// elements per scale (both at least 1).
struct Fp8Block {
  uint64_t rows = kernels::kFp8DefaultBlock;
  uint64_t cols = kernels::kFp8DefaultBlock;
};

// Why a tensor is or is not quantized, in the order they are checked.
enum class Fp8Decision {
  kQuantize,
  kNotBf16,           // other dtypes are kept as stored
  kNot2d,             // norms, biases, scalars, stacked 3-D experts
  kNotWeight,         // the name does not end in ".weight"
  kSkippedModule,     // a component matches skip_modules or skip_substrings
  kNotBlockMultiple,  // rows or columns not a multiple of the block's
};

Fp8Decision DecideFp8(const Fp8Policy& policy, Fp8Block block, std::string_view name, DType dtype,
                      std::span<const int64_t> shape);

inline bool QuantizeAsFp8(const Fp8Policy& policy, Fp8Block block, std::string_view name,
                          DType dtype, std::span<const int64_t> shape) {
  return DecideFp8(policy, block, name, dtype, shape) == Fp8Decision::kQuantize;
}

// Whether a weight the policy keeps in BF16 for this decision is listed in
// a checkpoint's modules_to_not_convert: a 2-D BF16 weight a loader would
// otherwise expect in FP8 (a skipped module, a shape off the blocks).
inline bool ListedAsNotConverted(Fp8Decision d) {
  return d == Fp8Decision::kSkippedModule || d == Fp8Decision::kNotBlockMultiple;
}

// A word for a decision ("quantized", "not BF16", ...), for listings and
// error messages.
std::string_view Fp8DecisionName(Fp8Decision d);

}  // namespace dte
