// The CUDA backend's entry points in builds without CUDA: every call reports
// kCudaNotBuilt so callers fall back to the CPU backend.
#if !defined(DTE_HAVE_CUDA)

#include <utility>

#include "kernels/cuda.h"

namespace dte::kernels {
namespace {

CudaStatus NotBuilt(const char* op) {
  return {kCudaNotBuilt, std::string(op) + ": dte was built without CUDA support"};
}

}  // namespace

bool CudaDeviceAvailable() { return false; }

CudaBuffer::~CudaBuffer() = default;
CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  data_ = std::exchange(other.data_, nullptr);
  size_ = std::exchange(other.size_, 0);
  return *this;
}
CudaStatus CudaBuffer::Allocate(size_t) { return NotBuilt("cudaMalloc"); }

CudaStatus CudaCopyToDevice(void*, const void*, size_t) { return NotBuilt("copy to device"); }
CudaStatus CudaCopyToHost(void*, const void*, size_t) { return NotBuilt("copy to host"); }
CudaStatus CudaCopyOnDevice(void*, const void*, size_t, void*) {
  return NotBuilt("copy on device");
}
CudaStatus CudaStreamSynchronize(void*) { return NotBuilt("stream synchronize"); }
CudaStatus CudaSetDevice(int) { return NotBuilt("set device"); }
CudaStatus CudaIpcOpenMemHandle(const uint8_t*, int, void**) { return NotBuilt("IPC open"); }
CudaStatus CudaIpcCloseMemHandle(void*) { return NotBuilt("IPC close"); }

CudaStatus CudaDetectChangesWorkspaceBytes(size_t, int, size_t*) {
  return NotBuilt("CUDA change detection workspace query");
}
CudaStatus CudaDetectChanges(void*, size_t, const void*, const void*, size_t, int, uint64_t*, void*,
                             uint64_t*, void*) {
  return NotBuilt("CUDA change detection");
}
CudaStatus CudaScatter(void*, int, const uint64_t*, const void*, size_t, void*) {
  return NotBuilt("CUDA scatter");
}
CudaStatus CudaCastFp32ToBf16(const float*, uint16_t*, size_t, void*) {
  return NotBuilt("CUDA FP32 to BF16 cast");
}
CudaStatus CudaCastBf16ToFp32(const uint16_t*, float*, size_t, void*) {
  return NotBuilt("CUDA BF16 to FP32 cast");
}
CudaStatus CudaAdamWInvert(const float*, const float*, const float*, size_t, const AdamWParams&,
                           float*, void*) {
  return NotBuilt("CUDA AdamW inversion");
}
CudaStatus CudaAdamWInvertDetectWorkspaceBytes(size_t, size_t*) {
  return NotBuilt("CUDA AdamW change detection workspace query");
}
CudaStatus CudaAdamWInvertDetect(void*, size_t, const float*, const float*, const float*, size_t,
                                 const AdamWParams&, const AdamWDetectOptions&, uint64_t*,
                                 uint16_t*, uint64_t*, void*) {
  return NotBuilt("CUDA AdamW change detection");
}
CudaStatus CudaAdamWFindChangesWorkspaceBytes(size_t, size_t*) {
  return NotBuilt("CUDA AdamW change finding workspace query");
}
CudaStatus CudaAdamWFindChanges(void*, size_t, const float*, const float*, const float*, size_t,
                                const AdamWParams&, uint32_t, uint64_t*, uint16_t*, uint64_t*,
                                void*) {
  return NotBuilt("CUDA AdamW change finding");
}
CudaStatus CudaRemapWorkspaceBytes(size_t, size_t*) {
  return NotBuilt("CUDA remap workspace query");
}
CudaStatus CudaRemapIndices(void*, size_t, const RemapPlan&, const uint64_t*, size_t, uint64_t*,
                            uint64_t*, uint64_t*, void*) {
  return NotBuilt("CUDA remap");
}

}  // namespace dte::kernels

#endif  // !defined(DTE_HAVE_CUDA)
