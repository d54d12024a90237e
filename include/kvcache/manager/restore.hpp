// SPDX-License-Identifier: Apache-2.0
// The restore plan of a BlockManager: which blocks of the restored sequences share blocks the
// index or another restored sequence has, which are filled fresh, and whether the pool has them.
// Part of BlockManager (block_manager.hpp includes it); the snapshot loader drives it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/manager/block_manager.hpp"
#include "kvcache/prefix/prefix_index.hpp"

namespace kvcache {

/// Replaces every *named* sequence (one that an extent or `tokens` names) by the one described;
/// other sequences are untouched. A named sequence's previous blocks are released (as release()
/// would); its leading blocks whose ids it has and that equal a block already indexed (same
/// prefix, same ids, same extra key, as admit() would match) or a block full in every layer, with
/// its ids, of another sequence named in the same call share that block, their rows not filled
/// again (so sequences that shared a prefix when saved share it again, in a pool of the same size).
/// Only blocks every restored layer fills are shared, and at most one more after them (as admit()
/// of a wholly cached prompt leaves it); blocks further on are filled fresh, so that no later write
/// copies a shared block whose child the sequence keeps. Fresh blocks are taken from the pool for
/// the rest of the positions of its longest restored layer; its ids and extra key are registered
/// (those `tokens` gives it; none and 0 if it gives none), and a layer without an extent is left
/// empty. Ids may run ahead of the K/V (as after admit()), never behind. end_restore() then runs
/// the normal commit path: the fresh blocks that are full in every layer and have their ids are
/// indexed, so a restored prefix serves prefix hits once released.
///
/// Blocks: the named sequences need the sum over them of ceil(longest restored layer /
/// block_size) blocks less those shared. Available are the free blocks plus those the replaced
/// sequences would free (held by no other sequence and not indexed), and with evict_when_full
/// also the cached blocks plus the indexed ones the replaced sequences would leave cached, less
/// those shared (counted exactly: each block's references from the named sequences against its
/// reference count).
///
/// Allocates the plan and scratch: O(num_layers * max_batch + max_seq_len / block_size), the ids
/// of the blocks the named sequences hold, and a scratch index of the committable blocks.
/// O(extents + num_layers * max_batch + H log H + I) for the H blocks the named sequences held
/// and the I ids they are given.
/// @pre extents name each (layer, sequence) at most once; no other thread operates on a named
///      sequence until end_restore() returns.
/// @throws layer_error, batch_error (out of range), shape_error (the ids of a sequence named
///         twice), position_error (a layer longer than the non-empty ids given for its
///         sequence), capacity_error (a length or more ids than max_seq_len),
///         pool_exhausted_error (names needed, free and evictable), std::bad_alloc; all before
///         anything changes.
template <BlockHasher Hasher>
RestorePlan BlockManager<Hasher>::begin_restore(std::span<const RestoreExtent> extents,
                                                std::span<const SequenceTokens> tokens) {
  const std::size_t num_layers = this->num_layers(), max_batch = this->max_batch();
  const std::size_t max_seq_len = this->max_seq_len();
  std::vector<std::size_t> length(max_batch * num_layers, 0);  // [seq][layer], restored
  std::vector<const SequenceTokens*> ids_of(max_batch, nullptr);
  RestorePlan plan;
  std::vector<bool>& named = plan.named;
  named.assign(max_batch, false);
  for (std::size_t i = 0; i < extents.size(); ++i) {
    const RestoreExtent& e = extents[i];
    detail::check_layer(name_, e.layer, num_layers);
    detail::check_seq(name_, e.seq, max_batch);
    if (e.length > max_seq_len) {
      throw capacity_error(detail::message(name_, ": restore entry ", i, ": sequence ", e.seq,
                                           " layer ", e.layer, " holds ", e.length,
                                           " tokens, more than max_seq_len ", max_seq_len));
    }
    length[e.seq * num_layers + e.layer] = e.length;
    named[e.seq] = true;
  }
  for (std::size_t j = 0; j < tokens.size(); ++j) {
    const SequenceTokens& t = tokens[j];
    if (t.seq >= max_batch) {
      throw batch_error(detail::message(name_, ": restore ids ", j, ": sequence ", t.seq,
                                        " out of range (max_batch ", max_batch, ")"));
    }
    if (ids_of[t.seq] != nullptr) {
      throw shape_error(
          detail::message(name_, ": restore names the ids of sequence ", t.seq, " twice"));
    }
    if (t.ids.size() > max_seq_len) {
      throw capacity_error(detail::message(name_, ": restore of ", t.ids.size(),
                                           " token ids into sequence ", t.seq,
                                           " exceeds max_seq_len ", max_seq_len));
    }
    ids_of[t.seq] = &t;
    named[t.seq] = true;
  }
  for (std::size_t q = 0; q < max_batch; ++q) {  // K/V never past the ids (a tracked sequence)
    if (ids_of[q] == nullptr || ids_of[q]->ids.empty()) continue;
    for (std::size_t l = 0; l < num_layers; ++l) {
      if (length[q * num_layers + l] <= ids_of[q]->ids.size()) continue;
      throw position_error(detail::message(name_, ": restore of sequence ", q, " gives layer ", l,
                                           " the K/V of ", length[q * num_layers + l],
                                           " positions but only ", ids_of[q]->ids.size(),
                                           " token ids: a sequence's K/V never runs past its ids"));
    }
  }
  // Per named sequence: its blocks; the leading ones its ids cover and every layer fills, plus
  // at most one more (shareable with an equal indexed block, as admit() shares them); of those,
  // the ones that commit() will index (committable: full in every layer). And the blocks the
  // named sequences hold now (sorted, so that each block's references can be counted).
  std::vector<std::size_t>&blocks = plan.blocks, &committable = plan.committable, &at = plan.at;
  std::vector<std::size_t> shareable(max_batch, 0);
  blocks.assign(max_batch, 0);
  committable.assign(max_batch, 0);
  at.assign(max_batch, 0);
  std::size_t num_named = 0, most_shared = 0, most_committed = 0;
  std::vector<block_id> held;
  for (std::size_t q = 0; q < max_batch; ++q) {
    if (!named[q]) continue;
    const auto first = length.begin() + static_cast<std::ptrdiff_t>(q * num_layers);
    const auto last = first + static_cast<std::ptrdiff_t>(num_layers);
    const std::size_t shortest = *std::min_element(first, last);
    blocks[q] = (*std::max_element(first, last) + block_size_ - 1) / block_size_;
    if (prefix_caching_ && ids_of[q] != nullptr) {
      // As admit() leaves them: every layer fills each shared block but perhaps the last.
      // Only ids of exact K/V name blocks (see "Moved K/V").
      const std::size_t exact = std::min(ids_of[q]->ids.size(), ids_of[q]->exact_prefix);
      shareable[q] = std::min({exact / block_size_, blocks[q], shortest / block_size_ + 1});
      committable[q] = std::min(shortest, exact) / block_size_;
      at[q] = most_shared;
      most_shared += shareable[q];
      most_committed += committable[q];
    }
    ++num_named;
    held.insert(held.end(), seqs_.table(q), seqs_.table(q) + seqs_.record(q).num_blocks);
  }
  std::sort(held.begin(), held.end());
  // The blocks the named sequences will index, once each: a scratch index of their committable
  // blocks, each inserted by the first sequence (in order) that has it, whose fresh block it will
  // be. Every other sequence whose ids reach it shares that block. Along one sequence's blocks
  // the first holders never decrease, so sequence q's shareable blocks run: [0, num_shared)
  // indexed already; [num_shared, head_end) from earlier sequences; [head_end, own_end) its own
  // fresh ones (up to committable); [own_end, tail_end) from any sequence (blocks its K/V fill
  // only in part); [tail_end, blocks) fresh again.
  std::vector<std::size_t>&head_end = plan.head_end, &own_end = plan.own_end,
  &tail_end = plan.tail_end, &first_holder = plan.first_holder, &num_shared = plan.num_shared;
  head_end.assign(max_batch, 0);
  own_end.assign(max_batch, 0);
  tail_end.assign(max_batch, 0);
  num_shared.assign(max_batch, 0);
  first_holder.assign(most_shared, 0);
  if (most_committed != 0) {
    PrefixIndex<Hasher> scratch(most_committed, block_size_, shared_->index.hasher());
    std::vector<std::size_t> holder;  // scratch block -> the sequence that inserted it
    holder.reserve(most_committed);
    std::vector<block_id> path(seqs_.max_blocks_per_seq());
    for (std::size_t q = 0; q < max_batch; ++q) {
      if (committable[q] == 0) continue;
      const std::span<const token_id> ids(ids_of[q]->ids);
      const std::uint64_t key = ids_of[q]->extra_key;
      const std::size_t m = scratch.match(ids.first(committable[q] * block_size_),
                                          std::span<block_id>(path).first(committable[q]), key);
      head_end[q] = m;
      for (std::size_t i = m; i < committable[q]; ++i) {
        path[i] = static_cast<block_id>(holder.size());
        holder.push_back(q);
        scratch.insert(path[i], i == 0 ? kNoBlock : path[i - 1],
                       ids.subspan(i * block_size_, block_size_), key);
      }
    }
    for (std::size_t q = 0; q < max_batch; ++q) {
      if (shareable[q] == 0) continue;
      const std::size_t m =
          scratch.match(std::span<const token_id>(ids_of[q]->ids).first(shareable[q] * block_size_),
                        std::span<block_id>(path).first(shareable[q]), ids_of[q]->extra_key);
      for (std::size_t i = 0; i < m; ++i) first_holder[at[q] + i] = holder[path[i]];
      tail_end[q] = m;
    }
  }
  // Indexed blocks equal to a named sequence's leading blocks (same prefix, same ids), shared
  // rather than filled with a copy: those of q are matched[at[q] ..], num_shared[q] of them.
  std::vector<block_id> matched(most_shared), pinned;
  pinned.reserve(most_shared);
  {
    const detail::MutexLock lock(shared_->mutex);
    BlockPool& pool = shared_->pool;
    std::size_t needed = 0, num_matched = 0, num_dup = 0;
    for (std::size_t q = 0; q < max_batch; ++q) {
      if (!named[q]) continue;
      if (shareable[q] != 0) {
        num_shared[q] = shared_->index.match(
            std::span<const token_id>(ids_of[q]->ids).first(shareable[q] * block_size_),
            std::span<block_id>(matched).subspan(at[q], shareable[q]), ids_of[q]->extra_key);
        num_matched += num_shared[q];
      }
      // A block the index has is that one for every sequence reaching it.
      head_end[q] = std::max(head_end[q], num_shared[q]);
      own_end[q] = std::max(head_end[q], committable[q]);
      tail_end[q] = std::max(tail_end[q], own_end[q]);
      num_dup += (head_end[q] - num_shared[q]) + (tail_end[q] - own_end[q]);
      needed += (own_end[q] - head_end[q]) + (blocks[q] - tail_end[q]);
    }
    std::size_t would_free = 0, would_cache = 0;  // what releasing the named sequences yields
    for (std::size_t i = 0, j = 0; i < held.size(); i = j) {
      while (j < held.size() && held[j] == held[i]) ++j;
      if (pool.ref_count(held[i]) == j - i) ++(pool.indexed(held[i]) ? would_cache : would_free);
    }
    // Shared blocks that are, or would be left, cached stay held: not evictable.
    for (std::size_t q = 0; q < max_batch; ++q) {
      const auto from = matched.begin() + static_cast<std::ptrdiff_t>(at[q]);
      pinned.insert(pinned.end(), from, from + static_cast<std::ptrdiff_t>(num_shared[q]));
    }
    std::sort(pinned.begin(), pinned.end());
    pinned.erase(std::unique(pinned.begin(), pinned.end()), pinned.end());
    std::size_t num_pinned = 0;
    for (const block_id b : pinned) {
      const auto [lo, hi] = std::equal_range(held.begin(), held.end(), b);
      if (pool.ref_count(b) == static_cast<std::size_t>(hi - lo)) ++num_pinned;
    }
    const std::size_t free = pool.num_free() + would_free;
    const std::size_t cached = pool.num_cached() + would_cache - num_pinned;
    if (needed > free && !(shared_->evict_when_full() && needed <= free + cached)) {
      shared_->throw_exhausted(
          detail::message(name_, ": restore of ", num_named, " sequences"), needed, free, cached,
          detail::message(", counting the ", would_free + would_cache,
                          " blocks only the replaced sequences hold, sharing ", num_matched,
                          " already cached and ", num_dup, " between the restored sequences"));
    }
    for (std::size_t q = 0; q < max_batch; ++q) {
      for (std::size_t i = 0; i < num_shared[q]; ++i) pool.acquire(matched[at[q] + i]);
    }
    for (std::size_t q = 0; q < max_batch; ++q) {
      if (named[q]) release_blocks(q, 0);
    }
    // The pool now has exactly `free` free and `cached` cached blocks: this cannot throw.
    shared_->reserve(needed, [this] { return std::string(name_); });
    for (std::size_t q = 0; q < max_batch; ++q) {
      if (!named[q]) continue;
      block_id* table = seqs_.table(q);
      std::copy_n(matched.begin() + static_cast<std::ptrdiff_t>(at[q]), num_shared[q], table);
      std::fill(table + num_shared[q], table + head_end[q], kNoBlock);  // set by end_restore()
      for (std::size_t i = head_end[q]; i < own_end[q]; ++i) table[i] = pool.allocate();
      std::fill(table + own_end[q], table + tail_end[q], kNoBlock);  // set by end_restore()
      for (std::size_t i = tail_end[q]; i < blocks[q]; ++i) table[i] = pool.allocate();
      seqs_.record(q).num_blocks = blocks[q];
    }
  }
  // The fresh blocks are this call's alone (held once, not indexed) until end_restore().
  for (std::size_t q = 0; q < max_batch; ++q) {
    if (!named[q]) continue;
    SequenceTable::Record& s = seqs_.record(q);
    s.num_tokens = 0;
    s.committed = std::min(head_end[q], committable[q]);  // not a block its K/V fill in part
    s.exact = SequenceTable::kAllExact;
    if (ids_of[q] != nullptr) {
      std::ranges::copy(ids_of[q]->ids, seqs_.ids(q));
      s.num_tokens = ids_of[q]->ids.size();
      if (ids_of[q]->exact_prefix < s.num_tokens) s.exact = ids_of[q]->exact_prefix;
    }
    s.extra_key = ids_of[q] != nullptr ? ids_of[q]->extra_key : 0;
    std::copy_n(length.begin() + static_cast<std::ptrdiff_t>(q * num_layers), num_layers,
                seqs_.lengths(q).begin());
  }
  return plan;
}

/// Sequences in order: the first holder of a block q shares at entries below head_end[q] is an
/// earlier one, whose commit() has indexed it; a block past own_end[q] may come from any
/// sequence, so those are set once every commit() has run.
template <BlockHasher Hasher>
void BlockManager<Hasher>::end_restore(const RestorePlan& plan) noexcept {
  const auto share = [&](std::size_t q, std::size_t begin, std::size_t end) {
    if (begin == end) return;
    const detail::MutexLock lock(shared_->mutex);
    block_id* table = seqs_.table(q);
    for (std::size_t i = begin; i < end; ++i) {
      const block_id b = seqs_.table(plan.first_holder[plan.at[q] + i])[i];
      shared_->pool.acquire(b);
      table[i] = b;
    }
  };
  for (std::size_t q = 0; q < max_batch(); ++q) {
    if (!plan.named[q]) continue;
    share(q, plan.num_shared[q], plan.head_end[q]);
    commit(q);
  }
  for (std::size_t q = 0; q < max_batch(); ++q) {
    if (plan.named[q]) share(q, plan.own_end[q], plan.tail_end[q]);
  }
}

}  // namespace kvcache
