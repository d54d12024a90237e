// SPDX-License-Identifier: Apache-2.0
// XXH64 (Yann Collet's xxHash, 64-bit), one-shot and streaming: the hash behind
// model_id_of_file(), fast enough to fingerprint a multi-gigabyte weights file.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace kvcache {

/// Streaming XXH64: update() any number of times, then value() (which may be read at any point).
/// Equals the reference implementation's XXH64(data, len, seed) for the concatenated input.
class XxHash64 {
 public:
  explicit constexpr XxHash64(std::uint64_t seed = 0) noexcept
      : acc_{seed + kP1 + kP2, seed + kP2, seed, seed - kP1}, seed_(seed) {}

  /// Feeds bytes. O(n).
  void update(std::span<const std::byte> data) noexcept {
    const std::byte* p = data.data();
    std::size_t n = data.size();
    total_ += n;
    if (buffered_ != 0) {
      const std::size_t take = std::min(n, kStripe - buffered_);
      std::memcpy(buffer_.data() + buffered_, p, take);
      buffered_ += take;
      p += take;
      n -= take;
      if (buffered_ < kStripe) return;
      consume_stripe(buffer_.data());
      buffered_ = 0;
    }
    for (; n >= kStripe; n -= kStripe, p += kStripe) consume_stripe(p);
    if (n != 0) std::memcpy(buffer_.data(), p, n);
    buffered_ = n;
  }

  /// The hash of everything fed so far.
  [[nodiscard]] std::uint64_t value() const noexcept {
    std::uint64_t h;
    if (total_ >= kStripe) {
      h = rotl(acc_[0], 1) + rotl(acc_[1], 7) + rotl(acc_[2], 12) + rotl(acc_[3], 18);
      for (std::uint64_t a : acc_) h = (h ^ round(0, a)) * kP1 + kP4;
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const std::byte* p = buffer_.data();
    std::size_t n = buffered_;
    for (; n >= 8; n -= 8, p += 8) h = rotl(h ^ round(0, load64(p)), 27) * kP1 + kP4;
    if (n >= 4) {
      h = rotl(h ^ (load32(p) * kP1), 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; --n, ++p) h = rotl(h ^ (static_cast<std::uint64_t>(*p) * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

 private:
  static constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ull;
  static constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
  static constexpr std::uint64_t kP3 = 0x165667B19E3779F9ull;
  static constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
  static constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ull;
  static constexpr std::size_t kStripe = 32;

  [[nodiscard]] static constexpr std::uint64_t rotl(std::uint64_t x, int r) noexcept {
    return (x << r) | (x >> (64 - r));
  }
  [[nodiscard]] static constexpr std::uint64_t round(std::uint64_t acc,
                                                     std::uint64_t input) noexcept {
    return rotl(acc + input * kP2, 31) * kP1;
  }
  [[nodiscard]] static std::uint64_t load64(const std::byte* p) noexcept {
    std::uint64_t v;
    std::memcpy(&v, p, 8);  // little-endian hosts
    return v;
  }
  [[nodiscard]] static std::uint64_t load32(const std::byte* p) noexcept {
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  void consume_stripe(const std::byte* p) noexcept {
    for (std::size_t i = 0; i < 4; ++i) acc_[i] = round(acc_[i], load64(p + 8 * i));
  }

  std::array<std::uint64_t, 4> acc_;
  std::uint64_t seed_;
  std::uint64_t total_ = 0;
  std::array<std::byte, kStripe> buffer_{};
  std::size_t buffered_ = 0;
};

/// XXH64 of `data` with `seed`: xxhash64("abc") == 0x44BC2CF5AD770999.
[[nodiscard]] inline std::uint64_t xxhash64(std::span<const std::byte> data,
                                            std::uint64_t seed = 0) noexcept {
  XxHash64 h(seed);
  h.update(data);
  return h.value();
}

}  // namespace kvcache
