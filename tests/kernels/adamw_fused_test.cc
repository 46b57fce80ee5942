// The fused CUDA AdamW orders (kTorchCudaFused, kTorchCudaFusedFp32) against
// a model of PyTorch's fused CUDA kernel written here in plain C++, on
// random and adversarial state: the forward update bit for bit, the
// inversion as a preimage, and the publisher's selection against the true
// BF16 changes. The orders' shared tests (every order) are in adamw_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "kernels/adamw_resolve_math.h"
#include "kernels/bf16_math.h"

namespace dte::kernels {
namespace {

// powf(base, e) correctly rounded, through long double (64-bit mantissa).
float ReferencePowf(float base, float e) {
  return static_cast<float>(std::pow(static_cast<long double>(base), static_cast<long double>(e)));
}

// One element of torch 2.4-2.10's fused CUDA AdamW (fused_adam_utils.cuh):
// FP32 opmath, FP64 kernel arguments, the decay line contracted into one
// FP64 fused multiply-add. This file is compiled with -ffp-contract=off, so
// every other operation rounds once, in the type C++ gives it.
float TorchFusedF64(float param, float exp_avg, float exp_avg_sq, const AdamWParams& p) {
  const float step_count = static_cast<float>(p.step);
  const float bias_correction1 = static_cast<float>(1 - std::pow(p.beta1, step_count));
  const float bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1 - std::pow(p.beta2, step_count)));
  if (p.weight_decay != 0) {
    param = static_cast<float>(std::fma(-(p.lr * p.weight_decay), param, double{param}));
  }
  const float step_size = static_cast<float>(p.lr / bias_correction1);
  const float denom =
      static_cast<float>(std::sqrt(exp_avg_sq) / bias_correction2_sqrt + p.eps);  // + in FP64
  return param - step_size * exp_avg / denom;
}

// The same kernel from torch 2.11 on: every argument rounded to FP32 first.
float TorchFusedF32(float param, float exp_avg, float exp_avg_sq, const AdamWParams& p) {
  const auto lr = static_cast<float>(p.lr), wd = static_cast<float>(p.weight_decay);
  const auto eps = static_cast<float>(p.eps), step_count = static_cast<float>(p.step);
  const float bias_correction1 = 1 - ReferencePowf(static_cast<float>(p.beta1), step_count);
  const float bias_correction2_sqrt =
      std::sqrt(1 - ReferencePowf(static_cast<float>(p.beta2), step_count));
  if (wd != 0) param = std::fma(-(lr * wd), param, param);
  const float step_size = lr / bias_correction1;
  const float denom = std::sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
  return param - step_size * exp_avg / denom;
}

float TorchFused(float param, float exp_avg, float exp_avg_sq, const AdamWParams& p) {
  return p.order == AdamWOrder::kTorchCudaFused ? TorchFusedF64(param, exp_avg, exp_avg_sq, p)
                                                : TorchFusedF32(param, exp_avg, exp_avg_sq, p);
}

// A step's state: previous weights, moments after the step, and theta from
// the reference model.
struct FusedStep {
  std::vector<float> prev, m, v, theta;
};

// Weights of every awkward kind: signed zeros, subnormal and tiny values,
// large ones, ordinary N(0, 0.02) ones, and values within 48 ulps of a BF16
// rounding tie whose size puts the step's update between 2^-6 and 2^5 of
// their ulp (so some cross the tie and some stop just short of it).
float AwkwardWeight(std::mt19937_64& rng, double lr) {
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const float sign = rng() % 2 ? -1.0f : 1.0f;
  switch (rng() % 8) {
    case 0:
      return sign * 0.0f;
    case 1:
      return sign * static_cast<float>(std::pow(10.0, -30 - 15 * unit(rng)));  // to 1e-45
    case 2:
      return sign * static_cast<float>(std::pow(10.0, 2 + 2 * unit(rng)));
    case 3:
    case 4: {
      const auto near = static_cast<float>(lr * std::ldexp(1.0, 18 + static_cast<int>(rng() % 11)));
      const uint32_t base = FloatBits(near) & 0xFFFF0000u;
      const int k = static_cast<int>(rng() % 97) - 48;
      return sign * BitsToFloat(base + static_cast<uint32_t>(0x8000 + k));
    }
    default:
      return weight(rng);
  }
}

FusedStep MakeFusedStep(size_t n, const AdamWParams& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  std::uniform_real_distribution<float> decade(-7.0f, 0.0f);
  FusedStep d{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n),
              std::vector<float>(n)};
  const auto b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  for (size_t i = 0; i < n; ++i) {
    d.prev[i] = AwkwardWeight(rng, p.lr);
    const float scale = std::pow(10.0f, decade(rng));
    const float g_old = unit(rng) * scale, g = unit(rng) * scale;
    d.m[i] = b1 * (1 - b1) * g_old + (1 - b1) * g;
    d.v[i] = b2 * (1 - b2) * g_old * g_old + (1 - b2) * g * g;
    const uint64_t kind = rng() % 64;
    if (kind == 0) d.m[i] = 0.0f;            // only the decay moves it
    if (kind == 1) d.m[i] = d.v[i] = 0.0f;   // the denominator is eps alone
    if (kind == 2) d.v[i] = 0.0f;            // eps alone under a real moment
    if (kind == 3) d.m[i] = -d.m[i] * 1e3f;  // an update that dwarfs the weight
    d.theta[i] = TorchFused(d.prev[i], d.m[i], d.v[i], p);
  }
  return d;
}

AdamWParams FusedParams(AdamWOrder order, double lr, double wd, double eps, int64_t step) {
  AdamWParams p;
  p.order = order;
  p.lr = lr;
  p.weight_decay = wd;
  p.eps = eps;
  p.step = step;
  return p;
}

std::string Describe(const AdamWParams& p) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%s lr=%g wd=%g eps=%g step=%lld",
                p.order == AdamWOrder::kTorchCudaFused ? "fused-f64" : "fused-f32", p.lr,
                p.weight_decay, p.eps, static_cast<long long>(p.step));
  return buf;
}

// Every combination of the ranges the brief of these orders covers, plus
// decay factors far from 1 (lr * wd of 0.1 and 0.5).
std::vector<AdamWParams> ForwardConfigs() {
  std::vector<AdamWParams> out;
  for (AdamWOrder order : {AdamWOrder::kTorchCudaFused, AdamWOrder::kTorchCudaFusedFp32}) {
    for (double lr : {1e-7, 3e-6, 1e-4, 1e-2}) {
      for (double wd : {0.0, 0.1}) {
        for (double eps : {1e-8, 1e-6}) {
          for (int64_t step : {1, 2, 10, 137, 1000}) {
            out.push_back(FusedParams(order, lr, wd, eps, step));
          }
        }
      }
    }
    out.push_back(FusedParams(order, 1e-2, 10.0, 1e-8, 3));
    out.push_back(FusedParams(order, 0.5, 1.0, 1e-8, 5));
  }
  return out;
}

TEST(AdamWFused, ScalarsAreTheKernelsRoundings) {
  AdamWParams p = FusedParams(AdamWOrder::kTorchCudaFused, 1e-3, 0.1, 1e-8, 3);
  // The step size divides lr by the FP32 bias correction, which at some
  // steps gives another FP32 value than Python's all-FP64 lr / bc1.
  int rounding_matters = 0;
  for (int64_t step = 1; step <= 200; ++step) {
    p.step = step;
    const auto bc1 = static_cast<float>(1 - std::pow(0.9, static_cast<double>(step)));
    const float neg_step_size = MakeAdamWScalars(p).neg_step_size;
    ASSERT_EQ(neg_step_size, -static_cast<float>(1e-3 / bc1)) << step;
    rounding_matters +=
        neg_step_size !=
        MakeAdamWScalars(FusedParams(AdamWOrder::kTorchCpu, 1e-3, 0.1, 1e-8, step)).neg_step_size;
  }
  EXPECT_GT(rounding_matters, 0);
  p.step = 3;
  AdamWScalars s = MakeAdamWScalars(p);
  EXPECT_EQ(s.lr_wd, 1e-3 * 0.1);
  EXPECT_EQ(s.eps_f64, 1e-8);
  EXPECT_TRUE(s.fused_decay);
  p.weight_decay = 0;
  EXPECT_FALSE(MakeAdamWScalars(p).fused_decay) << "the kernel skips the decay when wd == 0";
  p.order = AdamWOrder::kTorchCudaFusedFp32;
  p.weight_decay = 0.1;
  s = MakeAdamWScalars(p);
  EXPECT_EQ(s.lr_wd, double{1e-3f * 0.1f});
  EXPECT_EQ(s.eps, 1e-8f);
  EXPECT_EQ(s.bc2_sqrt, std::sqrt(1 - ReferencePowf(0.999f, 3.0f)));
  EXPECT_EQ(s.neg_step_size, -(1e-3f / (1 - ReferencePowf(0.9f, 3.0f))));
  // lr * wd just below 1 in FP64 rounds to 1 in FP32: no invertible decay.
  p.lr = 1.0;
  p.weight_decay = 1 - 1e-9;
  EXPECT_NE(AdamWParamsError(p).find("FP32"), std::string::npos) << AdamWParamsError(p);
  p.order = AdamWOrder::kTorchCudaFused;
  EXPECT_EQ(AdamWParamsError(p), "");
}

// Pairs (x, d) with x (1 - d) within a few 2^-54 of an FP32 rounding tie
// plus half an FP64 ulp: where one FP64 fused multiply-add and a rounded
// FP64 product followed by a subtraction round to FP64 values on either
// side of the tie, and so to different FP32 values.
struct HardDecay {
  float x;
  double d;
};

std::vector<HardDecay> HardFp64Decays() {
  std::vector<HardDecay> out;
  for (uint32_t j = 0; j < 200; ++j) {
    const float x = 1.25f + static_cast<float>(j) * 0x1p-12f;
    const double tie = 1.0 + (2.0 * j + 1) * 0x1p-24;  // between two FP32 values
    double d = 1.0 - (tie + 0x1p-53) / x;
    for (int k = 0; k < 8; ++k) d = std::nextafter(d, 1.0);
    for (int k = 0; k < 16; ++k, d = std::nextafter(d, 0.0)) out.push_back({x, d});
  }
  return out;
}

// The FP64 kernel's decay line is one FMA: on inputs where it matters, the
// model follows the FMA and neither a rounded FP64 product nor the FP32
// product of the other orders. (tools/gpu_check.sh runs such inputs through
// torch.)
TEST(AdamWFused, DecayIsOneFp64FusedMultiplyAdd) {
  size_t differs_from_two_roundings = 0, differs_from_fp32 = 0;
  for (const HardDecay& h : HardFp64Decays()) {
    const AdamWParams p = FusedParams(AdamWOrder::kTorchCudaFused, h.d, 1.0, 1e-8, 1);
    const AdamWScalars s = MakeAdamWScalars(p);
    const double xd = h.x;
    const auto want = static_cast<float>(std::fma(-h.d, xd, xd));
    ASSERT_EQ(FloatBits(TorchFusedF64(h.x, 0.0f, 1.0f, p)), FloatBits(want)) << h.x;
    ASSERT_EQ(FloatBits(AdamWForwardElement(h.x, 0.0f, 1.0f, s)), FloatBits(want)) << h.x;
    differs_from_two_roundings += FloatBits(want) != FloatBits(static_cast<float>(xd - h.d * xd));
    differs_from_fp32 += FloatBits(want) != FloatBits(h.x * s.decay);
  }
  EXPECT_GT(differs_from_two_roundings, 100u);
  EXPECT_GT(differs_from_fp32, 100u);
}

// The FP32 kernel's decay is one FP32 FMA, not x - RN(lr_wd * x).
TEST(AdamWFused, Fp32DecayIsOneFp32FusedMultiplyAdd) {
  const AdamWParams p = FusedParams(AdamWOrder::kTorchCudaFusedFp32, 0.3, 0.9, 1e-8, 1);
  const AdamWScalars s = MakeAdamWScalars(p);
  const float t = 0.3f * 0.9f;
  std::mt19937_64 rng(3);
  size_t differs = 0;
  for (int i = 0; i < 100000; ++i) {
    const float x = BitsToFloat(0x3F800000u | static_cast<uint32_t>(rng() & 0x7FFFFF));
    const float want = std::fma(-t, x, x);
    ASSERT_EQ(FloatBits(AdamWForwardElement(x, 0.0f, 1.0f, s)), FloatBits(want)) << x;
    differs += FloatBits(want) != FloatBits(x - t * x);
  }
  EXPECT_GT(differs, 1000u);
}

// A -0 weight without an update becomes +0 under the fused decay (the FMA
// gives +0 for either zero): its BF16 bits change from 0x8000 to 0x0000, and
// the publisher keeps it, whichever zero the weight was.
TEST(AdamWFused, NegativeZeroTurnedPositiveIsKept) {
  for (AdamWOrder order : {AdamWOrder::kTorchCudaFused, AdamWOrder::kTorchCudaFusedFp32}) {
    const AdamWParams p = FusedParams(order, 1e-4, 0.1, 1e-8, 7);
    const AdamWScalars s = MakeAdamWScalars(p);
    const float theta = AdamWForwardElement(-0.0f, 0.0f, 0.0f, s);
    ASSERT_EQ(FloatBits(theta), 0u);
    ASSERT_EQ(FloatBits(TorchFused(-0.0f, 0.0f, 0.0f, p)), 0u);
    EXPECT_TRUE(AdamWElementKept(theta, 0.0f, 0.0f, s, 16)) << static_cast<int>(order);
    EXPECT_EQ(ResolveOldBf16(theta, 0.0f, 0.0f, s).state, OldBits::kUnknown);
  }
}

TEST(AdamWFused, ForwardEqualsTheKernelModelBitForBit) {
  constexpr size_t kN = 1 << 15;
  size_t total = 0;
  for (const AdamWParams& p : ForwardConfigs()) {
    SCOPED_TRACE(Describe(p));
    ASSERT_EQ(AdamWParamsError(p), "");
    const FusedStep d = MakeFusedStep(kN, p, static_cast<uint64_t>(p.step) * 1000 + total);
    std::vector<float> theta(kN);
    AdamWForward(d.prev.data(), d.m.data(), d.v.data(), kN, p, theta.data());
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(FloatBits(theta[i]), FloatBits(d.theta[i]))
          << "element " << i << ": prev " << d.prev[i] << " m " << d.m[i] << " v " << d.v[i];
    }
    total += kN;
  }
  EXPECT_GT(total, 5'000'000u);
}

// Inversion, the fused detector with its margin, and the publisher's
// selection, against the real previous weights.
TEST(AdamWFused, InversionIsAPreimageAndFindChangesKeepsExactlyTheChanges) {
  constexpr size_t kN = 1 << 18;
  constexpr uint32_t kMargin = 16;
  size_t elements = 0, changes = 0, unknown = 0;
  for (const AdamWParams& p : ForwardConfigs()) {
    if (p.eps != 1e-8 || (p.step != 1 && p.step != 1000 && p.weight_decay < 1)) continue;
    SCOPED_TRACE(Describe(p));
    const FusedStep d = MakeFusedStep(kN, p, 77 + static_cast<uint64_t>(p.step));
    const AdamWScalars s = MakeAdamWScalars(p);
    std::vector<float> q(kN);
    AdamWInvert(d.theta.data(), d.m.data(), d.v.data(), kN, p, q.data());
    std::vector<uint64_t> idx(kN);
    std::vector<uint16_t> vals(kN);
    const size_t kept = AdamWFindChanges(d.theta.data(), d.m.data(), d.v.data(), kN, p, kMargin,
                                         idx.data(), vals.data());
    std::vector<uint8_t> is_kept(kN);
    for (size_t k = 0; k < kept; ++k) is_kept[idx[k]] = 1;
    size_t here = 0;
    for (size_t i = 0; i < kN; ++i) {
      const float theta = d.theta[i];
      if (!std::isfinite(theta)) continue;  // not produced by these inputs, but never trusted
      ASSERT_EQ(FloatBits(AdamWForwardElement(q[i], d.m[i], d.v[i], s)), FloatBits(theta))
          << "not a preimage at " << i << ": prev " << d.prev[i];
      const bool changed = Fp32ToBf16Bits(d.prev[i]) != Fp32ToBf16Bits(theta);
      here += changed;
      if (changed) {
        ASSERT_TRUE(is_kept[i]) << "a change at " << i << " was dropped: prev " << d.prev[i]
                                << " theta " << theta;
      } else if (is_kept[i]) {
        ASSERT_EQ(ResolveOldBf16(theta, d.m[i], d.v[i], s).state, OldBits::kUnknown)
            << "element " << i << " kept though provably unchanged";
        ++unknown;
      }
    }
    EXPECT_GT(here, 0u);
    changes += here;
    elements += kN;
  }
  // The unprovable ones are +0 weights without an update under weight decay
  // (AwkwardWeight's zeros): the decay maps -0 and +0 alike to +0.
  std::cout << "[ info ] " << elements << " elements, " << changes << " BF16 changes, all kept; "
            << unknown << " unchanged elements kept as unprovable\n";
  EXPECT_GE(elements, 8'000'000u);
  EXPECT_LE(unknown, changes / 100);
}

}  // namespace
}  // namespace dte::kernels
