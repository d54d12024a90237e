// SPDX-License-Identifier: Apache-2.0
// AlignedBuffer: the RAII owner of every K/V storage array, aligned to kStorageAlignment (64 B).
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "kvcache/core/config.hpp"

namespace kvcache {

/// Owns `size()` elements of trivially copyable T, 64-byte aligned, left uninitialized (caches
/// only ever expose elements they have written). Move-only; empty buffers own nothing.
template <class T>
requires std::is_trivially_copyable_v<T>
class AlignedBuffer {
 public:
  AlignedBuffer() noexcept = default;

  /// Allocates `size` elements. @throws std::bad_alloc, capacity_error if size * sizeof(T)
  /// overflows.
  explicit AlignedBuffer(std::size_t size) : size_(size) {
    if (size != 0) {
      const std::size_t bytes = detail::checked_mul(size, sizeof(T), "AlignedBuffer");
      ptr_.reset(static_cast<T*>(::operator new (bytes, std::align_val_t{kStorageAlignment})));
    }
  }

  AlignedBuffer(AlignedBuffer&& other) noexcept
      : ptr_(std::move(other.ptr_)), size_(std::exchange(other.size_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    ptr_ = std::move(other.ptr_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }

  [[nodiscard]] T* data() noexcept { return ptr_.get(); }
  [[nodiscard]] const T* data() const noexcept { return ptr_.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }

 private:
  struct Deleter {
    void operator()(T* p) const noexcept {
      ::operator delete (static_cast<void*>(p), std::align_val_t{kStorageAlignment});
    }
  };
  std::unique_ptr<T, Deleter> ptr_;
  std::size_t size_ = 0;
};

}  // namespace kvcache
