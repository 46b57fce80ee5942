// FP32 arithmetic rounded to nearest even and never contracted into an FMA,
// the same on the host and the device (rn::Mul, Div, Add, Sqrt, Fma), and
// the few FP64 operations PyTorch's fused AdamW performs per element
// (rn::AddF64, DivF64, FmaF64, and the rounding rn::F64ToF32): the
// per-element math of kernels/adamw_math.h and kernels/fp8_math.h, whose
// CPU and CUDA backends must agree bit for bit.
// Thread-safety: pure functions.
#pragma once

#include "kernels/hd.h"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace dte::kernels {

// FP32 operations rounded to nearest even, never contracted into an FMA.
namespace rn {

DTE_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DTE_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

DTE_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DTE_HD float Sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// a * b + c with a single rounding.
DTE_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// FP64 a + b, rounded once.
DTE_HD double AddF64(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// FP64 a / b, rounded once.
DTE_HD double DivF64(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// FP64 a * b + c with a single rounding.
DTE_HD double FmaF64(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// x rounded to the nearest FP32 value (ties to even; subnormal results are
// kept, overflow gives +-inf).
DTE_HD float F64ToF32(double x) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(x);
#else
  return static_cast<float>(x);
#endif
}

}  // namespace rn

}  // namespace dte::kernels
