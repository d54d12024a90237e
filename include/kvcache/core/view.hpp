// SPDX-License-Identifier: Apache-2.0
// Views: what attention needs from a cache. A view is a cheap value describing one layer of one
// sequence as a list of segments (runs of slots contiguous in memory with consecutive absolute
// positions). KVView is the concept; LayoutView (segments derived from the layout descriptor,
// core/layout.hpp) is the view of the contiguous, ring and paged policies, ChunkedView that of
// DynamicCache's chunks, SegmentView one built by hand from segments.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/layout.hpp"

namespace kvcache {

/// A run of `len` cache slots, contiguous in memory, holding consecutive positions
/// first_pos, first_pos + 1, ... . Layout per KV head: [len][head_dim] rows; heads are
/// `head_stride` elements apart. K of slot j, head h is at k + h * head_stride + j * head_dim.
/// Quantized formats (int8, fp8): the scale of that row is k_scale[h * head_stride / head_dim + j]
/// (v_scale likewise; its value is code x scale); k_scale and v_scale are null for f32/f16/bf16.
/// F is one format for K and V, or KVFormats<K, V>: K rows of type K (k_scale set when K is
/// quantized), V rows of type V (v_scale likewise), at the same element offsets.
template <KVFormat F>
struct KVSegment {
  const key_format_t<F>* k = nullptr;
  const value_format_t<F>* v = nullptr;
  std::size_t head_stride = 0;
  position_t first_pos = 0;
  std::size_t len = 0;
  const scale_type* k_scale = nullptr;
  const scale_type* v_scale = nullptr;
};

/// What attention needs from one layer of one sequence.
///
/// Requirements (for `const V v`, `std::size_t i`):
///  1. `V::value_type` is the element type (float, half, bfloat16, or the codes of a quantized
///     format, qint8 or fp8_e4m3, whose segments carry row scales), or KVFormats<K, V> for keys
///     and values stored in different formats (the caches' own views hold one format).
///  2. `v.num_kv_heads()`, `v.head_dim()` -> std::size_t: the row shape.
///  3. `v.length()` -> position_t: one past the last position of the sequence (its seq_length).
///  4. `v.sink_end()`, `v.recent_begin()` -> position_t: the positions the view holds are
///     [0, sink_end) and [recent_begin, length), with 0 <= sink_end <= recent_begin <= length.
///     Views that drop nothing report sink_end == recent_begin == 0; a sliding window reports its
///     attention sinks in [0, sink_end) and the gap it has evicted as [sink_end, recent_begin).
///  5. `v.num_segments()` -> std::size_t and `v.segment(i)` -> KVSegment<value_type> for
///     i < num_segments(): segments in increasing position order, non-empty, disjoint, and
///     together holding exactly the positions of (4). O(1) each; views never allocate.
/// A view is valid until the next mutating call on the cache it came from.
template <class V>
concept KVView = requires(const V& v, std::size_t i) {
  typename V::value_type;
  requires KVFormat<typename V::value_type>;
  { v.num_kv_heads() } -> std::same_as<std::size_t>;
  { v.head_dim() } -> std::same_as<std::size_t>;
  { v.length() } -> std::same_as<position_t>;
  { v.sink_end() } -> std::same_as<position_t>;
  { v.recent_begin() } -> std::same_as<position_t>;
  { v.num_segments() } -> std::same_as<std::size_t>;
  { v.segment(i) } -> std::same_as<KVSegment<typename V::value_type>>;
};

/// Number of token slots a view holds: sink_end + (length - recent_begin).
template <KVView V>
[[nodiscard]] constexpr std::size_t view_num_tokens(const V& v) noexcept {
  return static_cast<std::size_t>(v.sink_end() + (v.length() - v.recent_begin()));
}

/// The view of one sequence of a host KVLayout: StaticCache's (contiguous), SlidingWindowCache's
/// (ring) and PagedCache's (paged) view. Its segments are the layout's runs of rows contiguous in
/// memory (KVLayout::run_of: the whole sequence, the sinks then each lap of the ring, each block)
/// cut to the positions the sequence holds, [0, sink_end) then [recent_begin, length): for a paged
/// sequence that drops nothing, one segment per block. O(1) per segment; reads the layout's
/// addressing (row_offset), never its per-sequence arrays. T: one format for K and V, or
/// KVFormats<K, V> (a layout over the engine's own K and V arrays).
template <KVFormat T>
class LayoutView {
 public:
  using value_type = T;

  LayoutView() = default;
  /// Sequence `seq` of `layout`, holding the positions of `keys`. @pre the layout holds them.
  LayoutView(const KVLayout<T>& layout, int seq, const KeyRange& keys) noexcept
      : layout_(layout), keys_(keys), seq_(seq) {
    sink_runs_ = runs(0, keys.sink_end);
    first_recent_run_ = keys.recent_begin < keys.length ? layout.run_of(keys.recent_begin) : 0;
    num_segments_ = sink_runs_ + runs(keys.recent_begin, keys.length);
  }

  [[nodiscard]] std::size_t num_kv_heads() const noexcept {
    return static_cast<std::size_t>(layout_.num_kv_heads);
  }
  [[nodiscard]] std::size_t head_dim() const noexcept {
    return static_cast<std::size_t>(layout_.head_dim);
  }
  [[nodiscard]] position_t length() const noexcept { return keys_.length; }
  [[nodiscard]] position_t sink_end() const noexcept { return keys_.sink_end; }
  [[nodiscard]] position_t recent_begin() const noexcept { return keys_.recent_begin; }
  [[nodiscard]] std::size_t num_segments() const noexcept { return num_segments_; }
  [[nodiscard]] KVSegment<T> segment(std::size_t i) const noexcept {
    std::int64_t run = 0, begin = 0, end = 0;
    if (i < sink_runs_) {
      run = static_cast<std::int64_t>(i);
      begin = layout_.run_begin(run);
      end = std::min(keys_.sink_end, layout_.run_begin(run + 1));
    } else {
      run = first_recent_run_ + static_cast<std::int64_t>(i - sink_runs_);
      begin = std::max(keys_.recent_begin, layout_.run_begin(run));
      end = std::min(keys_.length, layout_.run_begin(run + 1));
    }
    const auto offset = static_cast<std::size_t>(layout_.row_offset(seq_, 0, begin));
    KVSegment<T> s{layout_.k + offset, layout_.v + offset,
                   static_cast<std::size_t>(layout_.head_stride), begin,
                   static_cast<std::size_t>(end - begin)};
    const std::size_t row = offset / static_cast<std::size_t>(layout_.head_dim);
    if (layout_.k_scale != nullptr) s.k_scale = layout_.k_scale + row;
    if (layout_.v_scale != nullptr) s.v_scale = layout_.v_scale + row;
    return s;
  }

  /// The layout the view reads and the sequence it reads in it.
  [[nodiscard]] const KVLayout<T>& layout() const noexcept { return layout_; }
  [[nodiscard]] int seq() const noexcept { return seq_; }
  /// Paged layouts: the sequence's block ids for positions [0, length), one per block; empty for
  /// other layouts.
  [[nodiscard]] std::span<const block_id> block_table() const noexcept {
    if (layout_.layout != LayoutKind::paged || keys_.length == 0) return {};
    return {layout_.block_table + static_cast<std::ptrdiff_t>(seq_) * layout_.max_blocks,
            static_cast<std::size_t>(layout_.run_of(keys_.length - 1) + 1)};
  }

 private:
  /// Runs the positions [a, b) span.
  [[nodiscard]] std::size_t runs(std::int64_t a, std::int64_t b) const noexcept {
    return b <= a ? 0 : static_cast<std::size_t>(layout_.run_of(b - 1) - layout_.run_of(a) + 1);
  }

  KVLayout<T> layout_{};
  KeyRange keys_{};
  int seq_ = 0;
  std::size_t sink_runs_ = 0;
  std::int64_t first_recent_run_ = 0;
  std::size_t num_segments_ = 0;
};

/// A view made of at most N segments stored inline, for K/V laid out in the caller's own way
/// (T: one format for K and V, or KVFormats<K, V>).
template <KVFormat T, std::size_t N>
class SegmentView {
 public:
  using value_type = T;

  SegmentView() = default;
  SegmentView(std::size_t num_kv_heads, std::size_t head_dim, position_t length,
              position_t sink_end, position_t recent_begin) noexcept
      : num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        length_(length),
        sink_end_(sink_end),
        recent_begin_(recent_begin) {}

  /// Appends a segment; empty segments are skipped. Segments go in position order, each within
  /// the positions the view holds, [0, sink_end) or [recent_begin, length).
  /// @throws capacity_error when the view holds N segments already; shape_error when the segment
  ///         has no K or V rows, or a quantized side (per the format) no row scales;
  ///         position_error when it starts before the previous segment ends or holds a position
  ///         the view does not. The view is unchanged on throw.
  void push(const KVSegment<T>& s) {
    if (s.len == 0) return;
    const auto first = s.first_pos;
    const auto end = first + static_cast<position_t>(s.len);
    const auto where = [&] {
      return detail::message("SegmentView: segment ", num_segments_, " (positions [", first, ", ",
                             end, "))");
    };
    if (num_segments_ == N) {
      throw capacity_error(detail::message(where(), " exceeds the view's ", N, " segments"));
    }
    if (s.k == nullptr || s.v == nullptr) {
      throw shape_error(detail::message(where(), " has no ", s.k == nullptr ? "K" : "V", " rows"));
    }
    const bool k_unscaled = scaled_v<key_format_t<T>> && s.k_scale == nullptr;
    const bool v_unscaled = scaled_v<value_format_t<T>> && s.v_scale == nullptr;
    if (k_unscaled || v_unscaled) {
      throw shape_error(detail::message(
          where(), " has quantized ", k_unscaled ? "K" : "V", " rows (",
          dtype_name(k_unscaled ? dtype_of<key_format_t<T>> : dtype_of<value_format_t<T>>),
          ") but no row scales"));
    }
    const position_t previous_end =
        num_segments_ == 0 ? 0
                           : segments_[num_segments_ - 1].first_pos +
                                 static_cast<position_t>(segments_[num_segments_ - 1].len);
    const bool held = end <= sink_end_ || (first >= recent_begin_ && end <= length_);
    if (first < previous_end || !held) {
      throw position_error(
          detail::message(where(), " does not follow the previous segment (which ends at ",
                          previous_end, ") within the positions the view holds, [0, ", sink_end_,
                          ") and [", recent_begin_, ", ", length_, ")"));
    }
    segments_[num_segments_++] = s;
  }

  [[nodiscard]] std::size_t num_kv_heads() const noexcept { return num_kv_heads_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] position_t length() const noexcept { return length_; }
  [[nodiscard]] position_t sink_end() const noexcept { return sink_end_; }
  [[nodiscard]] position_t recent_begin() const noexcept { return recent_begin_; }
  [[nodiscard]] std::size_t num_segments() const noexcept { return num_segments_; }
  [[nodiscard]] KVSegment<T> segment(std::size_t i) const noexcept { return segments_[i]; }

 private:
  std::array<KVSegment<T>, N> segments_{};
  std::size_t num_segments_ = 0;
  std::size_t num_kv_heads_ = 0;
  std::size_t head_dim_ = 0;
  position_t length_ = 0;
  position_t sink_end_ = 0;
  position_t recent_begin_ = 0;
};

/// A view over equally sized chunks, each a KVRows<F> of one slab holding K [num_kv_heads]
/// [chunk_len][head_dim] and V of the same shape: DynamicCache's view. Chunk i holds positions
/// [i * chunk_len, (i + 1) * chunk_len) clipped to length.
template <KVFormat F>
class ChunkedView {
 public:
  using value_type = F;

  ChunkedView() = default;
  ChunkedView(const KVRows<F>* chunks, std::size_t chunk_len, std::size_t num_kv_heads,
              std::size_t head_dim, position_t length) noexcept
      : chunks_(chunks),
        chunk_len_(chunk_len),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        length_(length) {}

  [[nodiscard]] std::size_t num_kv_heads() const noexcept { return num_kv_heads_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] position_t length() const noexcept { return length_; }
  [[nodiscard]] position_t sink_end() const noexcept { return 0; }
  [[nodiscard]] position_t recent_begin() const noexcept { return 0; }
  [[nodiscard]] std::size_t num_segments() const noexcept {
    return (static_cast<std::size_t>(length_) + chunk_len_ - 1) / chunk_len_;
  }
  [[nodiscard]] KVSegment<F> segment(std::size_t i) const noexcept {
    const KVRows<F>& chunk = chunks_[i];
    const std::size_t first = i * chunk_len_;
    return {chunk.k(0),
            chunk.v(0),
            chunk_len_ * head_dim_,
            static_cast<position_t>(first),
            std::min(chunk_len_, static_cast<std::size_t>(length_) - first),
            chunk.k_scale(0),
            chunk.v_scale(0)};
  }

 private:
  const KVRows<F>* chunks_ = nullptr;
  std::size_t chunk_len_ = 1;
  std::size_t num_kv_heads_ = 0;
  std::size_t head_dim_ = 0;
  position_t length_ = 0;
};

static_assert(KVView<LayoutView<float>>);
static_assert(KVView<SegmentView<float, 1>>);
static_assert(KVView<ChunkedView<half>>);
static_assert(KVView<SegmentView<KVFormats<half, qint8>, 1>>);
static_assert(KVView<LayoutView<KVFormats<qint8, half>>>);
static_assert(KVView<ChunkedView<KVFormats<half, fp8_e4m3>>>);

}  // namespace kvcache
