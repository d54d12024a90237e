// SPDX-License-Identifier: Apache-2.0
// The memory formula and what each policy reports it holds.
#include <limits>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/throws.hpp"

using namespace kvcache;

TEST_CASE("kv_cache_bytes reproduces the seed's Llama-3-8B examples") {
  // 32 layers, 32 KV heads (as if no GQA), head_dim 128, 4096 tokens, fp16: 2 GiB exactly.
  STATIC_REQUIRE(kv_cache_bytes(32, 32, 128, 4096, 2) == 2'147'483'648ull);
  // its real 8 KV heads: 512 MiB
  STATIC_REQUIRE(kv_cache_bytes(32, 8, 128, 4096, 2) == 536'870'912ull);
  STATIC_REQUIRE(
      kv_cache_bytes({.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .dtype = DType::f16},
                     4096) == 536'870'912ull);
  // batch multiplies, fp32 doubles
  STATIC_REQUIRE(kv_cache_bytes(32, 8, 128, 4096, 4, 3) == 3 * 2 * 536'870'912ull);
}

TEST_CASE("kv_cache_bytes reports overflow instead of wrapping") {
  kvcache::test::require_throws<capacity_error>(
      [] { (void)kv_cache_bytes(1u << 20, 1u << 20, 1u << 20, 1u << 20, 2); }, "overflows");
}

TEST_CASE("every policy's memory_bytes is what it holds") {
  StaticCache<half> s(
      {.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .max_batch = 1, .max_seq_len = 4096});
  REQUIRE(s.memory_bytes() == 536'870'912ull);

  SlidingWindowCache<float> w({.num_layers = 2,
                               .num_kv_heads = 2,
                               .head_dim = 4,
                               .max_batch = 3,
                               .window = 10,
                               .num_sink_tokens = 2,
                               .max_append_len = 5});
  REQUIRE(w.ring_len() == 14);
  REQUIRE(w.memory_bytes() == kv_cache_bytes(2, 2, 4, 2 + 14, 4, 3));

  DynamicCache<bfloat16> d({.num_layers = 2,
                            .num_kv_heads = 2,
                            .head_dim = 4,
                            .max_batch = 2,
                            .chunk_len = 8,
                            .max_spare_chunks = 0});  // freed at once; spares: dynamic_cache_test
  REQUIRE(d.memory_bytes() == 0);
  std::vector<float> kv(9 * 2 * 4, 1.0f);
  d.append(0, 1, TokenBlock<const float>{kv, 9, 2, 4}, TokenBlock<const float>{kv, 9, 2, 4});
  REQUIRE(d.memory_bytes() == kv_cache_bytes(1, 2, 4, 16, 2));  // two chunks of 8 in one layer
  d.crop(1, 8);
  REQUIRE(d.memory_bytes() == kv_cache_bytes(1, 2, 4, 8, 2));
  d.reset(1);
  REQUIRE(d.memory_bytes() == 0);
}

TEST_CASE("configs with a zero field are rejected by name") {
  using kvcache::test::require_throws;
  require_throws<shape_error>(
      [] {
        StaticCache<float>({.num_layers = 1, .num_kv_heads = 1, .head_dim = 1, .max_seq_len = 0});
      },
      "StaticCache", "max_seq_len");
  require_throws<shape_error>(
      [] { DynamicCache<float>({.num_layers = 1, .num_kv_heads = 0, .head_dim = 1}); },
      "DynamicCache", "num_kv_heads");
  require_throws<shape_error>(
      [] {
        SlidingWindowCache<float>({.num_layers = 1, .num_kv_heads = 1, .head_dim = 1, .window = 0});
      },
      "SlidingWindowCache", "window");
}
