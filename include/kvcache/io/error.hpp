// SPDX-License-Identifier: Apache-2.0
// Errors of kvcache's file I/O: an operating-system failure (io_error), and the ways a snapshot
// can be refused (malformed, truncated, checksum mismatch, or valid but for another cache).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "kvcache/core/error.hpp"

namespace kvcache {

/// A system call on a file failed (open, read, write, fsync, rename...). The message names the
/// call, the path and strerror(errno); code() is the errno value.
class io_error : public error {
 public:
  io_error(const std::string& what, int code)
      : error(detail::message(what, ": ", std::strerror(code))), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A snapshot is malformed. offset() is the file offset of the offending field (or of the
/// first byte of the damaged range), and the message says what was expected there.
class snapshot_format_error : public format_error {
 public:
  snapshot_format_error(const std::string& what, std::uint64_t offset)
      : format_error(what), offset_(offset) {}
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }

 private:
  std::uint64_t offset_;
};

/// The file ends before a structure it declares (a partial copy, a crashed writer of a
/// non-atomic tool...).
class snapshot_truncated_error : public snapshot_format_error {
 public:
  using snapshot_format_error::snapshot_format_error;
};

/// A stored CRC32C does not match the bytes it covers (bit rot, a torn copy, tampering).
class snapshot_checksum_error : public snapshot_format_error {
 public:
  using snapshot_format_error::snapshot_format_error;
};

/// A well-formed snapshot that the destination cache cannot take: another model identity,
/// policy, dtype or shape, or more sequences / tokens than the destination holds.
class snapshot_mismatch_error : public format_error {
 public:
  snapshot_mismatch_error(const std::string& what, std::uint64_t offset)
      : format_error(what), offset_(offset) {}
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }

 private:
  std::uint64_t offset_;
};

}  // namespace kvcache
