// SPDX-License-Identifier: Apache-2.0
// TokenBlock: the one tensor view kvcache takes in and gives out, [num_tokens][num_heads][head_dim]
// row-major. The shape travels with the pointer so that a wrong head_dim is caught by name.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "kvcache/core/error.hpp"

namespace kvcache {

/// Non-owning, contiguous [num_tokens][num_heads][head_dim] block of per-token head vectors: new
/// keys/values to append, queries to attend with, attention output.
template <class T>
struct TokenBlock {
  std::span<T> data;
  std::size_t num_tokens = 0;
  std::size_t num_heads = 0;
  std::size_t head_dim = 0;

  /// Elements of one token: num_heads * head_dim.
  [[nodiscard]] constexpr std::size_t token_elems() const noexcept { return num_heads * head_dim; }
  /// Pointer to the head_dim elements of head `head` of token `token` (unchecked).
  [[nodiscard]] constexpr T* row(std::size_t token, std::size_t head) const noexcept {
    return data.data() + (token * num_heads + head) * head_dim;
  }
  /// The same block, read-only. A template (U = const T), so that TokenBlock<const T> declares
  /// no conversion to its own type (which nvcc reports, warning 554).
  template <class U>
  [[nodiscard]] constexpr operator TokenBlock<U>() const noexcept
      requires(!std::is_const_v<T> && std::is_same_v<U, const T>) {
    return {data, num_tokens, num_heads, head_dim};
  }

  /// @throws shape_error unless data.size() == num_tokens * num_heads * head_dim, naming `what`.
  void validate(const char* what) const {
    const std::size_t want = num_tokens * num_heads * head_dim;
    if (data.size() != want) {
      throw shape_error(detail::message(what, ": buffer holds ", data.size(),
                                        " elements but its shape [", num_tokens, "][", num_heads,
                                        "][", head_dim, "] needs ", want));
    }
  }
};

}  // namespace kvcache
