// SPDX-License-Identifier: Apache-2.0
// StaticCache: allocates once, never again; overflow and bad indices throw typed errors naming
// the numbers and leave the cache exactly as it was.
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/counting_new.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::g_allocations;

TEST_CASE("StaticCache allocates at construction and never again over 10k appends and attends") {
  StaticCache<half> cache(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .max_batch = 3, .max_seq_len = 10'000});
  const std::vector<float> k(2 * 16, 0.5f), v(2 * 16, -0.5f);
  const TokenBlock<const float> kb{k, 1, 2, 16}, vb{v, 1, 2, 16};
  cache.append(0, 0, kb, vb);
  const auto first_k = cache.view(0, 0).segment(0).k;
  REQUIRE(cache.view(1, 2).num_segments() == 0);  // nothing appended there yet
  ThreadPool pool(2);
  std::vector<float> q(4 * 16, 0.25f), out(q.size());
  const std::size_t before = g_allocations.load();
  for (std::size_t i = 1; i < 10'000; ++i) {
    for (std::size_t l = 0; l < 2; ++l) cache.append(l, i % 3, kb, vb);
    if (i % 100 == 0) {  // decode-style attention, threaded, on the hot path too
      attend({q, 1, 4, 16}, cache.view(1, i % 3), {out, 1, 4, 16}, {.pool = &pool});
    }
    if (i % 1000 == 0) {
      cache.crop(i % 3, cache.seq_length(i % 3) / 2);
    }
  }
  cache.reset(1);
  REQUIRE(g_allocations.load() == before);
  REQUIRE(cache.view(0, 0).segment(0).k == first_k);
  REQUIRE(cache.memory_bytes() == kv_cache_bytes(2, 2, 16, 10'000, 2, 3));
}

TEST_CASE("StaticCache overflow throws capacity_error naming the numbers, cache unchanged") {
  auto rng = kvcache::test::make_rng("static-overflow");
  StaticCache<float> cache(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 4, .max_seq_len = 16});
  const auto kv = kvcache::test::random_kv(rng, 20, 2, 8);
  for (std::size_t l = 0; l < 2; ++l) cache.append(l, 3, kv.k_block(0, 12), kv.v_block(0, 12));
  const auto before = kvcache::test::cache_contents(cache);
  kvcache::test::require_throws<capacity_error>(
      [&] { cache.append(0, 3, kv.k_block(12, 7), kv.v_block(12, 7)); }, "append of 7 tokens",
      "sequence 3", "max_seq_len 16", "holds 12");
  REQUIRE(kvcache::test::cache_contents(cache) == before);
  // filling exactly to capacity works
  for (std::size_t l = 0; l < 2; ++l) cache.append(l, 3, kv.k_block(12, 4), kv.v_block(12, 4));
  REQUIRE(cache.seq_length(3) == 16);
}

TEST_CASE("StaticCache rejects a sequence index >= max_batch instead of mis-shaping") {
  StaticCache<float> cache(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .max_batch = 2, .max_seq_len = 8});
  std::vector<float> kv(4, 1.0f);
  const TokenBlock<const float> b{kv, 1, 1, 4};
  const auto before = kvcache::test::cache_contents(cache);
  using kvcache::test::require_throws;
  require_throws<batch_error>([&] { cache.append(0, 2, b, b); }, "sequence 2", "max_batch 2");
  require_throws<batch_error>([&] { (void)cache.view(0, 5); }, "sequence 5");
  require_throws<batch_error>([&] { cache.reset(2); }, "sequence 2");
  require_throws<batch_error>([&] { cache.crop(9, 0); }, "sequence 9");
  require_throws<layer_error>([&] { cache.append(1, 0, b, b); }, "layer 1", "num_layers 1");
  REQUIRE(kvcache::test::cache_contents(cache) == before);
}
