#include "sync/push/internal/push_plan.h"

#include <cstring>
#include <map>

#include "store/dtype.h"
#include "store/store.h"

namespace dte::push_internal {

namespace {

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Result<std::vector<uint32_t>> MatchReceiverTensors(const TransferPlan& plan, int rank,
                                                   const std::vector<PlanTensor>& have,
                                                   const std::string& what) {
  if (rank < 0 || static_cast<size_t>(rank) >= plan.receiver_tensors.size()) {
    return InvalidArgument(what + ": rank " + std::to_string(rank) + " is outside the layout");
  }
  return MatchTensors(plan.receiver_tensors[rank], have, what);
}

Result<std::vector<uint32_t>> MatchTensors(const std::vector<PlanTensor>& want,
                                           const std::vector<PlanTensor>& have,
                                           const std::string& what) {
  std::map<std::string, uint32_t> by_name;
  for (uint32_t i = 0; i < have.size(); ++i) {
    if (!by_name.emplace(have[i].name, i).second) {
      return InvalidArgument(what + ": tensor " + have[i].name + " is given twice");
    }
  }
  std::vector<uint32_t> out;
  out.reserve(want.size());
  for (const PlanTensor& t : want) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      return InvalidArgument(what + ": tensor " + t.name + " " + DTypeName(t.dtype) +
                             ShapeText(t.shape) + " of the plan is not among the receiver's");
    }
    const PlanTensor& h = have[it->second];
    if (h.dtype != t.dtype || h.shape != t.shape) {
      return InvalidArgument(what + ": tensor " + t.name + " is " + DTypeName(h.dtype) +
                             ShapeText(h.shape) + ", the plan has " + DTypeName(t.dtype) +
                             ShapeText(t.shape));
    }
    out.push_back(it->second);
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return InvalidArgument(what + ": tensor " + by_name.begin()->first +
                           " is not in the version's plan for this layout (" +
                           std::to_string(by_name.size()) + " such tensors)");
  }
  return out;
}

Result<TensorBytes> LocateTensor(const Version& v, const std::string& name, uint64_t size,
                                 const std::string& what) {
  auto at = v.manifest.FindTensor(name);
  if (!at) {
    return Internal(what + ": tensor " + name + " of the plan is not in " +
                    VersionName(v.manifest.version));
  }
  if (at->tensor->bytes() != size) {
    return Internal(what + ": tensor " + name + " of " + VersionName(v.manifest.version) +
                    " holds " + std::to_string(at->tensor->bytes()) + " bytes, not " +
                    std::to_string(size));
  }
  return TensorBytes{at->file, at->file->header_size + at->tensor->begin};
}

Status ReadTensorInto(Materializer& reader, const std::shared_ptr<const Version>& v,
                      const std::string& name, void* dst, uint64_t size, const std::string& what) {
  ASSIGN_OR_RETURN(const TensorBytes at, LocateTensor(*v, name, size, what));
  return reader.ReadFile(v, *at.file, at.offset, size, static_cast<uint8_t*>(dst))
      .WithContext(what);
}

void CopyOpBox(const TransferPlan& plan, const TransferOp& op, const void* src, void* dst) {
  const auto& src_shape = plan.canonical[op.canonical].shape;
  const auto& dst_shape = plan.receiver_tensors[op.receiver][op.receiver_tensor].shape;
  const size_t w = DTypeWidth(plan.canonical[op.canonical].dtype);
  const size_t nd = op.extent.size();
  if (nd == 0) return;
  // Row-major strides in elements.
  std::vector<uint64_t> ss(nd, 1), ds(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) {
    ss[d - 1] = ss[d] * src_shape[d];
    ds[d - 1] = ds[d] * dst_shape[d];
  }
  const size_t row = op.extent[nd - 1] * w;
  std::vector<uint64_t> at(nd, 0);  // position within the box, last dim fixed at 0
  const auto* s = static_cast<const uint8_t*>(src);
  auto* o = static_cast<uint8_t*>(dst);
  for (;;) {
    uint64_t so = 0, doff = 0;
    for (size_t d = 0; d < nd; ++d) {
      so += (op.box_start[d] + at[d]) * ss[d];
      doff += (op.dst_start[d] + at[d]) * ds[d];
    }
    std::memcpy(o + doff * w, s + so * w, row);
    size_t d = nd - 1;
    for (; d > 0; --d) {
      if (++at[d - 1] < op.extent[d - 1]) break;
      at[d - 1] = 0;
    }
    if (d == 0) return;
  }
}

}  // namespace dte::push_internal
