// SPDX-License-Identifier: Apache-2.0
// Context shift of a paged DeviceCache: kvcache::context_shift() (policy/context_shift.hpp) on
// the device. The sequence's rows come to host memory, are shifted there by the host code (the
// same keys turned back, the same ids and exact prefix) and go back through DeviceCache::restore(),
// so the device follows the host PagedCache's rules and bits.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/attention/rope.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/view.hpp"
#include "kvcache/cuda/cache.cuh"
#include "kvcache/policy/context_shift.hpp"

namespace kvcache::cuda {

/// kvcache::context_shift() for a DeviceCache with the paged layout: drops positions
/// [n_keep, n_keep + n_discard) of `seq` in every layer and moves every later token back by
/// n_discard positions, its key turned back by n_discard positions of `rope`, its value moved
/// unchanged. The results and rules are the host PagedCache's, bit for bit: the ids of the dropped
/// positions go too, the blocks before n_keep stay shared as they were, and no block past n_keep
/// of this sequence is shared or indexed afterwards (exact_prefix() <= n_keep, "Moved K/V").
///
/// Staged through host memory, for the occasional shift of a full context rather than every
/// step: the sequence's rows are downloaded (read_rows(), one synchronisation of `stream` per
/// layer), shifted on the host, and restored (restore(), one more). Allocates host copies of the
/// sequence's K/V (three) and ids.
/// @throws shape_error (not the paged layout; a RoPE for another head_dim), batch_error,
///         position_error (n_keep + n_discard past the sequence's length, layers of different
///         lengths), pool_exhausted_error (the pool cannot hold the rewritten blocks): the cache
///         is unchanged. cuda_error.
template <Element T>
void context_shift(DeviceCache<T>& cache, std::size_t seq, std::size_t n_keep,
                   std::size_t n_discard, const Rope& rope, cudaStream_t stream) {
  const DeviceCacheConfig& c = cache.config();
  if (c.layout != Layout::paged) {
    throw shape_error(
        "cuda::context_shift: a DeviceCache with the paged layout only (contiguous and ring "
        "device caches have no restore())");
  }
  const CacheShape shape{c.num_layers, c.num_kv_heads, c.head_dim, dtype_of<T>};
  kvcache::detail::check_context_shift("cuda::context_shift", shape, c.max_batch, seq, n_keep,
                                       n_discard, rope,
                                       [&](std::size_t l) { return cache.layer_length(l, seq); });
  if (n_discard == 0) return;
  const std::size_t len = cache.seq_length(seq), layer_elems = len * shape.token_elems();
  std::vector<T> k(c.num_layers * layer_elems), v(k.size());
  for (std::size_t l = 0; l < c.num_layers; ++l) {
    cache.read_rows(l, seq, std::span<T>(k).subspan(l * layer_elems, layer_elems),
                    std::span<T>(v).subspan(l * layer_elems, layer_elems), stream);
  }
  const auto view_of = [&](std::size_t l) {  // the downloaded rows: one segment
    SegmentView<T, 1> view(c.num_kv_heads, c.head_dim, static_cast<position_t>(len), 0, 0);
    view.push({k.data() + l * layer_elems, v.data() + l * layer_elems, len * c.head_dim, 0, len});
    return view;
  };
  const kvcache::detail::ShiftedRows<T> rows =
      kvcache::detail::shift_rows<T>(shape, seq, n_keep, n_discard, rope, view_of);
  const BlockManager<>& m = cache.paged();
  const std::vector<token_id> ids = kvcache::detail::shifted_ids(m.tokens(seq), n_keep, n_discard);
  const SequenceTokens tokens[] = {{.seq = seq,
                                    .ids = ids,
                                    .exact_prefix = std::min(n_keep, m.exact_prefix(seq)),
                                    .extra_key = m.extra_key(seq)}};
  cache.restore(rows.entries, tokens, stream);
}

}  // namespace kvcache::cuda
