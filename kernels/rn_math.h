// FP32 arithmetic rounded to nearest even and never contracted into an FMA,
// the same on the host and the device (rn::Mul, Div, Add, Sqrt, Fma): the
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

}  // namespace rn

}  // namespace dte::kernels
