// SPDX-License-Identifier: Apache-2.0
// SequenceTable: what a BlockManager knows about each sequence slot — its block table, token ids,
// per-layer lengths and commitment — in arrays allocated once. Metadata only, no lock. Its
// constructor and scans are in manager/sequence_table_impl.hpp (where: core/compiled_once.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// One block a sequence copies before it writes (copy-on-write): table entry `index` held the
/// shared or indexed block `from` and now holds the fresh block `to`; the storage copies the rows
/// every layer holds there (BlockManager::block_rows) from `from` into `to`.
struct BlockCopy {
  std::size_t index = 0;
  block_id from = kNoBlock;
  block_id to = kNoBlock;
};

/// The per-sequence state of max_batch slots, each with room for max_blocks_per_seq table
/// entries and max_seq_len ids, all allocated by the constructor. Slot `seq` is touched only by
/// operations on that sequence (see BlockManager's thread-safety rules), so it needs no lock.
class SequenceTable {
 public:
  /// Leading positions whose K/V follows from their ids alone: every one of them.
  static constexpr std::size_t kAllExact = std::numeric_limits<std::size_t>::max();

  /// One sequence's counters.
  struct Record {
    std::size_t num_blocks = 0;  ///< table entries in use
    std::size_t num_tokens = 0;  ///< ids registered
    std::size_t committed = 0;   ///< leading blocks indexed under this sequence's prefix
    /// Leading positions whose K/V follows from their ids alone (BlockManager "Moved K/V"): no
    /// block past it is shared through the index or indexed.
    std::size_t exact = kAllExact;
    /// The key its blocks are indexed and matched under (BlockManager "Cache salt"); 0: none.
    std::uint64_t extra_key = 0;
  };

  /// The lengths of a sequence's shortest and longest layer.
  struct Extent {
    std::size_t shortest = 0, longest = 0;
  };

  SequenceTable() = default;
  /// @throws capacity_error when a size overflows (naming `name`); std::bad_alloc.
  SequenceTable(std::size_t max_batch, std::size_t num_layers, std::size_t max_blocks_per_seq,
                std::size_t max_seq_len, const char* name);

  [[nodiscard]] std::size_t max_batch() const noexcept { return max_batch_; }
  [[nodiscard]] std::size_t num_layers() const noexcept { return num_layers_; }
  [[nodiscard]] std::size_t max_blocks_per_seq() const noexcept { return max_blocks_; }
  [[nodiscard]] std::size_t max_seq_len() const noexcept { return max_seq_len_; }

  [[nodiscard]] Record& record(std::size_t seq) noexcept { return records_[seq]; }
  [[nodiscard]] const Record& record(std::size_t seq) const noexcept { return records_[seq]; }

  /// The block table of seq: max_blocks_per_seq entries, record(seq).num_blocks in use.
  [[nodiscard]] block_id* table(std::size_t seq) noexcept {
    return tables_.data() + seq * max_blocks_;
  }
  [[nodiscard]] const block_id* table(std::size_t seq) const noexcept {
    return tables_.data() + seq * max_blocks_;
  }
  /// The token ids of seq: max_seq_len entries, record(seq).num_tokens registered.
  [[nodiscard]] token_id* ids(std::size_t seq) noexcept { return ids_.data() + seq * max_seq_len_; }
  [[nodiscard]] const token_id* ids(std::size_t seq) const noexcept {
    return ids_.data() + seq * max_seq_len_;
  }
  /// Copy-on-write scratch of seq: max_blocks_per_seq entries.
  [[nodiscard]] BlockCopy* copies(std::size_t seq) noexcept {
    return copies_.data() + seq * max_blocks_;
  }

  /// Positions `layer` of seq holds.
  [[nodiscard]] std::size_t& length(std::size_t seq, std::size_t layer) noexcept {
    return lengths_[seq * num_layers_ + layer];
  }
  [[nodiscard]] std::size_t length(std::size_t seq, std::size_t layer) const noexcept {
    return lengths_[seq * num_layers_ + layer];
  }
  /// Every layer's length of seq, [num_layers].
  [[nodiscard]] std::span<std::size_t> lengths(std::size_t seq) noexcept {
    return {lengths_.data() + seq * num_layers_, num_layers_};
  }
  [[nodiscard]] std::span<const std::size_t> lengths(std::size_t seq) const noexcept {
    return {lengths_.data() + seq * num_layers_, num_layers_};
  }
  [[nodiscard]] Extent extent(std::size_t seq) const noexcept;

  /// Slot seq empty again: no blocks, ids or positions. (The caller releases the blocks first.)
  void clear(std::size_t seq) noexcept;

 private:
  std::size_t max_batch_ = 0;
  std::size_t num_layers_ = 0;
  std::size_t max_blocks_ = 0;
  std::size_t max_seq_len_ = 0;
  std::vector<Record> records_;
  std::vector<block_id> tables_;      // [seq][max_blocks_per_seq]
  std::vector<BlockCopy> copies_;     // [seq][max_blocks_per_seq]
  std::vector<token_id> ids_;         // [seq][max_seq_len]
  std::vector<std::size_t> lengths_;  // [seq][layer]
};

}  // namespace kvcache

#if KVCACHE_DETAIL_DEFINES_BODIES
#include "kvcache/manager/sequence_table_impl.hpp"
#endif
