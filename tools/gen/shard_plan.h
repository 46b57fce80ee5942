// Where every tensor goes: which shard file and at which byte offset.
//
// Sharding follows Hugging Face's rule: walk the tensors in state-dict order
// and start a new shard when the next tensor would push the current one past
// `max_shard_bytes` (a tensor larger than that gets a shard of its own). One
// shard is written as `model.safetensors` without an index; several as
// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
// Inside a file, tensors are laid out as the Python safetensors writer
// orders them: wider dtypes first, then by name.
//
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/safetensors.h"
#include "tools/gen/model_spec.h"

namespace dte::gen {

inline constexpr char kSingleFileName[] = "model.safetensors";
inline constexpr char kIndexFileName[] = "model.safetensors.index.json";

struct ShardPlan {
  std::string file_name;
  std::vector<size_t> tensors;  // indices into the spec list, in data order
  std::string header;           // 8-byte prefix + JSON, as written
  uint64_t file_size = 0;       // header + data
};

struct TensorPlacement {
  size_t shard = 0;
  uint64_t offset = 0;  // byte offset of the tensor's data in the shard file
};

struct CheckpointPlan {
  std::vector<ShardPlan> shards;
  std::vector<TensorPlacement> placements;  // parallel to the spec list
  uint64_t total_size = 0;                  // tensor bytes, headers excluded
  std::string index_json;                   // empty for a single file
};

CheckpointPlan PlanCheckpoint(const std::vector<TensorSpec>& specs, uint64_t max_shard_bytes);

}  // namespace dte::gen
