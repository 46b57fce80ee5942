// The FP8 change set between two versions of a tensor (kernels/fp8.h).
//
// Only blocks holding a changed BF16 element can change. For each such block
// both versions' scales are computed from the whole block; where the scale
// is unchanged only the changed elements can change their byte, so only
// they are requantized; where it changed every byte of the block is
// compared.
#include <algorithm>
#include <utility>

#include "kernels/fp8.h"
#include "kernels/internal/fp8_blocks.h"
#include "kernels/parallel.h"

namespace dte::kernels {
namespace {

using fp8_internal::BlockOf;
using fp8_internal::kNoElement;
using fp8_internal::RectOf;

// A touched block and its changed elements: bucket[begin, end).
struct Touched {
  uint64_t block;
  size_t begin, end;
};

// What one touched block contributes.
struct BlockResult {
  std::vector<std::pair<uint64_t, uint8_t>> bytes;
  bool scale_changed = false;
  float scale = 0.0f;
  uint64_t bad = kNoElement;  // first non-finite element of either version
};

// Pairs (block, index) for the in-bounds changed indices, grouped by block,
// indices ascending within a block.
std::vector<std::pair<uint64_t, uint64_t>> Bucket(const Fp8Layout& l, const uint64_t* changed,
                                                  size_t n) {
  std::vector<std::pair<uint64_t, uint64_t>> bucket;
  bucket.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    if (changed[k] < l.num_elements()) bucket.emplace_back(BlockOf(l, changed[k]), changed[k]);
  }
  std::sort(bucket.begin(), bucket.end());
  bucket.erase(std::unique(bucket.begin(), bucket.end()), bucket.end());
  return bucket;
}

std::vector<Touched> TouchedBlocks(const std::vector<std::pair<uint64_t, uint64_t>>& bucket) {
  std::vector<Touched> touched;
  for (size_t k = 0; k < bucket.size(); ++k) {
    if (touched.empty() || touched.back().block != bucket[k].first) {
      touched.push_back({bucket[k].first, k, k});
    }
    touched.back().end = k + 1;
  }
  return touched;
}

void CompareAt(uint64_t i, const uint16_t* parent, const uint16_t* child, float old_scale,
               float new_scale, BlockResult* res) {
  const uint8_t before = QuantizeE4m3(Bf16BitsToFp32(parent[i]), old_scale);
  const uint8_t after = QuantizeE4m3(Bf16BitsToFp32(child[i]), new_scale);
  if (before != after) res->bytes.emplace_back(i, after);
}

BlockResult ExamineBlock(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child,
                         const Touched& t,
                         const std::vector<std::pair<uint64_t, uint64_t>>& bucket) {
  BlockResult res;
  const fp8_internal::BlockRect rect = RectOf(l, t.block);
  const float old_scale = fp8_internal::BlockScale(l, parent, rect, &res.bad);
  const float new_scale = fp8_internal::BlockScale(l, child, rect, &res.bad);
  if (res.bad != kNoElement) return res;
  res.scale = new_scale;
  res.scale_changed = FloatBits(old_scale) != FloatBits(new_scale);
  if (!res.scale_changed) {
    for (size_t k = t.begin; k < t.end; ++k) {
      CompareAt(bucket[k].second, parent, child, old_scale, new_scale, &res);
    }
    return res;
  }
  for (uint64_t r = rect.r0; r < rect.r1; ++r) {
    for (uint64_t c = rect.c0; c < rect.c1; ++c) {
      CompareAt(r * l.cols + c, parent, child, old_scale, new_scale, &res);
    }
  }
  return res;
}

// Concatenates the blocks' results into *out (bytes sorted by index).
void Merge(const std::vector<Touched>& touched, std::vector<BlockResult>& results,
           Fp8ChangeSet* out) {
  std::vector<std::pair<uint64_t, uint8_t>> bytes;
  for (size_t k = 0; k < touched.size(); ++k) {
    bytes.insert(bytes.end(), results[k].bytes.begin(), results[k].bytes.end());
    if (results[k].scale_changed) {
      out->scale_index.push_back(touched[k].block);
      out->scale_value.push_back(results[k].scale);
    }
  }
  std::sort(bytes.begin(), bytes.end());
  out->byte_index.reserve(bytes.size());
  out->byte_value.reserve(bytes.size());
  for (const auto& [i, v] : bytes) {
    out->byte_index.push_back(i);
    out->byte_value.push_back(v);
  }
}

}  // namespace

std::string Fp8ChangesAt(const Fp8Layout& l, const uint16_t* parent, const uint16_t* child,
                         const uint64_t* changed, size_t n, std::string_view tensor,
                         Fp8ChangeSet* out) {
  *out = Fp8ChangeSet{};
  const auto bucket = Bucket(l, changed, n);
  const std::vector<Touched> touched = TouchedBlocks(bucket);
  std::vector<BlockResult> results(touched.size());
  ParallelFor(touched.size(), 1, [&](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      results[k] = ExamineBlock(l, parent, child, touched[k], bucket);
    }
  });
  for (const BlockResult& res : results) {
    if (res.bad == kNoElement) continue;
    const bool in_child = Bf16AbsNonFinite(Bf16AbsBits(child[res.bad]));
    return fp8_internal::Refusal(l, tensor, res.bad) +
           (in_child ? " (in the new version)" : " (in the parent version)");
  }
  out->blocks_touched = touched.size();
  Merge(touched, results, out);
  return {};
}

}  // namespace dte::kernels
