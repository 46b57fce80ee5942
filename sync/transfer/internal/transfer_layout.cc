#include "sync/transfer/internal/transfer_layout.h"

#include <algorithm>
#include <map>
#include <string_view>

namespace dte::transfer_internal {
namespace {

struct Rule {
  std::string_view module;  // the name's text before ".weight" / ".bias"
  Role role;
  bool weight_only;  // the rule applies to ".weight" only
};

// Suffix rules; the first match wins.
constexpr Rule kRules[] = {
    {"self_attn.q_proj", Role::kQ, false},
    {"self_attn.k_proj", Role::kK, false},
    {"self_attn.v_proj", Role::kV, false},
    {"mlp.gate_proj", Role::kGate, false},
    {"mlp.up_proj", Role::kUp, false},
    {"self_attn.o_proj", Role::kRowParallel, true},
    {"mlp.down_proj", Role::kRowParallel, true},
    {"embed_tokens", Role::kVocab, true},
    {"lm_head", Role::kVocab, true},
};

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

Status TensorError(const PlanTensor& t, const std::string& what) {
  return InvalidArgument("transfer plan: tensor '" + t.name + "': " + what);
}

std::string Str(uint64_t v) { return std::to_string(v); }

// Rows of one rank's q part and k (= v) part.
uint64_t QRowsPerRank(const AttentionGeometry& g, int tp) { return g.num_heads / tp * g.head_dim; }
uint64_t KvHeadsPerRank(const AttentionGeometry& g, int tp) {
  return g.num_kv_heads >= static_cast<uint64_t>(tp) ? g.num_kv_heads / tp : 1;
}

std::string FusedName(const Classified& c) {
  const bool attn = c.role == Role::kQ || c.role == Role::kK || c.role == Role::kV;
  return c.prefix + (attn ? "qkv_proj." : "gate_up_proj.") + c.param;
}

Status CheckAttention(const PlanTensor& t, const Classified& c, const AttentionGeometry& g,
                      int tp) {
  if (g.num_heads == 0 || g.num_kv_heads == 0 || g.head_dim == 0) {
    return TensorError(t, "attention geometry (heads, kv heads, head dim) must be non-zero");
  }
  const uint64_t heads = c.role == Role::kQ ? g.num_heads : g.num_kv_heads;
  if (t.shape[0] != heads * g.head_dim) {
    return TensorError(t, "has " + Str(t.shape[0]) + " rows, expected " + Str(heads) + " heads x " +
                              Str(g.head_dim));
  }
  if (c.role == Role::kQ && g.num_heads % tp != 0) {
    return TensorError(t, Str(g.num_heads) + " heads do not split over tp " + Str(tp));
  }
  const uint64_t kv = g.num_kv_heads;
  if (c.role != Role::kQ && kv >= static_cast<uint64_t>(tp) && kv % tp != 0) {
    return TensorError(t, Str(kv) + " kv heads do not split over tp " + Str(tp));
  }
  if (c.role != Role::kQ && kv < static_cast<uint64_t>(tp) && tp % kv != 0) {
    return TensorError(t, "tp " + Str(tp) + " is not a multiple of " + Str(kv) + " kv heads");
  }
  return Status::Ok();
}

Status CheckOne(const PlanTensor& t, const Classified& c, const AttentionGeometry& g, int tp) {
  if (t.shape.empty() || t.shape.size() > static_cast<size_t>(kernels::kRemapMaxDims)) {
    return TensorError(t, "has " + Str(t.shape.size()) + " dimensions, supported 1 to " +
                              Str(kernels::kRemapMaxDims));
  }
  switch (c.role) {
    case Role::kQ:
    case Role::kK:
    case Role::kV:
      return CheckAttention(t, c, g, tp);
    case Role::kGate:
    case Role::kUp:
      if (t.shape[0] % tp != 0) {
        return TensorError(t, Str(t.shape[0]) + " rows do not split over tp " + Str(tp));
      }
      return Status::Ok();
    case Role::kRowParallel:
      if (t.shape.size() != 2 || t.shape[1] % tp != 0) {
        return TensorError(
            t, "row-parallel weight must be 2-D with columns divisible by tp " + Str(tp));
      }
      return Status::Ok();
    default:
      return Status::Ok();
  }
}

bool SameTrailing(const PlanTensor& a, const PlanTensor& b) {
  return a.dtype == b.dtype && a.shape.size() == b.shape.size() &&
         std::equal(a.shape.begin() + 1, a.shape.end(), b.shape.begin() + 1);
}

// Every member of a fused group must be present and agree in dtype and
// trailing dimensions (and gate/up in rows).
Status CheckFusedPartners(const std::vector<PlanTensor>& canonical,
                          const std::vector<Classified>& classes, const ShardLayout& layout) {
  std::map<std::string, std::vector<size_t>> groups;  // fused name -> members
  for (size_t i = 0; i < canonical.size(); ++i) {
    const Role r = classes[i].role;
    const bool qkv = r == Role::kQ || r == Role::kK || r == Role::kV;
    const bool gate_up = r == Role::kGate || r == Role::kUp;
    if ((qkv && layout.fuse_qkv) || (gate_up && layout.fuse_gate_up)) {
      groups[FusedName(classes[i])].push_back(i);
    }
  }
  for (const auto& [fused, members] : groups) {
    const PlanTensor& first = canonical[members[0]];
    const bool qkv = classes[members[0]].role == Role::kQ || classes[members[0]].role == Role::kK ||
                     classes[members[0]].role == Role::kV;
    const size_t want = qkv ? 3 : 2;
    if (members.size() != want) {
      return TensorError(first, "fused into '" + fused + "' but its " +
                                    (qkv ? "q/k/v" : "gate/up") + " partners are missing");
    }
    for (size_t m : members) {
      const PlanTensor& t = canonical[m];
      if (!SameTrailing(first, t) || (!qkv && t.shape[0] != first.shape[0])) {
        return TensorError(t, "disagrees with '" + first.name + "' in dtype or shape, so '" +
                                  fused + "' cannot be formed");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Classified> Classify(const PlanTensor& t) {
  for (std::string_view param : {std::string_view("weight"), std::string_view("bias")}) {
    const std::string tail = "." + std::string(param);
    if (!EndsWith(t.name, tail)) continue;
    const std::string_view stem = std::string_view(t.name).substr(0, t.name.size() - tail.size());
    for (const Rule& rule : kRules) {
      if (!EndsWith(stem, rule.module)) continue;
      if (stem.size() > rule.module.size() && stem[stem.size() - rule.module.size() - 1] != '.') {
        continue;  // "xembed_tokens" is not "embed_tokens"
      }
      if (rule.weight_only && param != "weight") break;  // a bias: replicated below
      // The prefix keeps the parent module ("self_attn.", "mlp.") so the fused
      // name is prefix + "qkv_proj" / "gate_up_proj".
      const std::string_view module = rule.module.substr(rule.module.find('.') + 1);
      return Classified{rule.role, std::string(stem.substr(0, stem.size() - module.size())),
                        std::string(param)};
    }
  }
  const bool norm = t.name.find("norm") != std::string::npos;
  const bool row_parallel_bias =
      EndsWith(t.name, "o_proj.bias") || EndsWith(t.name, "down_proj.bias");
  if (norm || row_parallel_bias) return Classified{Role::kReplicated, "", ""};
  return TensorError(t,
                     "no layout rule (expected q/k/v/o_proj, gate/up/down_proj, "
                     "embed_tokens, lm_head or a norm)");
}

Status ValidateLayout(const std::vector<PlanTensor>& canonical,
                      const std::vector<Classified>& classes, const AttentionGeometry& g,
                      const ShardLayout& layout) {
  for (size_t i = 0; i < canonical.size(); ++i) {
    RETURN_IF_ERROR(CheckOne(canonical[i], classes[i], g, layout.tp));
  }
  return CheckFusedPartners(canonical, classes, layout);
}

namespace {

// A q, k or v piece in the fused qkv tensor, a gate or up piece in the
// fused gate_up tensor, when the layout fuses them: its rows' place there.
void PlaceInFused(const PlanTensor& t, const Classified& c, const ShardLayout& layout,
                  uint64_t q_rows, uint64_t kv_rows, Piece* p) {
  const bool qkv = c.role == Role::kQ || c.role == Role::kK || c.role == Role::kV;
  const bool gate_up = c.role == Role::kGate || c.role == Role::kUp;
  if (qkv && layout.fuse_qkv) {
    p->local.name = FusedName(c);
    p->local.shape[0] = q_rows + 2 * kv_rows;
    p->local_start[0] = c.role == Role::kQ ? 0 : c.role == Role::kK ? q_rows : q_rows + kv_rows;
  } else if (gate_up && layout.fuse_gate_up) {
    const uint64_t rows = t.shape[0] / layout.tp;
    p->local.name = FusedName(c);
    p->local.shape[0] = 2 * rows;
    p->local_start[0] = c.role == Role::kGate ? 0 : rows;
  }
}

}  // namespace

Piece LocalPiece(const PlanTensor& t, const Classified& c, const AttentionGeometry& g,
                 const ShardLayout& layout, int rank) {
  const int tp = layout.tp;
  const uint64_t r = static_cast<uint64_t>(rank);
  Piece p;
  p.local = t;
  p.box_start.assign(t.shape.size(), 0);
  p.extent = t.shape;
  p.local_start.assign(t.shape.size(), 0);
  auto split_rows = [&](uint64_t start, uint64_t rows) {
    p.box_start[0] = start;
    p.extent[0] = rows;
    p.local.shape[0] = rows;
  };
  const uint64_t q_rows = QRowsPerRank(g, tp);
  const uint64_t kv_rows = KvHeadsPerRank(g, tp) * g.head_dim;
  switch (c.role) {
    case Role::kQ:
      split_rows(r * q_rows, q_rows);
      break;
    case Role::kK:
    case Role::kV: {
      // With fewer kv heads than ranks, rank r holds head r * kv_heads / tp.
      const uint64_t kv = g.num_kv_heads;
      const uint64_t first_head = kv >= static_cast<uint64_t>(tp) ? r * (kv / tp) : r * kv / tp;
      split_rows(first_head * g.head_dim, kv_rows);
      break;
    }
    case Role::kGate:
    case Role::kUp:
      split_rows(r * (t.shape[0] / tp), t.shape[0] / tp);
      break;
    case Role::kRowParallel: {
      const uint64_t cols = t.shape[1] / tp;
      p.box_start[1] = r * cols;
      p.extent[1] = cols;
      p.local.shape[1] = cols;
      break;
    }
    case Role::kVocab: {
      const uint64_t v = t.shape[0];
      const uint64_t per = (v + tp - 1) / tp;
      const uint64_t lo = std::min(v, r * per);
      split_rows(lo, std::min(v, lo + per) - lo);
      p.local.shape[0] = per;  // padded to ceil(V / tp) rows
      break;
    }
    case Role::kReplicated:
      break;
  }
  PlaceInFused(t, c, layout, q_rows, kv_rows, &p);
  return p;
}

}  // namespace dte::transfer_internal
