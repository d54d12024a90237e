// SPDX-License-Identifier: Apache-2.0
// CRC32C (Castagnoli, the iSCSI/ext4 checksum) for snapshot sections: a portable slicing-by-8
// version and an SSE4.2 `crc32` version (three interleaved streams), chosen at run time by CPUID.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <nmmintrin.h>
#define KVCACHE_CRC32C_X86 1
#else
#define KVCACHE_CRC32C_X86 0
#endif

namespace kvcache {
namespace detail {

/// The Castagnoli polynomial 0x1EDC6F41, bit-reflected.
inline constexpr std::uint32_t kCrc32cPoly = 0x82f63b78u;

// All functions below work on the raw CRC register (no pre- or post-inversion); crc32c() and
// crc32c_extend() add the standard inversions.

/// One bit at a time: the obviously right version the others are tested against. O(8n).
[[nodiscard]] constexpr std::uint32_t crc32c_raw_bitwise(std::uint32_t crc, const std::byte* p,
                                                         std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= static_cast<std::uint32_t>(p[i]);
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (kCrc32cPoly & (0u - (crc & 1u)));
  }
  return crc;
}

/// table[k][i]: the CRC register after feeding byte i followed by k zero bytes.
inline constexpr auto kCrc32cTables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int b = 0; b < 8; ++b) c = (c >> 1) ^ (kCrc32cPoly & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  }
  return t;
}();

[[nodiscard]] inline std::uint64_t load_le64(const std::byte* p) noexcept {
  std::uint64_t w;
  std::memcpy(&w, p, sizeof w);  // little-endian hosts only (see io/snapshot_format.hpp)
  return w;
}

/// Slicing-by-8: eight table lookups per 8 bytes. Portable.
[[nodiscard]] inline std::uint32_t crc32c_raw_sliced(std::uint32_t crc, const std::byte* p,
                                                     std::size_t n) noexcept {
  const auto& t = kCrc32cTables;
  for (; n >= 8; n -= 8, p += 8) {
    const std::uint64_t w = load_le64(p) ^ crc;
    crc = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
          t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ static_cast<std::uint32_t>(*p)) & 0xff];
  return crc;
}

/// a * b modulo the polynomial, both bit-reflected (GF(2) multiplication).
[[nodiscard]] constexpr std::uint32_t crc32c_multmodp(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (std::uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b >> 1) ^ (kCrc32cPoly & (0u - (b & 1u)));
  }
  return product;
}

/// x^(8n) modulo the polynomial (bit-reflected): multiplying a register by it appends n zero
/// bytes. O(log n).
[[nodiscard]] constexpr std::uint32_t crc32c_x8nmodp(std::size_t n) noexcept {
  std::uint32_t result = 1u << 31;  // x^0
  std::uint32_t power = 1u << 23;   // x^8
  for (; n != 0; n >>= 1) {
    if (n & 1) result = crc32c_multmodp(power, result);
    power = crc32c_multmodp(power, power);
  }
  return result;
}

#if KVCACHE_CRC32C_X86
/// True when the CPU has SSE4.2 (the crc32 instruction); read once with CPUID.
[[nodiscard]] inline bool cpu_has_sse42() noexcept {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    return ((c >> 20) & 1u) != 0;
  }();
  return supported;
}

/// Bytes per stream of the three-way interleaved loop: three independent crc32 chains hide the
/// instruction's 3-cycle latency; the streams are joined with two multiplications per block.
inline constexpr std::size_t kCrc32cStride = 8192;
inline constexpr std::uint32_t kCrc32cShift1 = crc32c_x8nmodp(kCrc32cStride);
inline constexpr std::uint32_t kCrc32cShift2 = crc32c_x8nmodp(2 * kCrc32cStride);

__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_raw_sse42(std::uint32_t crc,
                                                                        const std::byte* p,
                                                                        std::size_t n) noexcept {
  std::uint64_t c0 = crc;
  for (; n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0; --n, ++p) {
    c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), static_cast<std::uint8_t>(*p));
  }
  for (; n >= 3 * kCrc32cStride; n -= 3 * kCrc32cStride, p += 3 * kCrc32cStride) {
    std::uint64_t c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < kCrc32cStride; i += 8) {
      c0 = _mm_crc32_u64(c0, load_le64(p + i));
      c1 = _mm_crc32_u64(c1, load_le64(p + kCrc32cStride + i));
      c2 = _mm_crc32_u64(c2, load_le64(p + 2 * kCrc32cStride + i));
    }
    c0 = crc32c_multmodp(kCrc32cShift2, static_cast<std::uint32_t>(c0)) ^
         crc32c_multmodp(kCrc32cShift1, static_cast<std::uint32_t>(c1)) ^
         static_cast<std::uint32_t>(c2);
  }
  for (; n >= 8; n -= 8, p += 8) c0 = _mm_crc32_u64(c0, load_le64(p));
  for (; n > 0; --n, ++p) {
    c0 = _mm_crc32_u8(static_cast<std::uint32_t>(c0), static_cast<std::uint8_t>(*p));
  }
  return static_cast<std::uint32_t>(c0);
}
#endif

/// The raw register update by the fastest implementation the CPU supports.
[[nodiscard]] inline std::uint32_t crc32c_raw(std::uint32_t crc, const std::byte* p,
                                              std::size_t n) noexcept {
#if KVCACHE_CRC32C_X86
  if (cpu_has_sse42()) return crc32c_raw_sse42(crc, p, n);
#endif
  return crc32c_raw_sliced(crc, p, n);
}

}  // namespace detail

/// CRC32C of `data` continued from `crc`, the CRC32C of the bytes before it (0 for none):
/// crc32c_extend(crc32c(a), b) == crc32c(a followed by b). O(n), about 8 bytes per cycle with
/// SSE4.2.
[[nodiscard]] inline std::uint32_t crc32c_extend(std::uint32_t crc,
                                                 std::span<const std::byte> data) noexcept {
  return ~detail::crc32c_raw(~crc, data.data(), data.size());
}

/// CRC32C (Castagnoli; init and final xor 0xFFFFFFFF, reflected) of `data`:
/// crc32c("123456789") == 0xE3069283.
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> data) noexcept {
  return crc32c_extend(0, data);
}

/// CRC32C of a followed by b, from crc32c(a), crc32c(b) and b's length, without the bytes.
/// O(log len_b).
[[nodiscard]] constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                                                     std::size_t len_b) noexcept {
  return detail::crc32c_multmodp(detail::crc32c_x8nmodp(len_b), crc_a) ^ crc_b;
}

}  // namespace kvcache
