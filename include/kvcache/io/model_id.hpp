// SPDX-License-Identifier: Apache-2.0
// ModelId: the caller-supplied identity of the model whose K/V a snapshot holds (K/V are
// prompt-specific and model-specific), and model_id_of_file(), which fingerprints a weights file.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/io/file.hpp"
#include "kvcache/io/xxhash64.hpp"

namespace kvcache {

/// Up to 64 opaque bytes naming a model (a hash of its weights, a name plus a revision...).
/// Snapshots store it and load only into a caller that presents the same bytes. The empty id is
/// valid and matches only itself.
class ModelId {
 public:
  static constexpr std::size_t kMaxBytes = 64;

  constexpr ModelId() noexcept = default;

  /// The 8 little-endian bytes of `hash`.
  [[nodiscard]] static constexpr ModelId from_u64(std::uint64_t hash) noexcept {
    ModelId id;
    for (std::size_t i = 0; i < 8; ++i) {
      id.bytes_[i] = static_cast<std::byte>((hash >> (8 * i)) & 0xffu);
    }
    id.size_ = 8;
    return id;
  }

  /// These bytes. @throws shape_error for more than kMaxBytes.
  explicit ModelId(std::span<const std::byte> bytes) {
    if (bytes.size() > kMaxBytes) {
      throw shape_error(detail::message("ModelId: ", bytes.size(), " bytes, at most ", kMaxBytes));
    }
    for (std::size_t i = 0; i < bytes.size(); ++i) bytes_[i] = bytes[i];
    size_ = bytes.size();
  }
  /// The bytes of a string ("llama-3-8b-instruct@rev3"). @throws shape_error beyond kMaxBytes.
  explicit ModelId(std::string_view text)
      : ModelId(std::span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                           text.size())) {}

  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {bytes_.data(), size_}; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Lower-case hex of the bytes ("" for the empty id), for messages.
  [[nodiscard]] std::string hex() const {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out;
    for (std::size_t i = 0; i < size_; ++i) {
      const auto b = static_cast<unsigned>(bytes_[i]);
      out += kDigits[b >> 4];
      out += kDigits[b & 15u];
    }
    return out;
  }

  friend bool operator==(const ModelId& a, const ModelId& b) noexcept {
    if (a.size_ != b.size_) return false;
    for (std::size_t i = 0; i < a.size_; ++i) {
      if (a.bytes_[i] != b.bytes_[i]) return false;
    }
    return true;
  }

 private:
  std::array<std::byte, kMaxBytes> bytes_{};
  std::size_t size_ = 0;
};

/// Fingerprints a weights file: 16 bytes, the file size (8 bytes, little-endian) followed by
/// XXH64 of its contents with seed 0 (8 bytes, little-endian). Reads the file once, in 1 MiB
/// pieces (a few GB/s). A different file of the same size collides with probability ~2^-64.
/// @throws io_error (missing or unreadable file), format_error (not a regular file).
[[nodiscard]] inline ModelId model_id_of_file(const std::filesystem::path& weights) {
  const detail::UniqueFd fd = detail::open_for_reading(weights);
  const std::uint64_t size = detail::regular_file_size(fd.get(), weights);
  std::vector<std::byte> buffer(std::size_t{1} << 20);
  XxHash64 hash;
  std::uint64_t offset = 0;
  while (offset < size) {
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), size - offset));
    detail::read_exact_at(fd.get(), buffer.data(), n, offset, weights);
    hash.update(std::span<const std::byte>(buffer.data(), n));
    offset += n;
  }
  std::array<std::byte, 16> bytes{};
  const std::uint64_t h = hash.value();
  for (std::size_t i = 0; i < 8; ++i) {
    bytes[i] = static_cast<std::byte>((size >> (8 * i)) & 0xffu);
    bytes[8 + i] = static_cast<std::byte>((h >> (8 * i)) & 0xffu);
  }
  return ModelId(std::span<const std::byte>(bytes));
}

}  // namespace kvcache
