// SPDX-License-Identifier: Apache-2.0
// The exception hierarchy of kvcache: one base `kvcache::error`, one subclass per kind of bad
// input. Every message names the numbers involved; every throwing API leaves its object unchanged.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace kvcache {

/// Base of every exception kvcache throws on bad input (never thrown for internal bugs).
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A sequence would outgrow what the cache can hold (max_seq_len, pool blocks, append limit).
class capacity_error : public error {
 public:
  using error::error;
};

/// A sequence index is not below the cache's max_batch.
class batch_error : public error {
 public:
  using error::error;
};

/// A layer index is not below the cache's num_layers.
class layer_error : public error {
 public:
  using error::error;
};

/// Tensor shapes disagree (head_dim, head counts, buffer sizes, zero-length input, bad config).
class shape_error : public error {
 public:
  using error::error;
};

/// Positions do not fit: a query needs keys the view does not hold, or a crop target is invalid.
class position_error : public error {
 public:
  using error::error;
};

/// A serialized file or buffer is malformed (used by the snapshot reader).
class format_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Concatenates string pieces and numbers into one message (g++ 12 has no <format>).
inline void append_piece(std::string& out, const char* s) { out += s; }
inline void append_piece(std::string& out, const std::string& s) { out += s; }
template <class N>
requires std::is_arithmetic_v<N>
inline void append_piece(std::string& out, N n) { out += std::to_string(n); }

template <class... Parts>
[[nodiscard]] std::string message(const Parts&... parts) {
  std::string out;
  (append_piece(out, parts), ...);
  return out;
}

}  // namespace detail
}  // namespace kvcache
