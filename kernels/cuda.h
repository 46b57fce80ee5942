// The CUDA backend: the same kernels as the CPU backend, on device memory.
//
// This header includes nothing from CUDA, so every module can call it in
// every build. Conventions (as in CUB):
//   - d_ pointers are device memory; h_ pointers host memory.
//   - `stream` is a cudaStream_t passed as void* (nullptr: the legacy default
//     stream). Calls only enqueue work; results are ready after the stream is
//     synchronized (CudaStreamSynchronize).
//   - Kernels that compact take a caller-provided workspace whose size comes
//     from the matching *WorkspaceBytes query for the same n (and width); any
//     cudaMalloc'ed block (256-byte aligned) of at least that size works. The
//     query itself needs a device, as CUB tunes for the device's architecture.
//   - Element counts of compacting kernels are written to device memory
//     (d_count_out, one uint64_t) so no host synchronization is needed.
//   - Per-element math is the DTE_HD code the CPU backend runs (bf16_math.h,
//     adamw_math.h, remap_math.h), so both backends return identical bits.
//
// Built without CUDA (DTE_HAVE_CUDA undefined), every call returns
// kCudaNotBuilt and CudaDeviceAvailable() is false.
//
// Thread-safety: functions may be called concurrently from any thread; the
// usual CUDA rules apply to buffers shared between streams.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/adamw.h"
#include "kernels/remap_math.h"

namespace dte::kernels {

inline constexpr int kCudaNotBuilt = -1;     // dte was compiled without CUDA
inline constexpr int kCudaBadArgument = -2;  // caught before reaching CUDA

// The outcome of a CUDA backend call: code 0 is success, a positive code is
// the cudaError_t returned by the runtime, negative codes are the constants
// above. message names the operation and the cause; empty on success.
struct [[nodiscard]] CudaStatus {
  int code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};

// True when the runtime reports at least one usable device. Never fails: a
// missing driver or device, or a build without CUDA, all yield false.
bool CudaDeviceAvailable();

// Device memory owned by this object; freed on destruction. Move-only.
class CudaBuffer {
 public:
  CudaBuffer() = default;
  ~CudaBuffer();
  CudaBuffer(CudaBuffer&& other) noexcept;
  CudaBuffer& operator=(CudaBuffer&& other) noexcept;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  // Frees any previous allocation, then allocates `bytes` (0 allowed).
  CudaStatus Allocate(size_t bytes);
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Synchronous copies (they wait for the legacy default stream).
CudaStatus CudaCopyToDevice(void* d_dst, const void* h_src, size_t bytes);
CudaStatus CudaCopyToHost(void* h_dst, const void* d_src, size_t bytes);
// Device to device, asynchronous on `stream` (null: the legacy default stream).
CudaStatus CudaCopyOnDevice(void* d_dst, const void* d_src, size_t bytes, void* stream);
CudaStatus CudaStreamSynchronize(void* stream);
// Makes `device` the calling thread's current device.
CudaStatus CudaSetDevice(int device);

// Maps device memory another process exported with cudaIpcGetMemHandle
// (`handle`: the 64 bytes of its cudaIpcMemHandle_t) on `device` into this
// process; close it with CudaIpcCloseMemHandle.
CudaStatus CudaIpcOpenMemHandle(const uint8_t* handle, int device, void** d_ptr);
CudaStatus CudaIpcCloseMemHandle(void* d_ptr);

// --- Change detection and scatter (see kernels/change_detect.h) ---

CudaStatus CudaDetectChangesWorkspaceBytes(size_t n, int width, size_t* bytes);
// Writes, in increasing i, the indices where d_old and d_new differ bitwise to
// d_idx_out and the new elements to d_val_out (room for n entries each), and
// their number to *d_count_out.
CudaStatus CudaDetectChanges(void* d_workspace, size_t workspace_bytes, const void* d_old,
                             const void* d_new, size_t n, int width, uint64_t* d_idx_out,
                             void* d_val_out, uint64_t* d_count_out, void* stream);

// d_dst[d_idx[k]] = d_vals[k] for k < count; indices distinct and in bounds.
CudaStatus CudaScatter(void* d_dst, int width, const uint64_t* d_idx, const void* d_vals,
                       size_t count, void* stream);

// --- BF16 (see kernels/bf16_math.h) ---

CudaStatus CudaCastFp32ToBf16(const float* d_in, uint16_t* d_out, size_t n, void* stream);
CudaStatus CudaCastBf16ToFp32(const uint16_t* d_in, float* d_out, size_t n, void* stream);

// --- AdamW inversion (see kernels/adamw.h); p must be valid ---

CudaStatus CudaAdamWInvert(const float* d_theta, const float* d_m, const float* d_v, size_t n,
                           const AdamWParams& p, float* d_prev_out, void* stream);
CudaStatus CudaAdamWInvertDetectWorkspaceBytes(size_t n, size_t* bytes);
// Same selection and order as AdamWInvertDetect; the near-boundary tally is
// not computed on this backend.
CudaStatus CudaAdamWInvertDetect(void* d_workspace, size_t workspace_bytes, const float* d_theta,
                                 const float* d_m, const float* d_v, size_t n, const AdamWParams& p,
                                 const AdamWDetectOptions& options, uint64_t* d_idx_out,
                                 uint16_t* d_bf16_out, uint64_t* d_count_out, void* stream);

CudaStatus CudaAdamWFindChangesWorkspaceBytes(size_t n, size_t* bytes);
// Same selection and order as AdamWFindChanges (kernels/adamw.h): the
// elements a publisher stores, with the exact resolution run on the device,
// so only those leave it.
CudaStatus CudaAdamWFindChanges(void* d_workspace, size_t workspace_bytes, const float* d_theta,
                                const float* d_m, const float* d_v, size_t n, const AdamWParams& p,
                                uint32_t margin_ulps, uint64_t* d_idx_out, uint16_t* d_bf16_out,
                                uint64_t* d_count_out, void* stream);

// --- Remap (see kernels/remap.h) ---

CudaStatus CudaRemapWorkspaceBytes(size_t n, size_t* bytes);
// Like RemapIndices over the n sorted indices at d_src_idx (d_pos_out may be
// null); the kept count goes to *d_count_out.
CudaStatus CudaRemapIndices(void* d_workspace, size_t workspace_bytes, const RemapPlan& plan,
                            const uint64_t* d_src_idx, size_t n, uint64_t* d_dst_idx_out,
                            uint64_t* d_pos_out, uint64_t* d_count_out, void* stream);

}  // namespace dte::kernels
