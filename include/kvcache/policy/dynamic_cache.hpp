// SPDX-License-Identifier: Apache-2.0
// DynamicCache: grows as tokens arrive, one fixed-size chunk at a time, so nothing already cached
// is ever copied again; crop and reset keep the chunks they empty for the next append to reuse,
// up to a bound, and shrink_to_fit() gives them back.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// Construction parameters of a DynamicCache.
struct DynamicCacheConfig {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  /// Sequences are 0 .. max_batch - 1 (each starts empty and costs nothing until it is used).
  std::size_t max_batch = 1;
  /// Largest length a sequence may reach; 0 = unbounded (capacity() == SIZE_MAX).
  std::size_t max_seq_len = 0;
  /// Tokens per chunk: the allocation granule. Memory held per (layer, sequence) is
  /// ceil(length / chunk_len) chunks.
  std::size_t chunk_len = 256;
  /// Most chunks that crop and reset keep as spares, instead of freeing them, for later appends
  /// of any layer or sequence to reuse: a reused chunk costs neither an allocation nor the
  /// page faults of first touching fresh memory. Spares count in memory_bytes();
  /// shrink_to_fit() frees them. 0 = free at once; the default keeps every one, so the cache
  /// holds its high-water mark like a std::vector after clear().
  std::size_t max_spare_chunks = std::numeric_limits<std::size_t>::max();
};

/// Growable cache. Each (layer, sequence) owns a list of chunks, each one allocation (KVRows) of
/// K [num_kv_heads][chunk_len][head_dim] then V of the same shape. Appending n tokens costs
/// O(n * num_kv_heads * head_dim) plus one allocation per chunk_len tokens; cached tokens are
/// never moved, so views of earlier positions stay cheap and the growth is amortised O(1) per
/// token without the 2x transient of a doubling vector. T: any storage format, or KVFormats<K, V>.
template <KVFormat T>
class DynamicCache {
 public:
  using value_type = T;
  using view_type = ChunkedView<T>;

  /// @throws shape_error for a zero num_layers, num_kv_heads, head_dim, max_batch or chunk_len.
  explicit DynamicCache(const DynamicCacheConfig& config)
      : shape_(cache_shape<T>(config.num_layers, config.num_kv_heads, config.head_dim)),
        max_batch_(config.max_batch),
        max_seq_len_(config.max_seq_len == 0 ? std::numeric_limits<std::size_t>::max()
                                             : config.max_seq_len),
        chunk_len_(config.chunk_len),
        max_spare_chunks_(config.max_spare_chunks) {
    detail::require_nonzero(config.num_layers, kName, "num_layers");
    detail::require_nonzero(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_nonzero(config.head_dim, kName, "head_dim");
    detail::require_nonzero(config.max_batch, kName, "max_batch");
    detail::require_nonzero(config.chunk_len, kName, "chunk_len");
    chunk_rows_ = detail::checked_mul(chunk_len_, shape_.num_kv_heads, "DynamicCache chunk");
    chunk_bytes_ =
        kv_cache_bytes(cache_shape<T>(1, shape_.num_kv_heads, shape_.head_dim), chunk_len_);
    slots_.resize(shape_.num_layers * max_batch_);
  }

  /// Appends n = k.num_tokens tokens to `layer` of `seq` (CacheConcept requirement 2), first
  /// taking the ceil((length + n) / chunk_len) - chunks held chunks it lacks from the spares,
  /// then allocating the rest.
  /// @throws layer_error, batch_error, shape_error, capacity_error (past max_seq_len),
  ///         std::bad_alloc; the cache is unchanged on throw.
  template <AppendRows<T> U>
  void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
    using In = TokenBlock<const std::remove_const_t<U>>;
    const In kin = k, vin = v;
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const std::size_t n = detail::check_kv_input(kName, shape_, kin, vin);
    Slot& slot = slots_[layer * max_batch_ + seq];
    if (n > max_seq_len_ - slot.length) {
      throw capacity_error(detail::message(kName, ": append of ", n, " tokens to sequence ", seq,
                                           " layer ", layer, " exceeds max_seq_len ", max_seq_len_,
                                           " (holds ", slot.length, ")"));
    }
    const std::size_t need = chunks_for(slot.length + n);
    if (need > slot.chunks.size()) {
      const std::size_t missing = need - slot.chunks.size();
      const std::size_t reused = std::min(missing, spare_.size());
      std::vector<KVRows<T>> grown;  // built aside, so bad_alloc changes nothing
      grown.reserve(missing - reused);
      for (std::size_t i = reused; i < missing; ++i)
        grown.emplace_back(1, chunk_rows_, shape_.head_dim);
      slot.chunks.reserve(need);
      for (std::size_t i = 0; i < reused; ++i) {  // no throw after the reserve
        slot.chunks.push_back(std::move(spare_.back()));
        spare_.pop_back();
      }
      for (auto& c : grown) slot.chunks.push_back(std::move(c));
      allocated_bytes_ += grown.size() * chunk_bytes();
    }
    const std::size_t d = shape_.head_dim;
    const std::size_t head_elems = chunk_len_ * d;
    for (std::size_t done = 0; done < n;) {
      const std::size_t pos = slot.length + done;
      const std::size_t in_chunk = pos % chunk_len_;
      const std::size_t run = std::min(n - done, chunk_len_ - in_chunk);
      KVRows<T>& chunk = slot.chunks[pos / chunk_len_];
      for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
        const std::size_t at = h * head_elems + in_chunk * d;
        detail::store_rows(chunk.k(at), chunk.k_scale(at), kin, done, run, h);
        detail::store_rows(chunk.v(at), chunk.v_scale(at), vin, done, run, h);
      }
      done += run;
    }
    slot.length += n;
  }

  /// View over `layer` of `seq`: one segment per chunk. O(1). @throws layer_error, batch_error.
  [[nodiscard]] view_type view(std::size_t layer, std::size_t seq) const {
    const Slot& slot = slot_at(layer, seq);
    return view_type(slot.chunks.data(), chunk_len_, shape_.num_kv_heads, shape_.head_dim,
                     static_cast<position_t>(slot.length));
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    return slot_at(layer, seq).length;
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  /// max_seq_len, or SIZE_MAX when unbounded.
  [[nodiscard]] std::size_t capacity() const noexcept { return max_seq_len_; }
  [[nodiscard]] std::size_t max_batch() const noexcept { return max_batch_; }
  [[nodiscard]] std::size_t chunk_len() const noexcept { return chunk_len_; }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  /// Bytes of all chunks currently allocated: those holding tokens and the spares.
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return allocated_bytes_; }
  /// Bytes of the spare chunks alone (part of memory_bytes()).
  [[nodiscard]] std::size_t spare_bytes() const noexcept { return spare_.size() * chunk_bytes(); }

  /// Frees every spare chunk; the chunks holding tokens stay. O(spares).
  void shrink_to_fit() noexcept {
    allocated_bytes_ -= spare_bytes();
    spare_.clear();
    spare_.shrink_to_fit();
  }

  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const { return n <= seq_length(seq); }

  /// Rolls every layer of `seq` back to at most n tokens; the chunks no longer needed become
  /// spares (up to max_spare_chunks) or are freed.
  /// @throws batch_error, position_error (n > seq_length), std::bad_alloc (room for the spare
  ///         list); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) {
    detail::check_crop_length(kName, seq, n, seq_length(seq));
    release(seq, n);
  }

  /// Empties `seq` in every layer; its chunks become spares (up to max_spare_chunks) or are
  /// freed. @throws batch_error, std::bad_alloc (room for the spare list); unchanged on throw.
  void reset(std::size_t seq) {
    detail::check_seq(kName, seq, max_batch_);
    release(seq, 0);
  }

  /// Snapshot restore hook: puts each listed (layer, seq) in the given state, positions
  /// [0, length) with the given K/V; other layers and sequences are untouched. The chunks the
  /// listed slots held and the spares are reused first (as reset() then append() would); only
  /// the shortfall is allocated, before anything changes. Chunks left over become spares (up to
  /// max_spare_chunks) or are freed. O(total elements).
  /// @pre entries name each (layer, seq) at most once; their K/V do not alias this cache's
  ///      storage.
  /// @post view(e.layer, e.seq) reports e.length and holds e.k / e.v.
  /// @throws layer_error, batch_error, shape_error, position_error (sink_end or recent_begin
  ///         not 0), capacity_error (length > max_seq_len), std::bad_alloc; all before anything
  ///         changes.
  void restore(std::span<const LayerRestore<T>> entries) {
    detail::check_restore_entries(kName, entries, shape_, max_batch_);
    std::size_t needed = 0, released = 0;  // chunks the entries need; the listed slots hold
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const LayerRestore<T>& e = entries[i];
      if (e.sink_end != 0 || e.recent_begin != 0) {
        throw position_error(detail::message(kName, ": restore entry ", i, " drops positions [",
                                             e.sink_end, ", ", e.recent_begin,
                                             "), but a DynamicCache holds every position"));
      }
      if (static_cast<std::size_t>(e.length) > max_seq_len_) {
        throw capacity_error(detail::message(kName, ": restore entry ", i, ": sequence ", e.seq,
                                             " layer ", e.layer, " holds ", e.length,
                                             " tokens, more than max_seq_len ", max_seq_len_));
      }
      needed += chunks_for(e.held());
      released += slots_[e.layer * max_batch_ + e.seq].chunks.size();
    }
    // Everything that can throw, aside: the shortfall's allocations, room in the spare list for
    // the released chunks, room in each slot's list.
    const std::size_t reusable = spare_.size() + released;
    std::vector<KVRows<T>> grown;
    grown.reserve(needed > reusable ? needed - reusable : 0);
    for (std::size_t i = reusable; i < needed; ++i)
      grown.emplace_back(1, chunk_rows_, shape_.head_dim);
    spare_.reserve(spare_.size() + released + grown.size());
    for (const LayerRestore<T>& e : entries) {
      slots_[e.layer * max_batch_ + e.seq].chunks.reserve(chunks_for(e.held()));
    }
    // Commit: within the reserves, nothing below throws.
    allocated_bytes_ += grown.size() * chunk_bytes();
    for (auto& c : grown) spare_.push_back(std::move(c));
    for (const LayerRestore<T>& e : entries) {
      Slot& slot = slots_[e.layer * max_batch_ + e.seq];
      for (auto& c : slot.chunks) spare_.push_back(std::move(c));
      slot.chunks.clear();
      slot.length = 0;
    }
    const std::size_t head_elems = chunk_len_ * shape_.head_dim;
    for (const LayerRestore<T>& e : entries) {
      Slot& slot = slots_[e.layer * max_batch_ + e.seq];
      const std::size_t n = e.held();
      for (std::size_t first = 0; first < n; first += chunk_len_) {
        slot.chunks.push_back(std::move(spare_.back()));
        spare_.pop_back();
        const std::size_t run = std::min(chunk_len_, n - first);
        detail::restore_rows(slot.chunks.back(), 0, head_elems, 0, e, first, run, shape_);
      }
      slot.length = n;
    }
    while (spare_.size() > max_spare_chunks_) {
      spare_.pop_back();
      allocated_bytes_ -= chunk_bytes();
    }
  }

 private:
  static constexpr const char* kName = "DynamicCache";

  struct Slot {
    std::vector<KVRows<T>> chunks;
    std::size_t length = 0;
  };

  [[nodiscard]] const Slot& slot_at(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    return slots_[layer * max_batch_ + seq];
  }

  // Bytes of one chunk's K and V rows and scales (what KVRows::bytes() reports).
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return chunk_bytes_; }
  /// Chunks that hold n tokens.
  [[nodiscard]] std::size_t chunks_for(std::size_t n) const noexcept {
    return (n + chunk_len_ - 1) / chunk_len_;
  }

  /// Cuts every layer of `seq` to at most n tokens. The spare list grows first (the only step
  /// that can throw), then chunks move into it or are freed.
  void release(std::size_t seq, std::size_t n) {
    const std::size_t keep = chunks_for(n);
    std::size_t emptied = 0;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      const Slot& slot = slots_[l * max_batch_ + seq];
      emptied += slot.chunks.size() > keep ? slot.chunks.size() - keep : 0;
    }
    const std::size_t room = max_spare_chunks_ - spare_.size();  // spares never exceed the bound
    spare_.reserve(spare_.size() + std::min(emptied, room));
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      Slot& slot = slots_[l * max_batch_ + seq];
      slot.length = std::min(slot.length, n);
      while (slot.chunks.size() > keep) {
        if (spare_.size() < max_spare_chunks_) {
          spare_.push_back(std::move(slot.chunks.back()));  // within the reserve: no throw
        } else {
          allocated_bytes_ -= chunk_bytes();
        }
        slot.chunks.pop_back();
      }
    }
  }

  CacheShape shape_;
  std::size_t max_batch_;
  std::size_t max_seq_len_;
  std::size_t chunk_len_;
  std::size_t max_spare_chunks_;
  std::size_t chunk_rows_ = 0;       // rows of one side of a chunk: num_kv_heads x chunk_len
  std::size_t chunk_bytes_ = 0;      // one chunk, both sides
  std::size_t allocated_bytes_ = 0;  // chunks in slots_ and in spare_
  std::vector<Slot> slots_;          // [layer][seq]
  std::vector<KVRows<T>> spare_;
};

}  // namespace kvcache
