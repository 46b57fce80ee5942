// Megatron-Core -> Hugging Face converters (Llama, Qwen3, Qwen3-MoE).
//
// A trainer holds its weights as Megatron-Core (MCore) tensors, sharded over
// tensor-parallel (TP) and expert-parallel (EP) ranks, with fused layouts
// (QKV in one GQA-grouped matrix, gate and up in one fc1). dte stores the
// canonical Hugging Face tensors. The conversion is planned once per model
// and layout as a list of units, each one HF-visible group (a layer's
// attention, a layer's MLP, one expert, the embeddings, ...). A unit lists
// the HF tensors it yields, the MCore shards it reads, and the rectangular
// block copies between them; running it gathers its shards from a
// ShardSource and returns its HF tensors, so at most one unit's HF tensors
// are held at a time (docs/converters.md has every mapping and the bound).
//
// Every tensor is viewed as a row-major matrix: rows = shape[0], cols = the
// product of the other dimensions (1 for vectors). Elements are copied as
// raw bits; any 2-byte or 4-byte dtype works (BF16, FP16, FP32 master
// weights), all shards of one HF tensor must share it.
//
// Thread-safety: plain values and pure functions. A ShardSource is used from
// the calling thread only.
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"

namespace dte {

// The architecture, as a Hugging Face config.json describes it.
struct ModelSpec {
  std::string model_type;  // "llama", "qwen3" or "qwen3_moe"
  int64_t num_layers = 0;
  int64_t hidden = 0;
  int64_t num_attention_heads = 0;
  int64_t num_kv_heads = 0;  // GQA groups; equal to num_attention_heads for MHA
  int64_t head_dim = 0;
  int64_t ffn_hidden = 0;  // intermediate_size of dense MLPs
  int64_t vocab = 0;
  int64_t num_experts = 0;  // 0: dense model
  int64_t moe_ffn_hidden = 0;
  int64_t decoder_sparse_step = 1;       // Qwen3-MoE: every n-th layer is sparse
  std::vector<int64_t> mlp_only_layers;  // Qwen3-MoE: layers kept dense
  bool tied_embeddings = false;          // lm_head shares embed_tokens
  bool qk_norm = false;                  // per-head RMSNorm of q and k (Qwen3)

  bool IsMoeLayer(int64_t layer) const;
};

// How MCore names its layer norms: Transformer Engine fuses the pre-attention
// norm into linear_qkv and the pre-MLP norm of dense layers into linear_fc1
// (`layer_norm_weight`); the local spec keeps input_layernorm and
// pre_mlp_layernorm modules. MoE layers have pre_mlp_layernorm in both.
enum class McoreNorms { kTransformerEngine, kLocal };
// How MCore names experts: SequentialMLP `experts.local_experts.{i}.linear_fc1
// .weight`, or TEGroupedMLP `experts.linear_fc1.weight{i}`.
enum class McoreExperts { kSequential, kGrouped };

// The trainer's parallel layout. Pipeline parallelism is not modelled: a
// source must present global layer numbers.
struct ParallelLayout {
  int tp = 1;
  int ep = 1;
  int etp = 0;                       // expert tensor parallelism; 0: same as tp
  int64_t vocab_divisible_by = 128;  // --make-vocab-size-divisible-by
  McoreNorms norms = McoreNorms::kTransformerEngine;
  McoreExperts experts = McoreExperts::kSequential;

  int expert_tp() const { return etp > 0 ? etp : tp; }
  // Rows of the MCore embedding and output layer: vocab rounded up to a
  // multiple of vocab_divisible_by * tp, as Megatron pads it.
  int64_t PaddedVocab(int64_t vocab) const;
};

// Reads the fields of a HF config.json (`file` names it in errors). The
// model type is "model_type", else the first entry of "architectures"
// (LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM); a key the file
// leaves out takes the default of transformers' configuration class for that
// type (LlamaConfig, Qwen3Config, Qwen3MoeConfig), as transformers would load
// it. Accepts llama, qwen3 and qwen3_moe (Unimplemented otherwise) and
// rejects attention or MLP biases. InvalidArgument names every key that is
// missing (a config naming no model type has no defaults) or of the wrong
// type at once.
Result<ModelSpec> ParseHfConfig(std::string_view json, const std::string& file);

// What attention heads look like: all a receiver's transfer plan needs.
struct HfAttention {
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};

// The attention geometry of a HF config.json of any model type: heads,
// num_key_value_heads (default: heads), head_dim (default: transformers'
// for a known type, else hidden_size / heads). InvalidArgument names every
// key missing at once.
Result<HfAttention> ParseHfAttention(std::string_view json, const std::string& file);

// Checks that `spec` is consistent and can be sharded as `layout` says:
// positive sizes, heads divisible by KV heads, KV heads divisible by TP
// (Megatron-Core gives every TP rank whole KV groups and refuses fewer groups
// than ranks), FFN widths divisible by TP / expert TP, experts by EP.
Status ValidateLayout(const ModelSpec& spec, const ParallelLayout& layout);

// One MCore shard: a parameter name as in the MCore state dict and the rank
// that holds it. Tensors replicated over ranks are read from tp 0, ep 0;
// non-expert tensors always from ep 0.
struct ShardKey {
  std::string name;
  int tp_rank = 0;
  int ep_rank = 0;
  auto operator<=>(const ShardKey&) const = default;
  std::string ToString() const;  // "name (tp rank 1, ep rank 0)"
};

struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t elements() const;
};

struct PlannedShard {
  ShardKey key;
  std::vector<int64_t> shape;
  uint64_t elements() const;
};

// Copies a rows x cols block between HF tensor `tensor` and shard `shard` of
// the same unit (indices into ConvertUnit::tensors / shards).
struct BlockCopy {
  uint32_t tensor = 0;
  uint32_t shard = 0;
  int64_t tensor_row = 0, tensor_col = 0;
  int64_t shard_row = 0, shard_col = 0;
  int64_t rows = 0, cols = 0;
};

// Every element of every tensor is written by exactly one copy; a shard
// element is read by at most one (vocab padding rows by none).
struct ConvertUnit {
  std::string label;  // "layer 3 attention", "layer 2 expert 17", ...
  std::vector<PlannedTensor> tensors;
  std::vector<PlannedShard> shards;
  std::vector<BlockCopy> copies;
  uint64_t elements() const;  // HF elements: the unit's output size
};

// The units in HF order: embeddings; per layer attention, then MLP (dense) or
// router followed by each expert (MoE); final norm; lm_head unless tied.
Result<std::vector<ConvertUnit>> PlanConversion(const ModelSpec& spec,
                                                const ParallelLayout& layout);

// The largest unit's element count: the converter's peak extra memory is
// this times the element width.
uint64_t MaxUnitElements(const std::vector<ConvertUnit>& plan);

// A borrowed view of one shard. `bytes` must stay valid while the view (or
// `owner`, which a source may use to keep copied bytes alive) exists.
struct ShardView {
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::string_view bytes;
  std::shared_ptr<const void> owner;
};

// Yields MCore shards by key. Get returns NotFound for a shard it lacks.
class ShardSource {
 public:
  virtual ~ShardSource() = default;
  virtual Result<ShardView> Get(const ShardKey& key) = 0;
};

// A tensor with its element bytes (little-endian), on either side.
struct TensorData {
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::string data;
};

struct HfTensor {
  std::string name;
  TensorData tensor;
};

// Runs one unit: reads its shards from `source`, checks each (dtype width 2
// or 4, one dtype per HF tensor, exact shape), and returns its HF tensors in
// plan order. Errors name the unit, the MCore tensor and its ranks.
Result<std::vector<HfTensor>> RunUnit(const ConvertUnit& unit, ShardSource& source);

struct ConvertStats {
  uint64_t units = 0;
  uint64_t tensors = 0;
  uint64_t bytes = 0;       // HF bytes produced
  uint64_t peak_bytes = 0;  // most HF bytes the converter held at once
};

// Runs every unit in order, handing each unit's tensors to `sink` and
// dropping them when it returns. Stops at the first error.
using UnitSink = std::function<Status(const ConvertUnit&, std::vector<HfTensor>&)>;
Status ConvertToHf(std::span<const ConvertUnit> plan, ShardSource& source, const UnitSink& sink,
                   ConvertStats* stats = nullptr);

// The inverse: shards a full HF state as `plan` lays it out. Shard elements
// no copy writes (vocab padding) are zero. Fails naming the HF tensor that is
// missing or has the wrong shape or dtype width.
using McoreState = std::map<ShardKey, TensorData>;
Result<McoreState> ShardHfState(const std::vector<ConvertUnit>& plan,
                                const std::map<std::string, TensorData>& hf);

// A ShardSource over an in-memory state (views into `state`, which must
// outlive the source).
class McoreStateSource : public ShardSource {
 public:
  explicit McoreStateSource(const McoreState* state) : state_(state) {}
  Result<ShardView> Get(const ShardKey& key) override;

 private:
  const McoreState* state_;
};

}  // namespace dte
