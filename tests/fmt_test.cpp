// SPDX-License-Identifier: Apache-2.0
// The optional fmt formatters: DType, CacheShape and the prefix-cache statistics print as
// documented.
#include "kvcache/fmt.hpp"

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"

using namespace kvcache;

TEST_CASE("fmt formats dtypes, shapes and prefix-cache statistics") {
  REQUIRE(fmt::format("{}", DType::bf16) == "bf16");
  REQUIRE(fmt::format("{}", CacheShape{5, 4, 8, DType::f16}) ==
          "5 layers x 4 kv heads x head_dim 8, f16");
  REQUIRE(fmt::format("{}", cache_shape<KVFormats<half, qint8>>(5, 4, 8)) ==
          "5 layers x 4 kv heads x head_dim 8, K f16 + V int8");
  PagedCache<float> cache({.num_layers = 1,
                           .num_kv_heads = 1,
                           .head_dim = 4,
                           .num_blocks = 8,
                           .block_size = 2,
                           .max_batch = 2});
  const std::vector<token_id> prompt{1, 2, 3, 4, 5};
  const std::vector<float> kv(5 * 4, 1.0f);
  REQUIRE(cache.admit(0, prompt) == 0);
  cache.append(0, 0, TokenBlock<const float>{kv, 5, 1, 4}, TokenBlock<const float>{kv, 5, 1, 4});
  cache.release(0);
  REQUIRE(cache.admit(1, prompt) == 4);
  REQUIRE(fmt::format("{}", cache.stats()) ==
          "blocks 8 x 2 tokens: 2 used, 0 cached, 6 free; prefix hit rate 40.0% (4 of 10 prompt "
          "tokens reused, 2 prompts); 0 evictions, 0 copy-on-write");
}
