// SPDX-License-Identifier: Apache-2.0
// The layout descriptor (KVLayout), the views derived from it (LayoutView) and the mask (KVMask),
// against plain definitions written out here: every row where the layout's definition puts it,
// every present position in exactly one segment, segments contiguous in memory; and
// SegmentView::push's checks of the segments a caller hands it.
#include "kvcache/core/layout.hpp"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "kvcache/core/mask.hpp"
#include "kvcache/core/view.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

using namespace kvcache;

namespace {

// A layout over real memory (views form pointers into it) with random geometry.
struct Fixture {
  KVLayout<float> layout;
  std::vector<float> storage;
  std::vector<block_id> table;
  std::int64_t capacity = 0;  // positions one sequence can address
};

Fixture make_fixture(std::mt19937_64& rng, LayoutKind kind) {
  Fixture f;
  KVLayout<float>& l = f.layout;
  l.layout = kind;
  l.num_seqs = static_cast<int>(test::uniform(rng, 1, 3));
  l.num_kv_heads = static_cast<int>(test::uniform(rng, 1, 3));
  l.head_dim = static_cast<int>(test::uniform(rng, 1, 5));
  const std::int64_t d = l.head_dim, h = l.num_kv_heads;
  std::int64_t elements = 0;
  if (kind == LayoutKind::paged) {
    l.block_size = static_cast<int>(test::uniform(rng, 1, 6));
    l.max_blocks = static_cast<int>(test::uniform(rng, 1, 6));
    l.head_stride = l.block_size * d;
    l.block_stride = 2 * h * l.head_stride + static_cast<std::int64_t>(test::uniform(rng, 0, 3));
    const std::int64_t num_blocks = l.num_seqs * l.max_blocks + 2;
    f.table.resize(static_cast<std::size_t>(l.num_seqs * l.max_blocks));
    std::vector<block_id> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), block_id{0});
    std::shuffle(ids.begin(), ids.end(), rng);
    std::copy_n(ids.begin(), f.table.size(), f.table.begin());
    l.block_table = f.table.data();
    elements = num_blocks * l.block_stride;
    f.capacity = static_cast<std::int64_t>(l.max_blocks) * l.block_size;
  } else {
    std::int64_t slots = static_cast<std::int64_t>(test::uniform(rng, 1, 12));
    if (kind == LayoutKind::ring) {
      l.num_sinks = static_cast<int>(test::uniform(rng, 0, 3));
      l.ring_len = static_cast<int>(test::uniform(rng, 1, 7));
      slots = l.num_sinks + l.ring_len;
      f.capacity = 1'000;  // a ring addresses any position
    } else {
      f.capacity = slots;
    }
    l.head_stride = slots * d + static_cast<std::int64_t>(test::uniform(rng, 0, 2));
    l.seq_stride = 2 * h * l.head_stride + static_cast<std::int64_t>(test::uniform(rng, 0, 2));
    elements = l.num_seqs * l.seq_stride;
  }
  f.storage.resize(static_cast<std::size_t>(2 * elements + 1));
  l.k = f.storage.data();
  l.v = f.storage.data() + elements;
  return f;
}

// The definition of each layout, written out.
std::int64_t expected_offset(const Fixture& f, int seq, int head, std::int64_t pos) {
  const KVLayout<float>& l = f.layout;
  switch (l.layout) {
    case LayoutKind::paged: {
      const block_id b =
          f.table.at(static_cast<std::size_t>(seq * l.max_blocks + pos / l.block_size));
      return static_cast<std::int64_t>(b) * l.block_stride + head * l.head_stride +
             (pos % l.block_size) * l.head_dim;
    }
    case LayoutKind::ring: {
      const std::int64_t slot =
          pos < l.num_sinks ? pos : l.num_sinks + (pos - l.num_sinks) % l.ring_len;
      return seq * l.seq_stride + head * l.head_stride + slot * l.head_dim;
    }
    default:
      return seq * l.seq_stride + head * l.head_stride + pos * l.head_dim;
  }
}

// A KeyRange the layout can hold for one sequence.
KeyRange random_keys(std::mt19937_64& rng, const Fixture& f) {
  const KVLayout<float>& l = f.layout;
  KeyRange r;
  if (l.layout == LayoutKind::ring) {
    r.length = static_cast<std::int64_t>(test::uniform(rng, 0, 40));
    r.sink_end = std::min<std::int64_t>(r.length, l.num_sinks);
    // the ring holds the last ring_len positions at or past the sinks
    const std::int64_t lo = std::max<std::int64_t>(r.sink_end, r.length - l.ring_len);
    r.recent_begin = std::max<std::int64_t>(
        lo, static_cast<std::int64_t>(test::uniform(rng, static_cast<std::size_t>(lo),
                                                    static_cast<std::size_t>(r.length))));
    return r;
  }
  r.length = static_cast<std::int64_t>(test::uniform(rng, 0, static_cast<std::size_t>(f.capacity)));
  if (test::uniform(rng, 0, 1) == 0) return r;  // drops nothing
  r.recent_begin =
      static_cast<std::int64_t>(test::uniform(rng, 0, static_cast<std::size_t>(r.length)));
  r.sink_end =
      static_cast<std::int64_t>(test::uniform(rng, 0, static_cast<std::size_t>(r.recent_begin)));
  return r;
}

}  // namespace

TEST_CASE("KVLayout::row_offset puts every row where its layout's definition says") {
  auto rng = test::make_rng("row_offset");
  for (const LayoutKind kind : {LayoutKind::contiguous, LayoutKind::ring, LayoutKind::paged}) {
    for (int trial = 0; trial < 200; ++trial) {
      const Fixture f = make_fixture(rng, kind);
      const auto& l = f.layout;
      const std::int64_t top = kind == LayoutKind::ring ? 200 : f.capacity;
      for (int seq = 0; seq < l.num_seqs; ++seq) {
        for (int head = 0; head < l.num_kv_heads; ++head) {
          for (std::int64_t pos = 0; pos < top; ++pos) {
            INFO("layout " << static_cast<int>(kind) << " seq " << seq << " head " << head
                           << " pos " << pos);
            REQUIRE(l.row_offset(seq, head, pos) == expected_offset(f, seq, head, pos));
          }
        }
      }
    }
  }
}

TEST_CASE("KVLayout::row_offset of a ring past 2^32 positions takes the 64-bit path") {
  KVLayout<float> l;
  l.layout = LayoutKind::ring;
  l.num_sinks = 4;
  l.ring_len = 1'000'003;
  l.head_dim = 8;
  l.head_stride = 8 * (4 + 1'000'003);
  for (const std::int64_t pos : {std::int64_t{0xffffffff}, std::int64_t{0xffffffff} + 4,
                                 std::int64_t{0x1'0000'0004}, std::int64_t{1} << 40}) {
    const std::int64_t slot = 4 + (pos - 4) % 1'000'003;
    REQUIRE(l.row_offset(0, 1, pos) == l.head_stride + slot * 8);
  }
}

TEST_CASE("LayoutView: each present position in exactly one segment, in order, rows contiguous") {
  auto rng = test::make_rng("layout_view");
  for (const LayoutKind kind : {LayoutKind::contiguous, LayoutKind::ring, LayoutKind::paged}) {
    for (int trial = 0; trial < 400; ++trial) {
      const Fixture f = make_fixture(rng, kind);
      const auto& l = f.layout;
      const int seq =
          static_cast<int>(test::uniform(rng, 0, static_cast<std::size_t>(l.num_seqs - 1)));
      const KeyRange keys = random_keys(rng, f);
      const LayoutView<float> view(l, seq, keys);
      INFO("layout " << static_cast<int>(kind) << " seq " << seq << " keys [0, " << keys.sink_end
                     << ") + [" << keys.recent_begin << ", " << keys.length << ")");
      REQUIRE(view.length() == keys.length);
      REQUIRE(view.sink_end() == keys.sink_end);
      REQUIRE(view.recent_begin() == keys.recent_begin);
      REQUIRE(view.num_kv_heads() == static_cast<std::size_t>(l.num_kv_heads));
      REQUIRE(view.head_dim() == static_cast<std::size_t>(l.head_dim));
      std::vector<std::int64_t> seen;
      for (std::size_t i = 0; i < view.num_segments(); ++i) {
        const KVSegment<float> s = view.segment(i);
        REQUIRE(s.len > 0);
        REQUIRE(s.head_stride == static_cast<std::size_t>(l.head_stride));
        for (std::size_t j = 0; j < s.len; ++j) {
          const std::int64_t pos = s.first_pos + static_cast<std::int64_t>(j);
          REQUIRE((seen.empty() || pos > seen.back()));
          seen.push_back(pos);
          for (int head = 0; head < l.num_kv_heads; ++head) {
            const std::size_t at = static_cast<std::size_t>(head) * s.head_stride +
                                   j * static_cast<std::size_t>(l.head_dim);
            const std::int64_t want = expected_offset(f, seq, head, pos);
            REQUIRE(s.k + at == l.k + want);
            REQUIRE(s.v + at == l.v + want);
          }
        }
      }
      std::vector<std::int64_t> present;
      for (std::int64_t i = 0; i < keys.count(); ++i) present.push_back(keys.pos(i));
      REQUIRE(seen == present);
      if (kind == LayoutKind::paged && keys.sink_end == 0 && keys.recent_begin == 0) {
        // one segment per block, and the block ids behind them
        const auto blocks =
            static_cast<std::size_t>((keys.length + l.block_size - 1) / l.block_size);
        REQUIRE(view.num_segments() == blocks);
        const auto table = view.block_table();
        REQUIRE(
            std::equal(table.begin(), table.end(), f.table.begin() + seq * l.max_blocks,
                       f.table.begin() + seq * l.max_blocks + static_cast<std::ptrdiff_t>(blocks)));
      }
      if (kind == LayoutKind::ring && keys.recent_begin >= l.num_sinks) {
        REQUIRE(view.num_segments() <= 3);  // sinks, then at most one wrap of the ring
      }
      if (kind == LayoutKind::contiguous && keys.sink_end == 0 && keys.recent_begin == 0) {
        REQUIRE(view.num_segments() == (keys.length > 0 ? 1u : 0u));
      }
    }
  }
}

TEST_CASE("KVMask: visibility and the sink shift as defined") {
  for (const bool causal : {true, false}) {
    for (std::int64_t window = 0; window < 6; ++window) {
      for (std::int64_t sinks = 0; sinks < 4; ++sinks) {
        const KVMask mask{.causal = causal, .window = window, .sinks = sinks};
        for (std::int64_t q = 0; q < 12; ++q) {
          for (std::int64_t p = 0; p < 14; ++p) {
            const bool in_window = window == 0 || q - p < window;
            const bool want = !causal || (p <= q && (in_window || p < sinks));
            REQUIRE(mask.visible(q, p) == want);
          }
          const std::int64_t lowest = window == 0 ? 0 : q - window + 1;
          REQUIRE(mask.low(q) == lowest);
          REQUIRE(mask.sink_shift(q) == 0);  // no RoPE: absolute positions
          const std::int64_t shift =
              window == 0 || sinks == 0 ? 0 : std::max<std::int64_t>(0, lowest - sinks);
          REQUIRE(mask.sink_shift(q, true) == shift);
          REQUIRE(mask.sink_shift(q, false) == 0);
        }
      }
    }
  }
}

TEST_CASE("KVMask::score takes a sink's precomputed score, every other key's own") {
  // 2 sequences x 3 rows x 2 heads x 4 sinks
  std::vector<float> scores(2 * 3 * 2 * 4);
  std::iota(scores.begin(), scores.end(), 100.0f);
  const KVMask mask{
      .window = 8, .sinks = 4, .sink_scores = scores.data(), .sink_rows = 3, .sink_heads = 2};
  REQUIRE(mask.score(-1.0f, 1, 2, 1, 3) == scores[((1 * 3 + 2) * 2 + 1) * 4 + 3]);
  REQUIRE(mask.score(-1.0f, 0, 0, 0, 0) == 100.0f);
  REQUIRE(mask.score(-1.0f, 1, 2, 1, 4) == -1.0f);  // past the sinks
  const KVMask plain{.window = 8, .sinks = 4};
  REQUIRE(plain.score(-1.0f, 0, 0, 0, 0) == -1.0f);
}

TEST_CASE("SegmentView::push takes segments in position order within the view, rejects the rest") {
  using test::require_throws;
  // 2 KV heads, head_dim 4; the view holds [0, 2) and [10, 20).
  std::vector<half> k(2 * 32 * 4);
  std::vector<qint8> codes(k.size());
  std::vector<scale_type> scales(2 * 32);
  using Pair = KVFormats<half, qint8>;
  SegmentView<Pair, 3> view(2, 4, 20, 2, 10);
  const auto seg = [&](position_t first, std::size_t len) {
    return KVSegment<Pair>{k.data(), codes.data(), 32 * 4, first, len, nullptr, scales.data()};
  };
  view.push(seg(0, 2));
  view.push(seg(15, 0));  // empty: skipped wherever it claims to be
  // In the evicted gap [2, 10), across the sinks' end, across the gap's end, past the end.
  const std::pair<position_t, std::size_t> outside[] = {{4, 2}, {1, 2}, {9, 3}, {15, 6}};
  for (const auto& [first, len] : outside) {
    INFO("segment at " << first << ", " << len << " positions");
    require_throws<position_error>([&, f = first, n = len] { view.push(seg(f, n)); }, "segment 1",
                                   "[0, 2) and [10, 20)");
    REQUIRE(view.num_segments() == 1);
  }
  auto no_k = seg(10, 4);
  no_k.k = nullptr;
  require_throws<shape_error>([&] { view.push(no_k); }, "segment 1 (positions [10, 14))",
                              "no K rows");
  auto no_v_scales = seg(10, 4);
  no_v_scales.v_scale = nullptr;  // int8 values need their scales; half keys need none
  require_throws<shape_error>([&] { view.push(no_v_scales); },
                              "quantized V rows (int8) but no row scales");
  REQUIRE(view.num_segments() == 1);
  view.push(seg(10, 4));
  require_throws<position_error>([&] { view.push(seg(12, 3)); }, "ends at 14");  // overlaps
  view.push(seg(14, 6));
  REQUIRE(view.num_segments() == 3);
  require_throws<capacity_error>([&] { view.push(seg(0, 1)); }, "the view's 3 segments");
  REQUIRE(view.num_segments() == 3);
  REQUIRE(view.segment(2).first_pos == 14);
  REQUIRE(view.segment(2).len == 6);
}
