// Layout rules for transfer plans: which box of a canonical tensor one rank
// of a ShardLayout holds, and where in which local tensor it sits.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "sync/transfer/transfer_plan.h"

namespace dte::transfer_internal {

enum class Role {
  kQ,            // self_attn.q_proj: rows split by query heads
  kK,            // self_attn.k_proj: rows split (or replicated) by kv heads
  kV,            // self_attn.v_proj: as k_proj
  kGate,         // mlp.gate_proj: rows split evenly
  kUp,           // mlp.up_proj: as gate_proj
  kRowParallel,  // o_proj, down_proj weights: columns split evenly
  kVocab,        // embed_tokens, lm_head: rows split into ceil(V / tp)
  kReplicated,   // norms, row-parallel biases: every rank holds all of it
};

// A canonical tensor's name split around its projection: for
// "model.layers.3.self_attn.q_proj.weight", role kQ, prefix
// "model.layers.3.self_attn.", param "weight".
struct Classified {
  Role role = Role::kReplicated;
  std::string prefix;
  std::string param;
};

// Fails with InvalidArgument naming the tensor when no rule applies.
Result<Classified> Classify(const PlanTensor& t);

// Checks every canonical tensor against the geometry and the layout: shapes,
// even splits, fused partners present and compatible. Errors name a tensor.
Status ValidateLayout(const std::vector<PlanTensor>& canonical,
                      const std::vector<Classified>& classes, const AttentionGeometry& g,
                      const ShardLayout& layout);

// What one rank holds of one canonical tensor: the box [box_start, +extent)
// in canonical coordinates, stored at local_start of local tensor `local`.
// An extent of 0 in some dimension means the rank holds none of it.
struct Piece {
  PlanTensor local;
  std::vector<uint64_t> box_start;
  std::vector<uint64_t> extent;
  std::vector<uint64_t> local_start;
};

// Requires ValidateLayout to have passed for the same arguments.
Piece LocalPiece(const PlanTensor& t, const Classified& c, const AttentionGeometry& g,
                 const ShardLayout& layout, int rank);

}  // namespace dte::transfer_internal
