#include "tools/gen/shard_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "tools/gen/hf_files.h"

namespace dte::gen {
namespace {

// Groups spec indices into shards, in state-dict order.
std::vector<std::vector<size_t>> GroupIntoShards(const std::vector<TensorSpec>& specs,
                                                 uint64_t max_shard_bytes) {
  std::vector<std::vector<size_t>> groups(1);
  uint64_t current = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    uint64_t bytes = specs[i].bytes();
    if (!groups.back().empty() && current + bytes > max_shard_bytes) {
      groups.emplace_back();
      current = 0;
    }
    groups.back().push_back(i);
    current += bytes;
  }
  return groups;
}

std::string ShardName(size_t index, size_t count) {
  if (count == 1) return kSingleFileName;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

// Orders one shard's tensors as the Python writer lays them out and builds
// its header; fills the placements of its tensors.
ShardPlan LayOutShard(const std::vector<TensorSpec>& specs, std::vector<size_t> group, size_t shard,
                      std::vector<TensorPlacement>* placements) {
  std::sort(group.begin(), group.end(), [&](size_t a, size_t b) {
    int wa = DTypeWidth(specs[a].dtype), wb = DTypeWidth(specs[b].dtype);
    return wa != wb ? wa > wb : specs[a].name < specs[b].name;
  });
  std::vector<TensorInfo> infos;
  uint64_t offset = 0;
  for (size_t i : group) {
    TensorInfo info;
    info.name = specs[i].name;
    info.dtype = specs[i].dtype;
    info.shape = specs[i].shape;
    info.begin = offset;
    info.end = offset + specs[i].bytes();
    offset = info.end;
    infos.push_back(std::move(info));
  }
  ShardPlan plan;
  plan.header = BuildSafetensorsHeader(infos, {{"format", "pt"}});
  plan.file_size = plan.header.size() + offset;
  for (size_t k = 0; k < group.size(); ++k) {
    (*placements)[group[k]] = {shard, plan.header.size() + infos[k].begin};
  }
  plan.tensors = std::move(group);
  return plan;
}

}  // namespace

CheckpointPlan PlanCheckpoint(const std::vector<TensorSpec>& specs, uint64_t max_shard_bytes) {
  CheckpointPlan plan;
  plan.placements.resize(specs.size());
  std::vector<std::vector<size_t>> groups = GroupIntoShards(specs, max_shard_bytes);
  std::map<std::string, std::string> weight_map;
  for (size_t s = 0; s < groups.size(); ++s) {
    ShardPlan shard = LayOutShard(specs, groups[s], s, &plan.placements);
    shard.file_name = ShardName(s, groups.size());
    for (size_t i : shard.tensors) {
      weight_map[specs[i].name] = shard.file_name;
      plan.total_size += specs[i].bytes();
    }
    plan.shards.push_back(std::move(shard));
  }
  if (plan.shards.size() > 1) plan.index_json = IndexJson(plan.total_size, weight_map);
  return plan;
}

}  // namespace dte::gen
