// Small model specs and random HF states for the converter tests.
//
// Header-only: it uses the sync module, which dte_testutil does not link.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "store/dtype.h"
#include "sync/convert/convert.h"
#include "tests/testutil/checkpoint.h"

namespace dte::test {

// A Llama-shaped spec: 2 layers, hidden 16, head_dim 4, ffn 24, vocab 50.
inline ModelSpec TinyLlama(int64_t heads, int64_t kv_heads) {
  ModelSpec s;
  s.model_type = "llama";
  s.num_layers = 2;
  s.hidden = 16;
  s.num_attention_heads = heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = 4;
  s.ffn_hidden = 24;
  s.vocab = 50;
  return s;
}

// Qwen3 dense: Llama plus q_norm / k_norm, and tied embeddings.
inline ModelSpec TinyQwen3(int64_t heads, int64_t kv_heads) {
  ModelSpec s = TinyLlama(heads, kv_heads);
  s.model_type = "qwen3";
  s.qk_norm = true;
  s.tied_embeddings = true;
  return s;
}

// Qwen3-MoE: 3 layers, 4 experts of width 8, layer 1 kept dense.
inline ModelSpec TinyQwen3Moe(int64_t heads, int64_t kv_heads) {
  ModelSpec s = TinyQwen3(heads, kv_heads);
  s.model_type = "qwen3_moe";
  s.tied_embeddings = false;
  s.num_layers = 3;
  s.num_experts = 4;
  s.moe_ffn_hidden = 8;
  s.mlp_only_layers = {1};
  return s;
}

// Random element bits (NaN payloads included) for every tensor of `plan`.
inline std::map<std::string, TensorData> RandomHfState(const std::vector<ConvertUnit>& plan,
                                                       DType dtype, uint64_t seed) {
  std::map<std::string, TensorData> hf;
  for (const ConvertUnit& unit : plan) {
    for (const PlannedTensor& t : unit.tensors) {
      TensorData& d = hf[t.name];
      d.dtype = dtype;
      d.shape = t.shape;
      d.data = RandomBytes(t.elements() * DTypeWidth(dtype), seed++);
    }
  }
  return hf;
}

}  // namespace dte::test
