// SPDX-License-Identifier: Apache-2.0
// AlignedBuffer: the RAII owner of every K/V storage array, aligned to kStorageAlignment (64 B),
// large ones to 2 MiB and advised to the kernel as transparent-huge-page candidates. RowBuffer:
// K/V rows of one storage format, with their scales when the format has them. KVRows: a cache's K
// and V rows, in slabs, of one format or a K/V pair.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "kvcache/core/config.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/layout.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvcache {

/// Buffers of at least this many bytes are aligned to kHugePageBytes and, on Linux, advised with
/// madvise(MADV_HUGEPAGE), which takes effect where transparent huge pages are set to `madvise`
/// or `always`. Decode reads every K/V row of a sequence once per step: with 4 KiB pages that is
/// a TLB miss every 4 KiB of each K and V stream (Zen 4, half K/V, 16k-token decode: 8-20%
/// more bandwidth with huge pages across runs), and a fresh cache takes 512x fewer first-touch
/// faults.
inline constexpr std::size_t kHugePageAdviceBytes = std::size_t{8} << 20;
/// The huge-page size the large buffers are aligned to (x86-64 and most arm64 kernels).
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

namespace detail {

/// Asks the kernel to back [p, p + bytes) with huge pages; a hint, so failure is ignored.
inline void advise_huge_pages([[maybe_unused]] void* p,
                              [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  (void)::madvise(p, bytes, MADV_HUGEPAGE);
#endif
}

}  // namespace detail

/// Owns `size()` elements of trivially copyable T, 64-byte aligned (2 MiB from
/// kHugePageAdviceBytes on), left uninitialized (caches only ever expose elements they have
/// written). Move-only; empty buffers own nothing.
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
      const bool huge = bytes >= kHugePageAdviceBytes;
      const std::align_val_t align{huge ? kHugePageBytes : kStorageAlignment};
      ptr_ = std::unique_ptr<T, Deleter>(static_cast<T*>(::operator new(bytes, align)),
                                         Deleter{align});
      // Whole huge pages only: the tail past the last 2 MiB boundary may be shared with the heap.
      if (huge) detail::advise_huge_pages(ptr_.get(), bytes / kHugePageBytes * kHugePageBytes);
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
    std::align_val_t align{kStorageAlignment};
    void operator()(T* p) const noexcept { ::operator delete(static_cast<void*>(p), align); }
  };
  std::unique_ptr<T, Deleter> ptr_;
  std::size_t size_ = 0;
};

/// Where RowBuffer and KVRows keep their arrays: `array<T>` is an owning, move-only buffer of T
/// with data(), size() and bytes(). HostArrays: AlignedBuffer (host memory; the CUDA backend has
/// its own, for device memory).
struct HostArrays {
  template <class T>
  using array = AlignedBuffer<T>;
};

/// Storage for `rows` K/V rows of head_dim elements of format T, plus, for a quantized format
/// (int8, fp8), one scale per row in a second buffer laid out as the rows: the scale of the row at
/// element offset o is scales()[o / head_dim] (KVLayout's k_scale convention). Arrays: where the
/// buffers live (HostArrays).
template <KVElement T, class Arrays = HostArrays>
class RowBuffer {
 public:
  RowBuffer() noexcept = default;
  /// @throws capacity_error if rows * head_dim overflows, std::bad_alloc. @pre head_dim >= 1.
  RowBuffer(std::size_t rows, std::size_t head_dim)
      : codes_(detail::checked_mul(rows, head_dim, "RowBuffer")),
        scales_(scaled_v<T> ? rows : 0),
        head_dim_(head_dim) {}

  [[nodiscard]] T* data() noexcept { return codes_.data(); }
  [[nodiscard]] const T* data() const noexcept { return codes_.data(); }
  /// The first row's scale; null for f32/f16/bf16.
  [[nodiscard]] scale_type* scales() noexcept { return scaled_v<T> ? scales_.data() : nullptr; }
  [[nodiscard]] const scale_type* scales() const noexcept {
    return scaled_v<T> ? scales_.data() : nullptr;
  }
  /// The scale of the row at element offset `offset` (a multiple of head_dim) and those after
  /// it; null for f32/f16/bf16.
  [[nodiscard]] scale_type* scale_at(std::size_t offset) noexcept {
    return scaled_v<T> ? scales_.data() + offset / head_dim_ : nullptr;
  }
  [[nodiscard]] const scale_type* scale_at(std::size_t offset) const noexcept {
    return scaled_v<T> ? scales_.data() + offset / head_dim_ : nullptr;
  }
  /// Elements (codes) held, rows x head_dim.
  [[nodiscard]] std::size_t size() const noexcept { return codes_.size(); }
  /// Elements of one row.
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  /// Bytes of rows and scales.
  [[nodiscard]] std::size_t bytes() const noexcept { return codes_.bytes() + scales_.bytes(); }

 private:
  typename Arrays::template array<T> codes_;
  typename Arrays::template array<scale_type> scales_;
  std::size_t head_dim_ = 1;
};

/// The K and V rows of a cache in format F (one element type, or KVFormats<K, V>), as
/// `num_slabs` slabs of `slab_rows` rows a side (a slab: one sequence of one layer, or one block
/// of one layer), each side's slabs laid out alike: the V row of the K row at element offset `at`
/// is v(at), and slab i's first K row is at i * slab_stride(). One format keeps both sides in one
/// allocation, each slab its K rows then its V rows ([K, V]: the layout PagedCache::layer_data()
/// exposes); a pair of formats keeps a K allocation and a V allocation. Row scales of a quantized
/// side sit beside its rows (RowBuffer). Arrays: where they live (HostArrays; the CUDA backend's
/// DeviceCache keeps its rows the same way in device memory). Move-only.
template <KVFormat F, class Arrays = HostArrays>
class KVRows {
 public:
  using key_type = key_format_t<F>;
  using value_type = value_format_t<F>;

  KVRows() noexcept = default;
  /// @throws capacity_error if the size overflows, std::bad_alloc. @pre head_dim >= 1.
  KVRows(std::size_t num_slabs, std::size_t slab_rows, std::size_t head_dim)
      : slab_stride_(
            detail::checked_mul(kOneFormat ? 2 * slab_rows : slab_rows, head_dim, "KVRows")) {
    const std::size_t rows = detail::checked_mul(num_slabs, slab_rows, "KVRows");
    k_ = RowBuffer<key_type, Arrays>(kOneFormat ? detail::checked_mul(rows, 2, "KVRows") : rows,
                                     head_dim);
    if constexpr (!kOneFormat) v_ = RowBuffer<value_type, Arrays>(rows, head_dim);
  }

  /// Elements from one slab's first row to the next slab's (the same on both sides).
  [[nodiscard]] std::size_t slab_stride() const noexcept { return slab_stride_; }

  /// The K row at element offset `at` (a multiple of head_dim) and those after it.
  [[nodiscard]] key_type* k(std::size_t at) noexcept { return k_.data() + at; }
  [[nodiscard]] const key_type* k(std::size_t at) const noexcept { return k_.data() + at; }
  /// The V row of the K row at `at`.
  [[nodiscard]] value_type* v(std::size_t at) noexcept {
    if constexpr (kOneFormat) {
      return k_.data() + at + v_offset();
    } else {
      return v_.data() + at;
    }
  }
  [[nodiscard]] const value_type* v(std::size_t at) const noexcept {
    if constexpr (kOneFormat) {
      return k_.data() + at + v_offset();
    } else {
      return v_.data() + at;
    }
  }
  /// The scale of the K row at `at` (and those after it); null when K is not quantized.
  [[nodiscard]] scale_type* k_scale(std::size_t at) noexcept { return k_.scale_at(at); }
  [[nodiscard]] const scale_type* k_scale(std::size_t at) const noexcept { return k_.scale_at(at); }
  /// The scale of the V row of the K row at `at`; null when V is not quantized.
  [[nodiscard]] scale_type* v_scale(std::size_t at) noexcept {
    if constexpr (kOneFormat) {
      return k_.scale_at(at + v_offset());
    } else {
      return v_.scale_at(at);
    }
  }
  [[nodiscard]] const scale_type* v_scale(std::size_t at) const noexcept {
    if constexpr (kOneFormat) {
      return k_.scale_at(at + v_offset());
    } else {
      return v_.scale_at(at);
    }
  }
  /// Every pointer a layout needs from the slab whose first K row is at `at`.
  [[nodiscard]] KVBases<F> bases(std::size_t at) const noexcept {
    return {k(at), v(at), k_scale(at), v_scale(at), static_cast<std::int64_t>(slab_stride_)};
  }
  /// Bytes of rows and scales, both sides.
  [[nodiscard]] std::size_t bytes() const noexcept { return k_.bytes() + v_.bytes(); }

  /// Calls f(array, slab_bytes) for each allocation, rows and scales alike, K's first: its first
  /// byte and the bytes one slab holds in it (slab i's part of an array starts i * slab_bytes in).
  /// Copies whole slabs (a paged cache's blocks) whatever the format: between two KVRows of the
  /// same F and slab size, the arrays come in the same order.
  template <class Fn>
  void for_each_array(Fn&& f) {
    each_array<std::byte>(k_, f);
    if constexpr (!kOneFormat) each_array<std::byte>(v_, f);
  }
  template <class Fn>
  void for_each_array(Fn&& f) const {
    each_array<const std::byte>(k_, f);
    if constexpr (!kOneFormat) each_array<const std::byte>(v_, f);
  }

 private:
  static constexpr bool kOneFormat = std::is_same_v<key_type, value_type>;

  // One format: elements from a K row to its V row, the second half of the slab.
  [[nodiscard]] std::size_t v_offset() const noexcept { return slab_stride_ / 2; }

  template <class Byte, class Rows, class Fn>
  void each_array(Rows& rows, Fn& f) const {
    using T = std::remove_cvref_t<decltype(*rows.data())>;
    f(reinterpret_cast<Byte*>(rows.data()), slab_stride_ * sizeof(T));
    if constexpr (scaled_v<T>) {
      f(reinterpret_cast<Byte*>(rows.scales()),
        slab_stride_ / rows.head_dim() * sizeof(scale_type));
    }
  }

  RowBuffer<key_type, Arrays> k_;    // one format: both sides
  RowBuffer<value_type, Arrays> v_;  // a pair: the V side; one format: empty
  std::size_t slab_stride_ = 0;
};

}  // namespace kvcache
