// SPDX-License-Identifier: Apache-2.0
// What a consumer project compiles: a cache, one append, one attention call. Exits non-zero if the
// result is wrong, so each consumption route (add_subdirectory, FetchContent, find_package) is
// proven to give a working library, not just a configured one. Given KVCACHE_PACKAGE_VERSION (the
// version find_package or pkg-config found), it checks that the headers' version is the same.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <kvcache/kvcache.hpp>
#include <vector>

int main() {
#if defined(KVCACHE_PACKAGE_VERSION)
  if (std::strcmp(KVCACHE_VERSION_STRING, KVCACHE_PACKAGE_VERSION) != 0) {
    std::printf("the headers are kvcache %s, the package %s\n", KVCACHE_VERSION_STRING,
                KVCACHE_PACKAGE_VERSION);
    return 1;
  }
#endif
  kvcache::StaticCache<kvcache::half> cache(
      {.num_layers = 1, .num_kv_heads = 2, .head_dim = 8, .max_batch = 1, .max_seq_len = 16});
  std::vector<float> k(3 * 2 * 8, 0.25f), v(3 * 2 * 8, 2.0f), q(4 * 8, 1.0f), out(4 * 8);
  cache.append(0, 0, kvcache::TokenBlock<const float>{k, 3, 2, 8},
               kvcache::TokenBlock<const float>{v, 3, 2, 8});
  kvcache::attend({q, 1, 4, 8}, cache.view(0, 0), {out, 1, 4, 8});
  for (float x : out) {
    if (std::fabs(x - 2.0f) > 1e-6f) {
      std::printf("wrong attention output %f\n", static_cast<double>(x));
      return 1;
    }
  }
  std::printf("kvcache %s consumer OK: %zu bytes of cache\n", KVCACHE_VERSION_STRING,
              cache.memory_bytes());
  return 0;
}
