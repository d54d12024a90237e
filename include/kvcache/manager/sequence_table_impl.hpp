// SPDX-License-Identifier: Apache-2.0
// SequenceTable's constructor and scans (manager/sequence_table.hpp includes this file where they
// are to be compiled, core/compiled_once.hpp; include that header, not this one).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/manager/sequence_table.hpp"

namespace kvcache {

KVCACHE_DETAIL_BODY_INLINE SequenceTable::SequenceTable(std::size_t max_batch,
                                                        std::size_t num_layers,
                                                        std::size_t max_blocks_per_seq,
                                                        std::size_t max_seq_len, const char* name)
    : max_batch_(max_batch),
      num_layers_(num_layers),
      max_blocks_(max_blocks_per_seq),
      max_seq_len_(max_seq_len) {
  records_.resize(max_batch);
  tables_.assign(detail::checked_mul(max_batch, max_blocks_per_seq, name), kNoBlock);
  copies_.resize(tables_.size());
  ids_.assign(detail::checked_mul(max_batch, max_seq_len, name), 0);
  lengths_.assign(detail::checked_mul(max_batch, num_layers, name), 0);
}

KVCACHE_DETAIL_BODY_INLINE SequenceTable::Extent SequenceTable::extent(
    std::size_t seq) const noexcept {
  const std::span<const std::size_t> l = lengths(seq);
  const auto [lo, hi] = std::minmax_element(l.begin(), l.end());
  return {*lo, *hi};
}

KVCACHE_DETAIL_BODY_INLINE void SequenceTable::clear(std::size_t seq) noexcept {
  records_[seq] = {};
  const std::span<std::size_t> l = lengths(seq);
  std::fill(l.begin(), l.end(), 0);
}

}  // namespace kvcache
