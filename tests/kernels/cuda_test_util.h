// What the CUDA backend's tests share: they skip, saying why, on a machine
// without a CUDA device, and check a CudaStatus with its message.
#pragma once

#include <gtest/gtest.h>

#include "kernels/cuda.h"

#define SKIP_WITHOUT_CUDA_DEVICE()                                                \
  if (!CudaDeviceAvailable()) {                                                   \
    GTEST_SKIP() << "no CUDA device: the runtime reports none (or dte was built " \
                    "without CUDA); the CPU tests cover the shared element math"; \
  }

#define ASSERT_CUDA_OK(expr)              \
  do {                                    \
    const CudaStatus st_ = (expr);        \
    ASSERT_TRUE(st_.ok()) << st_.message; \
  } while (0)
