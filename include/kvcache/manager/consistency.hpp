// SPDX-License-Identifier: Apache-2.0
// BlockManager::check_consistency(): every invariant of the block bookkeeping, checked from
// scratch, for tests. Part of BlockManager (block_manager.hpp includes it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache {

/// Checks every invariant: each block exactly one of free, used, cached; reference counts equal
/// to table entries; tables as long as the longest layer; no layer of a sequence with ids holding
/// more positions than its ids; committed blocks indexed under the sequence's own prefix and ids;
/// every indexed block a sequence holds placed as "Where indexed blocks sit" says, its ids equal
/// to the sequence's wherever the sequence sees its K/V; index links and child counts; LRU order
/// children-before-parents. Returns "" or a description of the first violation. Needs no
/// concurrent mutation. O(num_blocks + max_batch * (blocks + num_layers)).
template <BlockHasher Hasher>
std::string BlockManager<Hasher>::check_consistency() const {
  const detail::MutexLock lock(shared_->mutex);
  const BlockPool& pool = shared_->pool;
  const PrefixIndex<Hasher>& index = shared_->index;
  using detail::message;
  std::vector<std::size_t> refs(num_blocks_, 0), lru_rank(num_blocks_, 0);
  std::vector<bool> on_free(num_blocks_, false);
  for (block_id b : pool.free_list()) {
    if (on_free[b]) return message("block ", std::size_t{b}, " twice on the free list");
    on_free[b] = true;
  }
  std::size_t rank = 0;
  for (block_id b = pool.lru().front(); b != kNoBlock; b = pool.lru().next(b)) {
    lru_rank[b] = ++rank;
  }
  for (std::size_t q = 0; q < max_batch(); ++q) {
    const SequenceTable::Record& s = seqs_.record(q);
    const block_id* table = seqs_.table(q);
    const token_id* ids = seqs_.ids(q);
    const auto [shortest, longest] = seqs_.extent(q);
    if (s.num_blocks != (longest + block_size_ - 1) / block_size_) {
      return message("sequence ", q, " holds ", s.num_blocks, " blocks for ", longest, " tokens");
    }
    if (s.committed * block_size_ > std::min({shortest, s.num_tokens, s.exact})) {
      return message("sequence ", q, " has ", s.committed, " committed blocks but ", shortest,
                     " tokens in its shortest layer and ", s.num_tokens, " ids");
    }
    if (s.num_tokens != 0 && longest > s.num_tokens) {
      return message("sequence ", q, " holds the K/V of ", longest, " positions but only ",
                     s.num_tokens, " token ids");
    }
    for (std::size_t i = 0; i < s.num_blocks; ++i) {
      const block_id b = table[i];
      if (b >= num_blocks_ || on_free[b] || lru_rank[b] != 0) {
        return message("sequence ", q, " block ", i, " is ", std::size_t{b},
                       ", which is free, cached or out of range");
      }
      ++refs[b];
      if (index.contains(b)) {
        if ((i + 1) * block_size_ > s.exact) {
          return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                         " past its ", s.exact, " positions of exact K/V");
        }
        if (index.extra_key(b) != s.extra_key) {
          return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                         " of extra key ", index.extra_key(b), " under its key ", s.extra_key);
        }
        if (index.parent(b) != (i == 0 ? kNoBlock : table[i - 1])) {
          return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                         " after another block than its parent");
        }
        if (shortest < i * block_size_) {
          return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                         " but its shortest layer holds only ", shortest, " positions");
        }
        const std::size_t end = std::min((i + 1) * block_size_, longest);
        for (std::size_t p = i * block_size_; p < end; ++p) {
          if (p >= s.num_tokens || ids[p] != index.tokens(b)[p - i * block_size_]) {
            return message("sequence ", q, " sees K/V of indexed block ", std::size_t{b},
                           " at position ", p, ", which its ids do not match");
          }
        }
      }
      if (i < s.committed) {
        const block_id parent = i == 0 ? kNoBlock : table[i - 1];
        const std::span<const token_id> block_ids(ids + i * block_size_, block_size_);
        if (!index.contains(b) || index.find(parent, block_ids, s.extra_key) != b) {
          return message("sequence ", q, " committed block ", i, " (", std::size_t{b},
                         ") is not indexed under its prefix");
        }
      }
    }
  }
  std::vector<std::size_t> children(num_blocks_, 0);
  for (std::size_t b = 0; b < num_blocks_; ++b) {
    const auto id = static_cast<block_id>(b);
    if (refs[b] != pool.ref_count(id)) {
      return message("block ", b, " has reference count ", std::size_t{pool.ref_count(id)}, " but ",
                     refs[b], " table entries");
    }
    const bool used = refs[b] != 0, cached = lru_rank[b] != 0;
    if (int{used} + int{cached} + int{on_free[b]} != 1) {
      return message("block ", b, " is not exactly one of free, used, cached");
    }
    if (index.contains(id) != pool.indexed(id) || (cached && !index.contains(id)) ||
        (on_free[b] && index.contains(id))) {
      return message("block ", b, " index membership disagrees with its state");
    }
    if (!index.contains(id)) continue;
    if (index.find(index.parent(id), index.tokens(id), index.extra_key(id)) != id) {
      return message("indexed block ", b, " is not found under its own key");
    }
    const block_id parent = index.parent(id);
    if (parent != kNoBlock) {
      if (!index.contains(parent)) return message("indexed block ", b, " has a lost parent");
      if (index.extra_key(parent) != index.extra_key(id)) {
        return message("indexed block ", b, " has another extra key than its parent");
      }
      ++children[parent];
      if (cached && lru_rank[parent] != 0 && lru_rank[parent] < lru_rank[b]) {
        return message("cached block ", b, " would be evicted after its parent");
      }
      if (used && refs[parent] == 0)
        return message("used block ", b, " has an unreferenced parent");
    }
  }
  for (std::size_t b = 0; b < num_blocks_; ++b) {
    if (children[b] != index.num_children(static_cast<block_id>(b))) {
      return message("block ", b, " child count is wrong");
    }
  }
  return {};
}

}  // namespace kvcache
