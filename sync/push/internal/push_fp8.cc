#include "sync/push/internal/push_fp8.h"

#include <cstring>
#include <map>
#include <set>

#include "kernels/parallel.h"
#include "store/dtype.h"
#include "store/store.h"
#include "sync/push/internal/push_plan.h"

namespace dte::push_internal {

const char* Fp8RuleName(kernels::Fp8ScaleRule rule) {
  return rule == kernels::Fp8ScaleRule::kPowerOfTwo ? "pow2" : "plain";
}

nlohmann::json Fp8OptionsJson(const Fp8ReceiverOptions& o) {
  return {{"block", {o.block_rows, o.block_cols}},
          {"scale_rule", Fp8RuleName(o.rule)},
          {"skip_modules", o.policy.skip_modules},
          {"skip_substrings", o.policy.skip_substrings},
          {"partial_blocks", o.policy.quantize_partial_blocks}};
}

namespace {

Status StringList(const nlohmann::json& j, const char* key, std::vector<std::string>* out) {
  if (!j.contains(key)) return Status::Ok();  // the default policy's
  if (!j[key].is_array()) return InvalidArgument(std::string("fp8.") + key + " is not a list");
  out->clear();
  for (const auto& s : j[key]) {
    if (!s.is_string()) return InvalidArgument(std::string("fp8.") + key + " holds a non-string");
    out->push_back(s.get<std::string>());
  }
  return Status::Ok();
}

}  // namespace

Result<Fp8ReceiverOptions> ParseFp8Options(const nlohmann::json& j) {
  Fp8ReceiverOptions o;
  // j is const: operator[] must only see keys that are there.
  if (!j.is_object() || !j.contains("block") || !j.contains("scale_rule") ||
      !j.at("block").is_array() || j.at("block").size() != 2 ||
      !j.at("block")[0].is_number_unsigned() || !j.at("block")[1].is_number_unsigned() ||
      !j.at("scale_rule").is_string()) {
    return InvalidArgument("fp8 options are not {block: [rows, cols], scale_rule, ...}");
  }
  o.block_rows = j.at("block")[0].get<uint64_t>();
  o.block_cols = j.at("block")[1].get<uint64_t>();
  if (std::string e = Fp8BlockError(o); !e.empty()) return InvalidArgument("fp8 options: " + e);
  const std::string rule = j.at("scale_rule").get<std::string>();
  if (rule != "plain" && rule != "pow2") {
    return InvalidArgument("fp8 scale rule '" + rule + "' is neither plain nor pow2");
  }
  o.rule = rule == "pow2" ? kernels::Fp8ScaleRule::kPowerOfTwo : kernels::Fp8ScaleRule::kPlain;
  RETURN_IF_ERROR(StringList(j, "skip_modules", &o.policy.skip_modules));
  RETURN_IF_ERROR(StringList(j, "skip_substrings", &o.policy.skip_substrings));
  if (j.contains("partial_blocks")) {
    if (!j.at("partial_blocks").is_boolean()) {
      return InvalidArgument("fp8.partial_blocks is not true or false");
    }
    o.policy.quantize_partial_blocks = j.at("partial_blocks").get<bool>();
  }
  return o;
}

std::vector<PlanTensor> Fp8ReceiverTensors(const TransferPlan& plan, const Fp8ReceiverPlan& fp8) {
  const auto& own = plan.receiver_tensors[fp8.rank];
  std::vector<PlanTensor> out(2 * own.size());
  for (size_t rt = 0; rt < own.size(); ++rt) {
    out[rt] = own[rt];
    if (!fp8.tensors[rt].fp8) continue;
    out[rt].dtype = DType::kF8E4M3;
    out[own.size() + rt] = {fp8.tensors[rt].scale_name, DType::kF32, fp8.tensors[rt].scale_shape};
  }
  return out;
}

namespace {

// A tensor given as F8_E4M3 that the plan holds in BF16: refused saying why
// (the decision of its first canonical tensor the policy keeps).
Status CheckNotFp8(const TransferPlan& plan, const Fp8ReceiverPlan& fp8,
                   const std::vector<PlanTensor>& have, const std::string& what) {
  const auto& own = plan.receiver_tensors[fp8.rank];
  for (const PlanTensor& h : have) {
    if (h.dtype != DType::kF8E4M3) continue;
    for (size_t rt = 0; rt < own.size(); ++rt) {
      if (own[rt].name != h.name || fp8.tensors[rt].fp8) continue;
      return InvalidArgument(what + ": tensor " + h.name + " is given as F8_E4M3 but is not held " +
                             "in FP8 (" + std::string(Fp8DecisionName(fp8.tensors[rt].decision)) +
                             ", FP8 block " + std::to_string(fp8.options.block_rows) + " x " +
                             std::to_string(fp8.options.block_cols) + "); give it as " +
                             DTypeName(own[rt].dtype));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<uint32_t>> MatchFp8ReceiverTensors(const TransferPlan& plan,
                                                      const Fp8ReceiverPlan& fp8,
                                                      const std::vector<PlanTensor>& have,
                                                      const std::string& what) {
  RETURN_IF_ERROR(CheckNotFp8(plan, fp8, have, what));
  const std::vector<PlanTensor> slots = Fp8ReceiverTensors(plan, fp8);
  std::vector<PlanTensor> want;
  std::vector<size_t> slot_of;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s].name.empty()) continue;
    want.push_back(slots[s]);
    slot_of.push_back(s);
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> idx, MatchTensors(want, have, what));
  std::vector<uint32_t> out(slots.size(), kNoTensor);
  for (size_t k = 0; k < idx.size(); ++k) out[slot_of[k]] = idx[k];
  return out;
}

std::vector<EntryKind> TensorKinds(const std::vector<PlanTensor>& tensors, bool fp8) {
  std::vector<EntryKind> kinds(tensors.size(), EntryKind::kElements);
  if (!fp8) return kinds;
  std::set<std::string> scales;
  for (const PlanTensor& t : tensors) {
    if (t.dtype == DType::kF8E4M3) scales.insert(Fp8ScaleName(t.name));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].dtype == DType::kF8E4M3) {
      kinds[i] = EntryKind::kFp8Bytes;
    } else if (tensors[i].dtype == DType::kF32 && scales.count(tensors[i].name)) {
      kinds[i] = EntryKind::kFp8Scales;
    }
  }
  return kinds;
}

const char* EntryKindName(EntryKind k) {
  switch (k) {
    case EntryKind::kElements:
      return "elements";
    case EntryKind::kFp8Bytes:
      return "FP8 bytes";
    case EntryKind::kFp8Scales:
      return "FP8 scales";
  }
  return "unknown";
}

Status CheckFp8Tensors(const std::vector<PlanTensor>& tensors, const Fp8ReceiverOptions& o,
                       const std::string& what) {
  if (std::string e = Fp8BlockError(o); !e.empty()) return InvalidArgument(what + ": " + e);
  std::map<std::string, const PlanTensor*> by_name;
  for (const PlanTensor& t : tensors) by_name[t.name] = &t;
  for (const PlanTensor& t : tensors) {
    if (t.dtype != DType::kF8E4M3) continue;
    if (t.shape.size() != 2) {
      return InvalidArgument(what + ": FP8 tensor " + t.name + " is " +
                             std::to_string(t.shape.size()) + "-D; FP8 tensors are 2-D");
    }
    const kernels::Fp8Layout l{t.shape[0], t.shape[1], o.block_rows, o.block_cols, o.rule};
    const std::vector<uint64_t> grid = {l.grid_rows(), l.grid_cols()};
    auto it = by_name.find(Fp8ScaleName(t.name));
    if (it == by_name.end() || it->second->dtype != DType::kF32 || it->second->shape != grid) {
      return InvalidArgument(what + ": FP8 tensor " + t.name + " needs its scales as F32 " +
                             Fp8ScaleName(t.name) + " of shape [" + std::to_string(grid[0]) + ", " +
                             std::to_string(grid[1]) + "] (blocks of " +
                             std::to_string(o.block_rows) + " x " + std::to_string(o.block_cols) +
                             ")");
    }
  }
  return Status::Ok();
}

Status ReadFp8Versions(Materializer& reader, const std::shared_ptr<const Version>& parent,
                       const PlanTensor& tensor, const TensorChanges& changes,
                       const std::string& what, Fp8Versions* out) {
  // Read straight into buffers a push keeps from tensor to tensor.
  const uint64_t n_el = ShapeElements(tensor.shape);
  out->parent.resize(n_el);
  RETURN_IF_ERROR(ReadTensorInto(reader, parent, tensor.name, out->parent.data(), n_el * 2, what));
  out->child.assign(out->parent.begin(), out->parent.end());
  for (size_t k = 0; k < changes.indices.size(); ++k) {
    uint16_t& x = out->child[changes.indices[k]];
    x = ApplyFp8Change(changes, k, x);
  }
  return Status::Ok();
}

uint16_t ApplyFp8Change(const TensorChanges& changes, size_t k, uint16_t x) {
  uint16_t now, was = 0;
  std::memcpy(&now, changes.values.data() + 2 * k, 2);
  const bool diff = !changes.old_values.empty() && (changes.known.empty() || changes.known[k]);
  if (!diff) return now;
  std::memcpy(&was, changes.old_values.data() + 2 * k, 2);
  return static_cast<uint16_t>(x + (now - was));
}

// In lanes the compiler can keep in one vector register.
uint16_t Bf16AmaxBits(const uint16_t* x, uint64_t n) {
  constexpr int kLanes = 16;
  uint16_t lane[kLanes] = {};
  uint64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const uint16_t a = x[i + k] & 0x7FFFu;
      lane[k] = a > lane[k] ? a : lane[k];
    }
  }
  uint16_t m = 0;
  for (int k = 0; k < kLanes; ++k) m = std::max(m, lane[k]);
  for (; i < n; ++i) m = std::max<uint16_t>(m, x[i] & 0x7FFFu);
  return m;
}

uint64_t Fp8BlockOf(const kernels::Fp8Layout& l, uint64_t i) {
  return (i / l.cols / l.block_rows) * l.grid_cols() + (i % l.cols) / l.block_cols;
}

namespace {

// The parent's scale of block b (row-major over the grid).
float ParentScale(const kernels::Fp8Layout& l, const uint16_t* x, uint64_t b) {
  const uint64_t r0 = (b / l.grid_cols()) * l.block_rows;
  const uint64_t c0 = (b % l.grid_cols()) * l.block_cols;
  const uint64_t r1 = std::min(r0 + l.block_rows, l.rows);
  const uint64_t c1 = std::min(c0 + l.block_cols, l.cols);
  uint16_t amax = 0;
  for (uint64_t r = r0; r < r1; ++r) {
    amax = std::max(amax, Bf16AmaxBits(x + r * l.cols + c0, c1 - c0));
  }
  return kernels::Fp8BlockScale(kernels::Bf16BitsToFp32(amax), l.rule);
}

}  // namespace

Status ComputeFp8Changes(const kernels::Fp8Layout& layout, const Fp8Versions& v,
                         const TensorChanges& changes, const std::string& tensor, Fp8Changes* out) {
  return ComputeFp8ChangesAt(layout, v, changes.indices.data(), changes.indices.size(), tensor,
                             out);
}

Status ComputeFp8ChangesAt(const kernels::Fp8Layout& layout, const Fp8Versions& v,
                           const uint64_t* changed, size_t n, const std::string& tensor,
                           Fp8Changes* out) {
  const std::string bad =
      kernels::Fp8ChangesAt(layout, v.parent.data(), v.child.data(), changed, n, tensor, &out->set);
  if (!bad.empty()) return InvalidArgument(bad);
  // The parent's scale of every block holding a changed byte or scale.
  std::vector<uint64_t> blocks;
  for (uint64_t i : out->set.byte_index) {
    const uint64_t b = Fp8BlockOf(layout, i);
    if (blocks.empty() || blocks.back() != b) blocks.push_back(b);
  }
  blocks.insert(blocks.end(), out->set.scale_index.begin(), out->set.scale_index.end());
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  std::vector<float> scale(blocks.size());
  kernels::ParallelFor(blocks.size(), 16, [&](size_t lo, size_t hi) {
    for (size_t k = lo; k < hi; ++k) scale[k] = ParentScale(layout, v.parent.data(), blocks[k]);
  });
  auto scale_of = [&](uint64_t b) {
    return scale[std::lower_bound(blocks.begin(), blocks.end(), b) - blocks.begin()];
  };
  out->old_bytes.resize(out->set.byte_index.size());
  for (size_t k = 0; k < out->set.byte_index.size(); ++k) {
    const uint64_t i = out->set.byte_index[k];
    out->old_bytes[k] = kernels::QuantizeE4m3(kernels::Bf16BitsToFp32(v.parent[i]),
                                              scale_of(Fp8BlockOf(layout, i)));
  }
  out->old_scales.resize(out->set.scale_index.size());
  for (size_t k = 0; k < out->set.scale_index.size(); ++k) {
    out->old_scales[k] = scale_of(out->set.scale_index[k]);
  }
  return Status::Ok();
}

void EncodeFp8Op(const Fp8ReceiverOp& op, const Fp8Changes& changes, uint64_t* n_bytes,
                 std::string* bytes_out, uint64_t* n_scales, std::string* scales_out) {
  Fp8OpIndices at;
  RemapFp8Changes(op, changes.set, &at);
  *n_bytes = at.byte_index.size();
  *n_scales = at.scale_index.size();
  if (*n_bytes > 0) {
    AppendOpSegments(at.byte_index.data(), at.byte_pos.data(), at.byte_index.size(), 1,
                     changes.set.byte_value.data(), changes.old_bytes.data(), nullptr, bytes_out);
  }
  if (*n_scales > 0) {
    AppendOpSegments(at.scale_index.data(), at.scale_pos.data(), at.scale_index.size(), 4,
                     reinterpret_cast<const uint8_t*>(changes.set.scale_value.data()),
                     reinterpret_cast<const uint8_t*>(changes.old_scales.data()), nullptr,
                     scales_out);
  }
}

}  // namespace dte::push_internal
