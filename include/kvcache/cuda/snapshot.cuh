// SPDX-License-Identifier: Apache-2.0
// Snapshots of a paged DeviceCache in the file format of the host caches (a PagedCache
// snapshot): the sequences pass through a host PagedCache sized for them, so a prompt prefilled
// on a GPU loads into a CPU cache, or another GPU's, and the reverse.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <numeric>
#include <span>
#include <vector>

#include "kvcache/cuda/cache.cuh"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/policy/paged_cache.hpp"

namespace kvcache::cuda {

namespace detail {

// A host PagedCache with the device cache's shape, slots, max_seq_len and block size, and
// `blocks` blocks: the staging of a device snapshot.
template <KVFormat T>
PagedCache<T> staging_cache(const DeviceCache<T>& cache, std::size_t blocks) {
  const DeviceCacheConfig& c = cache.config();
  return PagedCache<T>({.num_layers = c.num_layers,
                        .num_kv_heads = c.num_kv_heads,
                        .head_dim = c.head_dim,
                        .num_blocks = std::max<std::size_t>(blocks, 1),
                        .block_size = c.block_size,
                        .max_batch = c.max_batch,
                        .max_seq_len = c.max_seq_len});
}

// The rows of every (layer, seq) collect() gathers (K and V, each in its side's format), and a
// quantized side's scales.
template <KVFormat T>
struct CollectedRows {
  std::vector<std::vector<key_format_t<T>>> k;
  std::vector<std::vector<value_format_t<T>>> v;
  std::vector<std::vector<scale_type>> scales;
};

// What restore() takes to put `seqs` of `source` into another cache of shape `c`: per (layer,
// seq) the rows and, for a quantized side, their scales (`store` owns them; none for a side in
// f32/f16/bf16), per seq its ids, exact prefix and extra key. read(l, q, k, v, k_scale, v_scale)
// fills them.
template <KVFormat T, class Source, class Read>
void collect(const Source& source, std::span<const std::size_t> seqs, const DeviceCacheConfig& c,
             Read&& read, CollectedRows<T>& store, std::vector<LayerRestore<T>>& entries,
             std::vector<SequenceTokens>& tokens) {
  constexpr bool k_scaled = scaled_v<key_format_t<T>>, v_scaled = scaled_v<value_format_t<T>>;
  store.k.reserve(seqs.size() * c.num_layers);
  store.v.reserve(seqs.size() * c.num_layers);
  store.scales.reserve(2 * seqs.size() * c.num_layers);
  for (std::size_t q : seqs) {
    for (std::size_t l = 0; l < c.num_layers; ++l) {
      const std::size_t len = source.layer_length(l, q);
      auto& k = store.k.emplace_back(len * c.num_kv_heads * c.head_dim);
      auto& v = store.v.emplace_back(k.size());
      std::vector<scale_type>& ks = store.scales.emplace_back(k_scaled ? len * c.num_kv_heads : 0);
      std::vector<scale_type>& vs = store.scales.emplace_back(v_scaled ? len * c.num_kv_heads : 0);
      read(l, q, std::span(k), std::span(v), std::span(ks), std::span(vs));
      LayerRestore<T> e;
      e.layer = l;
      e.seq = q;
      e.length = static_cast<position_t>(len);
      e.k = k;
      e.v = v;
      if constexpr (k_scaled) e.k_scale = ks;
      if constexpr (v_scaled) e.v_scale = vs;
      entries.push_back(e);
    }
    tokens.push_back({.seq = q,
                      .ids = source.tokens(q),
                      .exact_prefix = source.exact_prefix(q),
                      .extra_key = source.extra_key(q)});
  }
}

}  // namespace detail

/// kvcache::save_snapshot() of a paged DeviceCache: sequences `seqs` (empty: all) are read from
/// the device (DeviceCache::read_rows: after the work already on `stream`) into a host
/// PagedCache just large enough for them, which is then saved: the file is a PagedCache
/// snapshot, token ids, cache salts and exact prefixes included. Host memory: about twice the
/// saved K/V. The device cache is only read.
/// @throws shape_error (not paged; a sequence listed twice), batch_error, io_error,
///         cuda_error, std::bad_alloc.
template <KVFormat T>
void save_snapshot(const std::filesystem::path& path, const DeviceCache<T>& cache,
                   const ModelId& model_id, std::span<const std::size_t> seqs = {},
                   const SaveOptions& options = {}, cudaStream_t stream = nullptr) {
  const BlockManager<>& m = cache.paged();
  std::vector<std::size_t> list(seqs.begin(), seqs.end());
  if (list.empty()) {
    list.resize(m.max_batch());
    std::iota(list.begin(), list.end(), std::size_t{0});
  }
  std::size_t blocks = 0;
  for (std::size_t q : list) blocks += m.block_table(q).size();
  PagedCache<T> staging = detail::staging_cache(cache, blocks);
  detail::CollectedRows<T> rows;
  std::vector<LayerRestore<T>> entries;
  std::vector<SequenceTokens> tokens;
  const DeviceCacheConfig& c = cache.config();
  detail::collect<T>(
      m, list, c,
      [&](std::size_t l, std::size_t q, std::span<key_format_t<T>> k,
          std::span<value_format_t<T>> v, std::span<scale_type> ks,
          std::span<scale_type> vs) { cache.read_rows(l, q, k, v, ks, vs, stream); },
      rows, entries, tokens);
  staging.restore(entries, tokens);
  kvcache::save_snapshot(path, staging, model_id, seqs, options);
}

/// kvcache::load_snapshot() into a paged DeviceCache: the file (a PagedCache snapshot, from a
/// host or a device cache) is validated and loaded into a host PagedCache sized from
/// read_snapshot_info(), then restored into the device (DeviceCache::restore: blocks equal to
/// cached ones, or to another loaded sequence's, are shared; the full blocks are indexed, so a
/// loaded prompt serves prefix hits on the GPU). Returns what load_snapshot() reports.
/// @post on throw before the device copy, `cache` is unchanged (every check, the pool's
///       included, comes first).
/// @throws as kvcache::load_snapshot() (snapshot_mismatch_error for another policy, model or
///         shape), shape_error (not paged), pool_exhausted_error (the device pool lacks the
///         blocks), cuda_error, std::bad_alloc.
template <KVFormat T>
SnapshotInfo load_snapshot(const std::filesystem::path& path, DeviceCache<T>& cache,
                           const ModelId& model_id, const LoadOptions& options = {},
                           cudaStream_t stream = nullptr) {
  (void)cache.paged();  // shape_error unless paged
  const SnapshotInfo file = read_snapshot_info(path);
  const std::size_t bs = cache.config().block_size;
  std::size_t blocks = 0;
  for (const SnapshotSequenceInfo& s : file.sequences) blocks += (s.longest + bs - 1) / bs;
  PagedCache<T> staging = detail::staging_cache(cache, blocks);
  SnapshotInfo info = kvcache::load_snapshot(path, staging, model_id, options);
  std::vector<std::size_t> dest(options.dest_seqs.begin(), options.dest_seqs.end());
  if (dest.empty()) {
    for (const SnapshotSequenceInfo& s : info.sequences) dest.push_back(s.seq);
  }
  detail::CollectedRows<T> rows;
  std::vector<LayerRestore<T>> entries;
  std::vector<SequenceTokens> tokens;
  const DeviceCacheConfig& c = cache.config();
  detail::collect<T>(
      staging, dest, c,
      [&](std::size_t l, std::size_t q, std::span<key_format_t<T>> k,
          std::span<value_format_t<T>> v, std::span<scale_type> ks, std::span<scale_type> vs) {
        kvcache::detail::pack_view_rows(staging.view(l, q), k.data(), v.data(), ks.data(),
                                        vs.data());
      },
      rows, entries, tokens);
  cache.restore(entries, tokens, stream);
  return info;
}

}  // namespace kvcache::cuda
