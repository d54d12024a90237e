// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the snapshot loader: any input either loads into each destination cache
// (which must then be self-consistent and re-serialize to a snapshot that loads again) or throws
// a kvcache::error leaving the cache unchanged. Anything else (a crash, a sanitizer report, an
// uncaught exception, an allocation past -malloc_limit_mb) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "fuzz_caches.hpp"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/snapshot_edit.hpp"

namespace {

using namespace kvcache;

/// Reads every element a view exposes, so that ASan sees any out-of-bounds segment.
template <class Cache>
float touch_all(const Cache& cache) {
  float sum = 0.0f;
  for (std::size_t l = 0; l < cache.shape().num_layers; ++l) {
    for (std::size_t s = 0; s < cache.max_batch(); ++s) {
      const auto view = cache.view(l, s);
      if (view.length() != static_cast<position_t>(cache.layer_length(l, s))) std::abort();
      if (!(0 <= view.sink_end() && view.sink_end() <= view.recent_begin() &&
            view.recent_begin() <= view.length())) {
        std::abort();
      }
      std::size_t held = 0;
      for (std::size_t i = 0; i < view.num_segments(); ++i) {
        const auto seg = view.segment(i);
        held += seg.len;
        for (std::size_t h = 0; h < view.num_kv_heads(); ++h) {
          for (std::size_t j = 0; j < seg.len * view.head_dim(); ++j) {
            sum +=
                to_float(seg.k[h * seg.head_stride + j]) + to_float(seg.v[h * seg.head_stride + j]);
          }
        }
      }
      if (held != view_num_tokens(view)) std::abort();
    }
  }
  return sum;
}

/// A paged cache's pool statistics and invariants (nothing for the other policies).
template <class Cache>
PrefixCacheStats pool_stats(const Cache& cache) {
  if constexpr (PrefixCacheConcept<Cache>) {
    if (!cache.check_consistency().empty()) std::abort();
    return cache.stats();
  } else {
    return {};
  }
}

template <class Make>
void fuzz_into(Make make, std::span<const std::byte> bytes) {
  auto cache = make();
  const std::vector<std::byte> before = snapshot_to_bytes(cache, fuzz::kModel);
  const PrefixCacheStats stats_before = pool_stats(cache);
  try {
    (void)load_snapshot_bytes(bytes, cache, fuzz::kModel);
  } catch (const kvcache::error&) {
    // strong guarantee
    if (snapshot_to_bytes(cache, fuzz::kModel) != before) std::abort();
    if (!(pool_stats(cache) == stats_before)) std::abort();
    return;
  }
  (void)pool_stats(cache);  // consistent after a load
  volatile float sink = touch_all(cache);
  (void)sink;
  // What was loaded saves and loads again, identically.
  const std::vector<std::byte> again = snapshot_to_bytes(cache, fuzz::kModel);
  auto copy = make();
  (void)load_snapshot_bytes(again, copy, fuzz::kModel);
  if (snapshot_to_bytes(copy, fuzz::kModel) != again) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  fuzz_into(fuzz::make_static, bytes);
  fuzz_into(fuzz::make_sliding, bytes);
  fuzz_into(fuzz::make_dynamic, bytes);
  fuzz_into(fuzz::make_tracked, bytes);
  fuzz_into(fuzz::make_paged, bytes);
  return 0;
}

extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max_size);

/// libFuzzer's own mutations, then, for every other input, all checksums recomputed: without
/// that almost every mutant dies at the first CRC and the parser behind it is never explored.
extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size,
                                               std::size_t max_size, unsigned int seed) {
  const std::size_t n = LLVMFuzzerMutate(data, size, max_size);
  if (seed % 2 == 0) {
    kvcache::test::fix_checksums(std::span<std::byte>(reinterpret_cast<std::byte*>(data), n));
  }
  return n;
}
