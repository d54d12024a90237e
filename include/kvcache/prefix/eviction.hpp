// SPDX-License-Identifier: Apache-2.0
// LruList: the eviction order of cached blocks, an intrusive doubly linked list over block ids
// whose storage is allocated once, so that caching and evicting a block never allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// A least-recently-used order over a subset of the block ids [0, capacity). push_back makes a
/// block the most recent; front() is the least recent. Every operation is O(1) and noexcept;
/// only the constructor allocates. Not thread-safe (the owning cache locks around it).
class LruList {
 public:
  /// @throws std::bad_alloc.
  explicit LruList(std::size_t capacity)
      : prev_(capacity, kNoBlock), next_(capacity, kNoBlock), listed_(capacity, 0) {}

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] bool contains(block_id b) const noexcept { return listed_[b] != 0; }

  /// The least recently pushed block still listed, or kNoBlock.
  [[nodiscard]] block_id front() const noexcept { return head_; }
  /// The block listed after b (more recent), or kNoBlock. @pre contains(b).
  [[nodiscard]] block_id next(block_id b) const noexcept { return next_[b]; }

  /// Lists b as the most recent. @pre !contains(b), b < capacity.
  void push_back(block_id b) noexcept {
    prev_[b] = tail_;
    next_[b] = kNoBlock;
    if (tail_ != kNoBlock) {
      next_[tail_] = b;
    } else {
      head_ = b;
    }
    tail_ = b;
    listed_[b] = 1;
    ++size_;
  }

  /// Unlists b. @pre contains(b).
  void erase(block_id b) noexcept {
    const block_id p = prev_[b], n = next_[b];
    if (p != kNoBlock) {
      next_[p] = n;
    } else {
      head_ = n;
    }
    if (n != kNoBlock) {
      prev_[n] = p;
    } else {
      tail_ = p;
    }
    prev_[b] = next_[b] = kNoBlock;
    listed_[b] = 0;
    --size_;
  }

 private:
  std::vector<block_id> prev_;
  std::vector<block_id> next_;
  std::vector<std::uint8_t> listed_;
  block_id head_ = kNoBlock;
  block_id tail_ = kNoBlock;
  std::size_t size_ = 0;
};

}  // namespace kvcache
