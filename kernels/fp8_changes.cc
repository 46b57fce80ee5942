// The FP8 change set between two versions of a tensor (kernels/fp8.h).
//
// Only blocks holding a changed BF16 element can change. For each such block
// both versions' scales are computed from the whole block; where the scale
// is unchanged only the changed elements can change their byte, so only
// they are requantized; where it changed every byte of the block is
// compared. Blocks are independent and examined in parallel.
#include <algorithm>
#include <utility>

#include "kernels/fp8.h"
#include "kernels/internal/fp8_blocks.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

using fp8_internal::BlockOf;
using fp8_internal::BlockRect;
using fp8_internal::kNoElement;
using fp8_internal::RectOf;

// What one examined block contributes.
struct BlockResult {
  bool touched = false;
  std::vector<std::pair<uint64_t, uint8_t>> bytes;
  bool scale_changed = false;
  float scale = 0.0f;
  uint64_t bad = kNoElement;  // first non-finite element of either version
};

void CompareAt(uint64_t i, const uint16_t* parent, const uint16_t* child, float old_scale,
               float new_scale, BlockResult* res) {
  const uint8_t before = QuantizeE4m3(Bf16BitsToFp32(parent[i]), old_scale);
  const uint8_t after = QuantizeE4m3(Bf16BitsToFp32(child[i]), new_scale);
  if (before != after) res->bytes.emplace_back(i, after);
}

// Block b, whose changed elements are changed[0 .. n) (n > 0).
BlockResult ExamineBlock(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child,
                         uint64_t b, const uint64_t* changed, size_t n) {
  BlockResult res;
  res.touched = true;
  const BlockRect rect = RectOf(l, b);
  const float old_scale = fp8_internal::FastBlockScale(l, parent, rect, &res.bad);
  const float new_scale = fp8_internal::FastBlockScale(l, child, rect, &res.bad);
  if (res.bad != kNoElement) return res;
  res.scale = new_scale;
  res.scale_changed = FloatBits(old_scale) != FloatBits(new_scale);
  if (!res.scale_changed) {
    for (size_t k = 0; k < n; ++k) CompareAt(changed[k], parent, child, old_scale, new_scale, &res);
    return res;
  }
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    for (uint64_t c = rect.c0; c < rect.c1; ++c) {
      CompareAt(r * l.cols + c, parent, child, old_scale, new_scale, &res);
    }
  }
  return res;
}

// The flat indices of block b where parent and child differ, into *out.
void DifferingIn(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child, uint64_t b,
                 std::vector<uint64_t>* out) {
  out->clear();
  const BlockRect rect = RectOf(l, b);
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    for (uint64_t i = r * l.cols + rect.c0; i < r * l.cols + rect.c1; ++i) {
      if (parent[i] != child[i]) out->push_back(i);
    }
  }
}

// The refusal for the first refused block, or collects every block's bytes
// and scales into *out (bytes sorted by index).
std::string Merge(const Fp8Layout& l, const uint16_t* child, std::string_view tensor,
                  std::vector<BlockResult>& results, const std::vector<uint64_t>& block_of,
                  Fp8ChangeSet* out) {
  std::vector<std::pair<uint64_t, uint8_t>> bytes;
  for (size_t k = 0; k < results.size(); ++k) {
    const BlockResult& res = results[k];
    if (!res.touched) continue;
    if (res.bad != kNoElement) {
      const bool in_child = Bf16AbsNonFinite(Bf16AbsBits(child[res.bad]));
      return fp8_internal::Refusal(l, tensor, res.bad) +
             (in_child ? " (in the new version)" : " (in the parent version)");
    }
    ++out->blocks_touched;
    bytes.insert(bytes.end(), res.bytes.begin(), res.bytes.end());
    if (res.scale_changed) {
      out->scale_index.push_back(block_of.empty() ? k : block_of[k]);
      out->scale_value.push_back(res.scale);
    }
  }
  std::sort(bytes.begin(), bytes.end());
  out->byte_index.reserve(bytes.size());
  out->byte_value.reserve(bytes.size());
  for (const auto& [i, v] : bytes) {
    out->byte_index.push_back(i);
    out->byte_value.push_back(v);
  }
  return {};
}

// The distinct in-bounds changed indices grouped by block, blocks
// ascending, indices ascending within each: block_of[k]'s are
// idx[starts[k] .. starts[k + 1]).
struct BlockGroups {
  std::vector<uint64_t> idx, block_of;
  std::vector<size_t> starts;
};

// Any order: sorts (block, index) pairs.
void GroupBySorting(const Fp8Layout& l, const uint64_t* changed, size_t n, BlockGroups* g) {
  std::vector<std::pair<uint64_t, uint64_t>> bucket;
  bucket.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    if (changed[k] < l.num_elements()) bucket.emplace_back(BlockOf(l, changed[k]), changed[k]);
  }
  std::sort(bucket.begin(), bucket.end());
  bucket.erase(std::unique(bucket.begin(), bucket.end()), bucket.end());
  g->idx.resize(bucket.size());
  for (size_t k = 0; k < bucket.size(); ++k) {
    g->idx[k] = bucket[k].second;
    if (k == 0 || bucket[k].first != bucket[k - 1].first) {
      g->starts.push_back(k);
      g->block_of.push_back(bucket[k].first);
    }
  }
  g->starts.push_back(bucket.size());
}

// Ascending input, at most a few blocks per index: a counting sort by
// block, which keeps each block's indices ascending (no n log n sort).
void GroupSortedByBlock(const Fp8Layout& l, const uint64_t* changed, size_t n, BlockGroups* g) {
  std::vector<uint64_t> block(n, kNoElement);
  std::vector<size_t> next(l.num_blocks() + 1, 0);
  for (size_t k = 0; k < n; ++k) {
    if (changed[k] >= l.num_elements() || (k > 0 && changed[k] == changed[k - 1])) continue;
    block[k] = BlockOf(l, changed[k]);
    ++next[block[k] + 1];
  }
  // next[b + 1] counts block b's indices; made into block b's first slot.
  for (uint64_t b = 0; b < l.num_blocks(); ++b) {
    if (next[b + 1] != 0) g->block_of.push_back(b);
    next[b + 1] += next[b];
  }
  for (uint64_t b : g->block_of) g->starts.push_back(next[b]);
  g->starts.push_back(next[l.num_blocks()]);
  g->idx.resize(next[l.num_blocks()]);
  for (size_t k = 0; k < n; ++k) {
    if (block[k] != kNoElement) g->idx[next[block[k]]++] = changed[k];
  }
}

}  // namespace

std::string Fp8Changes(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child,
                       std::string_view tensor, Fp8ChangeSet* out) {
  *out = Fp8ChangeSet{};
  std::vector<BlockResult> results(l.num_blocks());
  ParallelFor(l.num_blocks(), 1, [&](size_t begin, size_t end) {
    std::vector<uint64_t> changed;
    for (size_t b = begin; b < end; ++b) {
      DifferingIn(l, parent, child, b, &changed);
      if (!changed.empty()) {
        results[b] = ExamineBlock(l, parent, child, b, changed.data(), changed.size());
      }
    }
  });
  return Merge(l, child, tensor, results, {}, out);
}

std::string Fp8ChangesAt(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child,
                         const uint64_t* changed, size_t n, std::string_view tensor,
                         Fp8ChangeSet* out) {
  *out = Fp8ChangeSet{};
  BlockGroups g;
  if (std::is_sorted(changed, changed + n) && l.num_blocks() <= 4 * uint64_t{n} + 1024) {
    GroupSortedByBlock(l, changed, n, &g);
  } else {
    GroupBySorting(l, changed, n, &g);
  }
  std::vector<BlockResult> results(g.block_of.size());
  ParallelFor(g.block_of.size(), 1, [&](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      results[k] = ExamineBlock(l, parent, child, g.block_of[k], g.idx.data() + g.starts[k],
                                g.starts[k + 1] - g.starts[k]);
    }
  });
  return Merge(l, child, tensor, results, g.block_of, out);
}

}  // namespace dte::kernels
