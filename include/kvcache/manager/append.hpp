// SPDX-License-Identifier: Apache-2.0
// BlockManager's appends: the checks, the blocks an append takes or copies (copy-on-write), and
// what it registers once the storage has written. Part of BlockManager (block_manager.hpp
// includes it).
#pragma once

#include <algorithm>
#include <cstddef>

#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
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

/// First half of appending to `layer` of several sequences at once (a decode step's batch):
/// requests[i] appends requests[i].n tokens to sequence requests[i].seq (ids: their ids, or
/// nullptr). Checks every request, then takes all the blocks they need (new ones, and fresh ones
/// for the shared or indexed blocks the rows go into: copy-on-write) under one lock, so the batch
/// succeeds or fails whole. plans[i] says where request i writes and what to copy first; the
/// storage copies every plan's blocks (in one launch, on a GPU) and writes the rows (neither may
/// throw), then end_append(plans) finishes. A block that two sequences of one batch share is
/// copied for each of them (appended one at a time, the second would find it unshared): the same
/// contents, one more block until end_append() frees the original. Never allocates. O(sum of n /
/// block_size + requests^2) (the check that no sequence is listed twice).
/// @throws shape_error (plans shorter than requests, a sequence listed twice), layer_error,
///         batch_error, capacity_error (past max_seq_len), position_error (see "Token ids and
///         commitment"), pool_exhausted_error; nothing changed on throw.
template <BlockHasher Hasher>
void BlockManager<Hasher>::begin_append(std::size_t layer, std::span<const AppendRequest> requests,
                                        std::span<AppendPlan> plans) {
  if (plans.size() < requests.size()) {
    throw shape_error(detail::message(name_, ": begin_append of ", requests.size(),
                                      " requests into ", plans.size(), " plans"));
  }
  std::size_t tokens = 0;
  for (std::size_t r = 0; r < requests.size(); ++r) {
    check_append(layer, requests[r].seq, requests[r].n, requests[r].ids);
    for (std::size_t j = 0; j < r; ++j) {
      if (requests[j].seq == requests[r].seq) {
        throw shape_error(
            detail::message(name_, ": append lists sequence ", requests[r].seq, " twice"));
      }
    }
    tokens += requests[r].n;
  }
  const detail::MutexLock lock(shared_->mutex);
  BlockPool& pool = shared_->pool;
  std::size_t needed = 0, num_copies = 0;
  for (const AppendRequest& r : requests) {
    const std::size_t len = seqs_.length(r.seq, layer), num_blocks = seqs_.record(r.seq).num_blocks;
    const std::size_t first = len / block_size_, end = (len + r.n + block_size_ - 1) / block_size_;
    for (std::size_t i = first; i < std::min(end, num_blocks); ++i) {
      if (!writable(pool, seqs_.table(r.seq)[i])) ++num_copies;
    }
    needed += end > num_blocks ? end - num_blocks : 0;
  }
  shared_->reserve(needed + num_copies, [&] {
    if (requests.size() == 1) {
      const AppendRequest& r = requests[0];
      return detail::message(name_, ": append of ", r.n, " tokens to sequence ", r.seq, " layer ",
                             layer, " (holds ", seqs_.length(r.seq, layer), ")");
    }
    return detail::message(name_, ": append of ", tokens, " tokens to ", requests.size(),
                           " sequences of layer ", layer);
  });
  // The copied blocks stay held (their counts are not dropped until end_append()), so nobody can
  // evict or reuse them while the storage copies them; the new ones are their sequence's alone.
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const std::size_t seq = requests[r].seq, n = requests[r].n;
    const std::size_t len = seqs_.length(seq, layer);
    SequenceTable::Record& s = seqs_.record(seq);
    block_id* table = seqs_.table(seq);
    BlockCopy* copies = seqs_.copies(seq);
    const std::size_t first = len / block_size_, end = (len + n + block_size_ - 1) / block_size_;
    std::size_t c = 0;
    for (std::size_t i = first; i < std::min(end, s.num_blocks); ++i) {
      if (writable(pool, table[i])) continue;
      const block_id to = pool.allocate();
      copies[c++] = {i, table[i], to};
      table[i] = to;
    }
    for (std::size_t i = s.num_blocks; i < end; ++i) table[i] = pool.allocate();
    s.num_blocks = std::max(s.num_blocks, end);
    plans[r] = {layer, seq, len, n, table, {copies, c}, requests[r].ids};
  }
  shared_->cow_copies += num_copies;
}

/// begin_append() of one sequence: n tokens to `layer` of `seq`, `ids` their ids or nullptr.
/// @throws as the batch; nothing changed on throw.
template <BlockHasher Hasher>
typename BlockManager<Hasher>::AppendPlan BlockManager<Hasher>::begin_append(std::size_t layer,
                                                                             std::size_t seq,
                                                                             std::size_t n,
                                                                             const token_id* ids) {
  const AppendRequest request{seq, n, ids};
  AppendPlan plan;
  begin_append(layer, std::span(&request, 1), std::span(&plan, 1));
  return plan;
}

/// Second half of an append, once the storage has copied and written: lets go of the copied
/// blocks, registers the new ids, moves each layer's length on and indexes the blocks this
/// completes (see "Token ids and commitment"). Never throws or allocates.
template <BlockHasher Hasher>
void BlockManager<Hasher>::end_append(std::span<const AppendPlan> plans) noexcept {
  {
    const detail::MutexLock lock(shared_->mutex);
    for (const AppendPlan& plan : plans) {
      for (std::size_t c = plan.copies.size(); c-- > 0;) {
        shared_->pool.release(plan.copies[c].from);
      }
    }
  }
  for (const AppendPlan& plan : plans) {
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
}

}  // namespace kvcache
