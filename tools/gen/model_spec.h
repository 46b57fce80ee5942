// The synthetic model's architecture: a Llama/Qwen-style decoder (grouped-
// query attention, SwiGLU MLP, RMSNorm) with Hugging Face tensor names, and
// the choice of dimensions that reaches a target checkpoint size.
//
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"

namespace dte::gen {

struct ModelDims {
  int64_t hidden = 0;
  int64_t layers = 0;
  int64_t intermediate = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab = 0;
  bool tied_embeddings = false;
};

// What the tensor is, which decides its initialization and gradients.
enum class TensorRole { kEmbedding, kLmHead, kAttention, kMlp, kNorm, kBuffer };

struct TensorSpec {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  TensorRole role = TensorRole::kAttention;

  uint64_t elements() const;
  uint64_t bytes() const { return elements() * DTypeWidth(dtype); }
  // Matrices are rows x cols; vectors are one row.
  int64_t rows() const { return shape.size() == 2 ? shape[0] : 1; }
  int64_t cols() const { return shape.back(); }
};

inline constexpr int64_t kMaxPositions = 4096;

// Number of weight elements of a model with these dims.
uint64_t ParamCount(const ModelDims& dims);

// Fills every zero field of `fixed`. With `target_bytes` > 0, searches the
// free dims for a model of about target_bytes / 2 BF16 elements with usual
// proportions (MLP ~2.75x hidden, ~64 hidden per layer, 4 query heads per KV
// head); with 0, `fixed` must name hidden and layers and the rest get
// defaults. Errors explain which combination is impossible.
Result<ModelDims> ChooseDims(uint64_t target_bytes, const ModelDims& fixed);

// The tensors in Hugging Face state-dict order. `dtype_mix` stores the norm
// weights as F32 and adds a constant I64 buffer, to exercise non-BF16 dtypes.
std::vector<TensorSpec> BuildTensorList(const ModelDims& dims, bool dtype_mix);

// One line: "hidden 1024, 16 layers, ... (123.4M params)".
std::string DescribeDims(const ModelDims& dims);

}  // namespace dte::gen
