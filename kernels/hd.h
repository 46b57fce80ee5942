// DTE_HD marks per-element math compiled for both the host (CPU backend,
// tests) and the device (CUDA backend). Keep such functions free of host-only
// calls so the CPU tests cover exactly the math the GPU runs.
#pragma once

#if defined(__CUDACC__)
#define DTE_HD __host__ __device__ __forceinline__
#else
#define DTE_HD inline
#endif
