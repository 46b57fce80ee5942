// Model specs: parsing a Hugging Face config.json and checking a layout.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "sync/convert/convert.h"
#include "sync/convert/internal/convert_matrix.h"

namespace dte {
namespace {

using nlohmann::json;

// An integer field: nullopt if absent (or null), an error if not an integer.
Result<std::optional<int64_t>> OptionalInt(const json& j, const char* key,
                                           const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::optional<int64_t>();
  if (!it->is_number_integer()) {
    return InvalidArgument(file + ": \"" + key + "\" is not an integer");
  }
  return std::optional<int64_t>(it->get<int64_t>());
}

Result<int64_t> RequiredInt(const json& j, const char* key, const std::string& file) {
  ASSIGN_OR_RETURN(std::optional<int64_t> v, OptionalInt(j, key, file));
  if (!v) return InvalidArgument(file + ": missing \"" + key + "\"");
  return *v;
}

Result<bool> OptionalBool(const json& j, const char* key, bool fallback, const std::string& file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return InvalidArgument(file + ": \"" + key + "\" is not a boolean");
  return it->get<bool>();
}

Status ParseMoeFields(const json& j, const std::string& file, ModelSpec* spec) {
  ASSIGN_OR_RETURN(spec->num_experts, RequiredInt(j, "num_experts", file));
  ASSIGN_OR_RETURN(spec->moe_ffn_hidden, RequiredInt(j, "moe_intermediate_size", file));
  ASSIGN_OR_RETURN(std::optional<int64_t> step, OptionalInt(j, "decoder_sparse_step", file));
  spec->decoder_sparse_step = step.value_or(1);
  auto it = j.find("mlp_only_layers");
  if (it != j.end() && !it->is_null()) {
    if (!it->is_array()) return InvalidArgument(file + ": \"mlp_only_layers\" is not a list");
    for (const json& l : *it) {
      if (!l.is_number_integer()) {
        return InvalidArgument(file + ": \"mlp_only_layers\" holds a non-integer");
      }
      spec->mlp_only_layers.push_back(l.get<int64_t>());
    }
  }
  return Status::Ok();
}

Status Positive(int64_t v, const char* what) {
  if (v <= 0)
    return InvalidArgument(std::string(what) + " must be positive, got " + std::to_string(v));
  return Status::Ok();
}

Status Divisible(int64_t a, const char* a_name, int64_t b, const char* b_name) {
  if (a % b != 0) {
    return InvalidArgument(std::string(a_name) + " " + std::to_string(a) + " is not divisible by " +
                           b_name + " " + std::to_string(b));
  }
  return Status::Ok();
}

// How many layers IsMoeLayer calls MoE layers, counted without walking
// every layer: num_layers comes from a caller's config.json.
int64_t MoeLayers(const ModelSpec& s) {
  if (s.num_experts <= 0 || s.decoder_sparse_step <= 0) return 0;
  std::set<int64_t> kept_dense;  // mlp_only_layers that would be sparse
  for (int64_t l : s.mlp_only_layers) {
    if (l >= 0 && l < s.num_layers && (l + 1) % s.decoder_sparse_step == 0) kept_dense.insert(l);
  }
  return s.num_layers / s.decoder_sparse_step - static_cast<int64_t>(kept_dense.size());
}

}  // namespace

bool ModelSpec::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0 || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ParallelLayout::PaddedVocab(int64_t vocab) const {
  int64_t multiple = vocab_divisible_by * tp;
  return (vocab + multiple - 1) / multiple * multiple;
}

std::string ShardKey::ToString() const {
  return name + " (tp rank " + std::to_string(tp_rank) + ", ep rank " + std::to_string(ep_rank) +
         ")";
}

uint64_t PlannedTensor::elements() const { return internal::ShapeElements(shape); }
uint64_t PlannedShard::elements() const { return internal::ShapeElements(shape); }

Result<ModelSpec> ParseHfConfig(std::string_view text, const std::string& file) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(file + ": not a JSON object");
  ModelSpec spec;
  auto type = j.find("model_type");
  if (type == j.end() || !type->is_string()) {
    return InvalidArgument(file + ": missing \"model_type\"");
  }
  spec.model_type = type->get<std::string>();
  const bool qwen3 = spec.model_type == "qwen3" || spec.model_type == "qwen3_moe";
  if (!qwen3 && spec.model_type != "llama") {
    return Unimplemented(file + ": model_type \"" + spec.model_type +
                         "\" has no converter (llama, qwen3, qwen3_moe)");
  }
  ASSIGN_OR_RETURN(spec.num_layers, RequiredInt(j, "num_hidden_layers", file));
  ASSIGN_OR_RETURN(spec.hidden, RequiredInt(j, "hidden_size", file));
  ASSIGN_OR_RETURN(spec.num_attention_heads, RequiredInt(j, "num_attention_heads", file));
  ASSIGN_OR_RETURN(spec.ffn_hidden, RequiredInt(j, "intermediate_size", file));
  ASSIGN_OR_RETURN(spec.vocab, RequiredInt(j, "vocab_size", file));
  ASSIGN_OR_RETURN(std::optional<int64_t> kv, OptionalInt(j, "num_key_value_heads", file));
  spec.num_kv_heads = kv.value_or(spec.num_attention_heads);
  ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, OptionalInt(j, "head_dim", file));
  if (!head_dim && qwen3) return InvalidArgument(file + ": missing \"head_dim\"");
  if (head_dim) {
    spec.head_dim = *head_dim;
  } else if (spec.num_attention_heads > 0) {
    spec.head_dim = spec.hidden / spec.num_attention_heads;
  }
  ASSIGN_OR_RETURN(spec.tied_embeddings, OptionalBool(j, "tie_word_embeddings", false, file));
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    ASSIGN_OR_RETURN(bool has_bias, OptionalBool(j, bias, false, file));
    if (has_bias)
      return Unimplemented(file + ": \"" + bias + "\" is set; biases have no converter");
  }
  spec.qk_norm = qwen3;
  if (spec.model_type == "qwen3_moe") RETURN_IF_ERROR(ParseMoeFields(j, file, &spec));
  return spec;
}

Status ValidateLayout(const ModelSpec& s, const ParallelLayout& p) {
  RETURN_IF_ERROR(Positive(s.num_layers, "num_layers"));
  RETURN_IF_ERROR(Positive(s.hidden, "hidden"));
  RETURN_IF_ERROR(Positive(s.num_attention_heads, "num_attention_heads"));
  RETURN_IF_ERROR(Positive(s.num_kv_heads, "num_kv_heads"));
  RETURN_IF_ERROR(Positive(s.head_dim, "head_dim"));
  RETURN_IF_ERROR(Positive(s.vocab, "vocab"));
  RETURN_IF_ERROR(Positive(p.tp, "tensor parallel size"));
  RETURN_IF_ERROR(Positive(p.ep, "expert parallel size"));
  RETURN_IF_ERROR(Positive(p.vocab_divisible_by, "vocab_divisible_by"));
  // PaddedVocab rounds vocab up to a multiple of vocab_divisible_by * tp:
  // both must fit in 64 bits (the layout comes from callers of the C ABI).
  int64_t multiple = 0, rounded = 0;
  if (__builtin_mul_overflow(p.vocab_divisible_by, int64_t{p.tp}, &multiple) ||
      __builtin_add_overflow(s.vocab, multiple - 1, &rounded)) {
    return InvalidArgument("vocab_divisible_by " + std::to_string(p.vocab_divisible_by) +
                           " times tensor parallel size " + std::to_string(p.tp) + " pads vocab " +
                           std::to_string(s.vocab) + " beyond 64 bits");
  }
  RETURN_IF_ERROR(
      Divisible(s.num_attention_heads, "num_attention_heads", s.num_kv_heads, "num_kv_heads"));
  // Megatron-Core gives each TP rank whole query groups and rejects fewer
  // groups than ranks; so does this converter (no KV replication).
  RETURN_IF_ERROR(Divisible(s.num_kv_heads, "num_kv_heads", p.tp, "tensor parallel size"));
  if (s.num_experts > 0) {
    RETURN_IF_ERROR(Positive(s.decoder_sparse_step, "decoder_sparse_step"));
  }
  const int64_t moe_layers = MoeLayers(s);
  const bool any_dense = moe_layers < s.num_layers;
  const bool any_moe = moe_layers > 0;
  if (any_dense) {
    RETURN_IF_ERROR(Positive(s.ffn_hidden, "ffn_hidden"));
    RETURN_IF_ERROR(Divisible(s.ffn_hidden, "ffn_hidden", p.tp, "tensor parallel size"));
  }
  if (any_moe) {
    RETURN_IF_ERROR(Positive(s.moe_ffn_hidden, "moe_ffn_hidden"));
    RETURN_IF_ERROR(Positive(p.expert_tp(), "expert tensor parallel size"));
    RETURN_IF_ERROR(Divisible(s.moe_ffn_hidden, "moe_ffn_hidden", p.expert_tp(),
                              "expert tensor parallel size"));
    RETURN_IF_ERROR(Divisible(s.num_experts, "num_experts", p.ep, "expert parallel size"));
  } else if (p.ep != 1) {
    return InvalidArgument("expert parallel size " + std::to_string(p.ep) +
                           " given for a model without MoE layers");
  }
  return Status::Ok();
}

}  // namespace dte
