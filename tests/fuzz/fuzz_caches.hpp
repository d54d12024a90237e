// SPDX-License-Identifier: Apache-2.0
// The destination caches of the snapshot fuzzer, shared with the seed-corpus generator so that
// valid seeds load all the way into a cache (and mutations explore from there).
#pragma once

#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"

namespace kvcache::fuzz {

inline const ModelId kModel("fuzz-model");

inline StaticCache<half> make_static() {
  return StaticCache<half>(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .max_batch = 2, .max_seq_len = 16});
}
inline SlidingWindowCache<float> make_sliding() {
  return SlidingWindowCache<float>({.num_layers = 2,
                                    .num_kv_heads = 1,
                                    .head_dim = 4,
                                    .max_batch = 2,
                                    .window = 4,
                                    .num_sink_tokens = 2,
                                    .max_append_len = 2});
}
inline DynamicCache<bfloat16> make_dynamic() {
  return DynamicCache<bfloat16>(
      {.num_layers = 1, .num_kv_heads = 2, .head_dim = 4, .max_batch = 2, .chunk_len = 3});
}
inline TokenTrackedCache<StaticCache<half>> make_tracked() {
  return TokenTrackedCache<StaticCache<half>>(make_static());
}
/// A small pool holding a cached prefix of its own (ids 1, 2, 3, 4 in blocks of 2), so that loads
/// also meet the prefix index (deduplication, eviction-free exhaustion).
inline PagedCache<half> make_paged() {
  PagedCache<half> cache({.num_layers = 2,
                          .num_kv_heads = 2,
                          .head_dim = 4,
                          .num_blocks = 10,
                          .block_size = 2,
                          .max_batch = 2,
                          .max_seq_len = 12});
  const token_id ids[] = {1, 2, 3, 4, 5};
  (void)cache.admit(0, ids);
  const std::vector<float> k(5 * 2 * 4, 0.25f), v(k.size(), -0.25f);
  for (std::size_t l = 0; l < 2; ++l) {
    cache.append(l, 0, TokenBlock<const float>{k, 5, 2, 4}, TokenBlock<const float>{v, 5, 2, 4});
  }
  cache.release(0);
  return cache;
}

}  // namespace kvcache::fuzz
