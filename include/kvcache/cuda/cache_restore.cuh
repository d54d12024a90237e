// SPDX-License-Identifier: Apache-2.0
// DeviceCache::restore() and read_rows(): a device cache's rows to and from host memory, what
// snapshots and context shifts of device caches go through (cuda/snapshot.cuh,
// cuda/context_shift.cuh). Part of DeviceCache (cache.cuh includes it).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/core/layout.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/view.hpp"
#include "kvcache/cuda/cache.cuh"
#include "kvcache/cuda/runtime.cuh"

namespace kvcache::cuda {

namespace detail {

/// The runs of rows that hold `keys` of sequence `seq` in `layout` (a LayoutView's segments),
/// per KV head: fn(element offset of the run's first row from the layer's K base, head, packed
/// index of the run's first position, rows). Host arithmetic only: nothing is dereferenced.
template <KVFormat T, class F>
void for_each_run(const KVLayout<T>& layout, int seq, const KeyRange& keys, F&& fn) {
  const LayoutView<T> view(layout, seq, keys);
  std::size_t row = 0;
  for (std::size_t i = 0; i < view.num_segments(); ++i) {
    const KVSegment<T> seg = view.segment(i);
    const auto first = static_cast<std::size_t>(seg.k - layout.k);
    for (std::size_t h = 0; h < view.num_kv_heads(); ++h) {
      fn(first + h * seg.head_stride, h, row, seg.len);
    }
    row += seg.len;
  }
}

/// Copies the slab whose first K row is at element offset `from` of `src` to the slab at `to` of
/// `dst` (the same format and slab size; host and device KVRows), every array (rows and scales,
/// KVRows::for_each_array), asynchronously on `stream` in direction `kind`.
template <class Src, class Dst>
void copy_slab(const Src& src, std::size_t from, Dst& dst, std::size_t to, cudaMemcpyKind kind,
               cudaStream_t stream) {
  const std::byte* src_arrays[4] = {};
  std::size_t slab_bytes[4] = {};
  std::size_t n = 0;
  src.for_each_array([&](const std::byte* array, std::size_t bytes) {
    src_arrays[n] = array;
    slab_bytes[n++] = bytes;
  });
  n = 0;
  const std::size_t stride = src.slab_stride();  // elements per slab, the same in dst
  dst.for_each_array([&](std::byte* array, std::size_t bytes) {
    // slab i of an array starts i * bytes in; `from` and `to` count elements of the rows
    check(cudaMemcpyAsync(array + to / stride * bytes, src_arrays[n] + from / stride * bytes,
                          slab_bytes[n], kind, stream),
          "cudaMemcpyAsync(slab)");
    ++n;
  });
}

}  // namespace detail

/// The host caches' restore() on the device; snapshots of device caches go through it (see
/// cuda/snapshot.cuh), and so does cuda::context_shift.
///  - Paged layout: PagedCache::restore(): replaces every sequence an entry or `tokens` names,
///    sharing the blocks the index or another named sequence already has and copying the other
///    rows from host memory into fresh blocks, then indexing the full ones. One host-to-device
///    copy per fresh block of each layer.
///  - Contiguous and ring layouts: StaticCache::restore() and SlidingWindowCache::restore()
///    (the same checks): each entry's (layer, seq) holds exactly its positions afterwards, other
///    layers and sequences untouched; `tokens` must be empty (these layouts keep no ids). One
///    host-to-device copy per run of rows and head.
/// All copies go on `stream`, which is synchronised once at the end (the paged rows are staged
/// in host memory until then). Quantized formats: the rows' scales go with their codes.
/// Allocates the staging buffer and the plan (paged).
/// @throws shape_error (ids for a layout without them), and as the host cache's restore(), all
///         before anything changes; cuda_error.
template <KVFormat T>
void DeviceCache<T>::restore(std::span<const LayerRestore<T>> entries,
                             std::span<const SequenceTokens> tokens, cudaStream_t stream) {
  const CacheShape shape =
      cache_shape<T>(config_.num_layers, config_.num_kv_heads, config_.head_dim);
  kvcache::detail::check_restore_entries("DeviceCache", entries, shape, config_.max_batch);
  const auto to_device = [&](auto* dst, const auto* src, std::size_t count) {
    check(cudaMemcpyAsync(dst, src, count * sizeof(*src), cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync(restore)");
  };
  if (!paged_) {
    if (!tokens.empty()) {
      throw shape_error(
          kvcache::detail::message("DeviceCache::restore: ", tokens.size(),
                                   " token-id records, but only the paged layout keeps token ids"));
    }
    if (config_.layout == Layout::ring) {
      kvcache::detail::check_window_restore("DeviceCache", entries, config_.num_sink_tokens,
                                            config_.window, config_.max_append_len);
    } else {
      kvcache::detail::check_whole_restore("DeviceCache", entries, config_.max_seq_len);
    }
    const std::size_t d = config_.head_dim;
    const auto s = static_cast<std::int64_t>(sinks());
    detail::MetaBatch meta;
    for (const LayerRestore<T>& e : entries) {
      const std::size_t base = layer_offset(e.layer);
      const std::size_t held = e.held();
      detail::for_each_run(view(e.layer), static_cast<int>(e.seq),
                           KeyRange{e.sink_end, e.recent_begin, e.length},
                           [&](std::size_t offset, std::size_t h, std::size_t row, std::size_t n) {
                             const std::size_t at = (h * held + row) * d, k_at = base + offset;
                             to_device(storage_.k(k_at), e.k.data() + at, n * d);
                             to_device(storage_.v(k_at), e.v.data() + at, n * d);
                             if constexpr (scaled_v<key_format_t<T>>) {
                               to_device(storage_.k_scale(k_at), e.k_scale.data() + at / d, n);
                             }
                             if constexpr (scaled_v<value_format_t<T>>) {
                               to_device(storage_.v_scale(k_at), e.v_scale.data() + at / d, n);
                             }
                           });
      state(e.layer, e.seq) = State{e.length, e.length <= s ? s : e.recent_begin};
      push_meta(meta, e.layer, e.seq, stream);
    }
    flush_meta(meta, stream);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(restore)");
    return;
  }
  std::vector<RestoreExtent> extents(entries.size());
  std::size_t most_fresh = 0;  // blocks the rows could need: the staging, allocated up front
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const LayerRestore<T>& e = entries[i];
    if (e.sink_end != 0 || e.recent_begin != 0) {
      throw position_error(kvcache::detail::message(
          "DeviceCache: restore entry ", i, " drops positions [", e.sink_end, ", ", e.recent_begin,
          "), but a paged cache holds every position"));
    }
    extents[i] = {e.layer, e.seq, static_cast<std::size_t>(e.length)};
    most_fresh += (e.held() + config_.block_size - 1) / config_.block_size;
  }
  // the fresh blocks' rows, staged in host memory laid out as the device's blocks
  KVRows<T> staging(most_fresh, config_.num_kv_heads * config_.block_size, config_.head_dim);
  std::vector<bool> named(config_.max_batch, false);  // whose table and lengths change
  for (const LayerRestore<T>& e : entries) named[e.seq] = true;
  for (const SequenceTokens& t : tokens) {
    if (t.seq < config_.max_batch) named[t.seq] = true;  // begin_restore() refuses the others
  }
  BlockManager<>& m = paged_->manager();
  const RestorePlan plan = m.begin_restore(extents, tokens);
  std::size_t used = 0;
  for (const LayerRestore<T>& e : entries) {  // rows into the fresh blocks only
    const std::size_t n = e.held();
    const auto table = m.block_table(e.seq);
    for (const RestorePlan::Range r : plan.fresh_blocks(e.seq)) {
      for (std::size_t i = r.begin; i < r.end && i * config_.block_size < n; ++i) {
        const std::size_t from = used++ * staging.slab_stride();
        kvcache::detail::fill_packed_block(staging.k(from), staging.v(from), staging.k_scale(from),
                                           staging.v_scale(from), config_.block_size, shape, e, i);
        const std::size_t to =
            layer_offset(e.layer) + std::size_t{table[i]} * storage_.slab_stride();
        detail::copy_slab(staging, from, storage_, to, cudaMemcpyHostToDevice, stream);
      }
    }
  }
  m.end_restore(plan);
  for (std::size_t q = 0; q < config_.max_batch; ++q) {
    if (named[q]) sync_sequence(q, stream);
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(restore)");
}

/// The rows `layer` of `seq` holds, downloaded into host memory packed as a LayerRestore holds
/// them: k and v [num_kv_heads][held][head_dim], held = keys(layer, seq).count() (the
/// sequence's length, except for a ring that has evicted: its sinks, then its window); a
/// quantized format's scales into k_scale and v_scale, [num_kv_heads][held] (empty otherwise).
/// One copy per block (paged) or per run of rows and head, then one synchronisation of `stream`
/// (after the cache's earlier work on it).
/// @throws shape_error (an output of another size), layer_error, batch_error, cuda_error.
template <KVFormat T>
void DeviceCache<T>::read_rows(std::size_t layer, std::size_t seq, std::span<key_format_t<T>> k,
                               std::span<value_format_t<T>> v, std::span<scale_type> k_scale,
                               std::span<scale_type> v_scale, cudaStream_t stream) const {
  const KeyRange held_keys = keys(layer, seq);
  const auto held = static_cast<std::size_t>(held_keys.count());
  const std::size_t row = config_.num_kv_heads * config_.head_dim;
  const std::size_t k_scales = scaled_v<key_format_t<T>> ? held * config_.num_kv_heads : 0;
  const std::size_t v_scales = scaled_v<value_format_t<T>> ? held * config_.num_kv_heads : 0;
  if (k.size() != held * row || v.size() != held * row || k_scale.size() != k_scales ||
      v_scale.size() != v_scales) {
    throw shape_error(kvcache::detail::message(
        "DeviceCache::read_rows: sequence ", seq, " layer ", layer, " holds ", held,
        " positions: K and V need ", held * row, " elements each and ", k_scales, " and ", v_scales,
        " scales, got ", k.size(), " and ", v.size(), " elements, ", k_scale.size(), " and ",
        v_scale.size(), " scales"));
  }
  const auto to_host = [&](auto* dst, const auto* src, std::size_t count) {
    check(cudaMemcpyAsync(dst, src, count * sizeof(*src), cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync(read_rows)");
  };
  if (!paged_) {
    const std::size_t d = config_.head_dim;
    const std::size_t base = layer_offset(layer);
    detail::for_each_run(view(layer), static_cast<int>(seq), held_keys,
                         [&](std::size_t offset, std::size_t h, std::size_t first, std::size_t n) {
                           const std::size_t at = (h * held + first) * d, k_at = base + offset;
                           to_host(k.data() + at, storage_.k(k_at), n * d);
                           to_host(v.data() + at, storage_.v(k_at), n * d);
                           if constexpr (scaled_v<key_format_t<T>>) {
                             to_host(k_scale.data() + at / d, storage_.k_scale(k_at), n);
                           }
                           if constexpr (scaled_v<value_format_t<T>>) {
                             to_host(v_scale.data() + at / d, storage_.v_scale(k_at), n);
                           }
                         });
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(read_rows)");
    return;
  }
  const std::size_t len = held;  // a paged sequence holds every position
  if (len == 0) return;          // no blocks to stage (and no slab 0 to point into)
  const std::size_t bs = config_.block_size;
  const std::size_t pages = (len + bs - 1) / bs;
  KVRows<T> staging(pages, config_.num_kv_heads * bs, config_.head_dim);
  const auto table = paged_->manager().block_table(seq);
  for (std::size_t i = 0; i < pages; ++i) {
    detail::copy_slab(storage_,
                      layer_offset(layer) + std::size_t{table[i]} * storage_.slab_stride(), staging,
                      i * staging.slab_stride(), cudaMemcpyDeviceToHost, stream);
  }
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(read_rows)");
  // the staged blocks as a paged layout of their own, block i at index i
  std::vector<block_id> identity(pages);
  for (std::size_t i = 0; i < pages; ++i) identity[i] = static_cast<block_id>(i);
  const KVLayout<T> staged = paged_layout(staging.bases(0), static_cast<int>(config_.num_kv_heads),
                                          static_cast<int>(config_.head_dim), static_cast<int>(bs),
                                          identity.data(), 1, static_cast<int>(pages));
  kvcache::detail::pack_view_rows(
      LayoutView<T>(staged, 0, KeyRange{0, 0, static_cast<std::int64_t>(len)}), k.data(), v.data(),
      k_scale.data(), v_scale.data());
}

}  // namespace kvcache::cuda
