// SPDX-License-Identifier: Apache-2.0
// Storage formats of K/V rows: how a row of head_dim floats is written into a cache and read
// back. f32, f16 and bf16 rows are the elements themselves; int8 and fp8 (e4m3) rows are codes
// plus one scale per (token, KV head) row, value = code x scale. The scales live beside the codes
// in an array of their own, one per row, indexed by row offset / head_dim (see KVLayout).
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/host_device.hpp"
#include "kvcache/core/math.hpp"

namespace kvcache {

/// The type of a quantized row's scale. bfloat16 has float's range, so no row of finite floats
/// overflows its scale, and 2 bytes keep an int8 or fp8 row of head_dim >= 64 within 0.53 of a
/// half row (head_dim + 2 bytes against 2 x head_dim).
using scale_type = bfloat16;

/// Keys stored in format K and values in format V, chosen independently (each an element format
/// or a quantized one): llama.cpp's --cache-type-k / --cache-type-v. Attention reads such K/V
/// through any view whose value_type is KVFormats<K, V> (SegmentView over the caller's own
/// storage): a quantized side's rows carry their scales, the other side's do not. KVFormats<T, T>
/// reads as T (canonical_format_t).
template <KVElement K, KVElement V>
struct KVFormats {
  using key_type = K;
  using value_type = V;
};

namespace detail {
template <class F>
struct FormatSides {};  // F is not a K/V format: no key, no value
template <KVElement T>
struct FormatSides<T> {
  using key = T;
  using value = T;
};
template <KVElement K, KVElement V>
struct FormatSides<KVFormats<K, V>> {
  using key = K;
  using value = V;
};
}  // namespace detail

/// What a view's K and V are stored as: one KVElement for both, or a KVFormats pair.
template <class F>
concept KVFormat = requires {
  typename detail::FormatSides<F>::key;
  typename detail::FormatSides<F>::value;
};

/// The key and the value format of F (both F for a KVElement).
template <KVFormat F>
using key_format_t = typename detail::FormatSides<F>::key;
template <KVFormat F>
using value_format_t = typename detail::FormatSides<F>::value;

/// The format F is read as: T for KVFormats<T, T> (the same rows as a view of T, so the same
/// kernels), F otherwise.
template <KVFormat F>
using canonical_format_t =
    std::conditional_t<std::same_as<key_format_t<F>, value_format_t<F>>, key_format_t<F>, F>;

/// U is T, an element format (f32, f16 or bf16): rows of it are stored as they are.
template <class U, class T>
concept SameElement = Element<T> && std::same_as<U, T>;

/// U is float, const or not.
template <class U>
concept FloatRows = std::same_as<float, std::remove_const_t<U>>;

/// The rows (of element type U, const or not) that a cache of format T appends: float, rounded
/// to T or quantized per row, or T itself for an f32/f16/bf16 cache. A quantized cache takes no
/// codes from outside: its scales are its own.
template <class U, class T>
concept AppendRows = FloatRows<U> || SameElement<std::remove_const_t<U>, T>;

/// True for the formats whose rows carry a scale.
template <KVElement T>
inline constexpr bool scaled_v = QuantizedElement<T>;

/// True when rows of format F carry scales on either side: int8, fp8, or a KVFormats pair with a
/// quantized side (LayerRestore<F> then holds scales).
template <KVFormat F>
inline constexpr bool has_row_scales_v = scaled_v<key_format_t<F>> || scaled_v<value_format_t<F>>;

/// The largest code magnitude of a quantized format: 127 for int8 (symmetric), 448 for fp8.
template <QuantizedElement T>
inline constexpr float code_max = std::same_as<T, qint8> ? 127.0f : fp8_e4m3::max_finite;

/// The code nearest to x (round to nearest even) for x within +-code_max<T> (int8: clamped to
/// +-127; fp8: saturated at +-448). @pre x is not NaN.
template <QuantizedElement T>
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE T encode(float x) noexcept {
  if constexpr (std::same_as<T, qint8>) {
    const float clamped = x < -127.0f ? -127.0f : x > 127.0f ? 127.0f : x;
    return qint8(
        static_cast<std::int8_t>(detail::math::nearbyint(clamped)));  // default mode: to even
  } else {
    return fp8_e4m3(x);
  }
}

/// A code's value (exact); the row's value is this times its scale.
template <QuantizedElement T>
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr float decode(T code) noexcept {
  return static_cast<float>(code);
}

/// One step of the largest magnitude of a row: max(acc, |x|), or inf once the row holds an inf
/// or NaN (which row_scale turns into a NaN scale). Fold it over the row from 0 in any order.
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr float row_amax_step(float acc,
                                                                       float x) noexcept {
  if (!(x - x == 0.0f)) return __builtin_huge_valf();  // inf - inf and NaN - NaN are NaN
  const float a = x < 0.0f ? -x : x;
  return a > acc ? a : acc;
}

/// The scale of a row whose largest magnitude is `amax`: amax / code_max<T> rounded up to a
/// bfloat16, so that no finite value of the row exceeds code_max x scale and its codes need no
/// clamping. 0 for a row of zeros, or one so small that amax / code_max underflows (amax below
/// ~1.8e-43 for int8): such a row reads back as zeros. NaN when amax is inf or NaN (a non-finite
/// row).
template <QuantizedElement T>
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr scale_type row_scale(float amax) noexcept {
  if (!(amax <= 3.4028235e38f)) return scale_type::from_bits(0x7fc0u);  // inf or NaN
  const std::uint32_t u = detail::float_bits(amax / code_max<T>);
  const auto top = static_cast<std::uint16_t>(u >> 16);
  return scale_type::from_bits(static_cast<std::uint16_t>((u & 0xffffu) != 0 ? top + 1 : top));
}

/// The code of x in a row whose scale (as a float) is `scale`: encode(x / scale), or 0 when the
/// scale is 0 or NaN (a row of zeros, or a non-finite one). A division, not a multiply by
/// 1 / scale: that reciprocal overflows for scales below ~3e-39.
template <QuantizedElement T>
[[nodiscard]] KVCACHE_HOST_DEVICE_INLINE T encode_in_row(float x, float scale) noexcept {
  return scale > 0.0f ? encode<T>(x / scale) : T{};
}

/// Writes one row of d floats in format T: for an Element, the values rounded to T (nearest even,
/// as convert_from_float); for a quantized format, codes = round-to-nearest-even(x / scale) with
/// scale = row_scale(max |x|), and *scale set. A row holding an inf or NaN gets a NaN scale and
/// zero codes: every value of it reads back as NaN (attention then gives NaN for the queries that
/// see it, as with an unquantized inf or NaN). `scale` is unused (may be null) for Elements.
template <KVElement T>
void quantize_row(const float* in, std::size_t d, T* out, scale_type* scale) noexcept {
  if constexpr (Element<T>) {
    convert_from_float(std::span<const float>(in, d), out);
  } else {
    float amax = 0.0f;
    for (std::size_t x = 0; x < d; ++x) amax = row_amax_step(amax, in[x]);
    *scale = row_scale<T>(amax);
    const auto sf = static_cast<float>(*scale);
    for (std::size_t x = 0; x < d; ++x) out[x] = encode_in_row<T>(in[x], sf);
  }
}

/// Reads one row of d elements of format T back as floats: the elements, or codes x scale.
template <KVElement T>
void dequantize_row(const T* in, const scale_type* scale, std::size_t d, float* out) noexcept {
  if constexpr (Element<T>) {
    (void)scale;
    convert_to_float(std::span<const T>(in, d), out);
  } else {
    const auto s = static_cast<float>(*scale);
    for (std::size_t x = 0; x < d; ++x) out[x] = decode(in[x]) * s;
  }
}

namespace detail {

/// Writes n rows of d elements of an append block (AppendRows: T itself, or float) in format T:
/// copied when U is T, else written with quantize_row, one scale per row into `scales` for a
/// quantized T (unused otherwise). Source rows `src_stride` elements apart, dst rows d apart.
template <KVElement T, AppendRows<T> U>
void write_rows(T* dst, scale_type* scales, const U* src, std::size_t src_stride, std::size_t n,
                std::size_t d) noexcept {
  for (std::size_t t = 0; t < n; ++t) {
    const U* row = src + t * src_stride;
    if constexpr (std::same_as<U, T>) {
      std::copy(row, row + d, dst + t * d);
    } else {
      quantize_row(row, d, dst + t * d, scales != nullptr ? scales + t : nullptr);
    }
  }
}

}  // namespace detail
}  // namespace kvcache
