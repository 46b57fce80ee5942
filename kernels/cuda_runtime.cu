// Device discovery, device buffers and copies for the CUDA backend.
#include <cstring>
#include <utility>

#include "kernels/cuda.h"
#include "kernels/internal/cuda_util.cuh"

namespace dte::kernels {

using cuda_internal::FromCuda;

bool CudaDeviceAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Do not leave the failure for an unrelated later check.
    return false;
  }
  return count > 0;
}

CudaBuffer::~CudaBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

CudaStatus CudaBuffer::Allocate(size_t bytes) {
  if (data_ != nullptr) cudaFree(data_);
  data_ = nullptr;
  size_ = 0;
  if (bytes == 0) return {};
  CudaStatus st = FromCuda(cudaMalloc(&data_, bytes), "cudaMalloc");
  if (!st.ok()) {
    data_ = nullptr;
    st.message += " (" + std::to_string(bytes) + " bytes)";
    return st;
  }
  size_ = bytes;
  return {};
}

CudaStatus CudaCopyToDevice(void* d_dst, const void* h_src, size_t bytes) {
  if (bytes == 0) return {};
  return FromCuda(cudaMemcpy(d_dst, h_src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

CudaStatus CudaCopyToHost(void* h_dst, const void* d_src, size_t bytes) {
  if (bytes == 0) return {};
  return FromCuda(cudaMemcpy(h_dst, d_src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

CudaStatus CudaCopyOnDevice(void* d_dst, const void* d_src, size_t bytes, void* stream) {
  if (bytes == 0) return {};
  return FromCuda(cudaMemcpyAsync(d_dst, d_src, bytes, cudaMemcpyDeviceToDevice,
                                  cuda_internal::AsStream(stream)),
                  "copy on device");
}

CudaStatus CudaStreamSynchronize(void* stream) {
  return FromCuda(cudaStreamSynchronize(cuda_internal::AsStream(stream)), "stream synchronize");
}

CudaStatus CudaSetDevice(int device) {
  return FromCuda(cudaSetDevice(device), "set device");
}

CudaStatus CudaIpcOpenMemHandle(const uint8_t* handle, int device, void** d_ptr) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is 64 bytes");
  if (handle == nullptr || d_ptr == nullptr) {
    return {kCudaBadArgument, "IPC open: handle and d_ptr must be set"};
  }
  CudaStatus s = FromCuda(cudaSetDevice(device), "set device for IPC open");
  if (!s.ok()) return s;
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof h);
  return FromCuda(cudaIpcOpenMemHandle(d_ptr, h, cudaIpcMemLazyEnablePeerAccess),
                  "IPC open of a memory handle");
}

CudaStatus CudaIpcCloseMemHandle(void* d_ptr) {
  return FromCuda(cudaIpcCloseMemHandle(d_ptr), "IPC close of a memory handle");
}

}  // namespace dte::kernels
