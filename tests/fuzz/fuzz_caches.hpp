// SPDX-License-Identifier: Apache-2.0
// The destination caches of the snapshot fuzzer, shared with the seed-corpus generator so that
// valid seeds load all the way into a cache (and mutations explore from there).
#pragma once

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

}  // namespace kvcache::fuzz
