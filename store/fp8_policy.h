// Which tensors of a version an FP8 view quantizes (docs/fp8.md).
//
// The default follows the published block-scaled FP8 checkpoints
// (DeepSeek-V3, Qwen3-FP8 and the like): the linear weights of attention,
// MLP and experts are quantized; embeddings, lm_head, norms, biases and MoE
// router gates stay in their stored dtype. A tensor is quantized when
//   - its dtype is BF16 and its shape is 2-D (norms and biases are 1-D),
//   - its name ends in ".weight", and
//   - no dot-separated component of its module path (the name without
//     ".weight") equals one of skip_modules or contains one of
//     skip_substrings.
// Component matching keeps "mlp.gate" (a router) apart from
// "mlp.gate_proj" (a linear layer).
//
// Thread-safety: pure functions; an Fp8Policy is a value.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "store/dtype.h"

namespace dte {

struct Fp8Policy {
  // Module path components whose weights stay unquantized: the output head
  // and MoE routers (DeepSeek "gate", Mixtral/Qwen "gate", "router",
  // Qwen2-MoE "shared_expert_gate").
  std::vector<std::string> skip_modules = {"lm_head", "gate", "router", "shared_expert_gate"};
  // Substrings of components that mark embeddings and norms.
  std::vector<std::string> skip_substrings = {"embed", "norm"};
};

// Why a tensor is or is not quantized.
enum class Fp8Decision {
  kQuantize,
  kNotBf16,        // other dtypes are kept as stored
  kNot2d,          // norms, biases, scalars, stacked 3-D experts
  kNotWeight,      // the name does not end in ".weight"
  kSkippedModule,  // a component matches skip_modules or skip_substrings
};

Fp8Decision DecideFp8(const Fp8Policy& policy, std::string_view name, DType dtype,
                      std::span<const int64_t> shape);

inline bool QuantizeAsFp8(const Fp8Policy& policy, std::string_view name, DType dtype,
                          std::span<const int64_t> shape) {
  return DecideFp8(policy, name, dtype, shape) == Fp8Decision::kQuantize;
}

// A word for a decision ("quantized", "not BF16", ...), for listings and
// error messages.
std::string_view Fp8DecisionName(Fp8Decision d);

}  // namespace dte
