// SPDX-License-Identifier: Apache-2.0
// The vocabulary of the block pool and the prefix index: block ids (core/config.hpp), and the error
// raised when the pool cannot supply the blocks an operation needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"

namespace kvcache {

/// The pool has fewer blocks than an operation needs: `needed` blocks were asked for while
/// `free` were free and `evictable` were cached but unreferenced (usable only when the caller
/// opted into eviction, or after evict_cached()). The cache is unchanged.
class pool_exhausted_error : public capacity_error {
 public:
  pool_exhausted_error(const std::string& what, std::size_t needed, std::size_t free,
                       std::size_t evictable)
      : capacity_error(what), needed_(needed), free_(free), evictable_(evictable) {}

  [[nodiscard]] std::size_t needed() const noexcept { return needed_; }
  [[nodiscard]] std::size_t free() const noexcept { return free_; }
  [[nodiscard]] std::size_t evictable() const noexcept { return evictable_; }

 private:
  std::size_t needed_;
  std::size_t free_;
  std::size_t evictable_;
};

}  // namespace kvcache
