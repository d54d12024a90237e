// SPDX-License-Identifier: Apache-2.0
// Element types of the cache: float, IEEE half (fp16) and bfloat16, with conversions that round
// exactly as the hardware does (round-to-nearest-even); the codes of the quantized formats (int8,
// fp8 e4m3, whose rows carry a scale: core/format.hpp); a runtime DType tag, and dtype dispatch.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

#include "kvcache/core/cpu_features.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/host_device.hpp"

namespace kvcache {

/// IEEE 754 binary16 storage type. Conversions round to nearest even, keep signed zeros,
/// subnormals, infinities and NaN payloads (quietened), bit for bit like x86 F16C and CUDA. A
/// float beyond half's range becomes ±inf (65520 and above in magnitude; 65519 rounds to 65504):
/// nothing saturates; NaN stays NaN.
struct half {
  std::uint16_t bits = 0;

  constexpr half() noexcept = default;
  KVCACHE_HOST_DEVICE constexpr explicit half(float f) noexcept : bits(from_float_bits(f)) {}
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return to_float(bits);
  }
  friend constexpr bool operator==(half, half) noexcept = default;

  /// float -> binary16 bits, round-to-nearest-even.
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr std::uint16_t from_float_bits(
      float f) noexcept {
    std::uint32_t u = detail::float_bits(f);
    const std::uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) {  // |f| >= 65536 (or inf/NaN): the result is inf or NaN
      if (u > 0x7f800000u) {
        return static_cast<std::uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
      }
      return static_cast<std::uint16_t>(sign | 0x7c00u);
    }
    if (u < 0x38800000u) {  // |f| < 2^-14: subnormal or zero half
      // Adding 0.5 aligns the 10 subnormal mantissa bits at the bottom of the float; the FP
      // addition itself rounds to nearest even.
      const float aligned = detail::bits_float(u) + 0.5f;
      return static_cast<std::uint16_t>(sign | (detail::float_bits(aligned) - 0x3f000000u));
    }
    const std::uint32_t mant_odd = (u >> 13) & 1u;
    u += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and add the rounding bias
    return static_cast<std::uint16_t>(sign | (u >> 13));
  }

  /// binary16 bits -> float (exact).
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr float to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      // zero or subnormal: mant * 2^-24 is exact in float
      const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
      return detail::bits_float(sign | detail::float_bits(mag));
    }
    if (exp == 31) {  // inf, or NaN (quietened, payload kept)
      return detail::bits_float(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
    }
    return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

/// bfloat16 storage type: the top 16 bits of a float. float -> bfloat16 rounds to nearest even
/// (subnormals kept, like CUDA's __float2bfloat16_rn); a float that rounds beyond bfloat16's range
/// becomes ±inf (nothing saturates); NaN stays NaN (quietened, sign kept).
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() noexcept = default;
  KVCACHE_HOST_DEVICE constexpr explicit bfloat16(float f) noexcept : bits(from_float_bits(f)) {}
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return to_float(bits);
  }
  friend constexpr bool operator==(bfloat16, bfloat16) noexcept = default;

  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr std::uint16_t from_float_bits(
      float f) noexcept {
    const std::uint32_t u = detail::float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<std::uint16_t>((u >> 16) | 0x40u);
    }
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr float to_float(std::uint16_t b) noexcept {
    return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
  }
};

/// OCP / NVIDIA fp8 E4M3 ("e4m3fn"): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
/// infinities, one NaN pattern per sign (0x7f, 0xff); largest finite 448, smallest subnormal 2^-9.
/// float -> e4m3 rounds to nearest even and saturates: a finite float or an infinity beyond 448 in
/// magnitude becomes ±448 (CUDA's __NV_SATFINITE); NaN becomes NaN. A code of a quantized cache
/// row, read with the row's scale (core/format.hpp).
struct fp8_e4m3 {
  std::uint8_t bits = 0;

  constexpr fp8_e4m3() noexcept = default;
  KVCACHE_HOST_DEVICE constexpr explicit fp8_e4m3(float f) noexcept : bits(from_float_bits(f)) {}
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr fp8_e4m3 from_bits(std::uint8_t b) noexcept {
    fp8_e4m3 x;
    x.bits = b;
    return x;
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return to_float(bits);
  }
  friend constexpr bool operator==(fp8_e4m3, fp8_e4m3) noexcept = default;

  /// The largest finite magnitude, 448.
  static constexpr float max_finite = 448.0f;

  /// float -> e4m3 bits: round to nearest even, saturating at ±448, NaN kept (sign kept).
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr std::uint8_t from_float_bits(
      float f) noexcept {
    const std::uint32_t u = detail::float_bits(f);
    const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);   // NaN
    if (a >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448 or inf
    if (a < 0x3c800000u) {  // below 2^-6: a subnormal code m * 2^-9, m = 0 .. 8 (8: 2^-6)
      // |f| * 2^9 is exact; adding and subtracting 2^23 rounds it to an integer, nearest even.
      const float scaled = detail::bits_float(a) * 512.0f;
      const float m = (scaled + 8388608.0f) - 8388608.0f;
      return static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(m));
    }
    // Keep 3 mantissa bits, nearest even: the carry may step the exponent (up to 448 at most,
    // as |f| < 448 here and 448 is a code).
    const std::uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    return static_cast<std::uint8_t>(sign | ((rounded >> 20) - (120u << 3)));
  }

  /// e4m3 bits -> float (exact).
  [[nodiscard]] KVCACHE_HOST_DEVICE static constexpr float to_float(std::uint8_t b) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
    const std::uint32_t exp = (b >> 3) & 0xfu;
    const std::uint32_t mant = b & 0x7u;
    if (exp == 0xfu && mant == 0x7u) return detail::bits_float(sign | 0x7fc00000u);
    if (exp == 0) {  // zero or subnormal: mant * 2^-9
      return detail::bits_float(sign | detail::float_bits(static_cast<float>(mant) * 0.001953125f));
    }
    return detail::bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
  }
};

/// A code of a symmetric int8 cache row: -127 .. 127 (-128 is never written), read as code x the
/// row's scale (core/format.hpp).
struct qint8 {
  std::int8_t value = 0;

  constexpr qint8() noexcept = default;
  KVCACHE_HOST_DEVICE constexpr explicit qint8(std::int8_t v) noexcept : value(v) {}
  [[nodiscard]] KVCACHE_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return static_cast<float>(value);
  }
  friend constexpr bool operator==(qint8, qint8) noexcept = default;
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);
static_assert(sizeof(fp8_e4m3) == 1 && std::is_trivially_copyable_v<fp8_e4m3>);
static_assert(sizeof(qint8) == 1 && std::is_trivially_copyable_v<qint8>);

/// Runtime tag of an element type (stable numbering: it is written into snapshot files).
enum class DType : std::uint8_t { f32 = 0, f16 = 1, bf16 = 2, i8 = 3, e4m3 = 4 };

/// The element types of activations (queries, outputs, appended K/V) and of the unquantized caches.
template <class T>
concept Element = std::same_as<T, float> || std::same_as<T, half> || std::same_as<T, bfloat16>;

/// The codes of the quantized cache formats: each K or V row of head_dim codes carries a scale.
template <class T>
concept QuantizedElement = std::same_as<T, qint8> || std::same_as<T, fp8_e4m3>;

/// What a cache can store: an Element, or the codes of a quantized format.
template <class T>
concept KVElement = Element<T> || QuantizedElement<T>;

template <KVElement T>
inline constexpr DType dtype_of = std::same_as<T, float>      ? DType::f32
                                  : std::same_as<T, half>     ? DType::f16
                                  : std::same_as<T, bfloat16> ? DType::bf16
                                  : std::same_as<T, qint8>    ? DType::i8
                                                              : DType::e4m3;

/// Bytes of one element (one code for int8 and fp8; their row scales are counted by row_bytes).
[[nodiscard]] constexpr std::size_t dtype_bytes(DType d) noexcept {
  return d == DType::f32 ? 4 : d == DType::i8 || d == DType::e4m3 ? 1 : 2;
}

/// True for the formats whose rows carry a scale (int8, fp8).
[[nodiscard]] constexpr bool dtype_scaled(DType d) noexcept {
  return d == DType::i8 || d == DType::e4m3;
}

/// Bytes of one K or V row of head_dim elements, its scale included: head_dim x dtype_bytes, plus
/// 2 (a bfloat16 scale) for int8 and fp8.
[[nodiscard]] constexpr std::size_t row_bytes(DType d, std::size_t head_dim) noexcept {
  return head_dim * dtype_bytes(d) + (dtype_scaled(d) ? 2 : 0);
}

[[nodiscard]] constexpr const char* dtype_name(DType d) noexcept {
  switch (d) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i8:
      return "int8";
    case DType::e4m3:
      return "fp8";
  }
  return "unknown";
}

/// How messages and kvcache/fmt.hpp name a storage format: "f16", or "K f16 + V int8" for keys
/// and values in different formats (a KVFormats pair). @throws std::bad_alloc.
[[nodiscard]] inline std::string format_name(DType key, DType value) {
  if (key == value) return dtype_name(key);
  return std::string("K ") + dtype_name(key) + " + V " + dtype_name(value);
}

/// Calls `f(std::type_identity<T>{})` with the Element type named by `d`.
/// @throws shape_error for a value outside the enum or a quantized format (i8, e4m3), listing the
///         supported ones.
template <class F>
decltype(auto) dispatch_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32:
      return f(std::type_identity<float>{});
    case DType::f16:
      return f(std::type_identity<half>{});
    case DType::bf16:
      return f(std::type_identity<bfloat16>{});
    case DType::i8:
    case DType::e4m3:
      break;
  }
  throw shape_error(detail::message("unsupported dtype ", static_cast<int>(d),
                                    "; supported: 0 (f32), 1 (f16), 2 (bf16)"));
}

/// Element -> float (exact).
template <Element T>
[[nodiscard]] constexpr float to_float(T x) noexcept {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else {
    return static_cast<float>(x);
  }
}

/// float -> element, round-to-nearest-even.
template <Element T>
[[nodiscard]] constexpr T from_float(float x) noexcept {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

namespace detail {

#if KVCACHE_X86_DISPATCH
// F16C's conversions of eight floats by the compiler's builtins (what <immintrin.h>'s
// _mm256_cvtps_ph / _mm256_cvtph_ps expand to, in GCC and clang alike), so that this header,
// which everything includes, does not pull every intrinsic header in.
using F16cFloats = float __attribute__((vector_size(32)));
using F16cHalves = short __attribute__((vector_size(16)));

__attribute__((target("avx2,f16c"))) inline void floats_to_half_f16c(const float* in, half* out,
                                                                     std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F16cFloats f;
    std::memcpy(&f, in + i, sizeof f);
    const F16cHalves h = __builtin_ia32_vcvtps2ph256(f, 0);  // 0: round to nearest even
    std::memcpy(static_cast<void*>(out + i), &h, sizeof h);  // half: trivially copyable
  }
  for (; i < n; ++i) out[i] = half(in[i]);
}

__attribute__((target("avx2,f16c"))) inline void half_to_floats_f16c(const half* in, float* out,
                                                                     std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    F16cHalves h;
    std::memcpy(&h, in + i, sizeof h);
    const F16cFloats f = __builtin_ia32_vcvtph2ps256(h);
    std::memcpy(out + i, &f, sizeof f);
  }
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
#endif

}  // namespace detail

/// Converts `in` to element type T, element by element, into `out` (same length; not checked:
/// internal callers validate). Uses F16C for half where the CPU has it (same results: ±inf
/// beyond the range, NaN kept).
template <Element T>
inline void convert_from_float(std::span<const float> in, T* out) noexcept {
  if constexpr (std::same_as<T, float>) {
    std::copy(in.begin(), in.end(), out);
  } else {
#if KVCACHE_X86_DISPATCH
    if constexpr (std::same_as<T, half>) {
      if (detail::cpu_has_avx2_fma_f16c()) {
        detail::floats_to_half_f16c(in.data(), out, in.size());
        return;
      }
    }
#endif
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = T(in[i]);
  }
}

/// Converts elements to float into `out` (same length; not checked).
template <Element T>
inline void convert_to_float(std::span<const T> in, float* out) noexcept {
  if constexpr (std::same_as<T, float>) {
    std::copy(in.begin(), in.end(), out);
  } else {
#if KVCACHE_X86_DISPATCH
    if constexpr (std::same_as<T, half>) {
      if (detail::cpu_has_avx2_fma_f16c()) {
        detail::half_to_floats_f16c(in.data(), out, in.size());
        return;
      }
    }
#endif
    for (std::size_t i = 0; i < in.size(); ++i) out[i] = static_cast<float>(in[i]);
  }
}

}  // namespace kvcache
