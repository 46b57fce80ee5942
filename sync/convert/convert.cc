// Running conversion units in both directions.
#include "sync/convert/convert.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "store/dtype.h"
#include "sync/convert/convert_matrix.h"

namespace dte {
namespace {

using internal::MatrixCols;

// One side of a block copy: a row-major matrix of `width`-byte elements.
struct Matrix {
  const char* in = nullptr;
  char* out = nullptr;
  int64_t cols = 0;
};

void CopyRows(const Matrix& src, int64_t src_row, int64_t src_col, const Matrix& dst,
              int64_t dst_row, int64_t dst_col, int64_t rows, int64_t cols, int width) {
  const size_t row_bytes = static_cast<size_t>(cols) * width;
  for (int64_t r = 0; r < rows; ++r) {
    const char* from = src.in + ((src_row + r) * src.cols + src_col) * width;
    char* to = dst.out + ((dst_row + r) * dst.cols + dst_col) * width;
    std::memcpy(to, from, row_bytes);
  }
}

Status CheckWidth(DType dtype, const std::string& what) {
  const int width = DTypeWidth(dtype);
  if (width != 2 && width != 4) {
    return InvalidArgument(what + ": dtype " + DTypeName(dtype) +
                           " is not a 2-byte or 4-byte element type");
  }
  return Status::Ok();
}

// Fetches a shard and checks it against the plan.
Result<ShardView> FetchShard(const PlannedShard& planned, ShardSource& source) {
  ASSIGN_OR_RETURN(ShardView view, source.Get(planned.key));
  const std::string what = planned.key.ToString();
  RETURN_IF_ERROR(CheckWidth(view.dtype, what));
  if (view.shape != planned.shape) {
    return InvalidArgument(what + ": shape " + ShapeString(view.shape) + ", expected " +
                           ShapeString(planned.shape));
  }
  const uint64_t want = planned.elements() * DTypeWidth(view.dtype);
  if (view.bytes.size() != want) {
    return InvalidArgument(what + ": " + std::to_string(view.bytes.size()) + " bytes, expected " +
                           std::to_string(want));
  }
  return view;
}

// Each HF tensor takes the dtype of the shards it is copied from; they must agree.
Result<std::vector<DType>> TensorDTypes(const ConvertUnit& unit,
                                        const std::vector<ShardView>& views) {
  std::vector<DType> dtypes(unit.tensors.size());
  std::vector<bool> seen(unit.tensors.size(), false);
  for (const BlockCopy& c : unit.copies) {
    const DType d = views[c.shard].dtype;
    if (!seen[c.tensor]) {
      dtypes[c.tensor] = d;
      seen[c.tensor] = true;
    } else if (dtypes[c.tensor] != d) {
      return InvalidArgument(unit.shards[c.shard].key.ToString() + ": dtype " + DTypeName(d) +
                             ", but other shards of " + unit.tensors[c.tensor].name + " are " +
                             DTypeName(dtypes[c.tensor]));
    }
  }
  for (size_t t = 0; t < seen.size(); ++t) {
    if (!seen[t]) return Internal("plan has no copy into " + unit.tensors[t].name);
  }
  return dtypes;
}

Result<std::vector<HfTensor>> RunUnitUnlabelled(const ConvertUnit& unit, ShardSource& source) {
  std::vector<ShardView> views;
  views.reserve(unit.shards.size());
  for (const PlannedShard& s : unit.shards) {
    ASSIGN_OR_RETURN(ShardView v, FetchShard(s, source));
    views.push_back(std::move(v));
  }
  ASSIGN_OR_RETURN(std::vector<DType> dtypes, TensorDTypes(unit, views));
  std::vector<HfTensor> out(unit.tensors.size());
  for (size_t t = 0; t < out.size(); ++t) {
    out[t].name = unit.tensors[t].name;
    out[t].tensor.dtype = dtypes[t];
    out[t].tensor.shape = unit.tensors[t].shape;
    out[t].tensor.data.resize(unit.tensors[t].elements() * DTypeWidth(dtypes[t]));
  }
  for (const BlockCopy& c : unit.copies) {
    const Matrix src{views[c.shard].bytes.data(), nullptr, MatrixCols(unit.shards[c.shard].shape)};
    const Matrix dst{nullptr, out[c.tensor].tensor.data.data(),
                     MatrixCols(unit.tensors[c.tensor].shape)};
    CopyRows(src, c.shard_row, c.shard_col, dst, c.tensor_row, c.tensor_col, c.rows, c.cols,
             DTypeWidth(dtypes[c.tensor]));
  }
  return out;
}

// Checks an HF tensor against its planned shape.
Result<const TensorData*> FindHf(const std::map<std::string, TensorData>& hf,
                                 const PlannedTensor& planned) {
  auto it = hf.find(planned.name);
  if (it == hf.end()) return NotFound("HF state has no tensor " + planned.name);
  const TensorData& t = it->second;
  RETURN_IF_ERROR(CheckWidth(t.dtype, planned.name));
  if (t.shape != planned.shape) {
    return InvalidArgument(planned.name + ": shape " + ShapeString(t.shape) + ", expected " +
                           ShapeString(planned.shape));
  }
  if (t.data.size() != planned.elements() * DTypeWidth(t.dtype)) {
    return InvalidArgument(planned.name + ": " + std::to_string(t.data.size()) +
                           " bytes do not match its shape and dtype");
  }
  return &t;
}

// The dtype of each shard: that of the HF tensors copied into it, which must
// agree; shards no copy touches (all vocab padding) take the first tensor's.
Result<std::vector<DType>> ShardDTypes(const ConvertUnit& unit,
                                       const std::vector<const TensorData*>& tensors) {
  std::vector<DType> dtypes(unit.shards.size(), tensors.front()->dtype);
  std::vector<bool> seen(unit.shards.size(), false);
  for (const BlockCopy& c : unit.copies) {
    const DType d = tensors[c.tensor]->dtype;
    if (seen[c.shard] && dtypes[c.shard] != d) {
      return InvalidArgument(unit.tensors[c.tensor].name + ": dtype " + DTypeName(d) +
                             " differs from the other tensors fused into " +
                             unit.shards[c.shard].key.name);
    }
    dtypes[c.shard] = d;
    seen[c.shard] = true;
  }
  return dtypes;
}

// Shards one unit's HF tensors into `state`.
Status ShardUnit(const ConvertUnit& unit, const std::map<std::string, TensorData>& hf,
                 McoreState* state) {
  std::vector<const TensorData*> tensors;
  for (const PlannedTensor& t : unit.tensors) {
    ASSIGN_OR_RETURN(const TensorData* data, FindHf(hf, t));
    tensors.push_back(data);
  }
  if (tensors.empty()) return Status::Ok();
  ASSIGN_OR_RETURN(std::vector<DType> dtypes, ShardDTypes(unit, tensors));
  std::vector<TensorData*> shards;
  for (size_t i = 0; i < unit.shards.size(); ++i) {
    const PlannedShard& planned = unit.shards[i];
    auto [it, inserted] = state->try_emplace(planned.key);
    if (!inserted) return Internal("plan names shard " + planned.key.ToString() + " twice");
    it->second.dtype = dtypes[i];
    it->second.shape = planned.shape;
    it->second.data.assign(planned.elements() * DTypeWidth(dtypes[i]), '\0');
    shards.push_back(&it->second);
  }
  for (const BlockCopy& c : unit.copies) {
    const TensorData& from = *tensors[c.tensor];
    const Matrix src{from.data.data(), nullptr, MatrixCols(from.shape)};
    const Matrix dst{nullptr, shards[c.shard]->data.data(), MatrixCols(unit.shards[c.shard].shape)};
    CopyRows(src, c.tensor_row, c.tensor_col, dst, c.shard_row, c.shard_col, c.rows, c.cols,
             DTypeWidth(from.dtype));
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<HfTensor>> RunUnit(const ConvertUnit& unit, ShardSource& source) {
  auto out = RunUnitUnlabelled(unit, source);
  if (!out.ok()) return out.status().WithContext("converting unit '" + unit.label + "'");
  return out;
}

Status ConvertToHf(std::span<const ConvertUnit> plan, ShardSource& source, const UnitSink& sink,
                   ConvertStats* stats) {
  ConvertStats local;
  for (const ConvertUnit& unit : plan) {
    ASSIGN_OR_RETURN(std::vector<HfTensor> tensors, RunUnit(unit, source));
    uint64_t held = 0;
    for (const HfTensor& t : tensors) held += t.tensor.data.size();
    local.units++;
    local.tensors += tensors.size();
    local.bytes += held;
    local.peak_bytes = std::max(local.peak_bytes, held);
    RETURN_IF_ERROR(sink(unit, tensors));
  }  // each unit's tensors are freed before the next unit runs
  if (stats != nullptr) *stats = local;
  return Status::Ok();
}

Result<McoreState> ShardHfState(const std::vector<ConvertUnit>& plan,
                                const std::map<std::string, TensorData>& hf) {
  McoreState state;
  std::set<std::string> planned;
  for (const ConvertUnit& unit : plan) {
    RETURN_IF_ERROR(ShardUnit(unit, hf, &state));
    for (const PlannedTensor& t : unit.tensors) planned.insert(t.name);
  }
  for (const auto& [name, t] : hf) {
    if (planned.count(name) == 0) {
      return InvalidArgument("HF tensor " + name + " is not part of the model spec");
    }
  }
  return state;
}

Result<ShardView> McoreStateSource::Get(const ShardKey& key) {
  auto it = state_->find(key);
  if (it == state_->end()) return NotFound("missing MCore shard " + key.ToString());
  ShardView view;
  view.dtype = it->second.dtype;
  view.shape = it->second.shape;
  view.bytes = it->second.data;
  return view;
}

}  // namespace dte
