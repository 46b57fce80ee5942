// Test fixtures for transfer plans: a small random HF-style model and a
// direct sharding of it into TP shards (fused or not) written with plain row
// and column slicing, independent of the plan's box math, so comparing the
// two can fail. Header-only: used by sync_test and tests/p2p/p2p_worker.
//
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "store/dtype.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::transfer_test {

using Bytes = std::vector<uint8_t>;
using State = std::map<std::string, Bytes>;  // tensor name -> raw bytes

struct ModelConfig {
  uint64_t layers = 2;
  uint64_t hidden = 16;
  uint64_t heads = 8;
  uint64_t kv_heads = 2;
  uint64_t head_dim = 4;
  uint64_t intermediate = 24;
  uint64_t vocab = 40;
  AttentionGeometry Geometry() const { return {heads, kv_heads, head_dim}; }
};

inline std::vector<PlanTensor> ModelSpecs(const ModelConfig& c) {
  std::vector<PlanTensor> s;
  const DType bf16 = DType::kBF16;
  s.push_back({"model.embed_tokens.weight", bf16, {c.vocab, c.hidden}});
  for (uint64_t l = 0; l < c.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const uint64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
    s.push_back({p + "input_layernorm.weight", DType::kF32, {c.hidden}});
    s.push_back({p + "self_attn.q_proj.weight", bf16, {q, c.hidden}});
    s.push_back({p + "self_attn.q_proj.bias", bf16, {q}});
    s.push_back({p + "self_attn.k_proj.weight", bf16, {kv, c.hidden}});
    s.push_back({p + "self_attn.k_proj.bias", bf16, {kv}});
    s.push_back({p + "self_attn.v_proj.weight", bf16, {kv, c.hidden}});
    s.push_back({p + "self_attn.v_proj.bias", bf16, {kv}});
    s.push_back({p + "self_attn.o_proj.weight", bf16, {c.hidden, q}});
    s.push_back({p + "post_attention_layernorm.weight", DType::kF32, {c.hidden}});
    s.push_back({p + "mlp.gate_proj.weight", bf16, {c.intermediate, c.hidden}});
    s.push_back({p + "mlp.up_proj.weight", bf16, {c.intermediate, c.hidden}});
    s.push_back({p + "mlp.down_proj.weight", bf16, {c.hidden, c.intermediate}});
  }
  s.push_back({"model.norm.weight", DType::kF32, {c.hidden}});
  s.push_back({"lm_head.weight", bf16, {c.vocab, c.hidden}});
  return s;
}

inline uint64_t ByteSize(const PlanTensor& t) {
  return ShapeElements(t.shape) * DTypeWidth(t.dtype);
}

inline std::pair<std::vector<PlanTensor>, State> RandomModel(const ModelConfig& c,
                                                             std::mt19937_64& rng) {
  std::vector<PlanTensor> specs = ModelSpecs(c);
  State state;
  for (const PlanTensor& t : specs) {
    Bytes b(ByteSize(t));
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    state[t.name] = std::move(b);
  }
  return {specs, state};
}

// Changes each element with probability `density` to different bits.
inline State RandomChange(const std::vector<PlanTensor>& specs, const State& old, double density,
                          std::mt19937_64& rng) {
  State out = old;
  std::uniform_real_distribution<double> u(0, 1);
  for (const PlanTensor& t : specs) {
    const int w = DTypeWidth(t.dtype);
    Bytes& b = out[t.name];
    for (size_t i = 0; i < b.size() / w; ++i) {
      if (u(rng) >= density) continue;
      const int byte = static_cast<int>(rng() % w);
      b[i * w + byte] ^= static_cast<uint8_t>(1 + rng() % 255);  // never a no-op
    }
  }
  return out;
}

// Rows [lo, lo + n) of a row-major tensor whose rows are row_bytes long.
inline Bytes Rows(const Bytes& b, uint64_t row_bytes, uint64_t lo, uint64_t n) {
  return Bytes(b.begin() + lo * row_bytes, b.begin() + (lo + n) * row_bytes);
}

// Columns [lo, lo + n) of a 2-D tensor of `cols` columns of width w.
inline Bytes Cols(const Bytes& b, uint64_t cols, int w, uint64_t lo, uint64_t n) {
  Bytes out;
  const uint64_t rows = b.size() / (cols * w);
  for (uint64_t r = 0; r < rows; ++r) {
    const auto* row = b.data() + r * cols * w;
    out.insert(out.end(), row + lo * w, row + (lo + n) * w);
  }
  return out;
}

inline bool EndsWith(const std::string& s, const std::string& t) {
  return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
}

// What `rank` of a layout with degree layout.tp holds, by local tensor name.
inline State ShardModel(const ModelConfig& c, const std::vector<PlanTensor>& specs,
                        const State& state, const ShardLayout& layout, int rank) {
  const uint64_t tp = layout.tp, r = rank;
  State out;
  for (const PlanTensor& t : specs) {
    const Bytes& b = state.at(t.name);
    const int w = DTypeWidth(t.dtype);
    const uint64_t row_bytes = t.shape.size() > 1 ? t.shape[1] * w : w;
    const std::string& n = t.name;
    const bool is_q = n.find("q_proj.") != std::string::npos;
    const bool is_kv =
        n.find("k_proj.") != std::string::npos || n.find("v_proj.") != std::string::npos;
    const bool is_gu =
        n.find("gate_proj.") != std::string::npos || n.find("up_proj.") != std::string::npos;
    if (is_q) {
      const uint64_t rows = c.heads / tp * c.head_dim;
      out[n] = Rows(b, row_bytes, r * rows, rows);
    } else if (is_kv) {
      const uint64_t heads = c.kv_heads >= tp ? c.kv_heads / tp : 1;
      const uint64_t first = c.kv_heads >= tp ? r * heads : r * c.kv_heads / tp;
      out[n] = Rows(b, row_bytes, first * c.head_dim, heads * c.head_dim);
    } else if (is_gu) {
      const uint64_t rows = t.shape[0] / tp;
      out[n] = Rows(b, row_bytes, r * rows, rows);
    } else if (EndsWith(n, "o_proj.weight") || EndsWith(n, "down_proj.weight")) {
      const uint64_t cols = t.shape[1] / tp;
      out[n] = Cols(b, t.shape[1], w, r * cols, cols);
    } else if (EndsWith(n, "embed_tokens.weight") || EndsWith(n, "lm_head.weight")) {
      const uint64_t per = (t.shape[0] + tp - 1) / tp;
      const uint64_t lo = std::min(t.shape[0], r * per);
      const uint64_t hi = std::min(t.shape[0], lo + per);
      Bytes s = Rows(b, row_bytes, lo, hi - lo);
      s.resize(per * row_bytes, 0);  // padding rows: zeros in old and new
      out[n] = std::move(s);
    } else {
      out[n] = b;
    }
  }
  // Fusion is concatenation of the rank's row blocks.
  auto fuse = [&](const std::vector<std::string>& parts, const std::string& from,
                  const std::string& to) {
    for (const PlanTensor& t : specs) {
      if (!EndsWith(t.name, from + ".weight") && !EndsWith(t.name, from + ".bias")) continue;
      const std::string stem =
          t.name.substr(0, t.name.size() - t.name.substr(t.name.rfind(from)).size());
      const std::string param = t.name.substr(t.name.rfind('.'));
      Bytes fused;
      for (const std::string& p : parts) {
        const Bytes& piece = out.at(stem + p + param);
        fused.insert(fused.end(), piece.begin(), piece.end());
      }
      for (const std::string& p : parts) out.erase(stem + p + param);
      out[stem + to + param] = std::move(fused);
    }
  };
  if (layout.fuse_qkv) fuse({"q_proj", "k_proj", "v_proj"}, "q_proj", "qkv_proj");
  if (layout.fuse_gate_up) fuse({"gate_proj", "up_proj"}, "gate_proj", "gate_up_proj");
  return out;
}

}  // namespace dte::transfer_test
