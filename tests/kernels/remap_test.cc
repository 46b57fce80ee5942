#include "kernels/remap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace dte::kernels {
namespace {

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t s : shape) n *= s;
  return n;
}

// Brute force: walk every coordinate of the box and record source flat index
// -> destination flat index.
std::map<uint64_t, uint64_t> BoxMap(const RemapSpec& s) {
  std::map<uint64_t, uint64_t> out;
  const size_t nd = s.src_shape.size();
  if (Numel(s.rect_extent) == 0) return out;
  std::vector<uint64_t> c(nd, 0);  // offset inside the box
  for (;;) {
    uint64_t src = 0, dst = 0;
    for (size_t d = 0; d < nd; ++d) {
      src = src * s.src_shape[d] + s.rect_start[d] + c[d];
      dst = dst * s.dst_shape[d] + s.dst_start[d] + c[d];
    }
    out[src] = dst;
    size_t d = nd;
    while (d > 0 && ++c[d - 1] == s.rect_extent[d - 1]) c[--d] = 0;
    if (d == 0) return out;
  }
}

RemapSpec RandomSpec(std::mt19937_64& rng, size_t ndim) {
  RemapSpec s;
  for (size_t d = 0; d < ndim; ++d) {
    const uint64_t src = 1 + rng() % 9, dst = 1 + rng() % 9;
    const uint64_t ext = rng() % (std::min(src, dst) + 1);  // zero allowed
    s.src_shape.push_back(src);
    s.dst_shape.push_back(dst);
    s.rect_extent.push_back(ext);
    s.rect_start.push_back(rng() % (src - ext + 1));
    s.dst_start.push_back(rng() % (dst - ext + 1));
  }
  return s;
}

TEST(Remap, MatchesBruteForceOnRandomShapesAndBoxesUpToFourDims) {
  std::mt19937_64 rng(1234);
  for (int trial = 0; trial < 2000; ++trial) {
    const RemapSpec s = RandomSpec(rng, 1 + trial % 4);
    RemapPlan plan;
    ASSERT_EQ(MakeRemapPlan(s, &plan), "");
    const uint64_t numel = Numel(s.src_shape);
    // A sorted random subset of the source plus a few indices past its end.
    std::vector<uint64_t> src;
    for (uint64_t i = 0; i < numel + 3; ++i) {
      if (rng() % 3 != 0) src.push_back(i);
    }
    const std::map<uint64_t, uint64_t> box = BoxMap(s);
    std::vector<uint64_t> want_dst, want_pos;
    for (size_t k = 0; k < src.size(); ++k) {
      if (auto it = box.find(src[k]); it != box.end()) {
        want_dst.push_back(it->second);
        want_pos.push_back(k);
      }
    }
    std::vector<uint64_t> dst(src.size()), pos(src.size());
    const size_t kept = RemapIndices(plan, src.data(), src.size(), dst.data(), pos.data());
    ASSERT_EQ(kept, want_dst.size()) << "trial " << trial;
    dst.resize(kept);
    pos.resize(kept);
    ASSERT_EQ(dst, want_dst) << "trial " << trial;
    ASSERT_EQ(pos, want_pos) << "trial " << trial;
  }
}

TEST(Remap, LargeInputUsesManyChunksAndMatchesElementMath) {
  // 8 dims; every one of the 1.8M source indices in order.
  RemapSpec s;
  s.src_shape = {3, 4, 5, 6, 7, 8, 9, 10};
  s.rect_start = {1, 0, 2, 1, 0, 3, 4, 5};
  s.rect_extent = {2, 4, 3, 5, 7, 5, 5, 5};
  s.dst_shape = {2, 8, 3, 5, 7, 5, 5, 6};
  s.dst_start = {0, 4, 0, 0, 0, 0, 0, 1};
  RemapPlan plan;
  ASSERT_EQ(MakeRemapPlan(s, &plan), "");
  std::vector<uint64_t> src(Numel(s.src_shape));
  for (uint64_t i = 0; i < src.size(); ++i) src[i] = i;
  std::vector<uint64_t> dst(src.size()), pos(src.size());
  const size_t kept = RemapIndices(plan, src.data(), src.size(), dst.data(), nullptr);
  ASSERT_EQ(kept, Numel(s.rect_extent));
  std::map<uint64_t, uint64_t> box = BoxMap(s);
  size_t j = 0;
  for (const auto& [from, to] : box) {
    ASSERT_EQ(dst[j], to) << "from " << from;
    ++j;
  }
}

TEST(Remap, PlanRejectsBadSpecsWithTheDimension) {
  RemapPlan plan;
  RemapSpec s{{4, 4}, {1, 1}, {3, 4}, {8, 8}, {0, 0}};
  EXPECT_NE(MakeRemapPlan(s, &plan).find("dimension 1"), std::string::npos);
  s = {{4, 4}, {1, 0}, {3, 4}, {8, 8}, {6, 0}};
  EXPECT_NE(MakeRemapPlan(s, &plan).find("destination"), std::string::npos);
  s = {{4}, {0, 0}, {1}, {4}, {0}};
  EXPECT_NE(MakeRemapPlan(s, &plan), "");
  s = {{}, {}, {}, {}, {}};
  EXPECT_NE(MakeRemapPlan(s, &plan), "");
  s = {std::vector<uint64_t>(9, 1), std::vector<uint64_t>(9, 0), std::vector<uint64_t>(9, 1),
       std::vector<uint64_t>(9, 1), std::vector<uint64_t>(9, 0)};
  EXPECT_NE(MakeRemapPlan(s, &plan).find("9 dimensions"), std::string::npos);
  s = {{uint64_t{1} << 40, uint64_t{1} << 40}, {0, 0}, {1, 1}, {1, 1}, {0, 0}};
  EXPECT_NE(MakeRemapPlan(s, &plan).find("overflow"), std::string::npos);
}

TEST(Remap, EmptyBoxOrZeroSizedTensorKeepsNothing) {
  RemapPlan plan;
  ASSERT_EQ(MakeRemapPlan({{0, 5}, {0, 0}, {0, 5}, {3, 5}, {0, 0}}, &plan), "");
  std::vector<uint64_t> src = {0, 1, 2, 3}, dst(4);
  EXPECT_EQ(RemapIndices(plan, src.data(), src.size(), dst.data(), nullptr), 0u);
  uint64_t out = 0;
  EXPECT_FALSE(RemapElement(plan, 0, &out));
}

}  // namespace
}  // namespace dte::kernels
