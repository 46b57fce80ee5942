// AdamW step inversion on the CPU backend (multi-threaded).
//
// A trainer holding FP32 master weights theta_t and AdamW's moments m_t, v_t
// right after optimizer step t can reconstruct theta_{t-1} without having
// kept a copy, and so find which BF16 elements the step changed. The element
// math and its exactness guarantee are in kernels/adamw_math.h.
//
// Supported optimizer: torch.optim.AdamW with amsgrad=False, maximize=False,
// real FP32 parameters and a constant lr for the step, either
//  - fused=False/None, capturable=False, lr a float: kTorchCpu on CPU
//    tensors, kTorchCudaForeach / kTorchCudaSingleTensor on CUDA tensors; or
//  - fused=True: kTorchCpu on CPU tensors (the fused CPU kernel performs the
//    same FP32 operations), kTorchCudaFused on CUDA tensors, capturable or
//    not; lr a float, or a tensor whose value (lr.item()) is given as lr.
// Moments must be those stored in the optimizer state after the step
// (state["exp_avg"], state["exp_avg_sq"]).
//
// Thread-safety: pure functions over caller-owned buffers; concurrent calls on
// disjoint outputs are safe. Outputs must not overlap inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/adamw_math.h"

namespace dte::kernels {

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  // The optimizer's step count after the step being inverted
  // (state["step"]; 1 for the first step).
  int64_t step = 1;
  AdamWOrder order = AdamWOrder::kTorchCpu;
};

// Empty when p can be used; otherwise says which field is wrong and why:
// lr, eps >= 0; 0 <= beta1, beta2 < 1; step >= 1; 0 < 1 - lr*wd (in FP32).
std::string AdamWParamsError(const AdamWParams& p);

// The per-step scalars, computed as Python computes them (double
// arithmetic, libm pow) and rounded as PyTorch rounds a Python float applied
// to an FP32 tensor; for kTorchCudaFused as the fused CUDA kernel computes
// them (kernels/adamw_math.h). p must be valid (AdamWParamsError(p) empty).
AdamWScalars MakeAdamWScalars(const AdamWParams& p);

// theta_out[i] = AdamWForwardElement(theta_prev[i], m[i], v[i]): the
// parameter update alone, with the moments after the step given. Used to
// check bit-exactness against PyTorch and in tests.
void AdamWForward(const float* theta_prev, const float* m, const float* v, size_t n,
                  const AdamWParams& p, float* theta_out);

// prev_out[i] = AdamWInvertElement(theta[i], m[i], v[i]) for i in [0, n).
void AdamWInvert(const float* theta, const float* m, const float* v, size_t n, const AdamWParams& p,
                 float* prev_out);

struct AdamWDetectOptions {
  // Also report elements whose reconstructed previous value lies within
  // margin_ulps FP32 ulps of a BF16 rounding boundary (or is not finite),
  // where the reconstruction error could hide a change. Reporting an element
  // that did not change is harmless: the delta then rewrites its current
  // value.
  bool report_near_boundary = false;
  uint32_t margin_ulps = 4;
};

struct AdamWDetectResult {
  size_t count = 0;          // entries written to idx_out / bf16_out
  size_t near_boundary = 0;  // of those, reported only because of the margin
};

// Fused inversion + BF16 cast + bitwise compare + compaction. For each i in
// [0, n), in increasing order, where AdamWElementChanged(...) holds, writes i
// to idx_out[k] and Fp32ToBf16Bits(theta[i]) to bf16_out[k]. Without the
// margin the output equals DetectChangesParallel over the BF16 casts of
// AdamWInvert's output and of theta. idx_out and bf16_out need room for n
// entries in the worst case.
AdamWDetectResult AdamWInvertDetect(const float* theta, const float* m, const float* v, size_t n,
                                    const AdamWParams& p, const AdamWDetectOptions& options,
                                    uint64_t* idx_out, uint16_t* bf16_out);

// The elements a publisher stores, for inputs on the host: for each i in
// [0, n), in increasing order, where AdamWElementKept(..., margin_ulps)
// holds (kernels/adamw_resolve_math.h: the fused detector with its margin,
// then the exact resolution of each reported element), writes i to
// idx_out[k] and Fp32ToBf16Bits(theta[i]) to bf16_out[k]; returns the count.
// CudaAdamWFindChanges (kernels/cuda.h) is the same on device memory. Room
// for n entries in the worst case.
size_t AdamWFindChanges(const float* theta, const float* m, const float* v, size_t n,
                        const AdamWParams& p, uint32_t margin_ulps, uint64_t* idx_out,
                        uint16_t* bf16_out);

}  // namespace dte::kernels
