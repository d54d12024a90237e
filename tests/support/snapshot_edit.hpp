// SPDX-License-Identifier: Apache-2.0
// Test-side snapshot surgery, written from the format description: split a file into its
// sections, re-encode a list of sections with fresh layout and checksums, and recompute the
// checksums of a damaged file in place (the fuzzer uses it to get past the CRCs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kvcache/io/crc32c.hpp"
#include "kvcache/io/snapshot_format.hpp"

namespace kvcache::test {

struct RawSection {
  std::uint32_t kind = 0;
  std::uint32_t flags = 0;
  std::vector<std::byte> payload;
};

inline std::uint32_t get32(std::span<const std::byte> b, std::size_t off) {
  std::uint32_t v;
  std::memcpy(&v, b.data() + off, 4);
  return v;
}
inline std::uint64_t get64(std::span<const std::byte> b, std::size_t off) {
  std::uint64_t v;
  std::memcpy(&v, b.data() + off, 8);
  return v;
}
inline void set32(std::span<std::byte> b, std::size_t off, std::uint32_t v) {
  std::memcpy(b.data() + off, &v, 4);
}
inline void set64(std::span<std::byte> b, std::size_t off, std::uint64_t v) {
  std::memcpy(b.data() + off, &v, 8);
}

/// The sections of a valid snapshot, in table order.
inline std::vector<RawSection> split_sections(std::span<const std::byte> file) {
  std::vector<RawSection> out;
  const std::uint32_t n = get32(file, 20);
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::size_t e = 64 + 32 * std::size_t{i};
    const std::uint64_t off = get64(file, e + 8), size = get64(file, e + 16);
    out.push_back({get32(file, e), get32(file, e + 4),
                   std::vector<std::byte>(file.begin() + static_cast<std::ptrdiff_t>(off),
                                          file.begin() + static_cast<std::ptrdiff_t>(off + size))});
  }
  return out;
}

/// Lays sections out as the format prescribes (64-aligned, zero padding) with a fresh header,
/// table and checksums.
inline std::vector<std::byte> encode_sections(const std::vector<RawSection>& sections) {
  const std::size_t table_end = 64 + 32 * sections.size();
  std::size_t end = table_end;
  std::vector<std::size_t> offsets;
  for (const auto& s : sections) {
    end = (end + 63) / 64 * 64;
    offsets.push_back(end);
    end += s.payload.size();
  }
  std::vector<std::byte> file(end);
  const std::span<std::byte> f(file);
  std::memcpy(file.data(), snapshot_format::kMagic, 8);
  set32(f, 8, 1);
  set32(f, 12, 0x0A0B0C0Du);
  set32(f, 16, 64);
  set32(f, 20, static_cast<std::uint32_t>(sections.size()));
  set64(f, 24, file.size());
  set64(f, 32, 64);
  set32(f, 60, crc32c(f.first(60)));
  for (std::size_t i = 0; i < sections.size(); ++i) {
    const std::size_t e = 64 + 32 * i;
    set32(f, e, sections[i].kind);
    set32(f, e + 4, sections[i].flags);
    set64(f, e + 8, offsets[i]);
    set64(f, e + 16, sections[i].payload.size());
    set32(f, e + 24, crc32c(sections[i].payload));
    set32(f, e + 28, crc32c(f.subspan(e, 28)));
    if (!sections[i].payload.empty()) {
      std::memcpy(file.data() + offsets[i], sections[i].payload.data(), sections[i].payload.size());
    }
  }
  return file;
}

/// Recomputes every checksum of a possibly damaged file wherever the structure it covers lies
/// inside the file; leaves everything else as it is.
inline void fix_checksums(std::span<std::byte> f) {
  if (f.size() < 64) return;
  set32(f, 60, crc32c(f.first(60)));
  const std::uint64_t n = get32(f, 20);
  for (std::uint64_t i = 0; i < n && 64 + 32 * (i + 1) <= f.size(); ++i) {
    const std::size_t e = 64 + 32 * static_cast<std::size_t>(i);
    const std::uint64_t off = get64(f, e + 8), size = get64(f, e + 16);
    if (off <= f.size() && size <= f.size() - off) {
      set32(f, e + 24,
            crc32c(f.subspan(static_cast<std::size_t>(off), static_cast<std::size_t>(size))));
    }
    set32(f, e + 28, crc32c(f.subspan(e, 28)));
  }
}

}  // namespace kvcache::test
