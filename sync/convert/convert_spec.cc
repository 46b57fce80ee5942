// Model specs: parsing a Hugging Face config.json and checking a layout.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sync/convert/convert.h"
#include "sync/convert/convert_matrix.h"

namespace dte {
namespace {

using nlohmann::json;

// What transformers' configuration class of a model type (LlamaConfig,
// Qwen3Config, Qwen3MoeConfig) gives a key that config.json leaves out:
// transformers loads the model with these sizes, so the converter and a
// push's plan do too.
struct HfDefaults {
  const char* model_type;
  const char* architecture;  // how "architectures" names it
  int64_t vocab, hidden, ffn, layers, heads;
  int64_t kv_heads;  // 0: num_attention_heads
  int64_t head_dim;  // 0: hidden_size / num_attention_heads
  int64_t experts, moe_ffn;
};

constexpr HfDefaults kHfDefaults[] = {
    {"llama", "LlamaForCausalLM", 32000, 4096, 11008, 32, 32, 0, 0, 0, 0},
    {"qwen3", "Qwen3ForCausalLM", 151936, 4096, 22016, 32, 32, 32, 128, 0, 0},
    {"qwen3_moe", "Qwen3MoeForCausalLM", 151936, 2048, 6144, 24, 32, 4, 0, 128, 768},
};

const HfDefaults* DefaultsOf(const std::string& model_type) {
  for (const HfDefaults& d : kHfDefaults) {
    if (model_type == d.model_type) return &d;
  }
  return nullptr;
}

std::string Quote(std::string_view key) { return "\"" + std::string(key) + "\""; }

// Reads the keys of one config.json, noting every key that is missing (and
// has no default) or has the wrong type, so that one error names them all.
class ConfigReader {
 public:
  ConfigReader(const json& j, std::string file) : j_(j), file_(std::move(file)) {}

  bool Has(const char* key) const {
    auto it = j_.find(key);
    return it != j_.end() && !it->is_null();
  }
  // The integer at `key`; `fallback` when absent or null (none: required).
  int64_t Int(const char* key, std::optional<int64_t> fallback) {
    if (!Has(key)) {
      if (!fallback) missing_.push_back(Quote(key));
      return fallback.value_or(0);
    }
    const json& v = j_.at(key);
    if (!v.is_number_integer()) {
      bad_.push_back(Quote(key) + " is not an integer");
      return 0;
    }
    return v.get<int64_t>();
  }
  bool Bool(const char* key, bool fallback) {
    if (!Has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_boolean()) {
      bad_.push_back(Quote(key) + " is not a boolean");
      return fallback;
    }
    return v.get<bool>();
  }
  std::vector<int64_t> IntList(const char* key) {
    std::vector<int64_t> out;
    if (!Has(key)) return out;
    const json& v = j_.at(key);
    if (!v.is_array()) {
      bad_.push_back(Quote(key) + " is not a list");
      return out;
    }
    for (const json& x : v) {
      if (!x.is_number_integer()) {
        bad_.push_back(Quote(key) + " holds a non-integer");
        return {};
      }
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
  void Missing(std::string what) { missing_.push_back(std::move(what)); }
  void Bad(std::string what) { bad_.push_back(std::move(what)); }

  // InvalidArgument naming the file and every key missing or bad.
  Status Finish() const {
    if (missing_.empty() && bad_.empty()) return Status::Ok();
    std::string m = file_ + ":";
    for (size_t i = 0; i < missing_.size(); ++i) m += (i ? ", " : " missing ") + missing_[i];
    for (size_t i = 0; i < bad_.size(); ++i) m += (i || !missing_.empty() ? "; " : " ") + bad_[i];
    return InvalidArgument(m);
  }

 private:
  const json& j_;
  std::string file_;
  std::vector<std::string> missing_, bad_;
};

// The model type a config names: "model_type", else the type whose
// architecture is the first entry of "architectures" (an architecture of no
// known type is returned as it is named). nullopt: the config names neither.
std::optional<std::string> ModelTypeOf(const json& j, ConfigReader& r) {
  if (r.Has("model_type")) {
    const json& t = j.at("model_type");
    if (t.is_string()) return t.get<std::string>();
    r.Bad("\"model_type\" is not a string");
    return std::string();
  }
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !arch->front().is_string()) {
    return std::nullopt;
  }
  const std::string a = arch->front().get<std::string>();
  for (const HfDefaults& d : kHfDefaults) {
    if (a == d.architecture) return std::string(d.model_type);
  }
  return a;
}

// The default of `field` when there are defaults, else none (the key is required).
std::optional<int64_t> Default(const HfDefaults* d, int64_t HfDefaults::*field) {
  if (d == nullptr) return std::nullopt;
  return d->*field;
}

// Whether head_dim comes from the config or the defaults (not from hidden_size).
bool HeadDimGiven(const ConfigReader& r, const HfDefaults* d) {
  return r.Has("head_dim") || (d != nullptr && d->head_dim > 0);
}

// Heads, KV heads and head_dim. `hidden` (0: not read) gives head_dim when
// neither the config nor the defaults do.
void ReadAttention(ConfigReader& r, const HfDefaults* d, int64_t hidden, ModelSpec* s) {
  s->num_attention_heads = r.Int("num_attention_heads", Default(d, &HfDefaults::heads));
  const int64_t kv = d != nullptr && d->kv_heads > 0 ? d->kv_heads : s->num_attention_heads;
  s->num_kv_heads = r.Int("num_key_value_heads", kv);
  if (HeadDimGiven(r, d)) {
    s->head_dim = r.Int("head_dim", d != nullptr ? d->head_dim : 0);
  } else if (s->num_attention_heads > 0) {
    s->head_dim = hidden / s->num_attention_heads;
  }
}

void ReadMoe(ConfigReader& r, const HfDefaults& d, ModelSpec* s) {
  s->num_experts = r.Int("num_experts", d.experts);
  s->moe_ffn_hidden = r.Int("moe_intermediate_size", d.moe_ffn);
  s->decoder_sparse_step = r.Int("decoder_sparse_step", 1);
  s->mlp_only_layers = r.IntList("mlp_only_layers");
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
  ConfigReader r(j, file);
  const std::optional<std::string> type = ModelTypeOf(j, r);
  const HfDefaults* d = type ? DefaultsOf(*type) : nullptr;
  if (type && !type->empty() && d == nullptr) {
    return Unimplemented(file + ": model type \"" + *type +
                         "\" has no converter (model_type llama, qwen3, qwen3_moe, or "
                         "architectures LlamaForCausalLM, Qwen3ForCausalLM, "
                         "Qwen3MoeForCausalLM)");
  }
  if (!type) r.Missing("\"model_type\" (or \"architectures\")");
  ModelSpec spec;
  spec.model_type = type.value_or("");
  spec.num_layers = r.Int("num_hidden_layers", Default(d, &HfDefaults::layers));
  spec.hidden = r.Int("hidden_size", Default(d, &HfDefaults::hidden));
  spec.ffn_hidden = r.Int("intermediate_size", Default(d, &HfDefaults::ffn));
  spec.vocab = r.Int("vocab_size", Default(d, &HfDefaults::vocab));
  ReadAttention(r, d, spec.hidden, &spec);
  spec.tied_embeddings = r.Bool("tie_word_embeddings", false);
  const bool attention_bias = r.Bool("attention_bias", false);
  const bool mlp_bias = r.Bool("mlp_bias", false);
  if (spec.model_type == "qwen3_moe") ReadMoe(r, *d, &spec);
  RETURN_IF_ERROR(r.Finish());
  for (auto [bias, set] : {std::pair{"attention_bias", attention_bias}, {"mlp_bias", mlp_bias}}) {
    if (set) return Unimplemented(file + ": \"" + bias + "\" is set; biases have no converter");
  }
  spec.qk_norm = spec.model_type == "qwen3" || spec.model_type == "qwen3_moe";
  return spec;
}

Result<HfAttention> ParseHfAttention(std::string_view text, const std::string& file) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(file + ": not a JSON object");
  ConfigReader r(j, file);
  const std::optional<std::string> type = ModelTypeOf(j, r);
  // Any model type: only the defaults differ (none for a type not known here).
  const HfDefaults* d = type ? DefaultsOf(*type) : nullptr;
  const int64_t hidden =
      HeadDimGiven(r, d) ? 0 : r.Int("hidden_size", Default(d, &HfDefaults::hidden));
  ModelSpec s;
  ReadAttention(r, d, hidden, &s);
  RETURN_IF_ERROR(r.Finish());
  for (auto [v, what] : {std::pair{s.num_attention_heads, "num_attention_heads"},
                         {s.num_kv_heads, "num_key_value_heads"},
                         {s.head_dim, "head_dim"}}) {
    if (v <= 0) {
      return InvalidArgument(file + ": " + what + " must be positive, got " + std::to_string(v));
    }
  }
  return HfAttention{s.num_attention_heads, s.num_kv_heads, s.head_dim};
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
