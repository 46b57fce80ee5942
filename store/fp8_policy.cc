// The FP8 tensor selection rule (store/fp8_policy.h).
#include "store/fp8_policy.h"

#include <algorithm>

namespace dte {
namespace {

constexpr std::string_view kWeightSuffix = ".weight";

bool SkippedComponent(const Fp8Policy& p, std::string_view c) {
  if (std::find(p.skip_modules.begin(), p.skip_modules.end(), c) != p.skip_modules.end()) {
    return true;
  }
  return std::any_of(p.skip_substrings.begin(), p.skip_substrings.end(),
                     [&](const std::string& s) { return c.find(s) != std::string_view::npos; });
}

// Whether n elements are a whole number of blocks of side b (b >= 1; a
// side of 0 is no block, and nothing is a multiple of it).
bool WholeBlocks(int64_t n, uint64_t b) {
  return b != 0 && n >= 0 && static_cast<uint64_t>(n) % b == 0;
}

}  // namespace

Fp8Decision DecideFp8(const Fp8Policy& policy, Fp8Block block, std::string_view name, DType dtype,
                      std::span<const int64_t> shape) {
  if (dtype != DType::kBF16) return Fp8Decision::kNotBf16;
  if (shape.size() != 2) return Fp8Decision::kNot2d;
  if (!name.ends_with(kWeightSuffix)) return Fp8Decision::kNotWeight;
  std::string_view module = name.substr(0, name.size() - kWeightSuffix.size());
  while (!module.empty()) {
    const size_t dot = module.find('.');
    if (SkippedComponent(policy, module.substr(0, dot))) return Fp8Decision::kSkippedModule;
    module = dot == std::string_view::npos ? std::string_view{} : module.substr(dot + 1);
  }
  if (!policy.quantize_partial_blocks &&
      !(WholeBlocks(shape[0], block.rows) && WholeBlocks(shape[1], block.cols))) {
    return Fp8Decision::kNotBlockMultiple;
  }
  return Fp8Decision::kQuantize;
}

std::string_view Fp8DecisionName(Fp8Decision d) {
  switch (d) {
    case Fp8Decision::kQuantize:
      return "quantized";
    case Fp8Decision::kNotBf16:
      return "not BF16";
    case Fp8Decision::kNot2d:
      return "not 2-D";
    case Fp8Decision::kNotWeight:
      return "not a weight";
    case Fp8Decision::kSkippedModule:
      return "skipped module";
    case Fp8Decision::kNotBlockMultiple:
      return "shape not a multiple of the block";
  }
  return "unknown";
}

}  // namespace dte
