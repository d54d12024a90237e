// SPDX-License-Identifier: Apache-2.0
// BlockPool: reference counts and states of a fixed set of KV blocks (free, used, cached), a free
// list and the LRU order of cached blocks. Metadata only: the K/V storage lives in the cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/prefix/eviction.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// The states of num_blocks blocks. Each block is exactly one of
///  - free:   reference count 0, not indexed; on the free list;
///  - used:   reference count >= 1 (held by that many block-table entries);
///  - cached: reference count 0 but indexed by a prefix index; in the LRU list, evictable.
/// A used block is "indexed" when a prefix index holds it; it becomes cached, not free, when its
/// last holder releases it. Allocation takes the most recently freed block (its memory is the
/// likeliest to be in a CPU cache). Every operation is O(1), noexcept and allocation-free; only
/// the constructor allocates. Not thread-safe (the owning cache locks around it).
class BlockPool {
 public:
  /// @throws shape_error for 0 blocks or more than kNoBlock - 1; std::bad_alloc.
  explicit BlockPool(std::size_t num_blocks) : lru_(check_count(num_blocks)) {
    ref_.assign(num_blocks, 0);
    indexed_.assign(num_blocks, 0);
    free_.reserve(num_blocks);
    for (std::size_t i = num_blocks; i-- > 0;) free_.push_back(static_cast<block_id>(i));
  }

  [[nodiscard]] std::size_t num_blocks() const noexcept { return ref_.size(); }
  [[nodiscard]] std::size_t num_free() const noexcept { return free_.size(); }
  [[nodiscard]] std::size_t num_cached() const noexcept { return lru_.size(); }
  [[nodiscard]] std::size_t num_used() const noexcept {
    return ref_.size() - free_.size() - lru_.size();
  }
  [[nodiscard]] std::uint32_t ref_count(block_id b) const noexcept { return ref_[b]; }
  [[nodiscard]] bool indexed(block_id b) const noexcept { return indexed_[b] != 0; }
  [[nodiscard]] bool cached(block_id b) const noexcept { return lru_.contains(b); }
  /// The eviction order: front() is the least recently released cached block.
  [[nodiscard]] const LruList& lru() const noexcept { return lru_; }
  /// Free blocks, the next one to be allocated last.
  [[nodiscard]] const std::vector<block_id>& free_list() const noexcept { return free_; }

  /// Takes a free block: reference count 1, not indexed. @pre num_free() > 0.
  [[nodiscard]] block_id allocate() noexcept {
    const block_id b = free_.back();
    free_.pop_back();
    ref_[b] = 1;
    return b;
  }

  /// One more holder of b; a cached block leaves the LRU list. @pre b is used or cached.
  void acquire(block_id b) noexcept {
    if (ref_[b]++ == 0) lru_.erase(b);
  }

  /// One holder fewer; at zero an indexed block becomes cached (most recent), any other free.
  /// @pre ref_count(b) > 0.
  void release(block_id b) noexcept {
    if (--ref_[b] != 0) return;
    if (indexed_[b] != 0) {
      lru_.push_back(b);
    } else {
      free_.push_back(b);
    }
  }

  /// Records that a prefix index now holds b. @pre ref_count(b) > 0, !indexed(b).
  void mark_indexed(block_id b) noexcept { indexed_[b] = 1; }

  /// Turns the cached block b into a free one (the caller removes it from its index).
  /// @pre cached(b).
  void evict(block_id b) noexcept {
    lru_.erase(b);
    indexed_[b] = 0;
    free_.push_back(b);
  }

 private:
  static std::size_t check_count(std::size_t n) {
    if (n == 0 || n >= kNoBlock) {
      throw shape_error(detail::message("BlockPool: num_blocks ", n, " must be in [1, ",
                                        static_cast<std::size_t>(kNoBlock) - 1, "]"));
    }
    return n;
  }

  LruList lru_;
  std::vector<std::uint32_t> ref_;
  std::vector<std::uint8_t> indexed_;
  std::vector<block_id> free_;
};

}  // namespace kvcache
