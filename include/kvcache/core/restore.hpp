// SPDX-License-Identifier: Apache-2.0
// The argument of the policies' restore() hooks: the state one (layer, sequence) is to be put in,
// described as its view would report it, plus the K/V of the positions it holds, packed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// What one (layer, sequence) holds, as its view reports it, plus the K/V of those positions.
/// Produced by the snapshot loader (kvcache/io/snapshot.hpp) and consumed by a policy's
/// `restore(std::span<const LayerRestore<T>>)`. After a restore, view(layer, seq) reports exactly
/// length, sink_end and recent_begin, and holds these K/V rows at those positions. F is the format
/// of the rows: one element type (what the policies' restore() take: each stores one format), or
/// KVFormats<K, V>, K rows of K and V rows of V, which the row-moving helpers below take too.
template <KVFormat F>
struct LayerRestore {
  std::size_t layer = 0;
  std::size_t seq = 0;
  /// view().length(): one past the last position (positions appended so far).
  position_t length = 0;
  /// view().sink_end() and view().recent_begin(): the positions held are [0, sink_end) and
  /// [recent_begin, length). Both 0 for the policies that drop nothing.
  position_t sink_end = 0;
  position_t recent_begin = 0;
  /// K and V of the held positions in increasing position order, each packed head-major
  /// [num_kv_heads][held][head_dim], held = sink_end + (length - recent_begin).
  std::span<const key_format_t<F>> k;
  std::span<const value_format_t<F>> v;

  /// Positions held: sink_end + (length - recent_begin). @pre the fields are consistent.
  [[nodiscard]] constexpr std::size_t held() const noexcept {
    return static_cast<std::size_t>(sink_end + (length - recent_begin));
  }
};

/// LayerRestore of a format whose rows carry scales (int8, fp8, or a pair with a quantized side):
/// the same fields, then the rows' scales, packed as the rows, [num_kv_heads][held] each: k_scale
/// when K is quantized, v_scale when V is; a side that is not quantized leaves its span empty.
template <KVFormat F>
requires has_row_scales_v<F>
struct LayerRestore<F> {
  std::size_t layer = 0;
  std::size_t seq = 0;
  position_t length = 0;
  position_t sink_end = 0;
  position_t recent_begin = 0;
  std::span<const key_format_t<F>> k;  ///< codes, or elements of an unquantized K
  std::span<const value_format_t<F>> v;
  std::span<const scale_type> k_scale;
  std::span<const scale_type> v_scale;

  [[nodiscard]] constexpr std::size_t held() const noexcept {
    return static_cast<std::size_t>(sink_end + (length - recent_begin));
  }
};

/// The token ids one sequence of a TokenTrackedCache or PagedCache is to hold after a restore.
struct SequenceTokens {
  std::size_t seq = 0;
  std::span<const token_id> ids;
  /// How many leading positions hold K/V computed from exactly their ids (what a prompt of those
  /// ids would compute): all (SIZE_MAX, the default), unless a context shift moved the tokens
  /// after its n_keep, whose K/V still carries the context it dropped. A PagedCache shares and
  /// indexes no block past it (PagedCache::exact_prefix()); a TokenTrackedCache ignores it.
  std::size_t exact_prefix = std::numeric_limits<std::size_t>::max();
  /// The key its blocks are shared and indexed under (PagedCache::admit()'s extra_key: a cache
  /// salt, an adapter id); 0 for none. A TokenTrackedCache ignores it.
  std::uint64_t extra_key = 0;
};

namespace detail {

/// Shared checks of restore(): layer and sequence in range, each (layer, seq) at most once,
/// 0 <= sink_end <= recent_begin <= length, and K/V spans sized for held() positions.
/// @throws layer_error, batch_error, position_error, shape_error naming entry `i`.
/// O(entries + num_layers * max_batch).
template <KVFormat T>
void check_restore_entries(const char* cache, std::span<const LayerRestore<T>> entries,
                           const CacheShape& shape, std::size_t max_batch) {
  std::vector<std::size_t> first_entry;  // [layer][seq] -> index + 1 of the entry naming it
  if (!entries.empty()) first_entry.assign(shape.num_layers * max_batch, 0);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const LayerRestore<T>& e = entries[i];
    if (e.layer >= shape.num_layers) {
      throw layer_error(detail::message(cache, ": restore entry ", i, ": layer ", e.layer,
                                        " out of range (num_layers ", shape.num_layers, ")"));
    }
    if (e.seq >= max_batch) {
      throw batch_error(detail::message(cache, ": restore entry ", i, ": sequence ", e.seq,
                                        " out of range (max_batch ", max_batch, ")"));
    }
    if (!(0 <= e.sink_end && e.sink_end <= e.recent_begin && e.recent_begin <= e.length)) {
      throw position_error(detail::message(cache, ": restore entry ", i,
                                           ": need 0 <= sink_end <= recent_begin <= length, got ",
                                           e.sink_end, ", ", e.recent_begin, ", ", e.length));
    }
    if (std::size_t& first = first_entry[e.layer * max_batch + e.seq]; first != 0) {
      throw shape_error(detail::message(cache, ": restore entries ", first - 1, " and ", i,
                                        " both name layer ", e.layer, " of sequence ", e.seq));
    } else {
      first = i + 1;
    }
    // held <= length, and every held position has K/V: the product cannot overflow once the
    // spans' sizes (real memory) are compared element count by element count.
    const std::size_t row = shape.token_elems();
    const std::size_t held = e.held();
    if (e.k.size() / row != held || e.k.size() % row != 0 || e.v.size() != e.k.size()) {
      throw shape_error(detail::message(
          cache, ": restore entry ", i, " holds ", held, " positions, so K and V need ", held,
          " x ", row, " elements each, but got ", e.k.size(), " and ", e.v.size()));
    }
    if constexpr (has_row_scales_v<T>) {  // a quantized side's scales, one per row; none else
      using K = key_format_t<T>;
      using V = value_format_t<T>;
      const std::size_t k_scales = scaled_v<K> ? held * shape.num_kv_heads : 0;
      const std::size_t v_scales = scaled_v<V> ? held * shape.num_kv_heads : 0;
      if (e.k_scale.size() != k_scales || e.v_scale.size() != v_scales) {
        throw shape_error(detail::message(
            cache, ": restore entry ", i, " of K ", dtype_name(dtype_of<K>), " and V ",
            dtype_name(dtype_of<V>), " rows needs ", k_scales, " K and ", v_scales,
            " V scales (one per row of a quantized side, none otherwise), but got ",
            e.k_scale.size(), " and ", e.v_scale.size()));
      }
    }
  }
}

/// restore() checks of a cache that holds every position of a sequence up to `max_len` (a
/// static or contiguous cache): no entry drops positions, none is longer than max_len.
/// @throws position_error, capacity_error naming entry `i`.
template <KVFormat T>
void check_whole_restore(const char* cache, std::span<const LayerRestore<T>> entries,
                         std::size_t max_len) {
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const LayerRestore<T>& e = entries[i];
    if (e.sink_end != 0 || e.recent_begin != 0) {
      throw position_error(detail::message(cache, ": restore entry ", i, " drops positions [",
                                           e.sink_end, ", ", e.recent_begin, "), but a ", cache,
                                           " holds every position"));
    }
    if (static_cast<std::size_t>(e.length) > max_len) {
      throw capacity_error(detail::message(cache, ": restore entry ", i, ": sequence ", e.seq,
                                           " layer ", e.layer, " holds ", e.length,
                                           " tokens, more than max_seq_len ", max_len));
    }
  }
}

/// restore() checks of a sliding window with `num_sinks` sinks and a ring of `ring_len`
/// positions (window + max_append_len - 1): each entry is a state such a window can be in, the
/// sinks whole ([0, min(length, num_sinks))), the rest at most ring_len positions past them.
/// @throws position_error, capacity_error naming entry `i`.
template <KVFormat T>
void check_window_restore(const char* cache, std::span<const LayerRestore<T>> entries,
                          std::size_t num_sinks, std::size_t window, std::size_t max_append_len) {
  const auto sinks = static_cast<position_t>(num_sinks);
  const std::size_t ring_len = window + max_append_len - 1;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const LayerRestore<T>& e = entries[i];
    const bool all_sinks = e.length <= sinks;
    if (all_sinks ? (e.sink_end != e.length || e.recent_begin != e.length)
                  : (e.sink_end != sinks || e.recent_begin < sinks)) {
      throw position_error(detail::message(
          cache, ": restore entry ", i, " (sequence ", e.seq, " layer ", e.layer, "): length ",
          e.length, ", sink_end ", e.sink_end, ", recent_begin ", e.recent_begin,
          " is not a state of a window with ", num_sinks, " sink tokens"));
    }
    if (static_cast<std::size_t>(e.length - e.recent_begin) > ring_len) {
      throw capacity_error(detail::message(
          cache, ": restore entry ", i, " (sequence ", e.seq, " layer ", e.layer, ") holds ",
          e.length - e.recent_begin, " ring positions, more than ring_len ", ring_len, " (window ",
          window, ", max_append_len ", max_append_len, ")"));
    }
  }
}

/// Copies positions [src_first, src_first + n) of a packed head-major [heads][held][row_len]
/// source into storage rows dst + h * head_stride + slot * row_len, from slot dst_slot (rows of
/// head_dim elements, or of one scale).
template <class T>
void copy_packed_rows(T* dst, std::size_t heads, std::size_t row_len, std::size_t head_stride,
                      std::size_t dst_slot, const T* src, std::size_t held, std::size_t src_first,
                      std::size_t n) noexcept {
  for (std::size_t h = 0; h < heads; ++h) {
    const T* from = src + (h * held + src_first) * row_len;
    std::copy(from, from + n * row_len, dst + h * head_stride + dst_slot * row_len);
  }
}

/// copy_packed_rows() of K and V, and of the scales of a quantized side: positions
/// [src_first, src_first + n) of entry `e` into the rows from `k` and `v` (heads head_stride
/// elements apart, starting at slot dst_slot) and the scales into `k_scale` (K quantized) and
/// `v_scale` (V quantized), heads head_stride / head_dim apart; a side's scale pointer is unused
/// (may be null) when that side is not quantized.
template <KVFormat F>
void restore_rows(key_format_t<F>* k, value_format_t<F>* v, scale_type* k_scale,
                  scale_type* v_scale, std::size_t head_stride, std::size_t dst_slot,
                  const LayerRestore<F>& e, std::size_t src_first, std::size_t n,
                  const CacheShape& shape) noexcept {
  const std::size_t held = e.held(), heads = shape.num_kv_heads, d = shape.head_dim;
  const std::size_t stride = head_stride / d;
  copy_packed_rows(k, heads, d, head_stride, dst_slot, e.k.data(), held, src_first, n);
  copy_packed_rows(v, heads, d, head_stride, dst_slot, e.v.data(), held, src_first, n);
  if constexpr (scaled_v<key_format_t<F>>) {
    copy_packed_rows(k_scale, heads, 1, stride, dst_slot, e.k_scale.data(), held, src_first, n);
  } else {
    (void)k_scale;
  }
  if constexpr (scaled_v<value_format_t<F>>) {
    copy_packed_rows(v_scale, heads, 1, stride, dst_slot, e.v_scale.data(), held, src_first, n);
  } else {
    (void)v_scale;
  }
}

/// restore_rows() into a cache's KVRows, rows from the slab offset `at` (K and V alike).
template <KVFormat F>
void restore_rows(KVRows<F>& storage, std::size_t at, std::size_t head_stride, std::size_t dst_slot,
                  const LayerRestore<F>& e, std::size_t src_first, std::size_t n,
                  const CacheShape& shape) noexcept {
  restore_rows(storage.k(at), storage.v(at), storage.k_scale(at), storage.v_scale(at), head_stride,
               dst_slot, e, src_first, n, shape);
}

/// Writes the positions [index * block_size, (index + 1) * block_size) that `e` holds into one
/// paged block: its K rows from `k` and V rows from `v`, each [num_kv_heads][block_size]
/// [head_dim], and the scales of a quantized side into `k_scale` / `v_scale`, each
/// [num_kv_heads][block_size] (unused, may be null, for a side that is not quantized): block
/// `index` of a sequence restored from e. A single-format block [K, V][num_kv_heads][block_size]
/// [head_dim] passes its start and the start of its V half (its scales likewise). @pre e holds
/// every position (sink_end == recent_begin == 0).
template <KVFormat F>
void fill_packed_block(key_format_t<F>* k, value_format_t<F>* v, scale_type* k_scale,
                       scale_type* v_scale, std::size_t block_size, const CacheShape& shape,
                       const LayerRestore<F>& e, std::size_t index) noexcept {
  const std::size_t n = e.held(), first = index * block_size;
  if (first >= n) return;
  restore_rows(k, v, k_scale, v_scale, block_size * shape.head_dim, 0, e, first,
               std::min(block_size, n - first), shape);
}

/// The rows `view` holds, packed as a LayerRestore holds them: k and v [num_kv_heads][held]
/// [head_dim], held = view_num_tokens(view), positions in view order (sinks, then the recent
/// ones); the scales of a quantized side into k_scale (K) or v_scale (V), packed
/// [num_kv_heads][held] (unused, may be null, for a side that is not quantized). F is the view's
/// format (a pair packs each side in its own format). @pre each output holds as many elements as
/// that.
template <KVView View, KVFormat F = typename View::value_type>
void pack_view_rows(const View& view, key_format_t<F>* k, value_format_t<F>* v,
                    scale_type* k_scale = nullptr, scale_type* v_scale = nullptr) noexcept {
  constexpr bool k_scaled = scaled_v<key_format_t<F>>, v_scaled = scaled_v<value_format_t<F>>;
  const std::size_t held = view_num_tokens(view), d = view.head_dim();
  std::size_t row = 0;  // packed index of the segment's first position
  for (std::size_t i = 0; i < view.num_segments(); ++i) {
    const KVSegment<F> seg = view.segment(i);
    for (std::size_t h = 0; h < view.num_kv_heads(); ++h) {
      std::copy_n(seg.k + h * seg.head_stride, seg.len * d, k + (h * held + row) * d);
      std::copy_n(seg.v + h * seg.head_stride, seg.len * d, v + (h * held + row) * d);
      if constexpr (k_scaled) {
        std::copy_n(seg.k_scale + h * seg.head_stride / d, seg.len, k_scale + h * held + row);
      }
      if constexpr (v_scaled) {
        std::copy_n(seg.v_scale + h * seg.head_stride / d, seg.len, v_scale + h * held + row);
      }
    }
    row += seg.len;
  }
  if constexpr (!k_scaled) (void)k_scale;
  if constexpr (!v_scaled) (void)v_scale;
}

}  // namespace detail
}  // namespace kvcache
