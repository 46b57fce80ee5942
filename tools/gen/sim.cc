// Same bits on every machine: never fuse a*b+c into one rounding. The hot
// loops are written to vectorize; ask for it even in -O2 builds (results are
// identical either way: only IEEE-exact operations, no reassociation).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "tree-vectorize", "vect-cost-model=dynamic")
#endif

#include "tools/gen/sim.h"

#include <algorithm>
#include <bit>
#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "kernels/bf16_math.h"
#include "tools/gen/rng.h"

// Hot loops get an AVX2 clone picked at run time. The results are the same
// bits on every clone: AVX2 does not enable FMA, and contraction is off.
#if defined(__x86_64__) && defined(__GNUC__)
#define DTE_GEN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DTE_GEN_CLONES
#endif

namespace dte::gen {
namespace {

constexpr float kInitStd = 0.02f;
constexpr float kGradScale = 1e-3f;      // typical gradient element magnitude
constexpr float kMaxSignal = 1.2f;       // strongest row's persistent/noise ratio
constexpr double kNeverSeenShare = 0.1;  // top token ids absent from every batch
constexpr double kSeenCoverage = 0.1;    // token r in a batch with p = min(1, c*V/(r+1))
constexpr uint64_t kWarmSteps = 1'000'000;

double PowInt(double base, uint64_t exponent) {
  double result = 1;
  for (; exponent > 0; exponent >>= 1, base *= base) {
    if (exponent & 1) result *= base;
  }
  return result;
}

}  // namespace

// Per-row gradient statistics.
struct RowInit {
  float signal = 0;  // persistent/noise ratio before the column factor
  float scale = 0;   // s_r
  float seen_p = 1;  // chance the row gets a gradient in a step
  float m_noise = 0;
};

namespace {

// The scalars of one AdamW step, in the float precision torch applies them.
struct AdamWScalars {
  uint32_t noise_key = 0;
  float decay = 1;  // 1 - lr * weight_decay
  float beta1 = 0;
  float one_minus_beta1 = 0;
  float beta2 = 0;
  float one_minus_beta2 = 0;
  float bc2_sqrt = 1;
  float eps = 0;
  float neg_step_size = 0;
};

}  // namespace

struct ChunkSimulator::StepConstants {
  AdamWScalars adamw;
  uint32_t seen_key = 0;
  float magnitude = 1;  // c_t
};

namespace {

// Elementwise square root. Written with SIMD intrinsics where available
// because compilers will not vectorize std::sqrt while it may set errno;
// sqrtps and sqrtss (and NEON's fsqrt) are all correctly rounded, so the
// bits equal the scalar fallback's.
void SqrtInto(const float* __restrict in, float* __restrict out, int64_t n) {
  int64_t j = 0;
#if defined(__SSE2__)
  for (; j + 4 <= n; j += 4) _mm_storeu_ps(out + j, _mm_sqrt_ps(_mm_loadu_ps(in + j)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  for (; j + 4 <= n; j += 4) vst1q_f32(out + j, vsqrtq_f32(vld1q_f32(in + j)));
#endif
  for (; j < n; ++j) out[j] = std::sqrt(in[j]);
}

// One AdamW step over n consecutive elements of a row, with the float
// arithmetic of torch.optim.AdamW's single-tensor path (torch 1.13), in the
// same evaluation order. Split into passes so that each vectorizes;
// `scratch` holds n floats.
DTE_GEN_CLONES void AdamWRow(const AdamWScalars& k, float scale, uint32_t first_index,
                             const float* __restrict mu, float* __restrict w, float* __restrict m,
                             float* __restrict v, float* __restrict scratch, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    float noise = CoarseNormal(Bits(k.noise_key, first_index + static_cast<uint32_t>(j)));
    float g = scale * (mu[j] + noise);
    m[j] = m[j] * k.beta1 + k.one_minus_beta1 * g;
    v[j] = v[j] * k.beta2 + k.one_minus_beta2 * g * g;
  }
  SqrtInto(v, scratch, n);
  for (int64_t j = 0; j < n; ++j) {
    float denom = scratch[j] / k.bc2_sqrt + k.eps;
    w[j] = w[j] * k.decay + k.neg_step_size * m[j] / denom;
  }
}

DTE_GEN_CLONES uint64_t EncodeBF16(const float* w, uint16_t* out, int64_t n) {
  uint64_t changed = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint16_t b = kernels::Fp32ToBf16Bits(w[j]);
    changed += b != out[j];
    out[j] = b;
  }
  return changed;
}

// Keys of the per-element initial values of one tensor.
struct InitKeys {
  uint32_t weight, weight2, dither, direction, momentum;
};

DTE_GEN_CLONES void InitWeights(const InitKeys& k, uint32_t first, float* __restrict w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t i = first + static_cast<uint32_t>(j);
    w[j] = kInitStd * FineNormal(Bits(k.weight, i), Bits(k.weight2, i), Bits(k.dither, i));
  }
}

// The persistent gradient component and the optimizer's warm start: m and v
// at their stationary values for this row's gradient statistics.
DTE_GEN_CLONES void InitMoments(const InitKeys& k, const RowInit& row, uint32_t first,
                                const float* __restrict col_signal, float* __restrict mu,
                                float* __restrict m, float* __restrict v, int64_t n) {
  const float p = row.seen_p, s = row.scale;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t i = first + static_cast<uint32_t>(j);
    mu[j] = row.signal * col_signal[j] * CoarseNormal(Bits(k.direction, i));
    m[j] = p * s * (mu[j] + row.m_noise * CoarseNormal(Bits(k.momentum, i)));
    v[j] = p * s * s * (mu[j] * mu[j] + 1.0f);
  }
}

uint64_t EncodeF32(const float* w, uint32_t* out, int64_t n) {
  uint64_t changed = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t b = std::bit_cast<uint32_t>(w[j]);
    changed += b != out[j];
    out[j] = b;
  }
  return changed;
}

}  // namespace

ChunkSimulator::ChunkSimulator(uint64_t seed, const AdamWConfig& config)
    : seed_(seed), config_(config) {}

void ChunkSimulator::Begin(const TensorSpec& spec, int64_t row_begin, int64_t row_end) {
  spec_ = &spec;
  tensor_hash_ = NameHash(spec.name);
  row_begin_ = row_begin;
  row_end_ = row_end;
  const size_t n = static_cast<size_t>((row_end - row_begin) * spec.cols());
  if (spec.role == TensorRole::kBuffer) {
    i64_.resize(n);
    for (size_t i = 0; i < n; ++i) i64_[i] = static_cast<int64_t>(i % spec.cols());
    return;
  }
  for (auto* buf : {&w_, &m_, &v_, &mu_}) buf->resize(n);
  scratch_.resize(static_cast<size_t>(spec.cols()));
  InitRows();
  if (spec.dtype == DType::kF32) {
    f32_.assign(n, 0);
  } else {
    bf16_.assign(n, 0);
  }
  Encode();
}

std::span<const uint8_t> ChunkSimulator::encoded() const {
  const void* data = bf16_.data();
  size_t bytes = bf16_.size() * sizeof(uint16_t);
  if (spec_->role == TensorRole::kBuffer) {
    data = i64_.data();
    bytes = i64_.size() * sizeof(int64_t);
  } else if (spec_->dtype == DType::kF32) {
    data = f32_.data();
    bytes = f32_.size() * sizeof(uint32_t);
  }
  return {static_cast<const uint8_t*>(data), bytes};
}

float ChunkSimulator::TokenSeenProbability(int64_t row) const {
  if (spec_->role != TensorRole::kEmbedding) return 1;
  const double vocab = static_cast<double>(spec_->rows());
  if (static_cast<double>(row) >= (1 - kNeverSeenShare) * vocab) return 0;
  return static_cast<float>(std::min(1.0, kSeenCoverage * vocab / static_cast<double>(row + 1)));
}

void ChunkSimulator::InitRows() {
  const int64_t cols = spec_->cols();
  const InitKeys keys = {
      StreamKey(seed_, tensor_hash_, Stream::kInitWeight, 0),
      StreamKey(seed_, tensor_hash_, Stream::kInitWeight, 1),
      StreamKey(seed_, tensor_hash_, Stream::kInitDither, 0),
      StreamKey(seed_, tensor_hash_, Stream::kDirection, 0),
      StreamKey(seed_, tensor_hash_, Stream::kMomentum, 0),
  };
  const uint32_t col_key = StreamKey(seed_, tensor_hash_, Stream::kColSignal, 0);
  col_signal_.resize(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    col_signal_[c] = 0.5f + Uniform(Bits(col_key, static_cast<uint32_t>(c)));
  }
  row_scale_.resize(static_cast<size_t>(row_end_ - row_begin_));
  seen_p_.resize(row_scale_.size());
  for (int64_t r = row_begin_; r < row_end_; ++r) {
    const size_t at = static_cast<size_t>(r - row_begin_) * static_cast<size_t>(cols);
    const uint32_t first = static_cast<uint32_t>(r) * static_cast<uint32_t>(cols);
    if (spec_->role == TensorRole::kNorm) {
      std::fill_n(&w_[at], cols, 1.0f);
    } else {
      InitWeights(keys, first, &w_[at], cols);
    }
    InitMoments(keys, MakeRowInit(r), first, col_signal_.data(), &mu_[at], &m_[at], &v_[at], cols);
  }
}

RowInit ChunkSimulator::MakeRowInit(int64_t row) {
  const uint32_t r = static_cast<uint32_t>(row);
  const size_t k = static_cast<size_t>(row - row_begin_);
  const float u = Uniform(Bits(StreamKey(seed_, tensor_hash_, Stream::kRowSignal, 0), r));
  const uint32_t scale_key = StreamKey(seed_, tensor_hash_, Stream::kRowScale, 0);
  RowInit init;
  init.signal = kMaxSignal * u * u;
  init.scale = kGradScale * (0.5f + Uniform(Bits(scale_key, r)));
  init.seen_p = TokenSeenProbability(row);
  // Stationary std of the EMA of unit-variance noise: sqrt((1-b1)/(1+b1)).
  init.m_noise = static_cast<float>(std::sqrt((1 - config_.beta1) / (1 + config_.beta1)));
  row_scale_[k] = init.scale;
  seen_p_[k] = init.seen_p;
  return init;
}

ChunkSimulator::StepConstants ChunkSimulator::MakeStepConstants(uint64_t step) const {
  StepConstants k;
  AdamWScalars& a = k.adamw;
  a.noise_key = StreamKey(seed_, tensor_hash_, Stream::kStepNoise, step);
  k.seen_key = StreamKey(seed_, tensor_hash_, Stream::kTokenSeen, step);
  k.magnitude =
      0.75f + 0.5f * Uniform(Bits(StreamKey(seed_, tensor_hash_, Stream::kStepScale, step), 0));
  const AdamWConfig& c = config_;
  const uint64_t t = kWarmSteps + step;
  const double bc1 = 1 - PowInt(c.beta1, t);
  const double bc2 = 1 - PowInt(c.beta2, t);
  a.decay = static_cast<float>(1 - c.lr * c.weight_decay);
  a.beta1 = static_cast<float>(c.beta1);
  a.one_minus_beta1 = static_cast<float>(1 - c.beta1);
  a.beta2 = static_cast<float>(c.beta2);
  a.one_minus_beta2 = static_cast<float>(1 - c.beta2);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.eps = static_cast<float>(c.eps);
  a.neg_step_size = static_cast<float>(-(c.lr / bc1));
  return k;
}

uint64_t ChunkSimulator::Advance(uint64_t step) {
  if (spec_->role == TensorRole::kBuffer) return 0;
  const StepConstants k = MakeStepConstants(step);
  const int64_t cols = spec_->cols();
  for (int64_t r = row_begin_; r < row_end_; ++r) {
    const size_t row = static_cast<size_t>(r - row_begin_);
    float scale = row_scale_[row] * k.magnitude;
    if (seen_p_[row] < 1 && !(Uniform(Bits(k.seen_key, static_cast<uint32_t>(r))) < seen_p_[row])) {
      scale = 0;  // the token is not in this step's batch
    }
    const size_t at = row * static_cast<size_t>(cols);
    AdamWRow(k.adamw, scale, static_cast<uint32_t>(r) * static_cast<uint32_t>(cols), &mu_[at],
             &w_[at], &m_[at], &v_[at], scratch_.data(), cols);
  }
  return Encode();
}

uint64_t ChunkSimulator::Encode() {
  const int64_t n = static_cast<int64_t>(w_.size());
  if (spec_->dtype == DType::kF32) return EncodeF32(w_.data(), f32_.data(), n);
  return EncodeBF16(w_.data(), bf16_.data(), n);
}

}  // namespace dte::gen
