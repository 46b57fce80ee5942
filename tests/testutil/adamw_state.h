// FP32 AdamW state of small tensors stepped with the project's bit-exact
// forward kernel, for the publisher tests: theta_prev, and after each step
// theta, m and v, with their BF16 casts as checkpoint tensors.
//
// Thread-safety: plain values and functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/adamw.h"
#include "sync/publish/publisher.h"
#include "tests/testutil/checkpoint.h"

namespace dte::test {

struct AdamWTensorState {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> prev, theta, m, v;
};

// Weights ~ N(0, 0.02), moments as after a few steps; theta is empty until
// the first AdamWStepState.
AdamWTensorState RandomAdamWState(const std::string& name, std::vector<int64_t> shape,
                                  uint64_t seed);

// Advances s by one AdamW step: prev <- theta (if stepped before), theta <-
// forward(prev), with fresh moments.
void AdamWStepState(AdamWTensorState* s, const kernels::AdamWParams& p, uint64_t seed);

// The publisher's step arguments for kernel parameters p.
AdamWStep AdamWStepOf(const kernels::AdamWParams& p);

// The BF16 cast of x as a checkpoint tensor.
TestTensor Bf16TensorOf(const std::string& name, const std::vector<int64_t>& shape,
                        const std::vector<float>& x);

// A llama checkpoint of one model.safetensors: the BF16 casts of each
// state's theta, then `others` (tensors no optimizer owns), as the
// publisher tests commit them to compare with a publish.
TestCheckpoint AdamWCheckpoint(const std::vector<AdamWTensorState>& states,
                               const std::vector<TestTensor>& others);

}  // namespace dte::test
