// SPDX-License-Identifier: Apache-2.0
// BlockManager's appends: the checks, the blocks an append takes or copies (copy-on-write), and
// what it registers once the storage has written. Part of BlockManager (block_manager.hpp
// includes it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>

#include "kvcache/core/error.hpp"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache {

// The checks of an append; nothing changes before they pass.
template <BlockHasher Hasher>
void BlockManager<Hasher>::check_append(std::size_t layer, std::size_t seq, std::size_t n,
                                        const token_id* ids) const {
  detail::check_layer(name_, layer, num_layers());
  detail::check_seq(name_, seq, max_batch());
  const std::size_t len = seqs_.length(seq, layer);
  if (n > max_seq_len() - len) {
    throw capacity_error(detail::message(name_, ": append of ", n, " tokens to sequence ", seq,
                                         " layer ", layer, " exceeds max_seq_len ", max_seq_len(),
                                         " (holds ", len, ")"));
  }
  const SequenceTable::Record& s = seqs_.record(seq);
  if (ids == nullptr) {
    if (s.num_tokens != 0 && len + n > s.num_tokens) {
      throw position_error(detail::message(
          name_, ": append of ", n, " tokens to sequence ", seq, " layer ", layer, " at positions ",
          len, "..", len + n - 1, " runs past its ", s.num_tokens,
          " registered token ids: register each token's id before its K/V (add_tokens(), or "
          "append() with the ids)"));
    }
    return;
  }
  require_trackable("append with ids to", seq);
  const token_id* held = seqs_.ids(seq);
  for (std::size_t i = 0; len + i < s.num_tokens && i < n; ++i) {
    if (ids[i] != held[len + i]) {
      throw position_error(detail::message(name_, ": append to sequence ", seq, " layer ", layer,
                                           " gives token id ", ids[i], " for position ", len + i,
                                           ", where id ", held[len + i], " is registered"));
    }
  }
}

/// First half of appending n tokens to `layer` of `seq`: checks, takes new blocks from the
/// pool and fresh blocks for the shared or indexed ones the rows go into (copy-on-write). The
/// storage then copies plan.copies and writes the rows (neither may throw), and end_append()
/// finishes. `ids`: the tokens' ids (n of them), or nullptr for an append without ids.
/// Never allocates. O(n / block_size) under the lock.
/// @throws layer_error, batch_error, capacity_error (past max_seq_len), position_error (see
///         "Token ids and commitment"), pool_exhausted_error; nothing changed on throw.
template <BlockHasher Hasher>
typename BlockManager<Hasher>::AppendPlan BlockManager<Hasher>::begin_append(std::size_t layer,
                                                                             std::size_t seq,
                                                                             std::size_t n,
                                                                             const token_id* ids) {
  check_append(layer, seq, n, ids);
  const std::size_t len = seqs_.length(seq, layer);
  SequenceTable::Record& s = seqs_.record(seq);
  block_id* table = seqs_.table(seq);
  BlockCopy* copies = seqs_.copies(seq);
  const std::size_t first = len / block_size_;
  const std::size_t end = (len + n + block_size_ - 1) / block_size_;
  std::size_t num_copies = 0;
  {
    std::lock_guard lock(shared_->mutex);
    BlockPool& pool = shared_->pool;
    for (std::size_t i = first; i < std::min(end, s.num_blocks); ++i) {
      if (!writable(pool, table[i])) ++num_copies;
    }
    const std::size_t fresh = end > s.num_blocks ? end - s.num_blocks : 0;
    shared_->reserve(fresh + num_copies, [&] {
      return detail::message(name_, ": append of ", n, " tokens to sequence ", seq, " layer ",
                             layer, " (holds ", len, ")");
    });
    for (std::size_t i = first, c = 0; c < num_copies; ++i) {
      if (writable(pool, table[i])) continue;
      const block_id to = pool.allocate();
      copies[c++] = {i, table[i], to};
      table[i] = to;
    }
    for (std::size_t i = s.num_blocks; i < end; ++i) table[i] = pool.allocate();
    s.num_blocks = std::max(s.num_blocks, end);
    shared_->cow_copies += num_copies;
  }
  // The copied blocks are still held (their counts were not dropped), so nobody can evict or
  // reuse them while the storage copies them; the new ones are this sequence's alone.
  return {layer, seq, len, n, table, {copies, num_copies}, ids};
}

/// Second half of an append, once the storage has copied and written: lets go of the copied
/// blocks, registers the new ids, moves the layer's length on and indexes the blocks this
/// completes (see "Token ids and commitment"). Never throws or allocates.
template <BlockHasher Hasher>
void BlockManager<Hasher>::end_append(const AppendPlan& plan) noexcept {
  if (!plan.copies.empty()) {
    std::lock_guard lock(shared_->mutex);
    for (std::size_t c = plan.copies.size(); c-- > 0;) shared_->pool.release(plan.copies[c].from);
  }
  SequenceTable::Record& s = seqs_.record(plan.seq);
  const std::size_t len = plan.position, n = plan.n;
  if (plan.ids != nullptr && len + n > s.num_tokens) {
    const std::size_t known = s.num_tokens - len;  // len <= num_tokens: the ids come first
    std::copy(plan.ids + known, plan.ids + n, seqs_.ids(plan.seq) + s.num_tokens);
    s.num_tokens = len + n;
  }
  seqs_.length(plan.seq, plan.layer) = len + n;
  commit(plan.seq);
}

}  // namespace kvcache
