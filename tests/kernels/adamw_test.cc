#include "kernels/adamw.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/adamw_resolve_math.h"
#include "kernels/bf16.h"
#include "kernels/change_detect.h"

namespace dte::kernels {
namespace {

// One optimizer step's inputs and outputs for n parameters.
struct StepData {
  std::vector<float> prev, m, v, theta;
};

// Plausible post-step AdamW state: weights mostly N(0, 0.02) with a few
// large ones and exact zeros, gradients spanning several decades, moments
// as a short AdamW history leaves them. theta is filled by AdamWForward.
StepData MakeStep(size_t n, const AdamWParams& p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> weight(0.0f, 0.02f), big(0.0f, 2.0f), unit(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-6.0f, 0.0f);
  StepData d{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n),
             std::vector<float>(n)};
  const auto b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t kind = rng() % 100;
    d.prev[i] = kind == 0 ? 0.0f : kind < 5 ? big(rng) : weight(rng);
    const float scale = std::pow(10.0f, decade(rng));
    const float g_old = unit(rng) * scale, g = unit(rng) * scale;
    d.m[i] = b1 * (1 - b1) * g_old + (1 - b1) * g;
    d.v[i] = b2 * (1 - b2) * g_old * g_old + (1 - b2) * g * g;
    if (kind == 1) d.m[i] = 0.0f;           // no update at all
    if (kind == 2) d.m[i] = d.v[i] = 0.0f;  // denominator is eps alone
  }
  AdamWForward(d.prev.data(), d.m.data(), d.v.data(), n, p, d.theta.data());
  return d;
}

const char* OrderName(AdamWOrder o) {
  switch (o) {
    case AdamWOrder::kTorchCpu:
      return "cpu";
    case AdamWOrder::kTorchCudaForeach:
      return "cuda-foreach";
    case AdamWOrder::kTorchCudaSingleTensor:
      return "cuda-single";
    case AdamWOrder::kTorchCudaFused:
      return "cuda-fused";
    case AdamWOrder::kTorchCudaFusedFp32:
      return "cuda-fused-fp32";
  }
  return "?";
}

std::vector<AdamWParams> Configs() {
  std::vector<AdamWParams> out;
  for (AdamWOrder order :
       {AdamWOrder::kTorchCpu, AdamWOrder::kTorchCudaForeach, AdamWOrder::kTorchCudaSingleTensor,
        AdamWOrder::kTorchCudaFused, AdamWOrder::kTorchCudaFusedFp32}) {
    // RL-sized lr (decay rounds to 1.0f), a large lr with strong decay, late steps.
    using Case = std::tuple<double, double, int64_t>;  // lr, weight decay, step
    for (auto [lr, wd, step] :
         {Case{1e-6, 0.01, 1}, Case{1e-6, 0.1, 37}, Case{1e-3, 0.1, 2}, Case{3e-4, 0.01, 1000}}) {
      AdamWParams p;
      p.lr = lr;
      p.weight_decay = wd;
      p.step = step;
      p.order = order;
      out.push_back(p);
    }
  }
  return out;
}

std::string Describe(const AdamWParams& p) {
  return std::string(OrderName(p.order)) + " lr=" + std::to_string(p.lr) +
         " wd=" + std::to_string(p.weight_decay) + " step=" + std::to_string(p.step);
}

TEST(AdamW, ScalarsRoundPythonDoublesToFp32) {
  AdamWParams p;
  p.lr = 1e-3;
  p.weight_decay = 0.1;
  p.step = 3;
  const AdamWScalars s = MakeAdamWScalars(p);
  EXPECT_EQ(s.decay, static_cast<float>(1.0 - 1e-3 * 0.1));
  EXPECT_EQ(s.neg_step_size, static_cast<float>(-(1e-3 / (1.0 - std::pow(0.9, 3.0)))));
  EXPECT_EQ(s.bc2_sqrt, static_cast<float>(std::sqrt(1.0 - std::pow(0.999, 3.0))));
  // The reciprocal is taken in double, as PyTorch's CUDA division by a scalar
  // does; at step 3 it differs from the reciprocal of the FP32 scalar.
  EXPECT_EQ(s.inv_bc2_sqrt, static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 3.0))));
  EXPECT_NE(s.inv_bc2_sqrt, 1.0f / s.bc2_sqrt);
  EXPECT_EQ(s.eps, 1e-8f);
  p.lr = 1e-6;
  p.weight_decay = 0.01;
  EXPECT_EQ(MakeAdamWScalars(p).decay, 1.0f) << "1 - 1e-8 must round to 1.0f";
}

TEST(AdamW, ParamsErrorNamesTheBadField) {
  EXPECT_EQ(AdamWParamsError(AdamWParams{}), "");
  AdamWParams p;
  p.lr = -1;
  EXPECT_NE(AdamWParamsError(p).find("lr"), std::string::npos);
  p = {};
  p.beta1 = 1.0;
  EXPECT_NE(AdamWParamsError(p).find("beta1"), std::string::npos);
  p = {};
  p.beta2 = NAN;
  EXPECT_NE(AdamWParamsError(p).find("beta2"), std::string::npos);
  p = {};
  p.step = 0;
  EXPECT_NE(AdamWParamsError(p).find("step"), std::string::npos);
  p = {};
  p.lr = 10;
  p.weight_decay = 0.1;
  EXPECT_NE(AdamWParamsError(p).find("weight_decay"), std::string::npos);
}

// |a - b| in ulps of the larger of |x| and |y|.
double UlpsOfLarger(float a, float b, float x, float y) {
  const double big = std::max(std::fabs(double{x}), std::fabs(double{y}));
  if (big == 0) return a == b ? 0.0 : INFINITY;
  return std::fabs(double{a} - double{b}) / std::ldexp(1.0, std::ilogb(big) - 23);
}

TEST(AdamW, InversionIsAnExactPreimageAndNeverMisjudgesABf16Change) {
  constexpr size_t kN = 1 << 20;
  for (const AdamWParams& p : Configs()) {
    SCOPED_TRACE(Describe(p));
    const StepData d = MakeStep(kN, p, static_cast<uint32_t>(p.step));
    std::vector<float> q(kN), again(kN);
    AdamWInvert(d.theta.data(), d.m.data(), d.v.data(), kN, p, q.data());
    AdamWForward(q.data(), d.m.data(), d.v.data(), kN, p, again.data());
    size_t exact = 0, misjudged = 0;
    double worst = 0;
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(FloatBits(again[i]), FloatBits(d.theta[i])) << "not a preimage at " << i;
      exact += FloatBits(q[i]) == FloatBits(d.prev[i]);
      worst = std::max(worst, UlpsOfLarger(q[i], d.prev[i], d.theta[i], d.prev[i]));
      const uint16_t now = Fp32ToBf16Bits(d.theta[i]);
      misjudged += (Fp32ToBf16Bits(q[i]) != now) != (Fp32ToBf16Bits(d.prev[i]) != now);
    }
    // Observed on this data: 93.6% (lr 1e-3, every weight moves) to 99.99%
    // (lr 1e-6) exact, error <= 2 ulps of max(|theta|, |prev|), and not one
    // element whose BF16 change is judged wrongly.
    EXPECT_GE(exact, kN * 9 / 10);
    EXPECT_LE(worst, 2.0);
    EXPECT_EQ(misjudged, 0u);
  }
}

// With lr = 0 (a warm-up's first step) a -0 weight whose moment is negative
// becomes +0 in every order: -0 + (+0) is +0. Its BF16 bits change (0x8000
// to 0x0000) although no value moved, and both zeros are preimages of +0,
// so the publisher must keep it: the walks step from +0 to -0, and zero
// counts as a BF16 boundary for the margin.
TEST(AdamW, ZeroWhoseSignTheStepFlipsIsKept) {
  for (AdamWOrder order : {AdamWOrder::kTorchCpu, AdamWOrder::kTorchCudaForeach,
                           AdamWOrder::kTorchCudaSingleTensor, AdamWOrder::kTorchCudaFused,
                           AdamWOrder::kTorchCudaFusedFp32}) {
    SCOPED_TRACE(OrderName(order));
    AdamWParams p;
    p.lr = 0;
    p.order = order;
    const AdamWScalars s = MakeAdamWScalars(p);
    const float m = -1e-3f, v = 1e-6f;
    const float theta = AdamWForwardElement(-0.0f, m, v, s);
    ASSERT_EQ(FloatBits(theta), 0u);
    EXPECT_EQ(ResolveOldBf16(theta, m, v, s).state, OldBits::kUnknown);
    EXPECT_TRUE(AdamWElementKept(theta, m, v, s, 16));
    uint64_t idx = 0;
    uint16_t bits = 0;
    EXPECT_EQ(AdamWFindChanges(&theta, &m, &v, 1, p, 16, &idx, &bits), 1u);
  }
}

TEST(AdamW, NonFiniteInputsPropagate) {
  const AdamWScalars s = MakeAdamWScalars(AdamWParams{});
  EXPECT_TRUE(std::isnan(AdamWInvertElement(NAN, 0.1f, 0.01f, s)));
  EXPECT_TRUE(std::isnan(AdamWInvertElement(1.0f, NAN, 0.01f, s)));
  EXPECT_EQ(AdamWInvertElement(INFINITY, 0.1f, 0.01f, s), INFINITY);
  EXPECT_EQ(AdamWInvertElement(-INFINITY, 0.1f, 0.01f, s), -INFINITY);
}

TEST(AdamW, NearBoundaryCountsUlpsFromTheBf16Midpoint) {
  EXPECT_TRUE(NearBf16Boundary(BitsToFloat(0x3F808000u), 0));
  EXPECT_TRUE(NearBf16Boundary(BitsToFloat(0x3F808003u), 3));
  EXPECT_FALSE(NearBf16Boundary(BitsToFloat(0x3F808003u), 2));
  EXPECT_TRUE(NearBf16Boundary(BitsToFloat(0xBF807FFDu), 3));
  EXPECT_FALSE(NearBf16Boundary(BitsToFloat(0xBF807FFDu), 2));
  EXPECT_FALSE(NearBf16Boundary(1.0f, 1000));
  // -0 and +0 round to different BF16 bits: zero is a boundary too.
  EXPECT_TRUE(NearBf16Boundary(0.0f, 0));
  EXPECT_TRUE(NearBf16Boundary(-0.0f, 0));
  EXPECT_TRUE(NearBf16Boundary(BitsToFloat(0x00000003u), 3));
  EXPECT_FALSE(NearBf16Boundary(BitsToFloat(0x80000004u), 3));
  EXPECT_TRUE(NearBf16Boundary(INFINITY, 0));
  EXPECT_TRUE(NearBf16Boundary(NAN, 0));
}

// Fused detection against the unfused pipeline: invert, cast both, diff.
TEST(AdamW, FusedDetectEqualsInvertCastAndDiff) {
  constexpr size_t kN = (1 << 18) + 123;
  for (const AdamWParams& p : Configs()) {
    SCOPED_TRACE(Describe(p));
    const StepData d = MakeStep(kN, p, 99);
    std::vector<float> q(kN);
    AdamWInvert(d.theta.data(), d.m.data(), d.v.data(), kN, p, q.data());
    std::vector<uint16_t> old_bf(kN), new_bf(kN);
    CastFp32ToBf16(q.data(), old_bf.data(), kN);
    CastFp32ToBf16(d.theta.data(), new_bf.data(), kN);
    std::vector<uint64_t> want_idx(kN);
    std::vector<uint16_t> want_val(kN);
    const size_t want = DetectChangesParallel(old_bf.data(), new_bf.data(), kN, 2, want_idx.data(),
                                              want_val.data());
    std::vector<uint64_t> idx(kN);
    std::vector<uint16_t> val(kN);
    const AdamWDetectResult r = AdamWInvertDetect(d.theta.data(), d.m.data(), d.v.data(), kN, p,
                                                  AdamWDetectOptions{}, idx.data(), val.data());
    ASSERT_EQ(r.count, want);
    EXPECT_EQ(r.near_boundary, 0u);
    idx.resize(want);
    val.resize(want);
    want_idx.resize(want);
    want_val.resize(want);
    EXPECT_EQ(idx, want_idx);
    EXPECT_EQ(val, want_val);
    EXPECT_GT(want, 0u);
  }
}

TEST(AdamW, MarginReportsEveryTrueChangeAndCountsTheExtras) {
  constexpr size_t kN = 1 << 18;
  for (const AdamWParams& p : Configs()) {
    SCOPED_TRACE(Describe(p));
    const StepData d = MakeStep(kN, p, 5);
    std::vector<uint64_t> plain(kN), wide(kN);
    std::vector<uint16_t> vals(kN);
    const size_t n_plain = AdamWInvertDetect(d.theta.data(), d.m.data(), d.v.data(), kN, p, {},
                                             plain.data(), vals.data())
                               .count;
    AdamWDetectOptions opt;
    opt.report_near_boundary = true;
    opt.margin_ulps = 4;
    const AdamWDetectResult r = AdamWInvertDetect(d.theta.data(), d.m.data(), d.v.data(), kN, p,
                                                  opt, wide.data(), vals.data());
    EXPECT_EQ(r.count, n_plain + r.near_boundary);
    // Ground truth from the real previous weights: nothing may be missed.
    std::vector<bool> reported(kN);
    for (size_t k = 0; k < r.count; ++k) reported[wide[k]] = true;
    size_t missed = 0;
    for (size_t i = 0; i < kN; ++i) {
      if (Fp32ToBf16Bits(d.prev[i]) != Fp32ToBf16Bits(d.theta[i]) && !reported[i]) ++missed;
    }
    EXPECT_EQ(missed, 0u);
    for (size_t k = 0; k < r.count; ++k) EXPECT_EQ(vals[k], Fp32ToBf16Bits(d.theta[wide[k]]));
  }
}

// The publisher's selection: every true change kept, every dropped element
// provably unchanged, and what is kept beyond the true changes is exactly
// the elements whose old bits the resolution cannot prove.
TEST(AdamW, FindChangesKeepsEveryChangeAndDropsWhatResolutionProves) {
  constexpr size_t kN = 1 << 18;
  constexpr uint32_t kMargin = 16;
  for (const AdamWParams& p : Configs()) {
    SCOPED_TRACE(Describe(p));
    const StepData d = MakeStep(kN, p, 11);
    const AdamWScalars s = MakeAdamWScalars(p);
    std::vector<uint64_t> idx(kN), flagged(kN);
    std::vector<uint16_t> vals(kN), flagged_vals(kN);
    const size_t kept = AdamWFindChanges(d.theta.data(), d.m.data(), d.v.data(), kN, p, kMargin,
                                         idx.data(), vals.data());
    AdamWDetectOptions opt;
    opt.report_near_boundary = true;
    opt.margin_ulps = kMargin;
    const size_t reported = AdamWInvertDetect(d.theta.data(), d.m.data(), d.v.data(), kN, p, opt,
                                              flagged.data(), flagged_vals.data())
                                .count;
    std::vector<uint8_t> is_kept(kN);
    for (size_t k = 0; k < kept; ++k) {
      ASSERT_TRUE(k == 0 || idx[k] > idx[k - 1]);
      is_kept[idx[k]] = 1;
      EXPECT_EQ(vals[k], Fp32ToBf16Bits(d.theta[idx[k]]));
    }
    size_t changes = 0, unknown = 0;
    for (size_t i = 0; i < kN; ++i) {
      const bool changed = Fp32ToBf16Bits(d.prev[i]) != Fp32ToBf16Bits(d.theta[i]);
      changes += changed;
      if (changed) {
        ASSERT_TRUE(is_kept[i]) << "a change at " << i << " was dropped";
      }
      if (is_kept[i] && !changed) {
        ASSERT_EQ(ResolveOldBf16(d.theta[i], d.m[i], d.v[i], s).state, OldBits::kUnknown) << i;
        ++unknown;
      }
    }
    EXPECT_EQ(kept, changes + unknown);
    EXPECT_GT(changes, 0u);
    EXPECT_LT(kept, reported);  // the resolution dropped some of the detector's reports
    // Known old bits are the real previous weight's.
    for (size_t k = 0; k < kept; ++k) {
      const size_t i = idx[k];
      const ResolvedOld r = ResolveOldBf16(d.theta[i], d.m[i], d.v[i], s);
      if (r.state == OldBits::kKnown) {
        ASSERT_EQ(r.bits, Fp32ToBf16Bits(d.prev[i])) << i;
      }
    }
  }
}

}  // namespace
}  // namespace dte::kernels
