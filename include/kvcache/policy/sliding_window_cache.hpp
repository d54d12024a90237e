// SPDX-License-Identifier: Apache-2.0
// SlidingWindowCache: constant memory however long a sequence grows. The first num_sink_tokens
// tokens (StreamingLLM attention sinks) are kept forever; the rest live in a ring buffer sized for
// the attention window plus one append's worth of slack, so chunked prefill and speculative
// rollback stay exact. Views report absolute positions, so RoPE and masks survive wrap-around.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// Construction parameters of a SlidingWindowCache.
struct SlidingWindowCacheConfig {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t max_batch = 1;
  /// Attention window W (>= 1): a query at position p attends to keys p - W < pos <= p, plus the
  /// sinks. Pass the same value as AttentionOptions::window.
  std::size_t window = 0;
  /// Tokens at positions [0, num_sink_tokens) kept forever (AttentionOptions::num_sink_tokens).
  std::size_t num_sink_tokens = 0;
  /// Largest n of one append (>= 1): a prefill longer than this is appended in chunks. Also
  /// how far crop() can always roll back: max_append_len tokens below the longest length the
  /// sequence has reached (see can_crop()).
  std::size_t max_append_len = 1;
};

/// Ring-buffer cache. Per (layer, sequence): num_sink_tokens sink slots plus
/// ring_len() = window + max_append_len - 1 ring slots, all allocated at construction; nothing
/// allocates afterwards. Position p >= num_sink_tokens lives in ring slot
/// (p - num_sink_tokens) % ring_len(). After appending n <= max_append_len tokens every query
/// among them still finds its whole window in the cache, and crop() can roll back up to
/// max_append_len tokens below the longest length reached (can_crop() states it exactly).
/// T: any storage format, or KVFormats<K, V>.
template <KVFormat T>
class SlidingWindowCache {
 public:
  using value_type = T;
  using view_type = LayoutView<T>;

  /// @throws shape_error for a zero num_layers, num_kv_heads, head_dim, max_batch, window or
  ///         max_append_len; capacity_error if the size overflows; std::bad_alloc.
  explicit SlidingWindowCache(const SlidingWindowCacheConfig& config)
      : shape_(cache_shape<T>(config.num_layers, config.num_kv_heads, config.head_dim)),
        max_batch_(config.max_batch),
        window_(config.window),
        num_sinks_(config.num_sink_tokens),
        max_append_len_(config.max_append_len) {
    detail::require_nonzero(config.num_layers, kName, "num_layers");
    detail::require_nonzero(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_nonzero(config.head_dim, kName, "head_dim");
    detail::require_nonzero(config.max_batch, kName, "max_batch");
    detail::require_nonzero(config.window, kName, "window");
    detail::require_nonzero(config.max_append_len, kName, "max_append_len");
    detail::require_int(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_int(config.head_dim, kName, "head_dim");
    detail::require_int(config.max_batch, kName, "max_batch");
    detail::require_int(config.window, kName, "window");
    detail::require_int(config.max_append_len, kName, "max_append_len");
    detail::require_int(config.num_sink_tokens, kName, "num_sink_tokens");
    ring_len_ = window_ + max_append_len_ - 1;
    slots_per_seq_ = num_sinks_ + ring_len_;
    detail::require_int(slots_per_seq_, kName, "num_sink_tokens + window + max_append_len - 1");
    (void)kv_cache_bytes(shape_, slots_per_seq_, max_batch_);  // throws if it overflows
    storage_ = KVRows<T>(shape_.num_layers * max_batch_, shape_.num_kv_heads * slots_per_seq_,
                         shape_.head_dim);
    state_.assign(shape_.num_layers * max_batch_, State{0, static_cast<position_t>(num_sinks_)});
  }

  /// Appends n = k.num_tokens tokens to `layer` of `seq`, evicting the oldest non-sink tokens
  /// once the ring is full. O(n * num_kv_heads * head_dim); never allocates.
  /// @throws layer_error, batch_error, shape_error, capacity_error (n > max_append_len);
  ///         the cache is unchanged on throw.
  template <AppendRows<T> U>
  void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
    using In = TokenBlock<const std::remove_const_t<U>>;
    const In kin = k, vin = v;
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const std::size_t n = detail::check_kv_input(kName, shape_, kin, vin);
    if (n > max_append_len_) {
      throw capacity_error(
          detail::message(kName, ": append of ", n, " tokens to sequence ", seq, " layer ", layer,
                          " exceeds max_append_len ", max_append_len_, " (window ", window_,
                          "); append in chunks of at most max_append_len tokens or raise it"));
    }
    State& st = state_[layer * max_batch_ + seq];
    const std::size_t base = slab_offset(layer, seq);
    const std::size_t d = shape_.head_dim;
    const std::size_t head_elems = slots_per_seq_ * d;
    for (std::size_t done = 0; done < n;) {
      const std::size_t pos = static_cast<std::size_t>(st.length) + done;
      const std::size_t slot = slot_of(pos);
      // contiguous run: up to the end of the sink region or of the ring
      const std::size_t region_end = pos < num_sinks_ ? num_sinks_ : slots_per_seq_;
      const std::size_t run = std::min(n - done, region_end - slot);
      for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
        const std::size_t at = base + h * head_elems + slot * d;
        detail::store_rows(storage_.k(at), storage_.k_scale(at), kin, done, run, h);
        detail::store_rows(storage_.v(at), storage_.v_scale(at), vin, done, run, h);
      }
      done += run;
    }
    st.length += static_cast<position_t>(n);
    st.ring_begin = std::max(st.ring_begin, st.length - static_cast<position_t>(ring_len_));
  }

  /// View over `layer` of `seq` (a ring layout): the sinks [0, sink_end) and the ring's positions
  /// [recent_begin, length), as at most 3 segments (sinks, then the ring in position order).
  /// @throws layer_error, batch_error.
  [[nodiscard]] view_type view(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const State& st = state_[layer * max_batch_ + seq];
    const position_t sinks = static_cast<position_t>(num_sinks_);
    const position_t sink_end = std::min(st.length, sinks);
    const position_t recent_begin = st.length <= sinks ? st.length : st.ring_begin;
    return view_type(layout(layer), static_cast<int>(seq),
                     KeyRange{sink_end, recent_begin, st.length});
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    return static_cast<std::size_t>(state_[layer * max_batch_ + seq].length);
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  /// Positions are unbounded: SIZE_MAX.
  [[nodiscard]] std::size_t capacity() const noexcept {
    return std::numeric_limits<std::size_t>::max();
  }
  [[nodiscard]] std::size_t max_batch() const noexcept { return max_batch_; }
  [[nodiscard]] std::size_t window() const noexcept { return window_; }
  [[nodiscard]] std::size_t num_sink_tokens() const noexcept { return num_sinks_; }
  [[nodiscard]] std::size_t max_append_len() const noexcept { return max_append_len_; }
  /// Ring slots per (layer, sequence): window + max_append_len - 1.
  [[nodiscard]] std::size_t ring_len() const noexcept { return ring_len_; }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  /// Constant: kv_cache_bytes(shape, num_sink_tokens + ring_len, max_batch).
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return storage_.bytes(); }

  /// True when crop(seq, n) keeps everything the token appended next, at position n, attends
  /// to: n <= seq_length and, in each layer, either n <= num_sink_tokens or the ring still holds
  /// positions [n - window + 1, n) (view().recent_begin() <= max(num_sink_tokens,
  /// n - window + 1)).
  ///
  /// The exact guarantee. The ring holds the last ring_len() = window + max_append_len - 1
  /// positions below the *peak*: the longest length the layer has had since the sequence was
  /// last reset, cropped to at most num_sink_tokens, or restored (after a restore, count the
  /// peak as recent_begin + ring_len()). So can_crop(seq, n) is true for every
  /// n >= peak - max_append_len (and every n <= num_sink_tokens), however often the sequence
  /// was cropped and appended to since: speculative decoding, which appends at most
  /// max_append_len draft tokens and rolls back to no earlier than the length before them,
  /// never fails, round after round. Rollbacks measured from the current length are not
  /// guaranteed: crop back max_append_len, append 1, crop back max_append_len again reaches
  /// peak - 2 * max_append_len + 1, whose window the ring overwrote at the peak.
  /// Re-attending the last held token after the crop (a query at n - 1) needs one position
  /// more, n - window: that holds for n >= peak - max_append_len + 1 (a rollback of at most
  /// max_append_len - 1 from the peak); after a rollback of exactly max_append_len, attend()
  /// with a query at n - 1 throws position_error.
  /// @throws batch_error.
  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const {
    if (n > seq_length(seq)) return false;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      if (!layer_can_crop(state_[l * max_batch_ + seq], n)) return false;
    }
    return true;
  }

  /// Rolls every layer of `seq` back to at most n tokens.
  /// @throws batch_error, position_error when !can_crop(seq, n); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) {
    detail::check_crop_length(kName, seq, n, seq_length(seq));
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      const State& st = state_[l * max_batch_ + seq];
      if (!layer_can_crop(st, n)) {
        throw position_error(detail::message(
            kName, ": crop of sequence ", seq, " to ", n, " tokens needs positions from ",
            static_cast<position_t>(n) - static_cast<position_t>(window_) + 1, " but layer ", l,
            " evicted everything before ", st.ring_begin, " (window ", window_, ", max_append_len ",
            max_append_len_, ")"));
      }
    }
    const position_t target = static_cast<position_t>(n);
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      State& st = state_[l * max_batch_ + seq];
      if (st.length <= target) continue;
      st.length = target;
      if (target <= static_cast<position_t>(num_sinks_)) {
        st.ring_begin = static_cast<position_t>(num_sinks_);
      }
    }
  }

  /// Empties `seq` in every layer. @throws batch_error.
  void reset(std::size_t seq) {
    detail::check_seq(kName, seq, max_batch_);
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      state_[l * max_batch_ + seq] = State{0, static_cast<position_t>(num_sinks_)};
    }
  }

  /// Snapshot restore hook: puts each listed (layer, seq) in the state its view is to report
  /// (length, sink_end, recent_begin), holding the given K/V at those absolute positions; other
  /// layers and sequences are untouched. Never allocates. O(total elements).
  /// Valid states: length <= num_sink_tokens with sink_end == recent_begin == length, or
  /// length > num_sink_tokens with sink_end == num_sink_tokens <= recent_begin <= length and
  /// length - recent_begin <= ring_len() (the ring holds [recent_begin, length)).
  /// @pre entries name each (layer, seq) at most once.
  /// @post view(e.layer, e.seq) reports e.length, e.sink_end, e.recent_begin and holds e.k / e.v.
  /// @throws layer_error, batch_error, shape_error, position_error (a state no sliding window
  ///         of this shape can be in), capacity_error (more ring positions than ring_len()),
  ///         all before anything changes.
  void restore(std::span<const LayerRestore<T>> entries) {
    detail::check_restore_entries(kName, entries, shape_, max_batch_);
    detail::check_window_restore(kName, entries, num_sinks_, window_, max_append_len_);
    const position_t sinks = static_cast<position_t>(num_sinks_);
    const std::size_t head_elems = slots_per_seq_ * shape_.head_dim;
    for (const LayerRestore<T>& e : entries) {
      const std::size_t base = slab_offset(e.layer, e.seq);
      auto copy = [&](std::size_t slot, std::size_t src_first, std::size_t n) {
        detail::restore_rows(storage_, base, head_elems, slot, e, src_first, n, shape_);
      };
      const std::size_t sink_end = static_cast<std::size_t>(e.sink_end);
      copy(0, 0, sink_end);
      for (position_t p = e.recent_begin; p < e.length;) {
        const std::size_t slot = slot_of(static_cast<std::size_t>(p));
        const std::size_t run =
            std::min(static_cast<std::size_t>(e.length - p), slots_per_seq_ - slot);
        copy(slot, sink_end + static_cast<std::size_t>(p - e.recent_begin), run);
        p += static_cast<position_t>(run);
      }
      state_[e.layer * max_batch_ + e.seq] =
          State{e.length, e.length <= sinks ? sinks : e.recent_begin};
    }
  }

 private:
  static constexpr const char* kName = "SlidingWindowCache";

  struct State {
    position_t length;      // positions appended
    position_t ring_begin;  // oldest ring position still held (>= num_sinks)
  };

  [[nodiscard]] bool layer_can_crop(const State& st, std::size_t n) const noexcept {
    const position_t target = static_cast<position_t>(n);
    if (st.length <= target || n <= num_sinks_) return true;
    return st.ring_begin <= std::max(static_cast<position_t>(num_sinks_),
                                     target - static_cast<position_t>(window_) + 1);
  }

  [[nodiscard]] std::size_t slot_of(std::size_t pos) const noexcept {
    return pos < num_sinks_ ? pos : num_sinks_ + (pos - num_sinks_) % ring_len_;
  }

  // The layer as a ring layout (slab_offset's).
  [[nodiscard]] KVLayout<T> layout(std::size_t layer) const noexcept {
    return slab_layout(storage_.bases(slab_offset(layer, 0)), static_cast<int>(max_batch_),
                       static_cast<int>(shape_.num_kv_heads), static_cast<int>(shape_.head_dim),
                       static_cast<std::int64_t>(slots_per_seq_), static_cast<int>(num_sinks_),
                       static_cast<int>(ring_len_));
  }

  // Layout: a slab per (layer, seq), each side [kv_head][num_sinks + ring_len][head_dim]
  // (KVRows).
  [[nodiscard]] std::size_t slab_offset(std::size_t layer, std::size_t seq) const noexcept {
    return (layer * max_batch_ + seq) * storage_.slab_stride();
  }

  CacheShape shape_;
  std::size_t max_batch_;
  std::size_t window_;
  std::size_t num_sinks_;
  std::size_t max_append_len_;
  std::size_t ring_len_ = 0;
  std::size_t slots_per_seq_ = 0;
  KVRows<T> storage_;
  std::vector<State> state_;  // [layer][seq]
};

}  // namespace kvcache
