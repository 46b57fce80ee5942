#include "tools/gen/model_spec.h"

#include <cmath>
#include <cstdio>

namespace dte::gen {
namespace {

constexpr double kMlpRatio = 2.75;        // intermediate / hidden
constexpr double kHiddenPerLayer = 64;    // hidden / layers
constexpr double kVocabShare = 0.06;      // embedding share of all params
constexpr int64_t kDefaultVocab = 32000;  // when no target size is given
constexpr int64_t kMaxHidden = 16384;
constexpr int64_t kMaxLayers = 256;

int64_t RoundUp(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

int64_t DefaultHeadDim(int64_t hidden) {
  if (hidden < 512) return 32;
  return hidden < 2048 ? 64 : 128;
}

int64_t DefaultKvHeads(int64_t heads) {
  if (heads % 4 == 0) return heads / 4;
  return heads % 2 == 0 ? heads / 2 : heads;
}

// Fills head_dim, heads and kv_heads for `hidden`; false if they don't fit.
bool CompleteHeads(const ModelDims& fixed, int64_t hidden, ModelDims* dims) {
  dims->hidden = hidden;
  if (fixed.head_dim > 0) {
    dims->head_dim = fixed.head_dim;
  } else if (fixed.heads > 0) {
    dims->head_dim = hidden / fixed.heads;
  } else {
    dims->head_dim = DefaultHeadDim(hidden);
  }
  if (dims->head_dim <= 0) return false;
  if (fixed.heads == 0 && hidden % dims->head_dim != 0) return false;
  dims->heads = fixed.heads > 0 ? fixed.heads : hidden / dims->head_dim;
  dims->kv_heads = fixed.kv_heads > 0 ? fixed.kv_heads : DefaultKvHeads(dims->heads);
  return dims->kv_heads > 0 && dims->heads % dims->kv_heads == 0;
}

double Score(const ModelDims& d, double target_params) {
  double total = static_cast<double>(ParamCount(d));
  double h = static_cast<double>(d.hidden);
  return std::abs(std::log(static_cast<double>(d.intermediate) / (h * kMlpRatio))) +
         0.5 * std::abs(std::log(h / (static_cast<double>(d.layers) * kHiddenPerLayer))) +
         10 * std::abs(std::log(total / target_params));
}

// Best layers/intermediate for a fixed hidden size; false if none fits.
bool BestForHidden(const ModelDims& fixed, const ModelDims& base, double params, ModelDims* best,
                   double* best_score) {
  bool found = false;
  int64_t first = fixed.layers > 0 ? fixed.layers : 1;
  int64_t last = fixed.layers > 0 ? fixed.layers : kMaxLayers;
  for (int64_t layers = first; layers <= last; ++layers) {
    ModelDims d = base;
    d.layers = layers;
    d.intermediate = 0;
    uint64_t without_mlp = ParamCount(d);
    if (fixed.intermediate > 0) {
      d.intermediate = fixed.intermediate;
    } else {
      double rest = params - static_cast<double>(without_mlp);
      double per = 3.0 * static_cast<double>(d.hidden * layers);
      d.intermediate = std::llround(rest / per / 32) * 32;
      if (d.intermediate < 32) break;  // more layers only leave less room
    }
    double score = Score(d, params);
    if (!found || score < *best_score) {
      *best = d;
      *best_score = score;
      found = true;
    }
  }
  return found;
}

Result<ModelDims> SearchDims(uint64_t target_bytes, const ModelDims& fixed) {
  double params = static_cast<double>(target_bytes) / 2;
  int64_t first = fixed.hidden > 0 ? fixed.hidden : 64;
  int64_t last = fixed.hidden > 0 ? fixed.hidden : kMaxHidden;
  int64_t step = fixed.hidden > 0 ? 1 : 64;
  ModelDims best;
  double best_score = 0;
  bool found = false;
  for (int64_t hidden = first; hidden <= last; hidden += step) {
    ModelDims d = fixed;
    if (!CompleteHeads(fixed, hidden, &d)) continue;
    if (fixed.heads == 0 && fixed.kv_heads == 0 && d.heads % 4 != 0) continue;  // keep 4:1 GQA
    if (fixed.vocab == 0) {
      int64_t vocab = RoundUp(std::llround(kVocabShare * params / static_cast<double>(hidden)), 64);
      d.vocab = std::min<int64_t>(std::max<int64_t>(vocab, 512), 152064);
    }
    ModelDims candidate;
    double score = 0;
    if (!BestForHidden(fixed, d, params, &candidate, &score)) continue;
    if (!found || score < best_score) {
      best = candidate;
      best_score = score;
      found = true;
    }
  }
  if (!found) return InvalidArgument("no model shape reaches the requested size with these dims");
  return best;
}

Status CheckDims(const ModelDims& d) {
  if (d.hidden <= 0 || d.layers <= 0 || d.intermediate <= 0 || d.heads <= 0 || d.kv_heads <= 0 ||
      d.head_dim <= 0 || d.vocab <= 0) {
    return InvalidArgument("model dims must be positive: " + DescribeDims(d));
  }
  if (d.heads % d.kv_heads != 0) {
    return InvalidArgument("heads (" + std::to_string(d.heads) +
                           ") must be a multiple of kv heads (" + std::to_string(d.kv_heads) + ")");
  }
  for (const TensorSpec& t : BuildTensorList(d, false)) {
    if (t.elements() >= (1ull << 32)) {
      return InvalidArgument("tensor " + t.name + " has 2^32 or more elements");
    }
  }
  return Status::Ok();
}

TensorSpec Spec(std::string name, std::vector<int64_t> shape, TensorRole role) {
  return TensorSpec{std::move(name), DType::kBF16, std::move(shape), role};
}

}  // namespace

uint64_t TensorSpec::elements() const {
  uint64_t n = 1;
  for (int64_t s : shape) n *= static_cast<uint64_t>(s);
  return n;
}

uint64_t ParamCount(const ModelDims& d) {
  uint64_t h = d.hidden;
  uint64_t q = d.heads * d.head_dim;
  uint64_t kv = d.kv_heads * d.head_dim;
  uint64_t per_layer = 2 * q * h + 2 * kv * h + 3 * h * d.intermediate + 2 * h;
  uint64_t embed = d.vocab * h * (d.tied_embeddings ? 1 : 2);
  return embed + d.layers * per_layer + h;
}

Result<ModelDims> ChooseDims(uint64_t target_bytes, const ModelDims& fixed) {
  ModelDims dims = fixed;
  if (target_bytes > 0) {
    ASSIGN_OR_RETURN(dims, SearchDims(target_bytes, fixed));
  } else {
    if (fixed.hidden <= 0 || fixed.layers <= 0) {
      return InvalidArgument("give --size, or at least --hidden and --layers");
    }
    if (!CompleteHeads(fixed, fixed.hidden, &dims)) {
      return InvalidArgument("cannot split hidden " + std::to_string(fixed.hidden) +
                             " into heads; give --heads, --kv-heads and --head-dim");
    }
    if (dims.intermediate <= 0) {
      dims.intermediate = RoundUp(std::llround(kMlpRatio * static_cast<double>(dims.hidden)), 32);
    }
    if (dims.vocab <= 0) dims.vocab = kDefaultVocab;
  }
  RETURN_IF_ERROR(CheckDims(dims));
  return dims;
}

std::vector<TensorSpec> BuildTensorList(const ModelDims& d, bool dtype_mix) {
  const int64_t h = d.hidden;
  const int64_t q = d.heads * d.head_dim;
  const int64_t kv = d.kv_heads * d.head_dim;
  const DType norm_dtype = dtype_mix ? DType::kF32 : DType::kBF16;
  std::vector<TensorSpec> out;
  out.push_back(Spec("model.embed_tokens.weight", {d.vocab, h}, TensorRole::kEmbedding));
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    out.push_back(Spec(p + "self_attn.q_proj.weight", {q, h}, TensorRole::kAttention));
    out.push_back(Spec(p + "self_attn.k_proj.weight", {kv, h}, TensorRole::kAttention));
    out.push_back(Spec(p + "self_attn.v_proj.weight", {kv, h}, TensorRole::kAttention));
    out.push_back(Spec(p + "self_attn.o_proj.weight", {h, q}, TensorRole::kAttention));
    out.push_back(Spec(p + "mlp.gate_proj.weight", {d.intermediate, h}, TensorRole::kMlp));
    out.push_back(Spec(p + "mlp.up_proj.weight", {d.intermediate, h}, TensorRole::kMlp));
    out.push_back(Spec(p + "mlp.down_proj.weight", {h, d.intermediate}, TensorRole::kMlp));
    out.push_back(Spec(p + "input_layernorm.weight", {h}, TensorRole::kNorm));
    out.push_back(Spec(p + "post_attention_layernorm.weight", {h}, TensorRole::kNorm));
    out[out.size() - 2].dtype = norm_dtype;
    out.back().dtype = norm_dtype;
  }
  out.push_back(Spec("model.norm.weight", {h}, TensorRole::kNorm));
  out.back().dtype = norm_dtype;
  if (!d.tied_embeddings) out.push_back(Spec("lm_head.weight", {d.vocab, h}, TensorRole::kLmHead));
  if (dtype_mix) {
    out.push_back(Spec("model.position_ids", {1, kMaxPositions}, TensorRole::kBuffer));
    out.back().dtype = DType::kI64;
  }
  return out;
}

std::string DescribeDims(const ModelDims& d) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "hidden %lld, %lld layers, intermediate %lld, %lld heads x %lld (kv %lld), "
                "vocab %lld%s, %.1fM params",
                static_cast<long long>(d.hidden), static_cast<long long>(d.layers),
                static_cast<long long>(d.intermediate), static_cast<long long>(d.heads),
                static_cast<long long>(d.head_dim), static_cast<long long>(d.kv_heads),
                static_cast<long long>(d.vocab), d.tied_embeddings ? " (tied)" : "",
                static_cast<double>(ParamCount(d)) / 1e6);
  return buf;
}

}  // namespace dte::gen
