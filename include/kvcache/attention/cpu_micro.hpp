// SPDX-License-Identifier: Apache-2.0
// What every micro-kernel of the fast CPU attention shares, whatever its instruction set: how a
// K/V element is read (code_value), the K/V ranges to prefetch while a tile is computed, and the
// dispatch on the number of query rows. No intrinsics: cpu_simd_ops.inc is written over these.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/format.hpp"

namespace kvcache::cpu::detail {

/// What the micro-kernels read a K/V element as: the element's value, an int8 code's value, and an
/// fp8 code's value x 2^-8 (the vector loads turn an e4m3 code into the half whose bits are the
/// code's shifted into place, which is exactly 2^-8 of its value, subnormals included). The sweep
/// multiplies each row's scale by kCodeUnit<T> to make up for it.
template <KVElement T>
inline constexpr float kCodeUnit = std::same_as<T, fp8_e4m3> ? 256.0f : 1.0f;

/// How the vector loads turn an e4m3 code, sign-extended to 16 bits, into the half exactly 2^-8 of
/// its value: shifted left by kFp8HalfShift (its exponent and mantissa under half's, a copy of
/// its sign in bit 15) and masked with kFp8HalfMask (clearing bit 14, where the code's own sign
/// bit landed).
inline constexpr int kFp8HalfShift = 7;
inline constexpr std::uint16_t kFp8HalfMask = 0xbfff;

/// The value the micro-kernels read for element x (see kCodeUnit).
template <KVElement T>
[[nodiscard]] constexpr float code_value(T x) noexcept {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else {
    return static_cast<float>(x) * (1.0f / kCodeUnit<T>);
  }
}

/// Memory a micro-kernel should start fetching while it computes: k_bytes from k and v_bytes
/// from v (the K and V rows a few tiles ahead; K and V may be stored in different formats).
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  std::size_t k_bytes = 0;
  std::size_t v_bytes = 0;
};

/// The 64-byte lines of the K (or V) side of a list of Prefetch ranges, prefetched into L2 in
/// order, a few at a time between a micro-kernel's blocks.
class FetchLines {
 public:
  FetchLines(const Prefetch* ranges, std::size_t n, bool v_side) noexcept
      : ranges_(ranges), left_(n), v_side_(v_side) {
    refill();
  }
  /// How many lines to fetch per slice to spread the lines left evenly over `slices` slices
  /// (0 for none).
  [[nodiscard]] std::size_t per_slice(std::size_t slices) const noexcept {
    if (slices == 0) return 0;
    std::size_t lines = (bytes_ + 63) / 64;
    for (std::size_t i = 0; i < left_; ++i) lines += (side_bytes(ranges_[i]) + 63) / 64;
    return (lines + slices) / slices;
  }
  /// Prefetches the next `n` lines, or as many as are left. fetch, fetch_rest and next are always
  /// inlined: one out-of-line call puts the cursor in memory for the whole micro-kernel (measured:
  /// AVX-512 16k-token half decode fell from 0.63-0.66 to 0.53-0.55 of the read bandwidth).
  [[gnu::always_inline]] void fetch(std::size_t n) noexcept {
    for (; n != 0 && bytes_ != 0; --n) to_l2(next());
  }
  /// Prefetches every line left.
  [[gnu::always_inline]] void fetch_rest() noexcept {
    while (bytes_ != 0) to_l2(next());
  }

 private:
  // A read prefetch with temporal locality 2: prefetcht1 on x86 (into L2, see qk_rows in
  // cpu_simd_ops.inc), pldl2keep on AArch64.
  [[gnu::always_inline]] static void to_l2(const char* line) noexcept {
    __builtin_prefetch(line, 0, 2);
  }
  // The next line. @pre bytes_ != 0.
  [[nodiscard, gnu::always_inline]] const char* next() noexcept {
    const char* line = cur_;
    if (bytes_ > 64) {
      cur_ += 64;
      bytes_ -= 64;
    } else {
      bytes_ = 0;
      refill();
    }
    return line;
  }

  // The bytes of this cursor's side (K or V) of a range.
  [[nodiscard]] std::size_t side_bytes(const Prefetch& r) const noexcept {
    return v_side_ ? r.v_bytes : r.k_bytes;
  }

  // Moves to the next non-empty range, if any.
  void refill() noexcept {
    for (; bytes_ == 0 && left_ != 0; ++ranges_, --left_) {
      cur_ = v_side_ ? ranges_->v : ranges_->k;
      bytes_ = side_bytes(*ranges_);
    }
  }

  const Prefetch* ranges_;
  std::size_t left_;  // ranges after the current one
  bool v_side_;
  const char* cur_ = nullptr;
  std::size_t bytes_ = 0;  // left in the current range, from cur_
};

/// Calls f(std::integral_constant<std::size_t, R>{}) with R = min(rows, 4): the SIMD micro-kernels
/// are instantiated for 1..4 query rows. @pre rows >= 1.
template <class F>
inline void with_rows(std::size_t rows, F&& f) {
  switch (rows) {
    case 1:
      return f(std::integral_constant<std::size_t, 1>{});
    case 2:
      return f(std::integral_constant<std::size_t, 2>{});
    case 3:
      return f(std::integral_constant<std::size_t, 3>{});
    default:
      return f(std::integral_constant<std::size_t, 4>{});
  }
}

}  // namespace kvcache::cpu::detail
