// SPDX-License-Identifier: Apache-2.0
// Context shift of a DeviceCache: kvcache::context_shift() (policy/context_shift.hpp) on the
// device. The sequence's rows come to host memory, are shifted there by the host code (the same
// keys turned back, the same ids and exact prefix) and go back through DeviceCache::restore(), so
// the device follows the host caches' rules and bits.
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

/// kvcache::context_shift() for a DeviceCache, any layout: drops positions
/// [n_keep, n_keep + n_discard) of `seq` in every layer and moves every later token back by
/// n_discard positions, its key turned back by n_discard positions of `rope`, its value moved
/// unchanged. The results and rules are those of the host cache of the same layout, bit for bit:
///  - paged (PagedCache): the ids of the dropped positions go too, the blocks before n_keep stay
///    shared as they were, and no block past n_keep of this sequence is shared or indexed
///    afterwards (exact_prefix() <= n_keep, "Moved K/V");
///  - ring (SlidingWindowCache): once the window has evicted, the shift must keep what it holds
///    (n_keep at most the sinks; dropping some sinks drops the whole evicted gap);
///  - contiguous (StaticCache): any shift.
/// int8 and fp8 caches: each moved key is read back (codes x scale), turned, and quantized again
/// with a fresh scale, as the host caches do.
///
/// Staged through host memory, for the occasional shift of a full context rather than every
/// step: the sequence's rows are downloaded (read_rows(), one synchronisation of `stream` per
/// layer), shifted on the host by the host caches' code, and restored (restore(), one more).
/// Allocates host copies of the sequence's K/V (three) and ids.
/// @throws shape_error (a RoPE for another head_dim), batch_error, position_error (n_keep +
///         n_discard past the sequence's length, layers of different lengths, a window's shift
///         named above), pool_exhausted_error (paged: the pool cannot hold the rewritten
///         blocks): the cache is unchanged. cuda_error.
template <KVFormat T>
void context_shift(DeviceCache<T>& cache, std::size_t seq, std::size_t n_keep,
                   std::size_t n_discard, const Rope& rope, cudaStream_t stream) {
  const DeviceCacheConfig& c = cache.config();
  const CacheShape shape = cache_shape<T>(c.num_layers, c.num_kv_heads, c.head_dim);
  kvcache::detail::check_context_shift("cuda::context_shift", shape, c.max_batch, seq, n_keep,
                                       n_discard, rope,
                                       [&](std::size_t l) { return cache.layer_length(l, seq); });
  if (n_discard == 0) return;
  // each layer's rows, packed: its sinks, then its recent positions
  std::vector<std::size_t> first(c.num_layers + 1, 0);
  for (std::size_t l = 0; l < c.num_layers; ++l) {
    first[l + 1] =
        first[l] + static_cast<std::size_t>(cache.keys(l, seq).count()) * shape.token_elems();
  }
  using K = key_format_t<T>;
  using V = value_format_t<T>;
  std::vector<K> k(first.back());
  std::vector<V> v(k.size());
  // a quantized side's row scales, packed as the rows (one per head_dim elements)
  const std::size_t d = c.head_dim;
  std::vector<scale_type> ks(scaled_v<K> ? k.size() / d : 0), vs(scaled_v<V> ? v.size() / d : 0);
  const auto part = [&](std::vector<scale_type>& scales, std::size_t from, std::size_t n) {
    return scales.empty() ? std::span<scale_type>() : std::span(scales).subspan(from / d, n / d);
  };
  for (std::size_t l = 0; l < c.num_layers; ++l) {
    const std::size_t n = first[l + 1] - first[l];
    cache.read_rows(l, seq, std::span(k).subspan(first[l], n), std::span(v).subspan(first[l], n),
                    part(ks, first[l], n), part(vs, first[l], n), stream);
  }
  const auto view_of = [&](std::size_t l) {
    const KeyRange r = cache.keys(l, seq);
    const auto held = static_cast<std::size_t>(r.count());
    const auto sink_rows = static_cast<std::size_t>(r.sink_end);
    const K* kl = k.data() + first[l];
    const V* vl = v.data() + first[l];
    const scale_type* ksl = ks.empty() ? nullptr : ks.data() + first[l] / d;
    const scale_type* vsl = vs.empty() ? nullptr : vs.data() + first[l] / d;
    const auto at = [](const scale_type* p, std::size_t rows) { return p ? p + rows : nullptr; };
    SegmentView<T, 2> view(c.num_kv_heads, d, r.length, r.sink_end, r.recent_begin);
    view.push({kl, vl, held * d, 0, sink_rows, ksl, vsl});
    view.push({kl + sink_rows * d, vl + sink_rows * d, held * d, r.recent_begin, held - sink_rows,
               at(ksl, sink_rows), at(vsl, sink_rows)});
    return view;
  };
  const kvcache::detail::ShiftedRows<T> rows =
      kvcache::detail::shift_rows<T>(shape, seq, n_keep, n_discard, rope, view_of);
  if (c.layout != Layout::paged) {
    cache.restore(rows.entries, {}, stream);
    return;
  }
  const BlockManager<>& m = cache.paged();
  const std::vector<token_id> ids = kvcache::detail::shifted_ids(m.tokens(seq), n_keep, n_discard);
  const SequenceTokens tokens[] = {{.seq = seq,
                                    .ids = ids,
                                    .exact_prefix = std::min(n_keep, m.exact_prefix(seq)),
                                    .extra_key = m.extra_key(seq)}};
  cache.restore(rows.entries, tokens, stream);
}

}  // namespace kvcache::cuda
