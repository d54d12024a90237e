// SPDX-License-Identifier: Apache-2.0
// The restore building blocks over any K/V format, a KVFormats pair included: a LayerRestore's
// packed rows as pack_view_rows() gathers them from a view, put back into paged blocks by
// fill_packed_block() and into ring slots by restore_rows(), each checked element by element
// against the storage indexed by hand; and check_restore_entries()'s checks of each side's
// sizes and scales.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "kvcache/core/layout.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/view.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

using namespace kvcache;

namespace {

// Bitwise equality of one element (half, codes and scales have no NaN-free operator== to rely
// on, and a restore must move bits).
template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// One side of a planar paged pool: rows [block][head][block_size][head_dim] of format T and,
// for a quantized T, their scales [block][head][block_size].
template <KVElement T>
struct Side {
  std::vector<T> rows;
  std::vector<scale_type> scales;

  Side(std::size_t num_rows, std::size_t d) : rows(num_rows * d), scales(num_rows) {}

  // Random rows written as an append would (quantize_row), so codes and scales are consistent.
  void fill(std::mt19937_64& rng, std::size_t d) {
    const std::vector<float> x = test::normal_floats(rng, rows.size());
    for (std::size_t r = 0; r < scales.size(); ++r) {
      quantize_row(x.data() + r * d, d, rows.data() + r * d, scales.data() + r);
    }
  }
  [[nodiscard]] const scale_type* scale_base() const {
    return scaled_v<T> ? scales.data() : nullptr;
  }
  [[nodiscard]] scale_type* scale_base() { return scaled_v<T> ? scales.data() : nullptr; }
};

struct Geometry {
  std::size_t heads = 0, d = 0, block_size = 0, num_blocks = 0, length = 0;
  [[nodiscard]] std::size_t rows() const { return num_blocks * heads * block_size; }
  // Row index of (block, head, slot) in a planar pool side.
  [[nodiscard]] std::size_t row(std::size_t block, std::size_t h, std::size_t slot) const {
    return (block * heads + h) * block_size + slot;
  }
};

template <KVFormat F>
KVLayout<F> planar_layout(const Side<key_format_t<F>>& k, const Side<value_format_t<F>>& v,
                          const Geometry& g, const std::vector<block_id>& table,
                          const std::int64_t* length) {
  KVLayout<F> l;
  l.k = k.rows.data();
  l.v = v.rows.data();
  l.k_scale = k.scale_base();
  l.v_scale = v.scale_base();
  l.num_seqs = 1;
  l.num_kv_heads = static_cast<int>(g.heads);
  l.head_dim = static_cast<int>(g.d);
  l.layout = LayoutKind::paged;
  l.block_size = static_cast<int>(g.block_size);
  l.head_stride = static_cast<std::int64_t>(g.block_size * g.d);
  l.block_stride = static_cast<std::int64_t>(g.heads * g.block_size * g.d);
  l.block_table = table.data();
  l.max_blocks = static_cast<int>(table.size());
  l.length = length;
  return l;
}

std::vector<block_id> shuffled_blocks(std::mt19937_64& rng, std::size_t n, std::size_t count) {
  std::vector<block_id> ids(n);
  std::iota(ids.begin(), ids.end(), block_id{0});
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(count);
  return ids;
}

// Packs a paged view of format F, restores the packed rows into other blocks of a second pool,
// and checks every element (rows and scales, each side) at each step against the pools.
template <KVFormat F>
void round_trip(std::mt19937_64& rng) {
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  Geometry g;
  g.heads = test::uniform(rng, 1, 3);
  g.d = test::uniform(rng, 1, 9);
  g.block_size = test::uniform(rng, 1, 5);
  g.length = test::uniform(rng, 1, 20);
  const std::size_t used = (g.length + g.block_size - 1) / g.block_size;
  g.num_blocks = used + test::uniform(rng, 0, 3);
  Side<K> k(g.rows(), g.d), k2(g.rows(), g.d);
  Side<V> v(g.rows(), g.d), v2(g.rows(), g.d);
  k.fill(rng, g.d);
  v.fill(rng, g.d);
  const std::vector<block_id> table = shuffled_blocks(rng, g.num_blocks, used);
  const auto length = static_cast<std::int64_t>(g.length);
  const KVLayout<F> layout = planar_layout<F>(k, v, g, table, &length);
  const LayoutView<F> view(layout, 0, KeyRange{0, 0, length});

  // pack_view_rows: [head][position][d] per side, scales [head][position].
  const std::size_t n = g.length;
  std::vector<K> kp(g.heads * n * g.d);
  std::vector<V> vp(g.heads * n * g.d);
  std::vector<scale_type> ksp(scaled_v<K> ? g.heads * n : 0), vsp(scaled_v<V> ? g.heads * n : 0);
  detail::pack_view_rows(view, kp.data(), vp.data(), ksp.data(), vsp.data());
  for (std::size_t h = 0; h < g.heads; ++h) {
    for (std::size_t p = 0; p < n; ++p) {
      const std::size_t src = g.row(table[p / g.block_size], h, p % g.block_size);
      for (std::size_t x = 0; x < g.d; ++x) {
        REQUIRE(same_bits(kp[(h * n + p) * g.d + x], k.rows[src * g.d + x]));
        REQUIRE(same_bits(vp[(h * n + p) * g.d + x], v.rows[src * g.d + x]));
      }
      if constexpr (scaled_v<K>) REQUIRE(same_bits(ksp[h * n + p], k.scales[src]));
      if constexpr (scaled_v<V>) REQUIRE(same_bits(vsp[h * n + p], v.scales[src]));
    }
  }

  LayerRestore<F> e;
  e.length = length;
  e.k = kp;
  e.v = vp;
  if constexpr (has_row_scales_v<F>) {
    e.k_scale = ksp;
    e.v_scale = vsp;
  }
  const CacheShape shape{1, g.heads, g.d, dtype_of<K>};
  detail::check_restore_entries<F>("test", std::span<const LayerRestore<F>>(&e, 1), shape, 1);

  // fill_packed_block into other blocks of a second pool: each side's rows and scales land
  // where the second table says, and nothing else of the pool changes.
  const std::vector<block_id> table2 = shuffled_blocks(rng, g.num_blocks, used);
  const std::vector<K> k2_before = k2.rows;
  const std::vector<V> v2_before = v2.rows;
  const std::size_t block_rows = g.heads * g.block_size;
  for (std::size_t i = 0; i < used; ++i) {
    const std::size_t b = table2[i];
    detail::fill_packed_block<F>(
        k2.rows.data() + b * block_rows * g.d, v2.rows.data() + b * block_rows * g.d,
        scaled_v<K> ? k2.scales.data() + b * block_rows : nullptr,
        scaled_v<V> ? v2.scales.data() + b * block_rows : nullptr, g.block_size, shape, e, i);
  }
  for (std::size_t b = 0; b < g.num_blocks; ++b) {
    for (std::size_t h = 0; h < g.heads; ++h) {
      for (std::size_t s = 0; s < g.block_size; ++s) {
        const std::size_t dst = g.row(b, h, s);
        std::size_t index = used;  // which table entry names b, if any
        for (std::size_t i = 0; i < used; ++i) index = table2[i] == b ? i : index;
        const std::size_t p = index * g.block_size + s;
        const bool written = index < used && p < n;
        for (std::size_t x = 0; x < g.d; ++x) {
          const std::size_t at = dst * g.d + x;
          if (written) {
            const std::size_t src = g.row(table[index], h, s) * g.d + x;
            REQUIRE(same_bits(k2.rows[at], k.rows[src]));
            REQUIRE(same_bits(v2.rows[at], v.rows[src]));
          } else {
            REQUIRE(same_bits(k2.rows[at], k2_before[at]));
            REQUIRE(same_bits(v2.rows[at], v2_before[at]));
          }
        }
        if (written) {
          const std::size_t src = g.row(table[index], h, s);
          if constexpr (scaled_v<K>) REQUIRE(same_bits(k2.scales[dst], k.scales[src]));
          if constexpr (scaled_v<V>) REQUIRE(same_bits(v2.scales[dst], v.scales[src]));
        }
      }
    }
  }

  // restore_rows of a window's state: sinks [0, s) and recent positions [r, length) into slots
  // from dst_slot on, heads `stride` rows apart (a ring slab's geometry), each side alike.
  const std::size_t sinks = test::uniform(rng, 0, n - 1), recent = test::uniform(rng, sinks, n - 1);
  const std::size_t held = sinks + (n - recent);
  std::vector<K> kw(g.heads * held * g.d);
  std::vector<V> vw(g.heads * held * g.d);
  std::vector<scale_type> ksw(scaled_v<K> ? g.heads * held : 0),
      vsw(scaled_v<V> ? g.heads * held : 0);
  const LayoutView<F> window(
      layout, 0,
      KeyRange{static_cast<std::int64_t>(sinks), static_cast<std::int64_t>(recent), length});
  detail::pack_view_rows(window, kw.data(), vw.data(), ksw.data(), vsw.data());
  LayerRestore<F> w;
  w.length = length;
  w.sink_end = static_cast<position_t>(sinks);
  w.recent_begin = static_cast<position_t>(recent);
  w.k = kw;
  w.v = vw;
  if constexpr (has_row_scales_v<F>) {
    w.k_scale = ksw;
    w.v_scale = vsw;
  }
  REQUIRE(w.held() == held);
  const std::size_t first = test::uniform(rng, 0, held - 1), count = held - first;
  const std::size_t dst_slot = test::uniform(rng, 0, 3), slots = dst_slot + count;
  std::vector<K> ks(g.heads * slots * g.d);
  std::vector<V> vs(g.heads * slots * g.d);
  std::vector<scale_type> kss(g.heads * slots), vss(g.heads * slots);
  detail::restore_rows<F>(ks.data(), vs.data(), kss.data(), vss.data(), slots * g.d, dst_slot, w,
                          first, count, shape);
  for (std::size_t h = 0; h < g.heads; ++h) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t logical = first + i;  // index among the held positions
      const std::size_t p = logical < sinks ? logical : recent + (logical - sinks);
      const std::size_t src = g.row(table[p / g.block_size], h, p % g.block_size);
      const std::size_t dst = h * slots + dst_slot + i;
      for (std::size_t x = 0; x < g.d; ++x) {
        REQUIRE(same_bits(ks[dst * g.d + x], k.rows[src * g.d + x]));
        REQUIRE(same_bits(vs[dst * g.d + x], v.rows[src * g.d + x]));
      }
      if constexpr (scaled_v<K>) REQUIRE(same_bits(kss[dst], k.scales[src]));
      if constexpr (scaled_v<V>) REQUIRE(same_bits(vss[dst], v.scales[src]));
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("restore building blocks move each side's rows and scales exactly", "[restore]",
                   float, half, qint8, fp8_e4m3, (KVFormats<half, qint8>),
                   (KVFormats<bfloat16, fp8_e4m3>), (KVFormats<qint8, half>),
                   (KVFormats<fp8_e4m3, float>), (KVFormats<qint8, fp8_e4m3>)) {
  auto rng = test::make_rng("restore_rows round trip");
  for (int trial = 0; trial < 40; ++trial) round_trip<TestType>(rng);
}

TEST_CASE("check_restore_entries checks each side of a pair", "[restore]") {
  using F = KVFormats<half, qint8>;  // K unquantized, V int8
  const CacheShape shape{1, 2, 4, DType::f16};
  constexpr std::size_t held = 3, rows = 2 * held, elems = rows * 4;
  const std::vector<half> k(elems);
  const std::vector<qint8> v(elems);
  const std::vector<scale_type> scales(rows), too_few(rows - 1);
  LayerRestore<F> e;
  e.length = held;
  e.k = k;
  e.v = v;
  e.v_scale = scales;
  const auto check = [&](const LayerRestore<F>& entry) {
    detail::check_restore_entries<F>("Cache", std::span<const LayerRestore<F>>(&entry, 1), shape,
                                     1);
  };
  check(e);  // K without scales, V with one per row

  LayerRestore<F> bad = e;
  bad.k_scale = scales;  // scales for the unquantized side
  test::require_throws<shape_error>([&] { check(bad); }, "restore entry 0", "K f16", "V int8",
                                    "needs 0 K and 6 V scales", "got 6 and 6");
  bad = e;
  bad.v_scale = too_few;
  test::require_throws<shape_error>([&] { check(bad); }, "needs 0 K and 6 V scales", "got 0 and 5");
  bad = e;
  bad.v_scale = {};
  test::require_throws<shape_error>([&] { check(bad); }, "got 0 and 0");
  bad = e;
  bad.v = std::span<const qint8>(v).first(elems - 4);  // one row short on the V side
  test::require_throws<shape_error>([&] { check(bad); }, "holds 3 positions", "got 24 and 20");

  using G = KVFormats<qint8, half>;  // the other way round
  const std::vector<qint8> kq(elems);
  const std::vector<half> vh(elems);
  LayerRestore<G> f;
  f.length = held;
  f.k = kq;
  f.v = vh;
  f.k_scale = scales;
  detail::check_restore_entries<G>("Cache", std::span<const LayerRestore<G>>(&f, 1), shape, 1);
  f.v_scale = scales;
  test::require_throws<shape_error>(
      [&] {
        detail::check_restore_entries<G>("Cache", std::span<const LayerRestore<G>>(&f, 1), shape,
                                         1);
      },
      "K int8", "V f16", "needs 6 K and 0 V scales");
}
