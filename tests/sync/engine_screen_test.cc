// The screen's vector widths against its scalar definition.
#include "sync/publish/internal/engine_screen.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16_math.h"

namespace dte {
namespace {

// Every width this CPU supports flags exactly the elements CertainlyUnchanged
// does not rule out, keeps (in order) exactly those whose ScreenOldBits differ
// from their new bits, with those old bits, and casts exactly as
// Fp32ToBf16Bits, on special values (NaN, infinities, zeros, subnormals, huge
// and tiny weights), on mostly unchanged weights (where whole vectors take
// the fast path, and some lanes lie near its bound) and every length up to a
// few vectors (the scalar tails).
TEST(EngineScreen, EveryWidthMatchesTheScalarForm) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const float specials[] = {NAN,         -NAN,       INFINITY,  -INFINITY,       0.0f,
                            -0.0f,       1e-40f,     0x1p-100f, 0x1.fffffep127f, 3e38f,
                            0x1.0180p0f, 0x1.0080p0f};
  constexpr size_t kN = 1 << 17;
  std::vector<float> theta(kN), m(kN), v(kN);
  for (size_t i = 0; i < kN; ++i) {
    const float scale = std::pow(10.0f, static_cast<float>(i % 5) - 2.0f);
    theta[i] = i % 997 == 0 ? specials[(i / 997) % std::size(specials)] : scale * g(rng);
    m[i] = i % 1009 == 0 ? specials[(i / 1009) % std::size(specials)] : 1e-3f * g(rng);
    v[i] = m[i] * m[i] * (0.1f + std::abs(g(rng))) + (i % 1013 == 0 ? 0.0f : 1e-12f);
  }
  const auto best = static_cast<int>(internal::BestScreenIsa());
  constexpr int kOrders = 5;  // every kernels::AdamWOrder
  for (int config = 0; config < 3 * kOrders; ++config) {
    const int order = config % kOrders, band = config / kOrders;
    kernels::AdamWParams p;
    p.lr = band == 0 ? 1e-5 : band == 1 ? 1e-3 : 3e-6;
    p.weight_decay = config == 1 ? 0.0 : band == 2 ? 0.01 : 0.1;
    p.order = static_cast<kernels::AdamWOrder>(order);
    p.step = 7;
    const auto sc = internal::MakeScreenScalars(kernels::MakeAdamWScalars(p));
    std::vector<uint32_t> want_idx, want_old;
    std::vector<size_t> flagged_before(kN + 1);  // flagged among [0, i)
    size_t decided = 0, flagged = 0;
    for (size_t i = 0; i < kN; ++i) {
      flagged_before[i] = flagged;
      if (internal::CertainlyUnchanged(theta[i], m[i], v[i], sc)) continue;
      ++flagged;
      const uint32_t old = internal::ScreenOldBits(theta[i], m[i], v[i], sc);
      decided += old != internal::kScreenUndecided;
      if (old == kernels::Fp32ToBf16Bits(theta[i])) continue;
      want_idx.push_back(static_cast<uint32_t>(i));
      want_old.push_back(old);
    }
    flagged_before[kN] = flagged;
    ASSERT_GT(flagged, 0u);
    ASSERT_LT(flagged, kN);
    ASSERT_LT(want_idx.size(), flagged);  // some candidates proven unchanged
    ASSERT_GT(decided, flagged / 2);
    for (int isa = 0; isa <= best; ++isa) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{23}, size_t{47}, size_t{4099}, kN}) {
        std::vector<uint32_t> idx(kN + internal::kScreenSlack), old(kN + internal::kScreenSlack);
        std::vector<uint16_t> cast(kN, 0x1234);
        const internal::ScreenCounts count = internal::ScreenAndCastWith(
            static_cast<internal::ScreenIsa>(isa), theta.data(), m.data(), v.data(), n, sc,
            idx.data(), old.data(), cast.data());
        const std::string where = "isa " + std::to_string(isa) + " config " +
                                  std::to_string(config) + " n " + std::to_string(n);
        ASSERT_EQ(count.flagged, flagged_before[n]) << where;
        idx.resize(count.kept);
        old.resize(count.kept);
        const size_t kept =
            std::lower_bound(want_idx.begin(), want_idx.end(), n) - want_idx.begin();
        ASSERT_EQ(idx, std::vector<uint32_t>(want_idx.begin(), want_idx.begin() + kept)) << where;
        ASSERT_EQ(old, std::vector<uint32_t>(want_old.begin(), want_old.begin() + kept)) << where;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(cast[i], kernels::Fp32ToBf16Bits(theta[i])) << where << " i " << i;
        }
        if (n < kN) {
          ASSERT_EQ(cast[n], 0x1234) << where << ": wrote past n";
        }
      }
    }
  }
}

// Every width computes each element's update bit for bit as ScreenUpdate
// (the step's own rounding), for every order, including kTorchCudaFused's
// FP64 eps addition: with eps = 1e-3 it gives other bits than an FP32
// addition on many elements, so a width that added in FP32 would fail.
TEST(EngineScreen, EveryWidthComputesTheStepsUpdate) {
  std::mt19937_64 rng(17);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-12.0f, 0.0f);
  constexpr size_t kN = (1 << 15) + 13;
  std::vector<float> m(kN), v(kN), u(kN);
  for (size_t i = 0; i < kN; ++i) {
    m[i] = std::pow(10.0f, decade(rng)) * g(rng);
    v[i] = i % 101 == 0 ? 0.0f : std::pow(10.0f, 2 * decade(rng)) * (0.5f + std::abs(g(rng)));
  }
  const auto best = static_cast<int>(internal::BestScreenIsa());
  for (int order = 0; order < 5; ++order) {
    for (double eps : {1e-8, 1e-3}) {
      kernels::AdamWParams p;
      p.lr = 1e-3;
      p.eps = eps;
      p.step = 7;
      p.order = static_cast<kernels::AdamWOrder>(order);
      const auto sc = internal::MakeScreenScalars(kernels::MakeAdamWScalars(p));
      size_t eps_f64_matters = 0;
      for (size_t i = 0; i < kN; ++i) {
        namespace rn = kernels::rn;
        const float f32_denom = rn::Add(rn::Div(rn::Sqrt(v[i]), sc.s.bc2_sqrt), sc.s.eps);
        const float f32_sum = rn::Div(rn::Mul(sc.s.neg_step_size, m[i]), f32_denom);
        eps_f64_matters += kernels::FloatBits(f32_sum) !=
                           kernels::FloatBits(internal::ScreenUpdate(m[i], v[i], sc.s));
      }
      if (p.order == kernels::AdamWOrder::kTorchCudaFused && eps == 1e-3) {
        EXPECT_GT(eps_f64_matters, kN / 100);
      }
      for (int isa = 0; isa <= best; ++isa) {
        internal::ScreenUpdatesWith(static_cast<internal::ScreenIsa>(isa), m.data(), v.data(), kN,
                                    sc, u.data());
        for (size_t i = 0; i < kN; ++i) {
          ASSERT_EQ(kernels::FloatBits(u[i]),
                    kernels::FloatBits(internal::ScreenUpdate(m[i], v[i], sc.s)))
              << "isa " << isa << " order " << order << " eps " << eps << " element " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dte
