// SPDX-License-Identifier: Apache-2.0
// Batch invariance of causal attention (with or without a window and sinks): a query's output is
// the same bits whether it is attended alone (a decode step) or together with other queries (a
// prefill chunk), on every kernel, with or without a thread pool. Inference engines rely on it so
// that a cached run and a from-scratch run of the same tokens agree exactly.
#include <cstring>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"

using namespace kvcache;

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
      const auto view = cache.view(0, 0);
      for (const AttentionOptions& mask : {AttentionOptions{}, AttentionOptions{.window = 40},
                                           AttentionOptions{.window = 33, .num_sink_tokens = 3}}) {
        for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{37}, len}) {
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
            REQUIRE(std::memcmp(alone.data(), together.data() + t * row, row * sizeof(float)) == 0);
          }
        }
      }
    }
  }
}
