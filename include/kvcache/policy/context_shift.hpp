// SPDX-License-Identifier: Apache-2.0
// Context shift (llama.cpp's seq_rm followed by seq_add): drop a run of a sequence's tokens after
// its first n_keep and move the later ones back by as many positions, re-rotating their keys, so
// that a full cache keeps generating past its capacity (or a model's training length) without
// recomputing anything. Written once over the policies' restore() hook, so it works with every
// policy and keeps token ids and (for a PagedCache) the prefix index consistent.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/attention/rope.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// A cache context_shift() can rewrite: a CacheConcept policy with a restore() hook, either
/// restore(entries) (StaticCache, DynamicCache, SlidingWindowCache) or restore(entries, tokens)
/// with tokens(seq) (PagedCache, TokenTrackedCache), whose ids are then shifted too.
template <class C>
concept ShiftableCache = CacheConcept<C> &&(
    requires(C& c, std::span<const LayerRestore<typename C::value_type>> e) { c.restore(e); } ||
    requires(C & c, const C& cc, std::span<const LayerRestore<typename C::value_type>> e,
             std::span<const SequenceTokens> t, std::size_t seq) {
      c.restore(e, t);
      { cc.tokens(seq) } -> std::convertible_to<std::span<const token_id>>;
    });

namespace detail {

/// What one layer's view reports after a shift: length, sink_end, recent_begin.
struct ShiftedLayout {
  position_t length = 0;
  position_t sink_end = 0;
  position_t recent_begin = 0;
};

/// The layout of a layer holding [0, sink_end) and [recent_begin, length) after positions
/// [keep, end) are dropped and the later ones moved back by end - keep.
/// @throws position_error when the result would not be a prefix plus a suffix of the positions,
///         i.e. when the layer has evicted a gap [sink_end, recent_begin) (a sliding window) and
///         the shift would keep a position of that gap (keep > sink_end) or keep the gap after
///         dropping part of the sinks (keep < sink_end and end < recent_begin).
inline ShiftedLayout shifted_layout(std::size_t seq, std::size_t layer, position_t length,
                                    position_t sink_end, position_t recent_begin, position_t keep,
                                    position_t end) {
  const position_t new_length = length - (end - keep);
  const bool gap = sink_end < recent_begin;
  if (gap && keep > sink_end) {
    throw position_error(message("context_shift: n_keep ", keep, " of sequence ", seq,
                                 " reaches past the ", sink_end, " attention sinks of layer ",
                                 layer, ", whose positions [", sink_end, ", ", recent_begin,
                                 ") the window has evicted"));
  }
  if (!gap || end >= recent_begin) {
    // every position left is held: the policy's own convention for a whole sequence
    const position_t whole = std::min(sink_end, new_length);
    return {new_length, whole, whole};
  }
  if (keep < sink_end) {
    throw position_error(
        message("context_shift: discarding positions [", keep, ", ", end, ") of sequence ", seq,
                " drops part of the ", sink_end, " attention sinks of layer ", layer,
                " but keeps its evicted gap [", sink_end, ", ", recent_begin, "): keep all ",
                sink_end, " sinks, or discard through position ", recent_begin - 1));
  }
  return {new_length, sink_end, recent_begin - (end - keep)};
}

/// Appends to k_out / v_out (each already sized; written from row `first` of a packed
/// [heads][held][head_dim] block of `held` rows) the rows of `view` that survive dropping
/// positions [keep, end), the keys of positions >= end turned back by end - keep (read as floats,
/// turned, and written back in the cache's format: rounded, or quantized with a fresh scale).
/// A quantized side's scales go to ks_out (K) / vs_out (V), packed [heads][held] (unused
/// otherwise). T is the view's format (a KVFormats pair: K rows turned in K's format, V rows
/// copied in V's). `scratch` holds at least kShiftTile * head_dim floats.
inline constexpr std::size_t kShiftTile = 64;

template <KVView V, KVFormat T = typename V::value_type>
void pack_shifted(const V& view, const Rope& rope, position_t keep, position_t end,
                  key_format_t<T>* k_out, value_format_t<T>* v_out, scale_type* ks_out,
                  scale_type* vs_out, std::size_t held, float* scratch) {
  using K = key_format_t<T>;
  using Val = value_format_t<T>;
  const std::size_t d = view.head_dim();
  const double delta = -static_cast<double>(end - keep);
  std::size_t row = 0;  // packed row of the next surviving position
  for (std::size_t i = 0; i < view.num_segments(); ++i) {
    const KVSegment<T> seg = view.segment(i);
    const position_t seg_end = seg.first_pos + static_cast<position_t>(seg.len);
    // the segment's two surviving runs: [first_pos, keep) as is, [end, seg_end) turned
    const position_t runs[2][2] = {{seg.first_pos, std::min(seg_end, keep)},
                                   {std::max(seg.first_pos, end), seg_end}};
    for (const auto& run : runs) {
      if (run[0] >= run[1]) continue;
      const bool turned = run[0] >= end;
      const auto from = static_cast<std::size_t>(run[0] - seg.first_pos);
      const auto n = static_cast<std::size_t>(run[1] - run[0]);
      for (std::size_t h = 0; h < view.num_kv_heads(); ++h) {
        const K* k = seg.k + h * seg.head_stride + from * d;
        const Val* v = seg.v + h * seg.head_stride + from * d;
        const std::size_t out_row = h * held + row;
        K* kd = k_out + out_row * d;
        std::copy(v, v + n * d, v_out + out_row * d);
        const std::size_t at = h * seg.head_stride / d + from;  // the rows' first scale
        if constexpr (scaled_v<Val>)
          std::copy(seg.v_scale + at, seg.v_scale + at + n, vs_out + out_row);
        const scale_type* k_scale = nullptr;
        if constexpr (scaled_v<K>) {
          k_scale = seg.k_scale + at;
          if (!turned) std::copy(k_scale, k_scale + n, ks_out + out_row);
        }
        if (!turned) {
          std::copy(k, k + n * d, kd);
          continue;
        }
        for (std::size_t t = 0; t < n; t += kShiftTile) {
          const std::size_t m = std::min(kShiftTile, n - t);
          for (std::size_t r = t; r < t + m; ++r) {
            dequantize_row(k + r * d, k_scale != nullptr ? k_scale + r : nullptr, d,
                           scratch + (r - t) * d);
          }
          rope.turn(scratch, m, delta);  // m rows of head_dim, one angle set
          for (std::size_t r = t; r < t + m; ++r) {
            quantize_row(scratch + (r - t) * d, d, kd + r * d,
                         scaled_v<K> ? ks_out + out_row + r : nullptr);
          }
        }
      }
      row += n;
    }
  }
}

/// The checks of a context shift of `seq` (see context_shift()), on a cache of `shape` and
/// `max_batch` slots whose layer_length(l, seq) is `layer_length(l)`. `who` names the caller.
template <class LayerLength>
void check_context_shift(const char* who, const CacheShape& shape, std::size_t max_batch,
                         std::size_t seq, std::size_t n_keep, std::size_t n_discard,
                         const Rope& rope, LayerLength&& layer_length) {
  detail::check_seq(who, seq, max_batch);
  if (rope.head_dim() != shape.head_dim) {
    throw shape_error(detail::message(who, ": the RoPE is for head_dim ", rope.head_dim(),
                                      " but the cache has head_dim ", shape.head_dim));
  }
  const std::size_t length = layer_length(std::size_t{0});
  for (std::size_t l = 1; l < shape.num_layers; ++l) {
    if (layer_length(l) != length) {
      throw position_error(detail::message(who, ": layer ", l, " of sequence ", seq, " holds ",
                                           layer_length(l), " positions but layer 0 holds ", length,
                                           "; shift between forward passes"));
    }
  }
  if (n_keep > length || n_discard > length - n_keep) {
    throw position_error(detail::message(who, ": discarding ", n_discard,
                                         " positions after n_keep ", n_keep, " of sequence ", seq,
                                         ", which holds only ", length));
  }
}

/// A shifted sequence, ready for a restore() hook: the packed rows of every layer and the
/// entries that point into them.
template <KVFormat T>
struct ShiftedRows {
  std::vector<key_format_t<T>> k;
  std::vector<value_format_t<T>> v;
  std::vector<scale_type> k_scale, v_scale;  // of a quantized side
  std::vector<LayerRestore<T>> entries;
};

/// The rows of every layer of `seq` after positions [n_keep, n_keep + n_discard) are dropped and
/// the later keys turned back (pack_shifted), read from `view_of(l)`, a host KVView of layer l.
/// @throws position_error (shifted_layout), std::bad_alloc.
template <KVFormat T, class ViewOf>
ShiftedRows<T> shift_rows(const CacheShape& shape, std::size_t seq, std::size_t n_keep,
                          std::size_t n_discard, const Rope& rope, ViewOf&& view_of) {
  const auto keep = static_cast<position_t>(n_keep);
  const auto end = static_cast<position_t>(n_keep + n_discard);
  std::vector<ShiftedLayout> layouts(shape.num_layers);
  std::vector<std::size_t> first_row(shape.num_layers + 1, 0);
  for (std::size_t l = 0; l < shape.num_layers; ++l) {
    const auto view = view_of(l);
    layouts[l] =
        shifted_layout(seq, l, view.length(), view.sink_end(), view.recent_begin(), keep, end);
    const ShiftedLayout& s = layouts[l];
    first_row[l + 1] =
        first_row[l] + static_cast<std::size_t>(s.sink_end + s.length - s.recent_begin);
  }
  const std::size_t row_elems = shape.token_elems();
  ShiftedRows<T> out;
  out.k.resize(first_row.back() * row_elems);
  out.v.resize(out.k.size());
  constexpr bool k_scaled = scaled_v<key_format_t<T>>, v_scaled = scaled_v<value_format_t<T>>;
  if constexpr (k_scaled) out.k_scale.resize(first_row.back() * shape.num_kv_heads);
  if constexpr (v_scaled) out.v_scale.resize(first_row.back() * shape.num_kv_heads);
  out.entries.resize(shape.num_layers);
  std::vector<float> scratch(kShiftTile * shape.head_dim);
  for (std::size_t l = 0; l < shape.num_layers; ++l) {
    const std::size_t held = first_row[l + 1] - first_row[l];
    key_format_t<T>* k_out = out.k.data() + first_row[l] * row_elems;
    value_format_t<T>* v_out = out.v.data() + first_row[l] * row_elems;
    scale_type* ks_out = nullptr;
    scale_type* vs_out = nullptr;
    if constexpr (k_scaled) ks_out = out.k_scale.data() + first_row[l] * shape.num_kv_heads;
    if constexpr (v_scaled) vs_out = out.v_scale.data() + first_row[l] * shape.num_kv_heads;
    pack_shifted(view_of(l), rope, keep, end, k_out, v_out, ks_out, vs_out, held, scratch.data());
    const ShiftedLayout& s = layouts[l];
    LayerRestore<T>& e = out.entries[l];
    e.layer = l;
    e.seq = seq;
    e.length = s.length;
    e.sink_end = s.sink_end;
    e.recent_begin = s.recent_begin;
    e.k = {k_out, held * row_elems};
    e.v = {v_out, held * row_elems};
    if constexpr (k_scaled) e.k_scale = {ks_out, held * shape.num_kv_heads};
    if constexpr (v_scaled) e.v_scale = {vs_out, held * shape.num_kv_heads};
  }
  return out;
}

/// The ids a sequence with ids `old` holds after the shift: the first n_keep, then those past
/// n_keep + n_discard.
inline std::vector<token_id> shifted_ids(std::span<const token_id> old, std::size_t n_keep,
                                         std::size_t n_discard) {
  const std::size_t head = std::min(old.size(), n_keep);
  const std::size_t tail_from = std::min(old.size(), n_keep + n_discard);
  std::vector<token_id> ids(head + (old.size() - tail_from));
  std::copy_n(old.data(), head, ids.data());
  std::copy_n(old.data() + tail_from, old.size() - tail_from, ids.data() + head);
  return ids;
}

}  // namespace detail

/// Context shift: drops positions [n_keep, n_keep + n_discard) of sequence `seq` in every layer
/// and moves every later token back by n_discard positions, turning its key back by n_discard
/// positions of `rope` (keys are stored rotated at their positions, as the example engine and
/// most engines store them; values are moved unchanged). Afterwards seq_length(seq) is
/// n_discard shorter, attention over the sequence equals attention over keys rotated at their
/// new positions in the first place (up to one rounding of each moved key to the cache's
/// element type), and the next append continues at the new length. This is how a full cache
/// keeps a chat going past its capacity or past the model's training length: keep the system
/// prompt (n_keep), drop the oldest turns, go on (llama.cpp's n_keep / n_discard).
///
/// Every policy: it rewrites the sequence through the policy's restore() hook, so the policy's
/// own rules hold after it.
///  - Token ids (PagedCache, TokenTrackedCache): the ids of the dropped positions are removed
///    too, so tokens(seq) stays the ids of what the sequence holds.
///  - Moved K/V is not what a prompt of the new ids would compute: in every layer but the first,
///    each moved token's K/V was computed with the dropped tokens in context (and so is every
///    token's appended after it). A PagedCache therefore keeps the blocks before n_keep (shared
///    as they were) but never shares or indexes a block past n_keep of this sequence
///    (PagedCache::exact_prefix(), "Moved K/V"): the rest go to fresh blocks, invisible to
///    other prompts, and the blocks the sequence held before stay cached for prompts with the
///    old ids, as release() would leave them. A TokenTrackedCache keeps matching the shifted
///    ids in reuse_prefix(): that is the sequence going on from where it was (llama.cpp's
///    behaviour); reset() the sequence before serving an unrelated prompt from it.
///  - SlidingWindowCache: while the window has evicted nothing, any shift works. Once it has
///    (view().sink_end() < recent_begin()), the positions kept must still be held: n_keep may
///    not pass the sinks, and a shift that drops some sinks (n_keep < num_sink_tokens) must drop
///    the whole evicted gap too. To go on past a long window with absolute positions, shift
///    with n_keep = num_sink_tokens; PositionMode::cache_relative needs no shift at all.
///
/// Call it between forward passes (every layer of the sequence at the same length). Allocates
/// one packed copy of the sequence's K/V (all layers) and, for caches with ids, of its ids; a
/// PagedCache's restore() allocates its scratch too. O(held elements + rotary_dims * held
/// tokens / 64 trigonometric pairs).
/// @throws batch_error (seq out of range); shape_error (rope.head_dim() differs from the
///         cache's head_dim); position_error (n_keep + n_discard past seq_length(seq), layers of
///         different lengths, a sliding window shift named above); whatever the policy's
///         restore() throws (pool_exhausted_error when a PagedCache's pool cannot hold the
///         rewritten blocks); std::bad_alloc. The cache is unchanged on throw.
template <ShiftableCache C>
void context_shift(C& cache, std::size_t seq, std::size_t n_keep, std::size_t n_discard,
                   const Rope& rope) {
  using T = typename C::value_type;
  const CacheShape shape = cache.shape();
  detail::check_context_shift("context_shift", shape, cache.max_batch(), seq, n_keep, n_discard,
                              rope, [&](std::size_t l) { return cache.layer_length(l, seq); });
  if (n_discard == 0) return;
  const detail::ShiftedRows<T> rows = detail::shift_rows<T>(
      shape, seq, n_keep, n_discard, rope, [&](std::size_t l) { return cache.view(l, seq); });
  const std::span<const LayerRestore<T>> all(rows.entries);
  if constexpr (requires { cache.restore(all, std::span<const SequenceTokens>{}); }) {
    const std::vector<token_id> ids = detail::shifted_ids(cache.tokens(seq), n_keep, n_discard);
    std::size_t exact = n_keep;  // what follows carries the dropped tokens' context
    if constexpr (requires { cache.exact_prefix(seq); }) {
      exact = std::min(exact, cache.exact_prefix(seq));
    }
    std::uint64_t extra_key = 0;
    if constexpr (requires { cache.extra_key(seq); }) extra_key = cache.extra_key(seq);
    const SequenceTokens tokens[] = {
        {.seq = seq, .ids = ids, .exact_prefix = exact, .extra_key = extra_key}};
    cache.restore(all, tokens);
  } else {
    cache.restore(all);
  }
}

}  // namespace kvcache
