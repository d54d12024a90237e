// SPDX-License-Identifier: Apache-2.0
// BlockManager's fork and beam reorder: sequences that become copies of others by sharing their
// blocks, nothing copied but block ids, token ids and lengths. Part of BlockManager
// (block_manager.hpp includes it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache {

/// Makes the empty sequence `dst` a copy of `src` sharing all of its blocks; the first append
/// of either into a shared block copies that block. Never allocates or needs a free block.
/// O(blocks + tokens + num_layers).
/// @throws batch_error (an index out of range, or src == dst); position_error when dst is not
///         empty. Unchanged on throw.
template <BlockHasher Hasher>
void BlockManager<Hasher>::fork(std::size_t src, std::size_t dst) {
  detail::check_seq(name_, src, max_batch());
  detail::check_seq(name_, dst, max_batch());
  if (src == dst) {
    throw batch_error(detail::message(name_, ": fork of sequence ", src, " into itself"));
  }
  require_empty("fork into", dst);
  const SequenceTable::Record& s = seqs_.record(src);
  {
    const detail::MutexLock lock(shared_->mutex);
    for (std::size_t i = 0; i < s.num_blocks; ++i) shared_->pool.acquire(seqs_.table(src)[i]);
  }
  std::copy_n(seqs_.table(src), s.num_blocks, seqs_.table(dst));
  std::copy_n(seqs_.ids(src), s.num_tokens, seqs_.ids(dst));
  std::ranges::copy(seqs_.lengths(src), seqs_.lengths(dst).begin());
  seqs_.record(dst) = s;
}

/// Beam reordering: for every i at once, sequence dst[i] becomes a copy of what src[i] was
/// before the call (sharing its blocks). Sequences not named in dst are unchanged. Allocates a
/// snapshot of the sources. O(sum of their blocks + tokens).
/// @throws shape_error (dst.size() != src.size()); batch_error (an index out of range, or an
///         index twice in dst); std::bad_alloc. Unchanged on throw.
template <BlockHasher Hasher>
void BlockManager<Hasher>::reorder(std::span<const std::size_t> dst,
                                   std::span<const std::size_t> src) {
  if (dst.size() != src.size()) {
    throw shape_error(detail::message(name_, ": reorder of ", dst.size(), " sequences from ",
                                      src.size(), " sources"));
  }
  std::vector<bool> seen(max_batch(), false);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    detail::check_seq(name_, dst[i], max_batch());
    detail::check_seq(name_, src[i], max_batch());
    if (seen[dst[i]]) {
      throw batch_error(
          detail::message(name_, ": reorder names sequence ", dst[i], " twice as a destination"));
    }
    seen[dst[i]] = true;
  }
  struct Snapshot {
    SequenceTable::Record record;
    std::vector<block_id> table;
    std::vector<token_id> ids;
    std::vector<std::size_t> lengths;
  };
  std::vector<Snapshot> snap;
  snap.reserve(src.size());
  for (std::size_t from : src) {
    const SequenceTable::Record& s = seqs_.record(from);
    const auto lengths = seqs_.lengths(from);
    snap.push_back({s,
                    {seqs_.table(from), seqs_.table(from) + s.num_blocks},
                    {seqs_.ids(from), seqs_.ids(from) + s.num_tokens},
                    {lengths.begin(), lengths.end()}});
  }
  {
    const detail::MutexLock lock(shared_->mutex);
    for (const Snapshot& sn : snap) {
      for (block_id b : sn.table) shared_->pool.acquire(b);
    }
    for (std::size_t to : dst) release_blocks(to, 0);
  }
  for (std::size_t i = 0; i < dst.size(); ++i) {
    const Snapshot& sn = snap[i];
    std::ranges::copy(sn.table, seqs_.table(dst[i]));
    std::ranges::copy(sn.ids, seqs_.ids(dst[i]));
    std::ranges::copy(sn.lengths, seqs_.lengths(dst[i]).begin());
    seqs_.record(dst[i]) = sn.record;
  }
}

}  // namespace kvcache
