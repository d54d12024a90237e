// SPDX-License-Identifier: Apache-2.0
// StaticCache: max_batch x max_seq_len slots for every layer, allocated once at construction and
// never again. Appends past max_seq_len and sequence indices >= max_batch throw, changing nothing.
#pragma once

#include <cstddef>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// Construction parameters of a StaticCache (all fields >= 1).
struct StaticCacheConfig {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t max_batch = 1;
  std::size_t max_seq_len = 0;
};

/// Fixed-capacity cache: one contiguous [num_kv_heads][max_seq_len][head_dim] K array and one V
/// array per (layer, sequence), of any storage format T (float, half, bfloat16, or qint8 /
/// fp8_e4m3 codes with a scale per row), or K in one format and V in another (KVFormats<K, V>).
/// memory_bytes() == kv_cache_bytes(shape, max_seq_len, max_batch) from construction on; append,
/// crop and reset never allocate.
template <KVFormat T>
class StaticCache {
 public:
  using value_type = T;
  using view_type = LayoutView<T>;

  /// Allocates all storage. @throws shape_error for a zero field, capacity_error if the size
  /// overflows, std::bad_alloc.
  explicit StaticCache(const StaticCacheConfig& config)
      : shape_(cache_shape<T>(config.num_layers, config.num_kv_heads, config.head_dim)),
        max_batch_(config.max_batch),
        max_seq_len_(config.max_seq_len) {
    detail::require_nonzero(config.num_layers, kName, "num_layers");
    detail::require_nonzero(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_nonzero(config.head_dim, kName, "head_dim");
    detail::require_nonzero(config.max_batch, kName, "max_batch");
    detail::require_nonzero(config.max_seq_len, kName, "max_seq_len");
    detail::require_int(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_int(config.head_dim, kName, "head_dim");
    detail::require_int(config.max_batch, kName, "max_batch");
    (void)kv_cache_bytes(shape_, max_seq_len_, max_batch_);  // throws if it overflows
    storage_ = KVRows<T>(shape_.num_layers * max_batch_, shape_.num_kv_heads * max_seq_len_,
                         shape_.head_dim);
    lengths_.assign(shape_.num_layers * max_batch_, 0);
  }

  /// Appends n = k.num_tokens tokens to `layer` of `seq` (CacheConcept requirement 2).
  /// O(n * num_kv_heads * head_dim); never allocates.
  /// @throws layer_error, batch_error, shape_error, capacity_error (appending past max_seq_len);
  ///         the cache is unchanged on throw.
  template <AppendRows<T> U>
  void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
    using In = TokenBlock<const std::remove_const_t<U>>;
    const In kin = k, vin = v;
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const std::size_t n = detail::check_kv_input(kName, shape_, kin, vin);
    std::size_t& len = lengths_[layer * max_batch_ + seq];
    if (n > max_seq_len_ - len) {
      throw capacity_error(detail::message(kName, ": append of ", n, " tokens to sequence ", seq,
                                           " layer ", layer, " exceeds max_seq_len ", max_seq_len_,
                                           " (holds ", len, ")"));
    }
    const std::size_t head_elems = max_seq_len_ * shape_.head_dim;
    for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
      const std::size_t at = slab_offset(layer, seq) + h * head_elems + len * shape_.head_dim;
      detail::store_rows(storage_.k(at), storage_.k_scale(at), kin, 0, n, h);
      detail::store_rows(storage_.v(at), storage_.v_scale(at), vin, 0, n, h);
    }
    len += n;
  }

  /// View over `layer` of `seq` (a contiguous layout): one segment, positions
  /// [0, layer_length). O(1).
  /// @throws layer_error, batch_error.
  [[nodiscard]] view_type view(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const auto len = static_cast<position_t>(lengths_[layer * max_batch_ + seq]);
    return view_type(layout(layer), static_cast<int>(seq), KeyRange{0, 0, len});
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    return lengths_[layer * max_batch_ + seq];
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  [[nodiscard]] std::size_t capacity() const noexcept { return max_seq_len_; }
  [[nodiscard]] std::size_t max_batch() const noexcept { return max_batch_; }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return storage_.bytes(); }

  /// True when crop(seq, n) would succeed: n <= seq_length(seq). @throws batch_error.
  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const { return n <= seq_length(seq); }

  /// Rolls every layer of `seq` back to at most n tokens. O(num_layers).
  /// @throws batch_error, position_error (n > seq_length); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) {
    detail::check_crop_length(kName, seq, n, seq_length(seq));
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      std::size_t& len = lengths_[l * max_batch_ + seq];
      len = std::min(len, n);
    }
  }

  /// Empties `seq` in every layer (storage stays allocated). @throws batch_error.
  void reset(std::size_t seq) {
    detail::check_seq(kName, seq, max_batch_);
    for (std::size_t l = 0; l < shape_.num_layers; ++l) lengths_[l * max_batch_ + seq] = 0;
  }

  /// Snapshot restore hook: puts each listed (layer, seq) in the given state, positions
  /// [0, length) with the given K/V; other layers and sequences are untouched. Never allocates.
  /// O(total elements).
  /// @pre entries name each (layer, seq) at most once.
  /// @post view(e.layer, e.seq) reports e.length and holds e.k / e.v.
  /// @throws layer_error, batch_error, shape_error, position_error (sink_end or recent_begin
  ///         not 0), capacity_error (length > max_seq_len), all before anything changes.
  void restore(std::span<const LayerRestore<T>> entries) {
    detail::check_restore_entries(kName, entries, shape_, max_batch_);
    detail::check_whole_restore(kName, entries, max_seq_len_);
    const std::size_t head_elems = max_seq_len_ * shape_.head_dim;
    for (const LayerRestore<T>& e : entries) {
      const std::size_t at = slab_offset(e.layer, e.seq), n = e.held();
      detail::restore_rows(storage_, at, head_elems, 0, e, 0, n, shape_);
      lengths_[e.layer * max_batch_ + e.seq] = n;
    }
  }

 private:
  static constexpr const char* kName = "StaticCache";

  // Layout: a slab per (layer, seq), each side [kv_head][max_seq_len][head_dim] (KVRows).
  // The layer as a contiguous layout.
  [[nodiscard]] KVLayout<T> layout(std::size_t layer) const noexcept {
    return slab_layout(storage_.bases(slab_offset(layer, 0)), static_cast<int>(max_batch_),
                       static_cast<int>(shape_.num_kv_heads), static_cast<int>(shape_.head_dim),
                       static_cast<std::int64_t>(max_seq_len_));
  }

  [[nodiscard]] std::size_t slab_offset(std::size_t layer, std::size_t seq) const noexcept {
    return (layer * max_batch_ + seq) * storage_.slab_stride();
  }

  CacheShape shape_;
  std::size_t max_batch_;
  std::size_t max_seq_len_;
  KVRows<T> storage_;
  std::vector<std::size_t> lengths_;  // [layer][seq]
};

}  // namespace kvcache
