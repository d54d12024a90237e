// SPDX-License-Identifier: Apache-2.0
// SharedBlocks: the block metadata every sequence of a BlockManager shares — pool, prefix index,
// eviction planning and counters — behind one mutex. Metadata only: no element type, no bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
#include "kvcache/prefix/block_pool.hpp"
#include "kvcache/prefix/prefix_index.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// Pool, index and counters of num_blocks blocks. Every member function but the constructor
/// expects the caller to hold `mutex` (hence the `_locked`-free names: there is nothing here to
/// call without it). Allocation-free after construction.
///
/// Eviction order. Every holder of an indexed block holds its parent too and releases children
/// before parents, so the LRU front is always a leaf of the trie and every cached block is
/// evictable. Eviction still only removes leaves, and plans before it evicts: it walks the LRU
/// list from the front (never past its end) for blocks whose children are all planned before
/// them.
template <BlockHasher Hasher = DefaultBlockHasher>
class SharedBlocks {
 public:
  /// @throws shape_error (num_blocks 0 or >= kNoBlock, block_size 0); std::bad_alloc.
  SharedBlocks(std::size_t num_blocks, std::size_t block_size, bool evict_when_full, Hasher hasher)
      : pool(num_blocks),
        index(num_blocks, block_size, std::move(hasher)),
        evict_when_full_(evict_when_full),
        victims_(num_blocks, kNoBlock),
        planned_children_(num_blocks, 0) {}

  detail::Mutex mutex;
  BlockPool pool;
  PrefixIndex<Hasher> index;
  std::size_t prompts = 0;
  std::size_t prompt_tokens = 0;
  std::size_t reused_tokens = 0;
  std::size_t evictions = 0;
  std::size_t cow_copies = 0;

  /// Whether the owner lets operations evict cached blocks when the free ones run out.
  [[nodiscard]] bool evict_when_full() const noexcept { return evict_when_full_; }

  /// Makes `needed` blocks allocatable, evicting cached ones where the owner opted in.
  /// @throws pool_exhausted_error (message: describe() + the numbers); nothing changed then.
  template <class Describe>
  void reserve(std::size_t needed, Describe&& describe) {
    const std::size_t free = pool.num_free(), cached = pool.num_cached();
    if (needed <= free) return;
    if (evict_when_full_ && needed <= free + cached) {
      const std::size_t planned = plan_evictions(needed - free);
      if (planned == needed - free) {
        evict_planned(planned);
        return;
      }
      throw_exhausted(describe(), needed, free, plan_evictions(cached));
    }
    throw_exhausted(describe(), needed, free, cached);
  }

  /// Throws the pool_exhausted_error of an operation: "<what> needs ... evictable<note> (...)".
  [[noreturn]] void throw_exhausted(const std::string& what, std::size_t needed, std::size_t free,
                                    std::size_t cached, const std::string& note = {}) const {
    throw pool_exhausted_error(
        detail::message(what, " needs ", needed, " blocks but the pool of ", pool.num_blocks(),
                        " has ", free, " free and ", cached, " evictable", note,
                        evict_when_full_ ? ""
                                         : " (eviction is off: set evict_when_full or call "
                                           "evict_cached)"),
        needed, free, cached);
  }

  /// Evicts up to max_blocks cached blocks in the planned order; returns how many. O(evicted).
  std::size_t evict(std::size_t max_blocks) noexcept {
    const std::size_t planned = plan_evictions(std::min(max_blocks, pool.num_cached()));
    evict_planned(planned);
    return planned;
  }

 private:
  // Plans the eviction of up to `count` cached blocks into victims_, in an order they can go in:
  // walking the LRU list from its front (and never past its end), each block whose indexed
  // children are all planned before it. By the ordering argument above that is the first `count`
  // blocks of the list. Changes nothing observable; returns how many it planned.
  [[nodiscard]] std::size_t plan_evictions(std::size_t count) noexcept {
    const LruList& lru = pool.lru();
    std::size_t planned = 0;
    for (block_id b = lru.front(); b != kNoBlock && planned < count; b = lru.next(b)) {
      if (planned_children_[b] != index.num_children(b)) continue;
      victims_[planned++] = b;
      if (const block_id parent = index.parent(b); parent != kNoBlock) {
        ++planned_children_[parent];
      }
    }
    for (std::size_t i = 0; i < planned; ++i) {
      if (const block_id parent = index.parent(victims_[i]); parent != kNoBlock) {
        planned_children_[parent] = 0;
      }
    }
    return planned;
  }

  // Evicts the first `planned` blocks plan_evictions() chose (children before parents).
  void evict_planned(std::size_t planned) noexcept {
    for (std::size_t i = 0; i < planned; ++i) {
      index.erase(victims_[i]);
      pool.evict(victims_[i]);
    }
    evictions += planned;
  }

  bool evict_when_full_;
  std::vector<block_id> victims_;              // plan_evictions() scratch: its plan
  std::vector<std::size_t> planned_children_;  // ... and per block, children planned (0 after)
};

}  // namespace kvcache
