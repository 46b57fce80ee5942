// The CUDA backend against the CPU backend. Without a device the tests that
// need one skip; the first test runs everywhere and checks that calls fail
// cleanly instead.
#include "kernels/cuda.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16.h"
#include "kernels/change_detect.h"
#include "kernels/remap.h"
#include "tests/kernels/cuda_test_util.h"

namespace dte::kernels {
namespace {

// A device copy of a host vector (or n uninitialized elements), read back
// with Download. Failures are reported as test failures where they happen.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& h) : DeviceVector(h.size()) {
    const CudaStatus st = CudaCopyToDevice(buf_.data(), h.data(), h.size() * sizeof(T));
    EXPECT_TRUE(st.ok()) << st.message;
  }
  explicit DeviceVector(size_t n) {
    const CudaStatus st = buf_.Allocate(n * sizeof(T));
    EXPECT_TRUE(st.ok()) << st.message;
  }
  T* get() const { return static_cast<T*>(buf_.data()); }
  std::vector<T> Download(size_t count) const {
    std::vector<T> h(count);
    const CudaStatus st = CudaCopyToHost(h.data(), buf_.data(), count * sizeof(T));
    EXPECT_TRUE(st.ok()) << st.message;
    return h;
  }

 private:
  CudaBuffer buf_;
};

uint64_t DownloadCount(const DeviceVector<uint64_t>& d_count) { return d_count.Download(1)[0]; }

// The first `count` elements on the device are want's first `count`.
template <typename T>
void ExpectPrefix(const DeviceVector<T>& d, std::vector<T> want, size_t count) {
  want.resize(count);
  EXPECT_EQ(d.Download(count), want);
}

TEST(Cuda, CallsFailCleanlyWithoutDeviceAndSucceedWithOne) {
  CudaBuffer buf;
  const CudaStatus alloc = buf.Allocate(1024);
  size_t bytes = 0;
  const CudaStatus query = CudaDetectChangesWorkspaceBytes(1000, 2, &bytes);
  if (CudaDeviceAvailable()) {
    EXPECT_TRUE(alloc.ok()) << alloc.message;
    EXPECT_TRUE(query.ok()) << query.message;
    EXPECT_GT(bytes, 0u);
  } else {
    EXPECT_FALSE(alloc.ok());
    EXPECT_NE(alloc.code, 0);
    EXPECT_NE(alloc.message.find("cudaMalloc"), std::string::npos) << alloc.message;
    EXPECT_FALSE(query.ok());
    EXPECT_NE(query.message.find("change detection"), std::string::npos) << query.message;
    EXPECT_EQ(buf.data(), nullptr);
  }
  const CudaStatus bad = CudaScatter(nullptr, 3, nullptr, nullptr, 0, nullptr);
  EXPECT_FALSE(bad.ok());
#if defined(DTE_HAVE_CUDA)
  EXPECT_EQ(bad.code, kCudaBadArgument) << bad.message;
#else
  EXPECT_EQ(bad.code, kCudaNotBuilt) << bad.message;
#endif
}

TEST(Cuda, DetectChangesMatchesCpuForEveryWidth) {
  SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937_64 rng(3);
  for (int width : {1, 2, 4, 8}) {
    const size_t n = 1000003;
    std::vector<uint8_t> a(n * width), b;
    for (auto& x : a) x = static_cast<uint8_t>(rng());
    b = a;
    for (size_t i = 0; i < n; i += 1 + rng() % 97) b[i * width] ^= 1;
    std::vector<uint64_t> want_idx(n);
    std::vector<uint8_t> want_val(n * width);
    const size_t want =
        DetectChangesParallel(a.data(), b.data(), n, width, want_idx.data(), want_val.data());

    size_t ws_bytes = 0;
    ASSERT_CUDA_OK(CudaDetectChangesWorkspaceBytes(n, width, &ws_bytes));
    DeviceVector<uint8_t> d_a(a), d_b(b), d_ws(ws_bytes), d_val(n * width);
    DeviceVector<uint64_t> d_idx(n), d_count(1);
    ASSERT_CUDA_OK(CudaDetectChanges(d_ws.get(), ws_bytes, d_a.get(), d_b.get(), n, width,
                                     d_idx.get(), d_val.get(), d_count.get(), nullptr));
    ASSERT_CUDA_OK(CudaStreamSynchronize(nullptr));
    ASSERT_EQ(DownloadCount(d_count), want) << "width=" << width;
    want_idx.resize(want);
    want_val.resize(want * width);
    EXPECT_EQ(d_idx.Download(want), want_idx);
    EXPECT_EQ(d_val.Download(want * width), want_val);

    // Scatter the changes back onto the old data.
    ASSERT_CUDA_OK(CudaScatter(d_a.get(), width, d_idx.get(), d_val.get(), want, nullptr));
    EXPECT_EQ(d_a.Download(n * width), b);

    // And a device-to-device copy brings back the old data.
    DeviceVector<uint8_t> d_old(a);
    ASSERT_CUDA_OK(CudaCopyOnDevice(d_a.get(), d_old.get(), n * width, nullptr));
    ASSERT_CUDA_OK(CudaStreamSynchronize(nullptr));
    EXPECT_EQ(d_a.Download(n * width), a);
  }
}

TEST(Cuda, Bf16CastsMatchCpuBitForBit) {
  SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(5);
  const size_t n = 1 << 22;
  std::vector<float> in(n);
  for (auto& f : in) f = BitsToFloat(static_cast<uint32_t>(rng()));
  std::vector<uint16_t> want(n);
  CastFp32ToBf16(in.data(), want.data(), n);
  DeviceVector<float> d_in(in), d_back(n);
  DeviceVector<uint16_t> d_out(n);
  ASSERT_CUDA_OK(CudaCastFp32ToBf16(d_in.get(), d_out.get(), n, nullptr));
  ASSERT_CUDA_OK(CudaCastBf16ToFp32(d_out.get(), d_back.get(), n, nullptr));
  EXPECT_EQ(d_out.Download(n), want);
  const std::vector<float> back = d_back.Download(n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(FloatBits(back[i]), uint32_t{want[i]} << 16);
}

// Inversion, fused detection and the publisher's selection of one step on
// the device vs the CPU.
void ExpectAdamWMatchesCpu(const std::vector<float>& theta, const std::vector<float>& m,
                           const std::vector<float>& v, const AdamWParams& p) {
  const size_t n = theta.size();
  std::vector<float> want_prev(n);
  AdamWInvert(theta.data(), m.data(), v.data(), n, p, want_prev.data());
  AdamWDetectOptions opt;
  opt.report_near_boundary = true;
  std::vector<uint64_t> want_idx(n);
  std::vector<uint16_t> want_val(n);
  const size_t want = AdamWInvertDetect(theta.data(), m.data(), v.data(), n, p, opt,
                                        want_idx.data(), want_val.data())
                          .count;

  DeviceVector<float> d_theta(theta), d_m(m), d_v(v), d_prev(n);
  ASSERT_CUDA_OK(CudaAdamWInvert(d_theta.get(), d_m.get(), d_v.get(), n, p, d_prev.get(), nullptr));
  const std::vector<float> got_prev = d_prev.Download(n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(FloatBits(got_prev[i]), FloatBits(want_prev[i]));

  size_t ws_bytes = 0;
  ASSERT_CUDA_OK(CudaAdamWInvertDetectWorkspaceBytes(n, &ws_bytes));
  DeviceVector<uint8_t> d_ws(ws_bytes);
  DeviceVector<uint64_t> d_idx(n), d_count(1);
  DeviceVector<uint16_t> d_val(n);
  ASSERT_CUDA_OK(CudaAdamWInvertDetect(d_ws.get(), ws_bytes, d_theta.get(), d_m.get(), d_v.get(), n,
                                       p, opt, d_idx.get(), d_val.get(), d_count.get(), nullptr));
  ASSERT_EQ(DownloadCount(d_count), want);
  ExpectPrefix(d_idx, want_idx, want);
  ExpectPrefix(d_val, want_val, want);

  // The publisher's selection, with the exact resolution on the device.
  constexpr uint32_t kMargin = 16;
  const size_t kept = AdamWFindChanges(theta.data(), m.data(), v.data(), n, p, kMargin,
                                       want_idx.data(), want_val.data());
  ASSERT_GT(kept, 0u);
  ASSERT_LE(kept, want);
  // At RL's small steps the resolution drops some of the detector's reports.
  if (p.lr < 1e-4) {
    EXPECT_LT(kept, want);
  }
  ASSERT_CUDA_OK(CudaAdamWFindChangesWorkspaceBytes(n, &ws_bytes));
  DeviceVector<uint8_t> d_ws2(ws_bytes);
  ASSERT_CUDA_OK(CudaAdamWFindChanges(d_ws2.get(), ws_bytes, d_theta.get(), d_m.get(), d_v.get(), n,
                                      p, kMargin, d_idx.get(), d_val.get(), d_count.get(),
                                      nullptr));
  ASSERT_EQ(DownloadCount(d_count), kept);
  ExpectPrefix(d_idx, want_idx, kept);
  ExpectPrefix(d_val, want_val, kept);
}

TEST(Cuda, AdamWInvertDetectAndFindChangesMatchCpuForEveryOrder) {
  SKIP_WITHOUT_CUDA_DEVICE();
  std::mt19937 rng(9);
  std::normal_distribution<float> w(0.0f, 0.02f), g(0.0f, 1e-3f);
  const size_t n = 1 << 21;
  std::vector<float> prev(n), m(n), v(n), theta(n);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = w(rng);
    const float gi = g(rng);
    m[i] = 0.1f * gi;
    v[i] = 0.001f * gi * gi;
  }
  for (AdamWOrder order :
       {AdamWOrder::kTorchCpu, AdamWOrder::kTorchCudaForeach, AdamWOrder::kTorchCudaSingleTensor,
        AdamWOrder::kTorchCudaFused, AdamWOrder::kTorchCudaFusedFp32}) {
    SCOPED_TRACE(static_cast<int>(order));
    for (double lr : {1e-3, 1e-6}) {  // a large step (nearly every element changes), RL's
      SCOPED_TRACE(lr);
      AdamWParams p;
      p.order = order;
      p.step = 4;
      p.lr = lr;
      AdamWForward(prev.data(), m.data(), v.data(), n, p, theta.data());
      ExpectAdamWMatchesCpu(theta, m, v, p);
    }
  }
}

TEST(Cuda, RemapMatchesCpu) {
  SKIP_WITHOUT_CUDA_DEVICE();
  RemapSpec s{{6, 40, 50}, {1, 8, 0}, {4, 16, 50}, {4, 32, 64}, {0, 16, 7}};
  RemapPlan plan;
  ASSERT_EQ(MakeRemapPlan(s, &plan), "");
  std::vector<uint64_t> src;
  for (uint64_t i = 0; i < 6 * 40 * 50 + 5; i += 3) src.push_back(i);
  const size_t n = src.size();
  std::vector<uint64_t> want_dst(n), want_pos(n);
  const size_t want = RemapIndices(plan, src.data(), n, want_dst.data(), want_pos.data());
  ASSERT_GT(want, 0u);
  size_t ws_bytes = 0;
  ASSERT_CUDA_OK(CudaRemapWorkspaceBytes(n, &ws_bytes));
  DeviceVector<uint8_t> d_ws(ws_bytes);
  DeviceVector<uint64_t> d_src(src), d_dst(n), d_pos(n), d_count(1);
  ASSERT_CUDA_OK(CudaRemapIndices(d_ws.get(), ws_bytes, plan, d_src.get(), n, d_dst.get(),
                                  d_pos.get(), d_count.get(), nullptr));
  ASSERT_EQ(DownloadCount(d_count), want);
  ExpectPrefix(d_dst, want_dst, want);
  ExpectPrefix(d_pos, want_pos, want);
}

TEST(Cuda, WorkspaceSmallerThanQueriedIsRejected) {
  SKIP_WITHOUT_CUDA_DEVICE();
  DeviceVector<uint64_t> d_count(1);
  const CudaStatus st = CudaDetectChanges(nullptr, 0, nullptr, nullptr, 100, 2, nullptr, nullptr,
                                          d_count.get(), nullptr);
  EXPECT_EQ(st.code, kCudaBadArgument) << st.message;
  EXPECT_NE(st.message.find("workspace"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace dte::kernels
