// SPDX-License-Identifier: Apache-2.0
// HostBlocks: the K/V bytes of a paged cache in host memory, and the three things a BlockManager
// asks of them: write an append's rows, copy a block (copy-on-write), fill a restored block.
#pragma once

#include <algorithm>
#include <cstddef>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// num_blocks blocks of block_size tokens of every layer, in 64-byte-aligned storage (KVRows, a
/// slab per block of a layer) laid out [layer][block][K, V][kv_head][block_size][head_dim] for one
/// format, and [layer][block][kv_head][block_size][head_dim] on each side for a KVFormats pair: a
/// layer's blocks form one array (what a GPU kernel takes with a block table; layer_bases()), and
/// a segment's heads are block_size * head_dim apart.
/// Knows nothing of tables or sequences: the caller names blocks. Not thread-safe by itself:
/// concurrent calls must touch different blocks (BlockManager's rules guarantee it).
template <KVFormat T>
class HostBlocks {
 public:
  HostBlocks() = default;
  /// @throws capacity_error when the size overflows (naming `name`); std::bad_alloc.
  HostBlocks(const CacheShape& shape, std::size_t num_blocks, std::size_t block_size,
             const char* name)
      : shape_(shape), block_size_(block_size), num_blocks_(num_blocks) {
    (void)kv_cache_bytes(shape, detail::checked_mul(num_blocks, block_size, name));  // overflow
    storage_ = KVRows<T>(detail::checked_mul(shape.num_layers, num_blocks, name),
                         shape.num_kv_heads * block_size, shape.head_dim);
  }

  /// The bases of layer `layer`'s pool (block 0), for paged_layout().
  [[nodiscard]] KVBases<T> layer_bases(std::size_t layer) const noexcept {
    return storage_.bases(offset(layer, 0));
  }
  /// Bytes of every block of every layer, row scales included.
  [[nodiscard]] std::size_t bytes() const noexcept { return storage_.bytes(); }

  /// Writes tokens [position, position + k.num_tokens) of one layer into the blocks of `table`
  /// (entry i holding positions [i * block_size, (i + 1) * block_size)), converting to T.
  template <class U>
  void write_rows(std::size_t layer, const block_id* table, std::size_t position,
                  const TokenBlock<const U>& k, const TokenBlock<const U>& v) noexcept {
    const std::size_t d = shape_.head_dim, head_elems = block_size_ * d;
    for (std::size_t done = 0; done < k.num_tokens;) {
      const std::size_t pos = position + done;
      const std::size_t in_block = pos % block_size_;
      const std::size_t run = std::min(k.num_tokens - done, block_size_ - in_block);
      const std::size_t base = offset(layer, table[pos / block_size_]);
      for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
        const std::size_t at = base + h * head_elems + in_block * d;
        detail::store_rows(storage_.k(at), storage_.k_scale(at), k, done, run, h);
        detail::store_rows(storage_.v(at), storage_.v_scale(at), v, done, run, h);
      }
      done += run;
    }
  }

  /// Copies the first rows(l) rows (of block_size) of every layer l from block `from` into `to`.
  template <class Rows>
  void copy_block(block_id from, block_id to, Rows&& rows) noexcept {
    const std::size_t d = shape_.head_dim, head_elems = block_size_ * d;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      const std::size_t n = rows(l);
      if (n == 0) continue;
      for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
        const std::size_t src = offset(l, from) + h * head_elems,
                          dst = offset(l, to) + h * head_elems;
        std::copy_n(storage_.k(src), n * d, storage_.k(dst));
        std::copy_n(storage_.v(src), n * d, storage_.v(dst));
        if constexpr (scaled_v<key_format_t<T>>) {
          std::copy_n(storage_.k_scale(src), n, storage_.k_scale(dst));
        }
        if constexpr (scaled_v<value_format_t<T>>) {
          std::copy_n(storage_.v_scale(src), n, storage_.v_scale(dst));
        }
      }
    }
  }

  /// Fills block `b` of e.layer with e's positions [first, first + block_size) that it holds:
  /// block `index` of a sequence restored from `e` (whose K/V is packed, PagedCache holding
  /// every position). @pre e.sink_end == e.recent_begin == 0.
  void fill_block(const LayerRestore<T>& e, std::size_t index, block_id b) noexcept {
    const std::size_t at = offset(e.layer, b);
    detail::fill_packed_block(storage_.k(at), storage_.v(at), storage_.k_scale(at),
                              storage_.v_scale(at), block_size_, shape_, e, index);
  }

 private:
  // Element offset of block b of `layer` (its K rows; KVRows finds the V rows).
  [[nodiscard]] std::size_t offset(std::size_t layer, block_id b) const noexcept {
    return (layer * num_blocks_ + std::size_t{b}) * storage_.slab_stride();
  }

  CacheShape shape_{};
  std::size_t block_size_ = 1;
  std::size_t num_blocks_ = 0;
  KVRows<T> storage_;  // a slab per (layer, block)
};

}  // namespace kvcache
