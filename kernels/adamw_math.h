// Per-element AdamW parameter update and its inversion, shared by the CPU and
// CUDA backends. Host-side setup (AdamWParams -> AdamWScalars) lives in
// kernels/adamw.h; the derivation is in docs/kernels.md.
//
// PyTorch's non-fused AdamW (amsgrad=False, maximize=False) updates one FP32
// parameter as
//   p     = theta_prev * decay                      decay = fp32(1 - lr*wd)
//   denom = sqrt(v) / bc2_sqrt + eps                v: exp_avg_sq after the step
//   theta = p + (-step_size) * m / denom            m: exp_avg after the step
// with every scalar computed in double by Python and rounded to FP32 when
// applied. The association and rounding of the last two lines differ between
// PyTorch's CPU and CUDA kernels; AdamWOrder selects which one to mirror.
// The fused optimizer (fused=True) runs, on CPU tensors, exactly kTorchCpu's
// FP32 operations; on CUDA tensors its own kernel, whose rounding changed in
// torch 2.11: kTorchCudaFused (torch 2.4 to 2.10, the decay and the eps
// addition in FP64) and kTorchCudaFusedFp32 (2.11 on, all FP32).
//
// Inversion: given theta, m and v after the step, AdamWInvertElement returns
// a value q with AdamWForwardElement(q, m, v) == theta whenever such a q
// exists (it does for inputs a matching PyTorch step produced). It undoes the
// update line from theta - update (or, failing that, the exact residual) and
// then the decay, each time moving by up to four FP32 ulps until the forward
// map reproduces theta exactly. Where several FP32 values map to the same
// theta, q may differ from the true previous value; against torch 1.13 CPU
// 89-99.9% of weights came back bit-exact and the rest within 2 ulps of
// max(|theta|, |prev|), and no BF16 change was misjudged (docs/kernels.md).
// kTorchCpu has been checked against PyTorch's CPU kernels and the two
// non-fused CUDA orders against torch 2.11 on an H200; the fused CUDA orders
// are modelled on the kernel's source and are checked against torch only by
// tools/gpu_check.sh on a GPU host.
//
// Every operation is an explicitly rounded FP32 or FP64 operation (rn::Mul,
// rn::FmaF64, ...) so nvcc's default multiply-add contraction cannot alter
// results; the kernels library is also compiled with -ffp-contract=off on
// the host.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

#include "kernels/bf16_math.h"
#include "kernels/hd.h"
#include "kernels/rn_math.h"

namespace dte::kernels {

// Which PyTorch kernel's operation order produced theta.
enum class AdamWOrder : uint8_t {
  // torch CPU tensors, foreach=False or True (both run the same CPU kernels):
  // denom = sqrt(v) / bc2_sqrt + eps; theta = p + ((-step_size) * m) / denom.
  // Also fused=True on CPU tensors: that kernel multiplies by
  // fp32(1 - lr*wd), divides sqrt(v) by fp32(bc2_sqrt), adds fp32(eps) and
  // adds (fp32(-step_size) * m) / denom (its scalar tail subtracts
  // (fp32(step_size) * m) / denom, the same value), all in FP32 as here.
  kTorchCpu = 0,
  // torch CUDA tensors, foreach=True (the default on GPUs): division by the
  // scalar is a true division; the final line is one fused multiply-add,
  // theta = fma(-step_size, m / denom, p).
  kTorchCudaForeach = 1,
  // torch CUDA tensors, foreach=False: dividing by the scalar bc2_sqrt is a
  // multiplication by its reciprocal (taken in double, rounded to FP32);
  // theta as for kTorchCudaForeach.
  kTorchCudaSingleTensor = 2,
  // torch CUDA tensors, fused=True, torch 2.4 to 2.10 (_fused_adamw_;
  // capturable or not, lr a float or a tensor: the same kernel). lr, wd and
  // eps are FP64 kernel arguments; bc1 = fp32(1 - beta1^step) and
  // bc2_sqrt = fp32(sqrt(1 - beta2^step)) are taken in FP64 from the FP32
  // step count:
  //   p     = fp32(fma(-(lr*wd), x, x))          FP64; skipped when wd == 0
  //   denom = fp32(fp32(sqrt(v) / bc2_sqrt) + eps)  the sum in FP64
  //   theta = p - (step_size * m) / denom        FP32, step_size = fp32(lr / bc1)
  // The decay is `param -= lr * weight_decay * param` on an FP32 param with
  // FP64 scalars, which nvcc (default -fmad=true) contracts into one FP64
  // fused multiply-add.
  kTorchCudaFused = 3,
  // torch CUDA tensors, fused=True, torch 2.11 and later (the same kernel
  // computing in FP32; read in 2.11.0's and 2.15.0's headers). With lr32,
  // wd32, eps32, beta32 the arguments rounded to FP32 (lr32 the tensor's
  // value for a tensor lr) and every operation FP32:
  //   p        = fma(-(lr32*wd32), x, x)         skipped when wd32 == 0
  //   bc1      = 1 - powf(beta1_32, step)        bc2_sqrt = sqrtf(1 - powf(beta2_32, step))
  //   denom    = sqrt(v) / bc2_sqrt + eps32      step_size = lr32 / bc1
  //   theta    = p - (step_size * m) / denom
  // powf is taken as correctly rounded (MakeAdamWScalars).
  kTorchCudaFusedFp32 = 4,
};

// The scalars one step applies, as PyTorch rounds them.
struct AdamWScalars {
  // fp32(1 - lr * weight_decay). The fused CUDA orders apply lr_wd instead;
  // for them decay is fp32(1 - lr_wd), the screen's estimate of the factor.
  float decay;
  // fp32(-(lr / (1 - beta1^step))); the fused CUDA orders: -step_size, whose
  // negation is exact, so adding RN(RN(neg_step_size * m) / denom) is
  // subtracting the kernel's RN(RN(step_size * m) / denom), bit for bit.
  float neg_step_size;
  float bc2_sqrt;      // fp32(sqrt(1 - beta2^step)) (kTorchCudaFusedFp32: as above)
  float inv_bc2_sqrt;  // fp32(1 / sqrt(1 - beta2^step)) (kTorchCudaSingleTensor only)
  float eps;           // fp32(eps)
  AdamWOrder order;
  // The fused CUDA orders only (false and 0 otherwise):
  bool fused_decay;  // the kernel's weight decay is not 0 (it skips the line then)
  double lr_wd;      // lr * wd in FP64 (kTorchCudaFused), lr32 * wd32 (Fp32)
  double eps_f64;    // eps, the FP64 argument (kTorchCudaFused)
};

// True for the orders whose update is rounded before it is added to p;
// the others add it in a fused multiply-add.
DTE_HD bool AdamWAddsRoundedUpdate(AdamWOrder order) {
  return order == AdamWOrder::kTorchCpu || order == AdamWOrder::kTorchCudaFused ||
         order == AdamWOrder::kTorchCudaFusedFp32;
}

namespace adamw_internal {

// The position of finite x in the order of FP32 values with -0 just below
// +0 (keys -1 and 0). Every order's forward map is monotone non-decreasing
// in this order, and BF16 rounding keeps -0 and +0 apart (0x8000, 0x0000),
// so the walks below visit both zeros.
DTE_HD int32_t OrderKey(float x) {
  const uint32_t u = FloatBits(x);
  return (u >> 31) != 0 ? -static_cast<int32_t>(u & 0x7FFFFFFFu) - 1 : static_cast<int32_t>(u);
}

// The FP32 neighbour of finite x towards +inf (up) or -inf (!up) in that
// order: the neighbour of +0 below is -0.
DTE_HD float StepUlp(float x, bool up) {
  const int32_t k = OrderKey(x) + (up ? 1 : -1);
  return BitsToFloat(k >= 0 ? static_cast<uint32_t>(k)
                            : 0x80000000u | static_cast<uint32_t>(-(k + 1)));
}

// Moves x by ulps until forward(x) has target's bits; forward must be
// monotone non-decreasing. Returns x unchanged if that takes more than
// kMaxSteps.
template <typename Forward>
DTE_HD float RefinePreimage(float x, float target, const Forward& forward) {
  constexpr int kMaxSteps = 4;
  const uint32_t want = FloatBits(target);
  float y = x;
  for (int i = 0; i < kMaxSteps; ++i) {
    const float f = forward(y);
    if (FloatBits(f) == want) return y;
    if (!IsFiniteBits(FloatBits(f)) || !IsFiniteBits(FloatBits(y))) break;
    y = StepUlp(y, OrderKey(f) < OrderKey(target));
  }
  return FloatBits(forward(y)) == want ? y : x;
}

// x -> p, the first line of the update, in three forms. Each is monotone
// non-decreasing in x where AdamWParamsError accepts the parameters (a
// positive factor, then roundings, which are monotone). Identity() says
// when the map is x itself; Start(p) is where the search for x starts.

// Every order but the fused CUDA ones: an FP32 product.
struct DecayMul {
  float decay;
  DTE_HD float operator()(float x) const { return rn::Mul(x, decay); }
  // For RL-sized lr * wd the decay often rounds to exactly 1.0f.
  DTE_HD bool Identity() const { return decay == 1.0f; }
  DTE_HD float Start(float p) const { return rn::Div(p, decay); }
};

// p / (1 - lr_wd) in FP64, rounded: within an ulp or two of x for both
// fused forms.
DTE_HD float FusedDecayStart(float p, double lr_wd) {
  return rn::F64ToF32(rn::DivF64(p, rn::AddF64(1.0, -lr_wd)));
}

// kTorchCudaFused: fp32(x - lr_wd * x), the FP64 product and difference
// rounded once (one FP64 fused multiply-add), then to FP32.
struct DecayFmaF64 {
  bool on;
  double lr_wd;
  DTE_HD float operator()(float x) const {
    if (!on) return x;
    const double xd = x;
    return rn::F64ToF32(rn::FmaF64(-lr_wd, xd, xd));
  }
  // Not when on with lr_wd == 0: the FMA still maps -0 to +0.
  DTE_HD bool Identity() const { return !on; }
  DTE_HD float Start(float p) const { return FusedDecayStart(p, lr_wd); }
};

// kTorchCudaFusedFp32: fma(-lr_wd, x, x) in FP32 (lr_wd holds an FP32 value).
struct DecayFmaF32 {
  bool on;
  float lr_wd;
  DTE_HD float operator()(float x) const { return on ? rn::Fma(-lr_wd, x, x) : x; }
  DTE_HD bool Identity() const { return !on; }
  DTE_HD float Start(float p) const { return FusedDecayStart(p, lr_wd); }
};

// Calls f(decay) with the decay map of s.order (f is generic over the three).
template <typename F>
DTE_HD auto WithDecay(const AdamWScalars& s, const F& f) {
  if (s.order == AdamWOrder::kTorchCudaFused) return f(DecayFmaF64{s.fused_decay, s.lr_wd});
  if (s.order == AdamWOrder::kTorchCudaFusedFp32) {
    return f(DecayFmaF32{s.fused_decay, static_cast<float>(s.lr_wd)});
  }
  return f(DecayMul{s.decay});
}

// p -> theta, the second line of the update, for each order.
struct AddRoundedUpdate {  // the orders of AdamWAddsRoundedUpdate
  float u;
  DTE_HD float operator()(float p) const { return rn::Add(p, u); }
};

struct AddUpdateFma {  // kTorchCudaForeach, kTorchCudaSingleTensor
  float neg_step_size;
  float q;
  DTE_HD float operator()(float p) const { return rn::Fma(neg_step_size, q, p); }
};

// x -> theta: the whole forward map.
template <typename Decay, typename AddUpdate>
struct DecayThenUpdate {
  Decay decay;
  AddUpdate add_update;
  DTE_HD float operator()(float x) const { return add_update(decay(x)); }
};

// Undoes add_update, starting from the rounded algebraic inverse p_round or,
// if no preimage is within reach of it, from the exact residual p_exact; then
// undoes the decay.
template <typename Decay, typename AddUpdate>
DTE_HD float Invert(float theta, float p_round, float p_exact, const Decay& decay,
                    const AddUpdate& add_update) {
  float p = RefinePreimage(p_round, theta, add_update);
  if (FloatBits(add_update(p)) != FloatBits(theta)) {
    p = RefinePreimage(p_exact, theta, add_update);
  }
  if (decay.Identity()) return p;
  // Several p may satisfy the first step and not all are images of the decay
  // (just below a power of two the products skip every other value), so the
  // second step refines against the whole forward map.
  return RefinePreimage(decay.Start(p), theta,
                        DecayThenUpdate<Decay, AddUpdate>{decay, add_update});
}

// WithDecay's callables for the forward map and the inversion.
struct ApplyDecay {
  float x;
  template <typename Decay>
  DTE_HD float operator()(const Decay& decay) const {
    return decay(x);
  }
};

struct InvertRoundedUpdate {
  float theta;
  AddRoundedUpdate add;
  template <typename Decay>
  DTE_HD float operator()(const Decay& decay) const {
    const float p0 = rn::Add(theta, -add.u);
    return Invert(theta, p0, p0, decay, add);
  }
};

}  // namespace adamw_internal

// sqrt(v) / bc2_sqrt + eps, rounded as `s.order` rounds it.
DTE_HD float AdamWDenom(float v, const AdamWScalars& s) {
  const float r = rn::Sqrt(v);
  if (s.order == AdamWOrder::kTorchCudaFused) {
    return rn::F64ToF32(rn::AddF64(rn::Div(r, s.bc2_sqrt), s.eps_f64));
  }
  const float scaled = s.order == AdamWOrder::kTorchCudaSingleTensor ? rn::Mul(r, s.inv_bc2_sqrt)
                                                                     : rn::Div(r, s.bc2_sqrt);
  return rn::Add(scaled, s.eps);
}

// The update the rounded-update orders add to p: RN(RN(neg_step_size * m) / denom).
DTE_HD float AdamWRoundedUpdate(float m, float v, const AdamWScalars& s) {
  return rn::Div(rn::Mul(s.neg_step_size, m), AdamWDenom(v, s));
}

// theta_prev -> theta: one parameter update, bit-identical to PyTorch's for
// the same m, v (the moments after the step) and order.
DTE_HD float AdamWForwardElement(float theta_prev, float m, float v, const AdamWScalars& s) {
  const float p = adamw_internal::WithDecay(s, adamw_internal::ApplyDecay{theta_prev});
  if (AdamWAddsRoundedUpdate(s.order)) return rn::Add(p, AdamWRoundedUpdate(m, v, s));
  return rn::Fma(s.neg_step_size, rn::Div(m, AdamWDenom(v, s)), p);
}

// theta -> an estimate of theta_prev (see the header comment for the
// guarantee). NaN and infinite inputs propagate without refinement.
DTE_HD float AdamWInvertElement(float theta, float m, float v, const AdamWScalars& s) {
  namespace ai = adamw_internal;
  if (AdamWAddsRoundedUpdate(s.order)) {
    return ai::WithDecay(s, ai::InvertRoundedUpdate{theta, {AdamWRoundedUpdate(m, v, s)}});
  }
  const float q = rn::Div(m, AdamWDenom(v, s));
  // Prefer theta - RN(step * q) to the exact residual: when the previous value
  // is tiny next to the update (a zero-initialized weight) a whole interval of
  // values are preimages, and this start picks the round one, 0 for a weight
  // that was exactly 0.
  const float p_round = rn::Add(theta, -rn::Mul(s.neg_step_size, q));
  const float p_exact = rn::Fma(-s.neg_step_size, q, theta);
  return ai::Invert(theta, p_round, p_exact, ai::DecayMul{s.decay},
                    ai::AddUpdateFma{s.neg_step_size, q});
}

// True when x lies within margin_ulps FP32 ulps of a BF16 rounding boundary
// (a value whose low 16 bits are 0x8000, halfway between two BF16 values, or
// the boundary between -0 and +0, whose BF16 bits differ), so an error of
// that many ulps in x could change Fp32ToBf16Bits(x). In relative terms
// margin_ulps ulps are between margin_ulps * 2^-24 and margin_ulps * 2^-23
// of |x|. NaN and +-inf count as near.
DTE_HD bool NearBf16Boundary(float x, uint32_t margin_ulps) {
  const uint32_t u = FloatBits(x);
  if (!IsFiniteBits(u)) return true;
  if ((u & 0x7FFFFFFFu) <= margin_ulps) return true;
  const uint32_t low = u & 0xFFFFu;
  const uint32_t distance = low >= 0x8000u ? low - 0x8000u : 0x8000u - low;
  return distance <= margin_ulps;
}

// The fused detector's per-element verdict.
enum class AdamWChange : uint8_t {
  kUnchanged = 0,
  kChanged = 1,       // BF16 of theta differs from BF16 of the reconstruction
  kNearBoundary = 2,  // equal BF16, but the reconstruction is too close to a
                      // boundary (or theta is not finite) to be sure
};

// kNearBoundary is only returned with use_margin.
DTE_HD AdamWChange AdamWClassify(float theta, float m, float v, const AdamWScalars& s,
                                 bool use_margin, uint32_t margin_ulps) {
  const float prev = AdamWInvertElement(theta, m, v, s);
  if (Fp32ToBf16Bits(prev) != Fp32ToBf16Bits(theta)) return AdamWChange::kChanged;
  if (use_margin && (NearBf16Boundary(prev, margin_ulps) || !IsFiniteBits(FloatBits(theta)))) {
    return AdamWChange::kNearBoundary;
  }
  return AdamWChange::kUnchanged;
}

// True when the fused detector reports the element.
DTE_HD bool AdamWElementChanged(float theta, float m, float v, const AdamWScalars& s,
                                bool use_margin, uint32_t margin_ulps) {
  return AdamWClassify(theta, m, v, s, use_margin, margin_ulps) != AdamWChange::kUnchanged;
}

}  // namespace dte::kernels
