// How a run's policy moves, from a store's manifests and block tables alone
// (no record payload is decoded): per version, the changed elements and
// stored bytes of each tensor, or grouped by layer index, by kind of tensor
// (q_proj, mlp, norm, embedding, ...) or for the whole version. What
// `dtectl stats` prints (docs/cli.md).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"
#include "store/manifest.h"
#include "store/store.h"

namespace dte {

enum class StatsGroup { kTensor, kLayer, kKind, kLayerKind, kVersion };

// "tensor", "layer", "kind", "layer-kind" (groups "LAYER/KIND", "-/KIND"
// outside the layers), "version"; nullopt for anything else.
std::optional<StatsGroup> ParseStatsGroup(const std::string& text);

// The kind of a Hugging Face tensor name: q_proj, k_proj, v_proj, o_proj,
// qkv_proj, mlp (gate, up, down, fused gate_up, experts, router), norm,
// embedding, lm_head, or other.
std::string TensorKind(const std::string& name);

// The decoder layer index in a Hugging Face tensor name ("...layers.N...");
// nullopt for tensors outside the layers (embeddings, final norm, head).
std::optional<uint64_t> TensorLayer(const std::string& name);

// One group of tensors of one version.
struct StatsRow {
  uint64_t version = 0;
  // How the version is stored: "anchor" (whole, no parent), "full" (a delta
  // that also carries a full table: a policy anchor) or "delta".
  std::string stored_as;
  std::string group;  // tensor name, layer index ("-": no layer), kind, or "all"
  uint64_t tensors = 0;
  uint64_t elements = 0;
  uint64_t changed = 0;  // elements that differ from the parent's (all, for an anchor)
  uint64_t blocks = 0;
  uint64_t blocks_changed = 0;  // block records that are not "same"
  uint64_t stored_bytes = 0;    // the block records' payload bytes
  uint64_t dense_bytes = 0;     // the tensors' bytes
  // Bytes of the blobs the version added, whatever the group (what
  // `dtectl log` shows: records, a full table, block table, headers).
  uint64_t version_stored_bytes = 0;
};

// The rows of version v grouped `by`, in the version's tensor order (by
// tensor), ascending layer ("-" last), kind name order, or one row.
// Corruption naming the version and tensor if its block table does not
// cover its tensors.
Result<std::vector<StatsRow>> VersionStats(const Version& v, StatsGroup by);

// Versions A..B (inclusive), A.. (A and later), ..B, or one version A;
// numbers or vNNNNNNNN. InvalidArgument naming the text otherwise.
struct VersionRange {
  std::optional<uint64_t> first, last;
};
Result<VersionRange> ParseVersionRange(const std::string& text);

// The versions of `listed` (number -> key, as Store::ListVersions gives)
// that `range` selects. NotFound naming the store when it has no versions,
// or naming the version when a bound of the range is not one of them.
Result<std::vector<std::pair<uint64_t, std::string>>> SelectVersions(
    const std::map<uint64_t, std::string>& listed, const VersionRange& range,
    const std::string& store_uri);

// How one tensor differs between two versions. Only blocks whose hashes
// differ are read (materialized from the store) and compared.
struct TensorDiff {
  std::string name;
  std::string status;  // "same", "differs", or "layout differs" / "only in A" / "only in B"
  DType dtype = DType::kU8;
  uint64_t elements = 0;
  uint64_t differ = 0;       // elements whose bits differ
  uint64_t blocks_read = 0;  // blocks (of each version) whose hashes differ
  // Floating-point tensors: the distance of each differing element in
  // units in the last place of its dtype (the distance between the two bit
  // patterns in the order of the values): ulps[k] counts distances in
  // (2^(k-1), 2^k] (ulps[0]: exactly 1), ulps[kDiffBuckets] larger ones;
  // `nan` counts pairs where either value is a NaN. max_ulp over the rest.
  static constexpr int kDiffBuckets = 16;
  bool floating = false;
  std::vector<uint64_t> ulps;
  uint64_t nan = 0;
  uint64_t max_ulp = 0;
};

// Every tensor of versions a and b of `store`, in a's tensor order (then
// those only in b). Errors name the version, tensor and block.
Result<std::vector<TensorDiff>> DiffVersions(Store& store, uint64_t a, uint64_t b);

}  // namespace dte
