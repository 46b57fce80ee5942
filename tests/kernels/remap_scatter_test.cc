// The fused remap + scatter (RemapScatter, CudaRemapScatter) against the
// two-step reference: RemapIndices, then a plain element copy.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/remap.h"
#include "kernels/remap_cuda.h"

namespace dte::kernels {
namespace {

struct Case {
  RemapPlan plan;
  std::vector<uint64_t> src;  // sorted, distinct source indices
  std::vector<unsigned char> vals;
  uint64_t dst_numel = 0;
};

// A 3-D overlap where the box is narrower than both tensors in every
// dimension, and about a third of the source indices chosen.
Case MakeCase(int width, uint64_t seed) {
  RemapSpec s{{6, 40, 50}, {1, 8, 3}, {4, 16, 40}, {5, 32, 64}, {1, 16, 7}};
  Case c;
  EXPECT_EQ(MakeRemapPlan(s, &c.plan), "");
  std::mt19937_64 rng(seed);
  for (uint64_t i = 0; i < 6 * 40 * 50; ++i) {
    if (rng() % 3 == 0) c.src.push_back(i);
  }
  c.vals.resize(c.src.size() * width);
  for (auto& b : c.vals) b = static_cast<unsigned char>(rng());
  c.dst_numel = 5 * 32 * 64;
  return c;
}

std::vector<unsigned char> Reference(const Case& c, int width,
                                     const std::vector<unsigned char>& base, size_t* written) {
  std::vector<uint64_t> dst(c.src.size()), pos(c.src.size());
  const size_t kept = RemapIndices(c.plan, c.src.data(), c.src.size(), dst.data(), pos.data());
  std::vector<unsigned char> out = base;
  for (size_t j = 0; j < kept; ++j) {
    std::memcpy(&out[dst[j] * width], &c.vals[pos[j] * width], width);
  }
  *written = kept;
  return out;
}

TEST(RemapScatter, MatchesRemapThenCopyForEveryWidthAndIndexType) {
  for (int width : {1, 2, 4, 8}) {
    const Case c = MakeCase(width, 77 + width);
    std::vector<unsigned char> base(c.dst_numel * width);
    std::mt19937_64 rng(width);
    for (auto& b : base) b = static_cast<unsigned char>(rng());
    size_t want_written = 0;
    const std::vector<unsigned char> want = Reference(c, width, base, &want_written);
    ASSERT_GT(want_written, 0u);
    ASSERT_LT(want_written, c.src.size());  // some indices fall outside the box

    std::vector<unsigned char> got64 = base;
    EXPECT_EQ(RemapScatter(c.plan, c.src.data(), c.vals.data(), c.src.size(), width, got64.data()),
              want_written);
    EXPECT_EQ(got64, want) << "width " << width;

    std::vector<uint32_t> src32(c.src.begin(), c.src.end());
    std::vector<unsigned char> got32 = base;
    EXPECT_EQ(RemapScatter(c.plan, src32.data(), c.vals.data(), src32.size(), width, got32.data()),
              want_written);
    EXPECT_EQ(got32, want) << "width " << width;
  }
}

TEST(RemapScatter, UnsortedInputAndIndicesPastTheSourceAreHandled) {
  const Case c = MakeCase(2, 5);
  std::vector<uint64_t> src(c.src.rbegin(), c.src.rend());
  std::vector<unsigned char> vals(c.vals.size());
  for (size_t k = 0; k < src.size(); ++k) {
    std::memcpy(&vals[k * 2], &c.vals[(src.size() - 1 - k) * 2], 2);
  }
  src.push_back(6 * 40 * 50 + 11);  // past the end of the source: ignored
  vals.resize(vals.size() + 2, 0xab);
  std::vector<unsigned char> base(c.dst_numel * 2, 0);
  size_t want_written = 0;
  const std::vector<unsigned char> want = Reference(c, 2, base, &want_written);
  std::vector<unsigned char> got = base;
  EXPECT_EQ(RemapScatter(c.plan, src.data(), vals.data(), src.size(), 2, got.data()), want_written);
  EXPECT_EQ(got, want);
}

TEST(Cuda, RemapScatterMatchesCpu) {
  if (!CudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device: the runtime reports none (or dte was built without CUDA); "
                    "the CPU tests cover the shared element math";
  }
  for (int width : {1, 2, 4, 8}) {
    const Case c = MakeCase(width, 900 + width);
    std::vector<unsigned char> base(c.dst_numel * width, 0x5a);
    size_t want_written = 0;
    const std::vector<unsigned char> want = Reference(c, width, base, &want_written);
    CudaBuffer d_src, d_vals, d_dst;
    ASSERT_TRUE(d_src.Allocate(c.src.size() * sizeof(uint64_t)).ok());
    ASSERT_TRUE(d_vals.Allocate(c.vals.size()).ok());
    ASSERT_TRUE(d_dst.Allocate(base.size()).ok());
    ASSERT_TRUE(CudaCopyToDevice(d_src.data(), c.src.data(), c.src.size() * sizeof(uint64_t)).ok());
    ASSERT_TRUE(CudaCopyToDevice(d_vals.data(), c.vals.data(), c.vals.size()).ok());
    ASSERT_TRUE(CudaCopyToDevice(d_dst.data(), base.data(), base.size()).ok());
    const CudaStatus st =
        CudaRemapScatter(c.plan, static_cast<const uint64_t*>(d_src.data()), d_vals.data(),
                         c.src.size(), width, d_dst.data(), nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    std::vector<unsigned char> got(base.size());
    ASSERT_TRUE(CudaCopyToHost(got.data(), d_dst.data(), got.size()).ok());
    EXPECT_EQ(got, want) << "width " << width;
  }
}

TEST(Cuda, RemapScatterRejectsBadWidthOrReportsNotBuilt) {
  const CudaStatus st = CudaRemapScatter(RemapPlan{}, nullptr, nullptr, 0, 3, nullptr, nullptr);
  EXPECT_FALSE(st.ok());
#if defined(DTE_HAVE_CUDA)
  EXPECT_EQ(st.code, kCudaBadArgument) << st.message;
#else
  EXPECT_EQ(st.code, kCudaNotBuilt) << st.message;
#endif
  EXPECT_NE(st.message.find("remap scatter"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace dte::kernels
