// Planning the conversion: which HF tensors each unit yields, which MCore
// shards it reads, and the block copies between them.
#include <algorithm>
#include <utility>

#include "sync/convert/convert.h"
#include "sync/convert/convert_matrix.h"

namespace dte {
namespace {

// Builds one unit. Shapes are [rows, cols] matrices or [n] vectors.
class UnitBuilder {
 public:
  explicit UnitBuilder(std::string label) { unit_.label = std::move(label); }

  uint32_t Tensor(std::string name, std::vector<int64_t> shape) {
    unit_.tensors.push_back({std::move(name), std::move(shape)});
    return static_cast<uint32_t>(unit_.tensors.size() - 1);
  }
  uint32_t Shard(std::string name, int tp, int ep, std::vector<int64_t> shape) {
    unit_.shards.push_back({{std::move(name), tp, ep}, std::move(shape)});
    return static_cast<uint32_t>(unit_.shards.size() - 1);
  }
  void Copy(uint32_t t, int64_t t_row, int64_t t_col, uint32_t s, int64_t s_row, int64_t s_col,
            int64_t rows, int64_t cols) {
    unit_.copies.push_back({t, s, t_row, t_col, s_row, s_col, rows, cols});
  }
  ConvertUnit Take() { return std::move(unit_); }

  // A tensor every rank holds whole (norms, the router): read from tp 0, ep 0.
  void Replicated(const std::string& hf, const std::string& mcore, std::vector<int64_t> shape) {
    uint32_t t = Tensor(hf, shape);
    uint32_t s = Shard(mcore, 0, 0, shape);
    Copy(t, 0, 0, s, 0, 0, internal::MatrixRows(shape), internal::MatrixCols(shape));
  }

  // Row-parallel linear weight [rows, cols]: rank r holds columns
  // [r * cols / tp, (r + 1) * cols / tp).
  void RowParallel(const std::string& hf, const std::string& mcore, int64_t rows, int64_t cols,
                   int tp, int ep) {
    uint32_t t = Tensor(hf, {rows, cols});
    const int64_t part = cols / tp;
    for (int r = 0; r < tp; ++r) {
      uint32_t s = Shard(mcore, r, ep, {rows, part});
      Copy(t, 0, r * part, s, 0, 0, rows, part);
    }
  }

  // Fused [gate; up] column-parallel fc1: rank r holds
  // [gate rows of rank r; up rows of rank r].
  void GatedFc1(const std::string& gate, const std::string& up, const std::string& mcore,
                int64_t ffn, int64_t hidden, int tp, int ep) {
    uint32_t g = Tensor(gate, {ffn, hidden});
    uint32_t u = Tensor(up, {ffn, hidden});
    const int64_t part = ffn / tp;
    for (int r = 0; r < tp; ++r) {
      uint32_t s = Shard(mcore, r, ep, {2 * part, hidden});
      Copy(g, r * part, 0, s, 0, 0, part, hidden);
      Copy(u, r * part, 0, s, part, 0, part, hidden);
    }
  }

  // Vocab-parallel [padded, hidden]: rank r holds padded rows
  // [r * padded / tp, ...); rows at and past `vocab` are padding, not in HF.
  void VocabParallel(const std::string& hf, const std::string& mcore, int64_t vocab, int64_t padded,
                     int64_t hidden, int tp) {
    uint32_t t = Tensor(hf, {vocab, hidden});
    const int64_t part = padded / tp;
    for (int r = 0; r < tp; ++r) {
      uint32_t s = Shard(mcore, r, 0, {part, hidden});
      const int64_t begin = r * part;
      const int64_t rows = std::clamp<int64_t>(vocab - begin, 0, part);
      if (rows > 0) Copy(t, begin, 0, s, 0, 0, rows, hidden);
    }
  }

 private:
  ConvertUnit unit_;
};

std::string Hf(int64_t l, const char* suffix) {
  return "model.layers." + std::to_string(l) + "." + suffix;
}
std::string Mc(int64_t l, const char* suffix) {
  return "decoder.layers." + std::to_string(l) + "." + suffix;
}

// linear_qkv: per KV group j the rows [q heads j*g .. (j+1)*g-1, k_j, v_j],
// head_dim rows each; TP rank r holds groups [r * kv / tp, (r + 1) * kv / tp).
void FusedQkv(UnitBuilder& b, const ModelSpec& s, int tp, int64_t l) {
  const int64_t d = s.head_dim;
  const int64_t g = s.num_attention_heads / s.num_kv_heads;
  uint32_t q = b.Tensor(Hf(l, "self_attn.q_proj.weight"), {s.num_attention_heads * d, s.hidden});
  uint32_t k = b.Tensor(Hf(l, "self_attn.k_proj.weight"), {s.num_kv_heads * d, s.hidden});
  uint32_t v = b.Tensor(Hf(l, "self_attn.v_proj.weight"), {s.num_kv_heads * d, s.hidden});
  const int64_t groups = s.num_kv_heads / tp;
  const int64_t group_rows = (g + 2) * d;
  for (int r = 0; r < tp; ++r) {
    uint32_t sh =
        b.Shard(Mc(l, "self_attention.linear_qkv.weight"), r, 0, {groups * group_rows, s.hidden});
    for (int64_t jl = 0; jl < groups; ++jl) {
      const int64_t j = r * groups + jl;
      const int64_t base = jl * group_rows;
      b.Copy(q, j * g * d, 0, sh, base, 0, g * d, s.hidden);
      b.Copy(k, j * d, 0, sh, base + g * d, 0, d, s.hidden);
      b.Copy(v, j * d, 0, sh, base + (g + 1) * d, 0, d, s.hidden);
    }
  }
}

ConvertUnit Attention(const ModelSpec& s, const ParallelLayout& p, int64_t l) {
  UnitBuilder b("layer " + std::to_string(l) + " attention");
  const char* norm = p.norms == McoreNorms::kTransformerEngine
                         ? "self_attention.linear_qkv.layer_norm_weight"
                         : "input_layernorm.weight";
  b.Replicated(Hf(l, "input_layernorm.weight"), Mc(l, norm), {s.hidden});
  FusedQkv(b, s, p.tp, l);
  b.RowParallel(Hf(l, "self_attn.o_proj.weight"), Mc(l, "self_attention.linear_proj.weight"),
                s.hidden, s.num_attention_heads * s.head_dim, p.tp, 0);
  if (s.qk_norm) {
    b.Replicated(Hf(l, "self_attn.q_norm.weight"), Mc(l, "self_attention.q_layernorm.weight"),
                 {s.head_dim});
    b.Replicated(Hf(l, "self_attn.k_norm.weight"), Mc(l, "self_attention.k_layernorm.weight"),
                 {s.head_dim});
  }
  return b.Take();
}

ConvertUnit DenseMlp(const ModelSpec& s, const ParallelLayout& p, int64_t l) {
  UnitBuilder b("layer " + std::to_string(l) + " mlp");
  const char* norm = p.norms == McoreNorms::kTransformerEngine ? "mlp.linear_fc1.layer_norm_weight"
                                                               : "pre_mlp_layernorm.weight";
  b.Replicated(Hf(l, "post_attention_layernorm.weight"), Mc(l, norm), {s.hidden});
  b.GatedFc1(Hf(l, "mlp.gate_proj.weight"), Hf(l, "mlp.up_proj.weight"),
             Mc(l, "mlp.linear_fc1.weight"), s.ffn_hidden, s.hidden, p.tp, 0);
  b.RowParallel(Hf(l, "mlp.down_proj.weight"), Mc(l, "mlp.linear_fc2.weight"), s.hidden,
                s.ffn_hidden, p.tp, 0);
  return b.Take();
}

ConvertUnit Router(const ModelSpec& s, int64_t l) {
  UnitBuilder b("layer " + std::to_string(l) + " router");
  b.Replicated(Hf(l, "post_attention_layernorm.weight"), Mc(l, "pre_mlp_layernorm.weight"),
               {s.hidden});
  b.Replicated(Hf(l, "mlp.gate.weight"), Mc(l, "mlp.router.weight"), {s.num_experts, s.hidden});
  return b.Take();
}

// Global expert e lives on EP rank e / (experts / ep) as local expert
// e % (experts / ep), tensor-parallel over the expert TP ranks.
ConvertUnit Expert(const ModelSpec& s, const ParallelLayout& p, int64_t l, int64_t e) {
  const std::string ex = std::to_string(e);
  UnitBuilder b("layer " + std::to_string(l) + " expert " + ex);
  const int64_t per_rank = s.num_experts / p.ep;
  const int ep = static_cast<int>(e / per_rank);
  const std::string local = std::to_string(e % per_rank);
  std::string fc1, fc2;
  if (p.experts == McoreExperts::kSequential) {
    fc1 = Mc(l, "mlp.experts.local_experts.") + local + ".linear_fc1.weight";
    fc2 = Mc(l, "mlp.experts.local_experts.") + local + ".linear_fc2.weight";
  } else {
    fc1 = Mc(l, "mlp.experts.linear_fc1.weight") + local;
    fc2 = Mc(l, "mlp.experts.linear_fc2.weight") + local;
  }
  const std::string hf = Hf(l, "mlp.experts.") + ex + ".";
  b.GatedFc1(hf + "gate_proj.weight", hf + "up_proj.weight", fc1, s.moe_ffn_hidden, s.hidden,
             p.expert_tp(), ep);
  b.RowParallel(hf + "down_proj.weight", fc2, s.hidden, s.moe_ffn_hidden, p.expert_tp(), ep);
  return b.Take();
}

}  // namespace

uint64_t ConvertUnit::elements() const {
  uint64_t n = 0;
  for (const PlannedTensor& t : tensors) n += t.elements();
  return n;
}

Result<std::vector<ConvertUnit>> PlanConversion(const ModelSpec& s, const ParallelLayout& p) {
  RETURN_IF_ERROR(ValidateLayout(s, p));
  const int64_t padded = p.PaddedVocab(s.vocab);
  std::vector<ConvertUnit> plan;
  UnitBuilder emb("embeddings");
  emb.VocabParallel("model.embed_tokens.weight", "embedding.word_embeddings.weight", s.vocab,
                    padded, s.hidden, p.tp);
  plan.push_back(emb.Take());
  for (int64_t l = 0; l < s.num_layers; ++l) {
    plan.push_back(Attention(s, p, l));
    if (!s.IsMoeLayer(l)) {
      plan.push_back(DenseMlp(s, p, l));
      continue;
    }
    plan.push_back(Router(s, l));
    for (int64_t e = 0; e < s.num_experts; ++e) plan.push_back(Expert(s, p, l, e));
  }
  UnitBuilder norm("final norm");
  norm.Replicated("model.norm.weight", "decoder.final_layernorm.weight", {s.hidden});
  plan.push_back(norm.Take());
  if (!s.tied_embeddings) {
    UnitBuilder head("lm_head");
    head.VocabParallel("lm_head.weight", "output_layer.weight", s.vocab, padded, s.hidden, p.tp);
    plan.push_back(head.Take());
  }
  return plan;
}

uint64_t MaxUnitElements(const std::vector<ConvertUnit>& plan) {
  uint64_t most = 0;
  for (const ConvertUnit& u : plan) most = std::max(most, u.elements());
  return most;
}

}  // namespace dte
