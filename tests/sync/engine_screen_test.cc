// The screen's vector widths against its scalar definition.
#include "sync/internal/engine_screen.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/bf16_math.h"

namespace dte {
namespace {

// Every width this CPU supports finds exactly the elements CertainlyUnchanged
// does not rule out, in order, and casts exactly as Fp32ToBf16Bits, on
// special values (NaN, infinities, zeros, subnormals, huge and tiny weights),
// on mostly unchanged weights (where whole vectors take the fast path, and
// some lanes lie near its bound) and every length up to a few vectors (the
// scalar tails).
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
  for (int order = 0; order < 6; ++order) {
    kernels::AdamWParams p;
    p.lr = order < 3 ? 1e-5 : 1e-3;
    p.weight_decay = order == 1 ? 0.0 : 0.1;
    p.order = static_cast<kernels::AdamWOrder>(order % 3);
    p.step = 7;
    const auto sc = internal::MakeScreenScalars(kernels::MakeAdamWScalars(p));
    std::vector<uint32_t> expect;
    for (size_t i = 0; i < kN; ++i) {
      if (!internal::CertainlyUnchanged(theta[i], m[i], v[i], sc)) {
        expect.push_back(static_cast<uint32_t>(i));
      }
    }
    ASSERT_GT(expect.size(), 0u);
    ASSERT_LT(expect.size(), kN);
    for (int isa = 0; isa <= best; ++isa) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{23}, size_t{47}, size_t{4099}, kN}) {
        std::vector<uint32_t> idx(kN);
        std::vector<uint16_t> cast(kN, 0x1234);
        const size_t count =
            internal::ScreenAndCastWith(static_cast<internal::ScreenIsa>(isa), theta.data(),
                                        m.data(), v.data(), n, sc, idx.data(), cast.data());
        idx.resize(count);
        std::vector<uint32_t> want(expect.begin(),
                                   std::lower_bound(expect.begin(), expect.end(), n));
        ASSERT_EQ(idx, want) << "isa " << isa << " order " << order << " n " << n;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(cast[i], kernels::Fp32ToBf16Bits(theta[i])) << "isa " << isa << " i " << i;
        }
        if (n < kN) {
          ASSERT_EQ(cast[n], 0x1234) << "isa " << isa << " wrote past n";
        }
      }
    }
  }
}

}  // namespace
}  // namespace dte
