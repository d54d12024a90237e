// SPDX-License-Identifier: Apache-2.0
// Batch invariance of causal attention (with or without a window and sinks): a query's output is
// the same bits whether it is attended alone (a decode step) or together with other queries (a
// prefill chunk), on every kernel, with or without a thread pool, over contiguous, paged and ring
// views. Inference engines rely on it so that a cached run and a from-scratch run of the same
// tokens agree exactly.
#include <span>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;

namespace {

// Attends the last n positions of `view` together, then each alone, for every n in `counts`, and
// requires the same bits.
template <KVView V>
void require_batch_invariant(std::mt19937_64& rng, const V& view, std::size_t q_heads,
                             const AttentionOptions& mask, cpu::Kernel kernel, ThreadPool& pool,
                             std::initializer_list<std::size_t> counts) {
  const std::size_t dim = view.head_dim();
  const auto len = static_cast<std::size_t>(view.length());
  for (std::size_t n : counts) {
    const position_t first = static_cast<position_t>(len - n);
    const auto q = test::normal_floats(rng, n * q_heads * dim);
    std::vector<float> together(q.size());
    AttentionOptions opts = mask;
    opts.query_pos = first;
    opts.pool = &pool;
    cpu::attend({q, n, q_heads, dim}, view, {together, n, q_heads, dim}, opts, kernel);
    for (std::size_t t = 0; t < n; ++t) {
      const std::size_t row = q_heads * dim;
      std::vector<float> alone(row);
      AttentionOptions one = mask;
      one.query_pos = first + static_cast<position_t>(t);
      cpu::attend({std::span<const float>(q).subspan(t * row, row), 1, q_heads, dim}, view,
                  {alone, 1, q_heads, dim}, one, kernel);
      INFO("query " << t << " of " << n << ", window " << mask.window << ", sinks "
                    << mask.num_sink_tokens);
      REQUIRE(test::same_bits(alone, std::span<const float>(together).subspan(t * row, row)));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a query's attention output does not depend on the queries beside it", "", float,
                   half) {
  auto rng = test::make_rng("a query's attention output does not depend on the queries beside it");
  ThreadPool pool(2);
  const std::size_t q_heads = 8, kv_heads = 2, len = 150;
  // Every SIMD width; AVX2 but not AVX-512; portable only.
  for (std::size_t dim : {std::size_t{64}, std::size_t{24}, std::size_t{12}}) {
    for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
      INFO("head_dim " << dim << " kernel " << test::kernel_name(kernel));
      const auto kv = test::random_kv(rng, len, kv_heads, dim);
      StaticCache<TestType> cache(
          {.num_layers = 1, .num_kv_heads = kv_heads, .head_dim = dim, .max_seq_len = len});
      cache.append(0, 0, kv.k_block(0, len), kv.v_block(0, len));
      for (const AttentionOptions& mask : {AttentionOptions{}, AttentionOptions{.window = 40},
                                           AttentionOptions{.window = 33, .num_sink_tokens = 3}}) {
        require_batch_invariant(rng, cache.view(0, 0), q_heads, mask, kernel, pool,
                                {1, 3, 37, len});
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "batch invariance holds over paged views (any block size) and ring views (any ring offset)", "",
    float, half) {
  auto rng = test::make_rng("batch invariance over paged and ring views");
  ThreadPool pool(2);
  const std::size_t q_heads = 8, kv_heads = 2, len = 150, dim = 16;
  const auto kv = test::random_kv(rng, len, kv_heads, dim);
  for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
    INFO("kernel " << test::kernel_name(kernel));
    // Blocks shorter than the sinks' tile, not dividing it, and as long as a tile.
    for (std::size_t block : {std::size_t{5}, std::size_t{16}, std::size_t{32}}) {
      INFO("paged, block " << block);
      PagedCache<TestType> paged({.num_layers = 1,
                                  .num_kv_heads = kv_heads,
                                  .head_dim = dim,
                                  .num_blocks = (len + block - 1) / block,
                                  .block_size = block});
      test::append_in_chunks(paged, 0, 0, kv, 0, len, {7, 64});
      for (const AttentionOptions& mask : {AttentionOptions{}, AttentionOptions{.window = 40},
                                           AttentionOptions{.window = 33, .num_sink_tokens = 3},
                                           AttentionOptions{.window = 20, .num_sink_tokens = 40}}) {
        require_batch_invariant(rng, paged.view(0, 0), q_heads, mask, kernel, pool, {1, 3, 37});
      }
    }
    // A ring of 33 + 37 - 1 slots after 150 tokens: its oldest position (81) starts mid-tile.
    SlidingWindowCache<TestType> ring({.num_layers = 1,
                                       .num_kv_heads = kv_heads,
                                       .head_dim = dim,
                                       .window = 33,
                                       .num_sink_tokens = 3,
                                       .max_append_len = 37});
    test::append_in_chunks(ring, 0, 0, kv, 0, len, {37});
    INFO("ring");
    require_batch_invariant(rng, ring.view(0, 0), q_heads,
                            AttentionOptions{.window = 33, .num_sink_tokens = 3}, kernel, pool,
                            {1, 3, 37});
  }
}
