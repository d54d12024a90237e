// SPDX-License-Identifier: Apache-2.0
// What every CUDA test needs: whether a device is there (or why the test skips), and host vectors
// copied to and from device memory.
#pragma once

#include <cstdlib>
#include <string>
#include <vector>

#include "kvcache/cuda/cuda.cuh"
#include "support/catch.hpp"

namespace kvcache::test {

// True when a CUDA device is present. Otherwise the test is skipped with CUDA's reason, or
// fails when KVCACHE_REQUIRE_CUDA_DEVICE is 1 (scripts/gpu-check.sh sets it: on a GPU machine a
// missing device, such as a driver older than the runtime, must not pass as a skip).
inline bool have_device() {
  if (cuda::device_count() > 0) return true;
  const std::string reason = cuda::no_device_reason();
  const char* required = std::getenv("KVCACHE_REQUIRE_CUDA_DEVICE");
  if (required != nullptr && std::string(required) == "1") {
    FAIL("no CUDA device (" << reason << ") and KVCACHE_REQUIRE_CUDA_DEVICE=1");
  }
  WARN("skipped: no CUDA device (" << reason
                                   << "); run scripts/gpu-check.sh on a machine with a GPU");
  return false;
}

template <class T>
std::vector<T> download(const T* device, std::size_t n) {
  std::vector<T> host(n);
  cuda::check(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return host;
}

template <class T>
cuda::DeviceBuffer<T> upload(const std::vector<T>& host) {
  cuda::DeviceBuffer<T> d(host.size());
  cuda::check(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              "upload");
  return d;
}

}  // namespace kvcache::test
