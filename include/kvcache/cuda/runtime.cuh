// SPDX-License-Identifier: Apache-2.0
// CUDA runtime glue for kvcache's GPU backend: every CUDA call checked and turned into a typed
// kvcache::cuda_error carrying the CUDA error string, and RAII device buffers.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "kvcache/core/error.hpp"

namespace kvcache {

/// A CUDA runtime call failed; the message names the call and CUDA's own error string.
class cuda_error : public error {
 public:
  cuda_error(const std::string& what, cudaError_t code)
      : error(what + ": " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")"),
        code_(code) {}
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace cuda {

/// @throws cuda_error naming `what` unless `code` is cudaSuccess.
inline void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess) throw cuda_error(what, code);
}

/// After a kernel launch: @throws cuda_error for a launch failure (bad configuration, too much
/// shared memory...). Does not synchronise.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

/// Number of usable CUDA devices (0 when there is no driver or no device; never throws).
[[nodiscard]] inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

/// Why device_count() is 0, in CUDA's words ("cudaErrorInsufficientDriver: CUDA driver version
/// is insufficient for CUDA runtime version"), for a message that tells a missing device from a
/// broken driver. Empty when there is a device.
[[nodiscard]] inline std::string no_device_reason() {
  int n = 0;
  const cudaError_t why = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (why == cudaSuccess)
    return n > 0 ? std::string() : std::string("cudaGetDeviceCount found none");
  return std::string(cudaGetErrorName(why)) + ": " + cudaGetErrorString(why);
}

/// Owns `size()` elements of T in device memory (cudaMalloc; contents uninitialised). Move-only.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() noexcept = default;
  /// @throws cuda_error (cudaErrorMemoryAllocation names the byte count in its message).
  explicit DeviceBuffer(std::size_t size) : size_(size) {
    if (size != 0) {
      void* p = nullptr;
      check(cudaMalloc(&p, size * sizeof(T)),
            ("cudaMalloc of " + std::to_string(size * sizeof(T)) + " bytes").c_str());
      ptr_ = static_cast<T*>(p);
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  [[nodiscard]] T* data() noexcept { return ptr_; }
  [[nodiscard]] const T* data() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }

  /// Asynchronous host -> device copy of `count` elements at element `offset`.
  void upload(const T* host, std::size_t count, cudaStream_t stream, std::size_t offset = 0) {
    check_range(offset, count, "upload");
    check(cudaMemcpyAsync(ptr_ + offset, host, count * sizeof(T), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (host to device)");
  }
  /// Asynchronous device -> host copy; the host buffer is valid after the stream synchronises.
  void download(T* host, std::size_t count, cudaStream_t stream, std::size_t offset = 0) const {
    check_range(offset, count, "download");
    check(cudaMemcpyAsync(host, ptr_ + offset, count * sizeof(T), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync (device to host)");
  }

 private:
  void check_range(std::size_t offset, std::size_t count, const char* what) const {
    if (offset > size_ || count > size_ - offset) {
      throw shape_error(kvcache::detail::message("DeviceBuffer::", what, " of ", count,
                                                 " elements at offset ", offset,
                                                 " exceeds its size ", size_));
    }
  }
  void release() noexcept {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
    ptr_ = nullptr;
  }

  T* ptr_ = nullptr;
  std::size_t size_ = 0;
};

/// Where a DeviceCache keeps its rows (KVRows<F, DeviceArrays>, core/buffer.hpp): DeviceBuffer.
struct DeviceArrays {
  template <class T>
  using array = DeviceBuffer<T>;
};

}  // namespace cuda
}  // namespace kvcache
