// SPDX-License-Identifier: Apache-2.0
// Snapshots of caches storing keys and values in different formats (KVFormats<K, V>): save then
// load reproduces every policy bit for bit, from any buffer alignment; the file says both formats
// (META flags bit 1 and value_dtype) and lays out its arrays as documented, decoded by hand here;
// a file of one format and a cache of a pair (or the reverse) refuse each other; and the META
// fields of the pair are validated.
#include <cstring>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/snapshot_edit.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::require_throws;

namespace {

const ModelId kModel = ModelId::from_u64(0xfeedbeef00112233ull);
constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 6, kBatch = 2;

template <KVFormat F>
StaticCache<F> make_static() {
  return StaticCache<F>({.num_layers = kLayers,
                         .num_kv_heads = kHeads,
                         .head_dim = kDim,
                         .max_batch = kBatch,
                         .max_seq_len = 40});
}
template <KVFormat F>
DynamicCache<F> make_dynamic() {
  return DynamicCache<F>({.num_layers = kLayers,
                          .num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .max_batch = kBatch,
                          .chunk_len = 7});
}
template <KVFormat F>
SlidingWindowCache<F> make_sliding() {
  return SlidingWindowCache<F>({.num_layers = kLayers,
                                .num_kv_heads = kHeads,
                                .head_dim = kDim,
                                .max_batch = kBatch,
                                .window = 9,
                                .num_sink_tokens = 2,
                                .max_append_len = 4});
}
template <KVFormat F>
PagedCache<F> make_paged() {
  return PagedCache<F>({.num_layers = kLayers,
                        .num_kv_heads = kHeads,
                        .head_dim = kDim,
                        .num_blocks = 30,
                        .block_size = 4,
                        .max_batch = kBatch,
                        .max_seq_len = 40});
}

// Each layer of each sequence gets the same random tokens, appended in chunks of up to 4.
template <class Cache>
void fill(Cache& cache, std::mt19937_64& rng) {
  for (std::size_t s = 0; s < kBatch; ++s) {
    const std::size_t n = test::uniform(rng, s == 0 ? 1 : 0, 30);
    const test::TokenKV kv = test::random_kv(rng, n, kHeads, kDim);
    std::vector<token_id> ids(n);
    for (token_id& id : ids) id = static_cast<token_id>(test::uniform(rng, 0, 9));
    for (std::size_t l = 0; l < kLayers; ++l) {
      for (std::size_t done = 0; done < n;) {
        const std::size_t c = std::min<std::size_t>(test::uniform(rng, 1, 4), n - done);
        if constexpr (requires { cache.admit(s, std::span<const token_id>()); }) {
          cache.append(l, s, std::span<const token_id>(ids).subspan(done, c), kv.k_block(done, c),
                       kv.v_block(done, c));
        } else {
          cache.append(l, s, kv.k_block(done, c), kv.v_block(done, c));
        }
        done += c;
      }
    }
  }
}

// Bitwise equality of two arrays (an empty one has no data() to compare).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Every layer of every sequence: the same positions and, on each side, the same bytes.
template <class A, class B>
void require_same_rows(const A& a, const B& b) {
  using F = typename A::value_type;
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (std::size_t s = 0; s < kBatch; ++s) {
      const auto va = a.view(l, s), vb = b.view(l, s);
      REQUIRE(va.length() == vb.length());
      REQUIRE(va.sink_end() == vb.sink_end());
      REQUIRE(va.recent_begin() == vb.recent_begin());
      const std::size_t held = view_num_tokens(va);
      std::vector<K> ka(held * kHeads * kDim), kb(ka.size());
      std::vector<V> vva(ka.size()), vvb(ka.size());
      std::vector<scale_type> ksa(held * kHeads), ksb(ksa.size()), vsa(ksa.size()), vsb(ksa.size());
      detail::pack_view_rows(va, ka.data(), vva.data(), ksa.data(), vsa.data());
      detail::pack_view_rows(vb, kb.data(), vvb.data(), ksb.data(), vsb.data());
      REQUIRE(same_bytes(ka, kb));
      REQUIRE(same_bytes(vva, vvb));
      REQUIRE(same_bytes(ksa, ksb));
      REQUIRE(same_bytes(vsa, vsb));
    }
  }
}

// Saves `a`, loads the bytes into a fresh cache from an aligned and a misaligned buffer.
template <class Cache, class Make>
void check_round_trip(const Cache& a, Make&& make_cache) {
  const std::vector<std::byte> bytes = snapshot_to_bytes(a, kModel);
  Cache b = make_cache();
  const SnapshotInfo info = load_snapshot_bytes(bytes, b, kModel);
  CHECK(info.shape == a.shape());
  require_same_rows(a, b);
  std::vector<std::byte> shifted(bytes.size() + 1);  // one byte off: loaded through a copy
  std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
  Cache c = make_cache();
  load_snapshot_bytes(std::span<const std::byte>(shifted).subspan(1), c, kModel);
  require_same_rows(a, c);
}

}  // namespace

TEMPLATE_TEST_CASE("a cache of a K/V pair survives save and load bit for bit, every policy",
                   "[snapshot][pair]", (KVFormats<half, qint8>), (KVFormats<qint8, half>),
                   (KVFormats<fp8_e4m3, bfloat16>)) {
  auto rng = test::make_rng("pair snapshots");
  for (int trial = 0; trial < 5; ++trial) {
    auto s = make_static<TestType>();
    fill(s, rng);
    check_round_trip(s, make_static<TestType>);
    auto d = make_dynamic<TestType>();
    fill(d, rng);
    check_round_trip(d, make_dynamic<TestType>);
    auto w = make_sliding<TestType>();
    fill(w, rng);
    check_round_trip(w, make_sliding<TestType>);
    auto p = make_paged<TestType>();
    fill(p, rng);
    check_round_trip(p, make_paged<TestType>);
    REQUIRE(p.check_consistency().empty());
  }
}

TEST_CASE("a pair file says both formats and pads each array to 8 bytes, decoded by hand") {
  // K int8, V f16, head_dim 3, 2 heads, 1 position: 6 K codes, 6 halves, 2 + 2 scales
  StaticCache<KVFormats<qint8, half>> c(
      {.num_layers = 1, .num_kv_heads = 2, .head_dim = 3, .max_batch = 1, .max_seq_len = 4});
  const std::vector<float> k = {1, -2, 3, 40, 50, -60}, v = {0.5f, 1, 1.5f, -2, -2.5f, -3};
  c.append(0, 0, TokenBlock<const float>{k, 1, 2, 3}, TokenBlock<const float>{v, 1, 2, 3});
  const auto bytes = snapshot_to_bytes(c, ModelId("pair"));
  const std::span<const std::byte> f(bytes);
  using kvcache::test::get32;
  using kvcache::test::get64;
  const std::size_t m = get64(f, 64 + 8), kv = get64(f, 64 + 2 * 32 + 8);
  REQUIRE(get32(f, m + 4) == 3);    // dtype: int8 (K)
  REQUIRE(get32(f, m + 88) == 2);   // flags: bit 1, V in value_dtype
  REQUIRE(get32(f, m + 168) == 1);  // value_dtype: f16
  // K 6 bytes (+ 2 of padding), V from 8 (12 bytes, + 4), K scales from 24 (4 bytes); f16 V has
  // none
  REQUIRE(get64(f, 64 + 2 * 32 + 16) == 64 + 28);
  const std::size_t rows = kv + 64;
  for (std::size_t i = 0; i < 6; ++i) {
    // K: codes of each head's row (scale max|x| / 127 rounded up to a bfloat16)
    const float k_scale =
        static_cast<float>(row_scale<qint8>(i < 3 ? 3.0f : 60.0f));  // the row's largest magnitude
    const auto code = static_cast<std::int8_t>(f[rows + i]);
    CHECK(std::abs(static_cast<float>(code) * k_scale - k[i]) <= k_scale / 2);
    std::uint16_t vb;
    std::memcpy(&vb, f.data() + rows + 8 + 2 * i, 2);  // V from byte 8: 6 codes, 2 of padding
    CHECK(half::to_float(vb) == v[i]);
  }
  CHECK(f[rows + 6] == std::byte{0});
  CHECK(f[rows + 7] == std::byte{0});
  CHECK(f[rows + 20] == std::byte{0});
  for (std::size_t h = 0; h < 2; ++h) {  // K scales from byte 24
    std::uint16_t sb;
    std::memcpy(&sb, f.data() + rows + 24 + 2 * h, 2);
    CHECK(sb == row_scale<qint8>(h == 0 ? 3.0f : 60.0f).bits);
  }
}

TEST_CASE("a pair file and a cache of one format refuse each other, nothing changed") {
  auto rng = test::make_rng("pair snapshot mismatch");
  auto pair = make_static<KVFormats<half, qint8>>();
  fill(pair, rng);
  auto one = make_static<half>();
  fill(one, rng);
  const auto pair_bytes = snapshot_to_bytes(pair, kModel);
  const auto one_bytes = snapshot_to_bytes(one, kModel);
  auto one_before = make_static<half>();
  load_snapshot_bytes(one_bytes, one_before, kModel);
  require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(pair_bytes, one, kModel); },
                                          "V is stored in int8", "destination's V in f16");
  require_same_rows(one, one_before);
  auto pair_before = make_static<KVFormats<half, qint8>>();
  load_snapshot_bytes(pair_bytes, pair_before, kModel);
  require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(one_bytes, pair, kModel); },
                                          "V is stored in f16", "destination's V in int8");
  require_same_rows(pair, pair_before);
  // K in another format than the destination's: the dtype check names K's
  auto other = make_static<KVFormats<bfloat16, qint8>>();
  require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(pair_bytes, other, kModel); },
                                          "dtype f16 differs from the destination's bf16");
}

TEST_CASE("META value_dtype is checked against flags bit 1") {
  auto rng = test::make_rng("pair snapshot meta");
  auto pair = make_static<KVFormats<half, qint8>>();
  fill(pair, rng);
  const auto good = snapshot_to_bytes(pair, kModel);
  const std::size_t m = kvcache::test::get64(std::span<const std::byte>(good), 64 + 8);
  const auto edited = [&](std::uint32_t flags, std::uint32_t value_dtype) {
    std::vector<std::byte> b = good;
    kvcache::test::set32(b, m + 88, flags);
    kvcache::test::set32(b, m + 168, value_dtype);
    kvcache::test::fix_checksums(b);
    return b;
  };
  auto dest = make_static<KVFormats<half, qint8>>();
  load_snapshot_bytes(edited(2, 3), dest, kModel);  // as written: loads
  require_throws<snapshot_format_error>([&] { load_snapshot_bytes(edited(2, 9), dest, kModel); },
                                        "value_dtype 9 is unknown");
  require_throws<snapshot_format_error>([&] { load_snapshot_bytes(edited(2, 1), dest, kModel); },
                                        "value_dtype 1 equals dtype");
  require_throws<snapshot_format_error>([&] { load_snapshot_bytes(edited(0, 3), dest, kModel); },
                                        "value_dtype 3 without META flags bit 1");
  require_throws<snapshot_format_error>([&] { load_snapshot_bytes(edited(6, 3), dest, kModel); },
                                        "unknown META flags");
}
