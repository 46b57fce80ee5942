// The CUDA FP8 quantizer (kernels/fp8_cuda.h) against the CPU one, bit for
// bit. Without a device the comparison skips; the first test runs
// everywhere and checks that calls fail cleanly instead.
#include "kernels/fp8_cuda.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tests/kernels/cuda_test_util.h"

namespace dte::kernels {
namespace {

TEST(Cuda, Fp8FailsCleanlyWithoutDeviceAndRejectsBadLayouts) {
  const Fp8Layout bad{.rows = 4, .cols = 4, .block_rows = 0};
  const CudaStatus st = CudaFp8Quantize(bad, nullptr, nullptr, nullptr, nullptr);
  EXPECT_FALSE(st.ok());
  if (CudaDeviceAvailable()) {
    EXPECT_EQ(st.code, kCudaBadArgument) << st.message;
    EXPECT_NE(st.message.find("at least 1"), std::string::npos) << st.message;
  } else {
    EXPECT_NE(st.message.find("CUDA FP8 quantize"), std::string::npos) << st.message;
  }
}

TEST(Cuda, Fp8QuantizeAndDequantizeEqualTheCpuBackend) {
  SKIP_WITHOUT_CUDA_DEVICE();
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kPlain, Fp8ScaleRule::kPowerOfTwo}) {
    const Fp8Layout l{.rows = 333, .cols = 517, .rule = rule};
    std::mt19937 rng(9);
    std::normal_distribution<float> d(0.0f, 0.02f);
    std::vector<uint16_t> x(l.num_elements());
    for (uint64_t i = 0; i < x.size(); ++i)
      x[i] = Fp32ToBf16Bits(i % 501 == 0 ? 30 * d(rng) : d(rng));
    x[200 * 517 + 300] = 0x7FC0;  // NaN: a NaN scale on both backends
    for (uint64_t i = 0; i < 517; ++i) x[i] = static_cast<uint16_t>(i);  // subnormals, zeros
    std::vector<uint8_t> q(x.size()), d_q_host(x.size());
    std::vector<float> s(l.num_blocks()), d_s_host(l.num_blocks());
    EXPECT_NE(Fp8Quantize(l, x.data(), q.data(), s.data(), "w"), "");
    CudaBuffer d_x, d_q, d_s, d_out;
    ASSERT_CUDA_OK(d_x.Allocate(x.size() * 2));
    ASSERT_CUDA_OK(d_q.Allocate(x.size()));
    ASSERT_CUDA_OK(d_s.Allocate(s.size() * 4));
    ASSERT_CUDA_OK(d_out.Allocate(x.size() * 4));
    ASSERT_CUDA_OK(CudaCopyToDevice(d_x.data(), x.data(), x.size() * 2));
    ASSERT_CUDA_OK(CudaFp8Quantize(l, static_cast<const uint16_t*>(d_x.data()),
                                   static_cast<uint8_t*>(d_q.data()),
                                   static_cast<float*>(d_s.data()), nullptr));
    ASSERT_CUDA_OK(CudaCopyToHost(d_q_host.data(), d_q.data(), x.size()));
    ASSERT_CUDA_OK(CudaCopyToHost(d_s_host.data(), d_s.data(), s.size() * 4));
    EXPECT_EQ(d_q_host, q);
    for (size_t b = 0; b < s.size(); ++b) {
      EXPECT_EQ(FloatBits(d_s_host[b]), FloatBits(s[b])) << b;
    }
    std::vector<float> out(x.size()), d_out_host(x.size());
    Fp8Dequantize(l, q.data(), s.data(), out.data());
    ASSERT_CUDA_OK(CudaFp8Dequantize(l, static_cast<const uint8_t*>(d_q.data()),
                                     static_cast<const float*>(d_s.data()),
                                     static_cast<float*>(d_out.data()), nullptr));
    ASSERT_CUDA_OK(CudaCopyToHost(d_out_host.data(), d_out.data(), x.size() * 4));
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(FloatBits(d_out_host[i]), FloatBits(out[i])) << i;
  }
}

}  // namespace
}  // namespace dte::kernels
