// Remap planning and the CPU array form of RemapElement.
#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/internal/change_scan.h"
#include "kernels/internal/compact.h"
#include "kernels/remap.h"
#include "kernels/width.h"

namespace dte::kernels {
namespace {

constexpr uint64_t kMaxU64 = ~uint64_t{0};

std::string DimError(size_t d, const std::string& what) {
  return "remap dimension " + std::to_string(d) + ": " + what;
}

// Returns an empty string when the per-dimension bounds hold.
std::string CheckBounds(const RemapSpec& s) {
  const size_t ndim = s.src_shape.size();
  for (size_t d = 0; d < ndim; ++d) {
    const uint64_t ext = s.rect_extent[d];
    if (s.rect_start[d] > s.src_shape[d] || ext > s.src_shape[d] - s.rect_start[d]) {
      return DimError(d, "box [" + std::to_string(s.rect_start[d]) + ", +" + std::to_string(ext) +
                             ") exceeds source extent " + std::to_string(s.src_shape[d]));
    }
    if (s.dst_start[d] > s.dst_shape[d] || ext > s.dst_shape[d] - s.dst_start[d]) {
      return DimError(d, "box [" + std::to_string(s.dst_start[d]) + ", +" + std::to_string(ext) +
                             ") exceeds destination extent " + std::to_string(s.dst_shape[d]));
    }
  }
  return {};
}

// Row-major strides of shape; false if the element count overflows 2^64.
bool Strides(const std::vector<uint64_t>& shape, uint64_t* strides) {
  uint64_t s = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    strides[d] = s;
    if (shape[d] != 0 && s > kMaxU64 / shape[d]) return false;
    s *= shape[d];
  }
  return true;
}

uint64_t Ravel(const uint64_t* coord, const uint64_t* strides, size_t ndim) {
  uint64_t flat = 0;
  for (size_t d = 0; d < ndim; ++d) flat += coord[d] * strides[d];
  return flat;
}

}  // namespace

std::string MakeRemapPlan(const RemapSpec& s, RemapPlan* plan) {
  const size_t ndim = s.src_shape.size();
  if (ndim < 1 || ndim > static_cast<size_t>(kRemapMaxDims)) {
    return "remap: " + std::to_string(ndim) + " dimensions, supported 1 to " +
           std::to_string(kRemapMaxDims);
  }
  if (s.rect_start.size() != ndim || s.rect_extent.size() != ndim || s.dst_shape.size() != ndim ||
      s.dst_start.size() != ndim) {
    return "remap: source shape has " + std::to_string(ndim) +
           " dimensions but box start/extent and destination shape/start differ in length";
  }
  if (std::string err = CheckBounds(s); !err.empty()) return err;
  RemapPlan p;
  uint64_t src_strides[kRemapMaxDims];
  if (!Strides(s.src_shape, src_strides)) return "remap: source element count overflows 2^64";
  if (!Strides(s.dst_shape, p.dst_stride)) return "remap: destination element count overflows 2^64";
  p.ndim = static_cast<int>(ndim);
  bool empty = false;
  uint64_t last[kRemapMaxDims];
  for (size_t d = 0; d < ndim; ++d) {
    // A zero extent empties the box; shape 1 then keeps RemapElement's
    // divisions defined while hi == lo rejects everything.
    p.src_shape[d] = std::max<uint64_t>(s.src_shape[d], 1);
    p.lo[d] = s.rect_start[d];
    p.hi[d] = s.rect_start[d] + s.rect_extent[d];
    empty = empty || s.rect_extent[d] == 0;
    last[d] = p.hi[d] - (s.rect_extent[d] != 0 ? 1 : 0);
    p.dst_offset += (s.dst_start[d] - s.rect_start[d]) * p.dst_stride[d];  // wraps mod 2^64
  }
  if (!empty) {
    p.src_first = Ravel(p.lo, src_strides, ndim);
    p.src_last = Ravel(last, src_strides, ndim);
  }
  *plan = p;
  return {};
}

size_t RemapIndices(const RemapPlan& plan, const uint64_t* src_idx, size_t n, uint64_t* dst_idx_out,
                    uint64_t* pos_out) {
  if (plan.src_first > plan.src_last) return 0;
  // Sorted input: only the run within the box's flat range can match.
  const uint64_t* begin = std::lower_bound(src_idx, src_idx + n, plan.src_first);
  const uint64_t* end = std::upper_bound(begin, src_idx + n, plan.src_last);
  const size_t offset = static_cast<size_t>(begin - src_idx);
  auto run = [&](size_t b, size_t e) {
    size_t k = b;
    for (size_t i = b; i < e; ++i) {
      if (!RemapElement(plan, begin[i], &dst_idx_out[k])) continue;
      if (pos_out != nullptr) pos_out[k] = offset + i;
      ++k;
    }
    return k - b;
  };
  auto move = [&](size_t from, size_t to, size_t count) {
    std::memmove(dst_idx_out + to, dst_idx_out + from, count * sizeof(uint64_t));
    if (pos_out != nullptr) std::memmove(pos_out + to, pos_out + from, count * sizeof(uint64_t));
  };
  return internal::ParallelCompact(static_cast<size_t>(end - begin), run, move);
}

namespace {

template <typename Index>
size_t RemapScatterImpl(const RemapPlan& plan, const Index* src_idx, const void* vals, size_t n,
                        int width, void* dst) {
  const auto* v = static_cast<const unsigned char*>(vals);
  auto* d = static_cast<unsigned char*>(dst);
  return DispatchWidth(width, [&](auto w) {
    constexpr int W = w.value;
    return internal::ParallelCount(n, [&](size_t begin, size_t end) {
      size_t written = 0;
      for (size_t k = begin; k < end; ++k) {
        written += RemapScatterElement<W>(plan, src_idx[k], v + k * W, d) ? 1 : 0;
      }
      return written;
    });
  });
}

}  // namespace

size_t RemapScatter(const RemapPlan& plan, const uint64_t* src_idx, const void* vals, size_t n,
                    int width, void* dst) {
  return RemapScatterImpl(plan, src_idx, vals, n, width, dst);
}

size_t RemapScatter(const RemapPlan& plan, const uint32_t* src_idx, const void* vals, size_t n,
                    int width, void* dst) {
  return RemapScatterImpl(plan, src_idx, vals, n, width, dst);
}

}  // namespace dte::kernels
