// SPDX-License-Identifier: Apache-2.0
// Every policy storing keys and values in different formats (KVFormats<K, V>): fed the same
// appends as a cache of K and a cache of V of the same policy, its K side holds exactly the first
// one's rows and scales and its V side the second one's (bit for bit), after random chunked
// appends, a crop, a context shift and a restore; its memory is the mean of theirs; its shape
// names both formats; attention over it equals the reference over the same view.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;

namespace {

enum class Kind { static_cache, dynamic, sliding, paged };

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 16, kBatch = 2, kCapacity = 48;
constexpr std::size_t kWindow = 12, kSinks = 2, kMaxAppend = 8;

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::static_cache:
      return "StaticCache";
    case Kind::dynamic:
      return "DynamicCache";
    case Kind::sliding:
      return "SlidingWindowCache";
    case Kind::paged:
      return "PagedCache";
  }
  return "?";
}

template <Kind P, KVFormat F>
auto make_cache() {
  if constexpr (P == Kind::static_cache) {
    return StaticCache<F>({.num_layers = kLayers,
                           .num_kv_heads = kHeads,
                           .head_dim = kDim,
                           .max_batch = kBatch,
                           .max_seq_len = kCapacity});
  } else if constexpr (P == Kind::dynamic) {
    return DynamicCache<F>({.num_layers = kLayers,
                            .num_kv_heads = kHeads,
                            .head_dim = kDim,
                            .max_batch = kBatch,
                            .chunk_len = 5});
  } else if constexpr (P == Kind::sliding) {
    return SlidingWindowCache<F>({.num_layers = kLayers,
                                  .num_kv_heads = kHeads,
                                  .head_dim = kDim,
                                  .max_batch = kBatch,
                                  .window = kWindow,
                                  .num_sink_tokens = kSinks,
                                  .max_append_len = kMaxAppend});
  } else {
    return PagedCache<F>({.num_layers = kLayers,
                          .num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .num_blocks = 40,
                          .block_size = 4,
                          .max_batch = kBatch,
                          .max_seq_len = kCapacity});
  }
}

// A view's rows packed [heads][held][dim] per side, with a quantized side's scales, as bytes: the
// sides of two caches compare bit for bit.
struct Packed {
  std::vector<std::byte> k, v, k_scale, v_scale;
};

template <class T>
std::vector<std::byte> bytes_of(const std::vector<T>& x) {
  std::vector<std::byte> out(x.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), x.data(), out.size());
  return out;
}

template <KVView View>
Packed pack(const View& view) {
  using F = typename View::value_type;
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  const std::size_t held = view_num_tokens(view);
  std::vector<K> k(held * kHeads * kDim);
  std::vector<V> v(k.size());
  std::vector<scale_type> ks(scaled_v<K> ? held * kHeads : 0), vs(scaled_v<V> ? held * kHeads : 0);
  detail::pack_view_rows(view, k.data(), v.data(), ks.data(), vs.data());
  return {bytes_of(k), bytes_of(v), bytes_of(ks), bytes_of(vs)};
}

// The pair cache's K side equals the K cache's, its V side the V cache's, in every layer and
// sequence (positions held included).
template <class Pair, class KCache, class VCache>
void require_sides_equal(const Pair& pair, const KCache& kc, const VCache& vc) {
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (std::size_t s = 0; s < kBatch; ++s) {
      INFO("layer " << l << " sequence " << s);
      const auto pv = pair.view(l, s);
      REQUIRE(pv.length() == kc.view(l, s).length());
      REQUIRE(pv.sink_end() == kc.view(l, s).sink_end());
      REQUIRE(pv.recent_begin() == kc.view(l, s).recent_begin());
      const Packed p = pack(pv), k = pack(kc.view(l, s)), v = pack(vc.view(l, s));
      REQUIRE(p.k == k.k);
      REQUIRE(p.k_scale == k.k_scale);
      REQUIRE(p.v == v.v);
      REQUIRE(p.v_scale == v.v_scale);
    }
  }
}

template <Kind P, KVFormat F>
void check_policy(std::mt19937_64& rng) {
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  INFO(kind_name(P));
  auto pair = make_cache<P, F>();
  auto kc = make_cache<P, K>();
  auto vc = make_cache<P, V>();
  static_assert(CacheConcept<decltype(pair)>);
  static_assert(std::same_as<typename decltype(pair)::value_type, F>);

  const CacheShape shape = pair.shape();
  CHECK(shape.dtype == dtype_of<K>);
  CHECK(shape.value_dtype == dtype_of<V>);
  CHECK(shape == cache_shape<F>(kLayers, kHeads, kDim));

  // The same random appends, in the same random chunks, to all three.
  const std::size_t lengths[kBatch] = {test::uniform(rng, 20, 40), test::uniform(rng, 1, 40)};
  for (std::size_t s = 0; s < kBatch; ++s) {
    const test::TokenKV kv = test::random_kv(rng, lengths[s], kHeads, kDim);
    std::vector<std::size_t> sizes;
    for (int i = 0; i < 4; ++i) sizes.push_back(test::uniform(rng, 1, kMaxAppend));
    for (std::size_t l = 0; l < kLayers; ++l) {
      test::append_in_chunks(pair, l, s, kv, 0, lengths[s], sizes);
      test::append_in_chunks(kc, l, s, kv, 0, lengths[s], sizes);
      test::append_in_chunks(vc, l, s, kv, 0, lengths[s], sizes);
    }
  }
  require_sides_equal(pair, kc, vc);
  // One allocation pattern for all three: a pair's bytes are the mean of its two formats'.
  CHECK(2 * pair.memory_bytes() == kc.memory_bytes() + vc.memory_bytes());
  if constexpr (P == Kind::static_cache) {
    CHECK(pair.memory_bytes() == kv_cache_bytes(shape, kCapacity, kBatch));
  }

  // Attention over the pair cache: the fast kernel equals the reference over the same view.
  const AttentionOptions opts = P == Kind::sliding
                                    ? AttentionOptions{.window = kWindow, .num_sink_tokens = kSinks}
                                    : AttentionOptions{};
  for (std::size_t s = 0; s < kBatch; ++s) {
    const auto view = pair.view(1, s);
    const std::size_t q_heads = 2 * kHeads;
    const std::vector<float> q = test::normal_floats(rng, q_heads * kDim);
    AttentionOptions at = opts;
    at.query_pos = view.length() - 1;
    test::require_close(test::attend_fast(q, 1, q_heads, view, at, cpu::Kernel::automatic),
                        test::attend_slow(q, 1, q_heads, view, at), {2e-6, 2e-5});
  }

  // Crop (where the policy can), then a context shift: the sides still match their caches.
  if (pair.can_crop(0, lengths[0] - 3)) {
    pair.crop(0, lengths[0] - 3);
    kc.crop(0, lengths[0] - 3);
    vc.crop(0, lengths[0] - 3);
    require_sides_equal(pair, kc, vc);
  }
  const Rope rope(RopeConfig{}, kDim);
  const std::size_t keep = P == Kind::sliding ? kSinks : test::uniform(rng, 0, 4);
  const std::size_t discard = test::uniform(rng, 1, 6);
  if (pair.seq_length(0) >= keep + discard) {
    context_shift(pair, 0, keep, discard, rope);
    context_shift(kc, 0, keep, discard, rope);
    context_shift(vc, 0, keep, discard, rope);
    require_sides_equal(pair, kc, vc);
  }

  // Restore: the rows of every layer of every sequence, packed as LayerRestore<F> entries, into
  // a fresh cache of the same policy: every view reads back bit for bit.
  std::vector<std::vector<K>> ks(kLayers * kBatch);
  std::vector<std::vector<V>> vs(ks.size());
  std::vector<std::vector<scale_type>> kss(ks.size()), vss(ks.size());
  std::vector<LayerRestore<F>> entries;
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (std::size_t s = 0; s < kBatch; ++s) {
      const auto view = pair.view(l, s);
      const std::size_t i = l * kBatch + s, held = view_num_tokens(view);
      ks[i].resize(held * kHeads * kDim);
      vs[i].resize(ks[i].size());
      kss[i].resize(scaled_v<K> ? held * kHeads : 0);
      vss[i].resize(scaled_v<V> ? held * kHeads : 0);
      detail::pack_view_rows(view, ks[i].data(), vs[i].data(), kss[i].data(), vss[i].data());
      LayerRestore<F> e;
      e.layer = l;
      e.seq = s;
      e.length = view.length();
      e.sink_end = view.sink_end();
      e.recent_begin = view.recent_begin();
      e.k = ks[i];
      e.v = vs[i];
      if constexpr (has_row_scales_v<F>) {
        e.k_scale = kss[i];
        e.v_scale = vss[i];
      }
      entries.push_back(e);
    }
  }
  auto restored = make_cache<P, F>();
  if constexpr (P == Kind::paged) {
    restored.restore(entries, {});
  } else {
    restored.restore(entries);
  }
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (std::size_t s = 0; s < kBatch; ++s) {
      const Packed a = pack(pair.view(l, s)), b = pack(restored.view(l, s));
      REQUIRE(a.k == b.k);
      REQUIRE(a.v == b.v);
      REQUIRE(a.k_scale == b.k_scale);
      REQUIRE(a.v_scale == b.v_scale);
    }
  }
}

template <class C, class U>
concept AppendsRowsOf = requires(C c, TokenBlock<const U> rows) {
  c.append(0, 0, rows, rows);
};
template <class C>
concept HasLayerData = requires(const C& c) {
  c.layer_data(0);
};

}  // namespace

TEMPLATE_TEST_CASE("a cache of a K/V format pair holds K as a cache of K and V as a cache of V",
                   "[pair]", (KVFormats<half, qint8>), (KVFormats<qint8, half>),
                   (KVFormats<bfloat16, fp8_e4m3>)) {
  auto rng = test::make_rng("pair caches");
  for (int trial = 0; trial < 4; ++trial) {
    check_policy<Kind::static_cache, TestType>(rng);
    check_policy<Kind::dynamic, TestType>(rng);
    check_policy<Kind::sliding, TestType>(rng);
    check_policy<Kind::paged, TestType>(rng);
  }
}

TEST_CASE("a pair cache takes float rows only, and its pool names both sides") {
  using F = KVFormats<half, qint8>;
  using Cache = StaticCache<F>;
  STATIC_REQUIRE(AppendsRowsOf<Cache, float>);
  STATIC_REQUIRE(!AppendsRowsOf<Cache, half>);
  STATIC_REQUIRE(AppendsRowsOf<StaticCache<half>, half>);
  PagedCache<F> paged({.num_layers = 1,
                       .num_kv_heads = 2,
                       .head_dim = 8,
                       .num_blocks = 3,
                       .block_size = 4,
                       .max_seq_len = 12});
  const KVBases<F> pool = paged.layer_pool(0);
  CHECK(pool.k_scale == nullptr);  // half keys
  CHECK(pool.v_scale != nullptr);  // int8 values
  CHECK(pool.slab_stride == 2 * 4 * 8);
  CHECK(static_cast<const void*>(pool.v) != static_cast<const void*>(pool.k));
  STATIC_REQUIRE(!HasLayerData<PagedCache<F>>);
  STATIC_REQUIRE(HasLayerData<PagedCache<half>>);
  // f16 keys + int8 values, per token and layer: 2 heads x (8 x 2 bytes of K + 8 + 2 of V).
  const CacheShape shape = cache_shape<F>(1, 2, 8);
  CHECK(kv_cache_bytes(shape, 1) == 2 * (8 * 2 + 8 + 2));
  CHECK(kv_cache_bytes(cache_shape<half>(1, 2, 8), 1) == 2 * 2 * 8 * 2);
}

namespace {

// Prefix caching on a pair PagedCache and on a PagedCache of each side, driven alike: a prompt
// appended with its ids, forked into a second sequence that writes into the shared last block
// (copy-on-write), released, then admitted again (its full blocks found in the index) and its
// tail appended.
template <KVFormat F>
void check_prefix_sharing(std::mt19937_64& rng) {
  auto pair = make_cache<Kind::paged, F>();
  auto kc = make_cache<Kind::paged, key_format_t<F>>();
  auto vc = make_cache<Kind::paged, value_format_t<F>>();
  const std::size_t n = test::uniform(rng, 9, 16);  // blocks of 4
  std::vector<token_id> prompt(n);
  for (token_id& id : prompt) id = static_cast<token_id>(test::uniform(rng, 1, 50));
  const test::TokenKV kv = test::random_kv(rng, n + 1, kHeads, kDim);
  const auto run = [&](auto& cache) {
    for (std::size_t l = 0; l < kLayers; ++l) {
      cache.append(l, 0, std::span<const token_id>(prompt), kv.k_block(0, n), kv.v_block(0, n));
    }
    cache.fork(0, 1);
    const token_id next = 7;
    for (std::size_t l = 0; l < kLayers; ++l) {  // writes into the shared last block: a copy
      cache.append(l, 1, std::span<const token_id>(&next, 1), kv.k_block(n, 1), kv.v_block(n, 1));
    }
  };
  run(pair);
  run(kc);
  run(vc);
  CHECK(pair.seq_length(1) == n + 1);
  require_sides_equal(pair, kc, vc);
  const auto again = [&](auto& cache) {
    cache.release(1);
    const std::size_t cached = cache.admit(1, prompt);
    // the full blocks, found by their ids; never the whole prompt (its last token is computed)
    CHECK(cached == std::min(n / 4 * 4, n - 1));
    for (std::size_t l = 0; l < kLayers; ++l) {
      cache.append(l, 1, kv.k_block(cached, n - cached), kv.v_block(cached, n - cached));
    }
  };
  again(pair);
  again(kc);
  again(vc);
  require_sides_equal(pair, kc, vc);
  CHECK(pair.check_consistency().empty());
}

}  // namespace

TEMPLATE_TEST_CASE("a pair PagedCache shares, forks and copies on write each side alike", "[pair]",
                   (KVFormats<half, qint8>), (KVFormats<fp8_e4m3, bfloat16>)) {
  auto rng = test::make_rng("pair prefix sharing");
  for (int trial = 0; trial < 8; ++trial) check_prefix_sharing<TestType>(rng);
}

TEST_CASE("a TokenTrackedCache of a pair reuses a prefix and crops each side alike") {
  using F = KVFormats<bfloat16, qint8>;
  auto rng = test::make_rng("pair token tracked");
  auto pair = TokenTrackedCache(make_cache<Kind::static_cache, F>());
  auto kc = TokenTrackedCache(make_cache<Kind::static_cache, bfloat16>());
  auto vc = TokenTrackedCache(make_cache<Kind::static_cache, qint8>());
  const std::vector<token_id> first = {5, 6, 7, 8, 9, 10}, second = {5, 6, 7, 1, 2};
  const test::TokenKV kv = test::random_kv(rng, 10, kHeads, kDim);
  const auto serve = [&](auto& cache, const std::vector<token_id>& prompt, std::size_t from) {
    const std::size_t reused = cache.reuse_prefix(0, prompt);
    for (std::size_t l = 0; l < kLayers; ++l) {
      cache.append(l, 0, kv.k_block(from + reused, prompt.size() - reused),
                   kv.v_block(from + reused, prompt.size() - reused));
    }
    cache.commit(0, std::span<const token_id>(prompt).subspan(reused));
    return reused;
  };
  CHECK(serve(pair, first, 0) == 0);
  CHECK(serve(kc, first, 0) == 0);
  CHECK(serve(vc, first, 0) == 0);
  require_sides_equal(pair, kc, vc);
  CHECK(serve(pair, second, 4) == 3);  // the common prefix 5, 6, 7 stays; the rest is new
  CHECK(serve(kc, second, 4) == 3);
  CHECK(serve(vc, second, 4) == 3);
  require_sides_equal(pair, kc, vc);
  CHECK(pair.tokens(0).size() == second.size());
}
