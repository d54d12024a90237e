// SPDX-License-Identifier: Apache-2.0
// Cache-relative positions (StreamingLLM): attention over q and K rotated at their absolute
// positions, with PositionMode::cache_relative, equals attention recomputed from scratch with
// q and K rotated at their positions within the cache (sinks 0..S-1, the window right after), in
// every policy, decode and prefill; it equals absolute positions until the window moves; each
// row is the same bits whatever shares its call; bad options are refused by name.
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

constexpr std::size_t kKvHeads = 2, kGroup = 2, kQHeads = kKvHeads * kGroup, kDim = 32;
constexpr std::size_t kWindow = 24, kSinks = 4;

// Raw (unrotated) q, k, v of `n` tokens.
struct Raw {
  std::vector<float> q, k, v;
};

Raw random_raw(std::mt19937_64& rng, std::size_t n) {
  return {kvcache::test::normal_floats(rng, n * kQHeads * kDim),
          kvcache::test::normal_floats(rng, n * kKvHeads * kDim),
          kvcache::test::normal_floats(rng, n * kKvHeads * kDim)};
}

// rows [first, first + n) of x (each `width` floats), rotated by `rope` at positions pos[i].
std::vector<float> rotated(const Rope& rope, const std::vector<float>& x, std::size_t width,
                           std::span<const position_t> rows, std::span<const position_t> pos) {
  std::vector<float> out;
  const std::size_t heads = width / kDim;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto r = static_cast<std::size_t>(rows[i]);
    std::vector<float> row(x.begin() + static_cast<std::ptrdiff_t>(r * width),
                           x.begin() + static_cast<std::ptrdiff_t>((r + 1) * width));
    rope.apply({row, 1, heads, kDim}, pos[i]);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

// StreamingLLM from scratch for the query token at absolute position p over tokens [0, p]:
// the keys it sees (sinks, then its window) get positions 0, 1, ... within the cache, the query
// the one after the last key; q and K are rotated at those and attended with no mask but
// causality.
std::vector<float> streaming_reference(const Rope& rope, const Raw& raw, position_t p) {
  const position_t lo = std::max<position_t>(kSinks, p - kWindow + 1);
  std::vector<position_t> rows, pos;
  for (position_t k = 0; k < std::min<position_t>(kSinks, p + 1); ++k) {
    rows.push_back(k);
    pos.push_back(k);
  }
  for (position_t k = lo; k <= p; ++k) {
    rows.push_back(k);
    pos.push_back(std::min<position_t>(kSinks, p + 1) + (k - lo));
  }
  const position_t qpos = pos.back();
  const auto k = rotated(rope, raw.k, kKvHeads * kDim, rows, pos);
  std::vector<float> v;
  for (position_t r : rows) {
    const auto at = raw.v.begin() + static_cast<std::ptrdiff_t>(r) * kKvHeads * kDim;
    v.insert(v.end(), at, at + kKvHeads * kDim);
  }
  const position_t one[] = {p};
  const position_t qp[] = {qpos};
  const auto q = rotated(rope, raw.q, kQHeads * kDim, one, qp);
  std::vector<float> out(kQHeads * kDim);
  reference::attend_dense({q, 1, kQHeads, kDim}, qp, {k, rows.size(), kKvHeads, kDim},
                          {v, rows.size(), kKvHeads, kDim}, pos, {out, 1, kQHeads, kDim});
  return out;
}

AttentionOptions streaming(const Rope& rope) {
  return {.window = kWindow,
          .num_sink_tokens = kSinks,
          .positions = PositionMode::cache_relative,
          .rope = &rope};
}

// Fills `cache` (sequence 0) with tokens [0, total) rotated at their absolute positions, in
// chunks of at most `chunk`, and checks the attention of each chunk's queries on the way.
template <class Cache>
void run_stream(Cache& cache, const Rope& rope, const Raw& raw, std::size_t total,
                std::size_t chunk, std::mt19937_64& rng) {
  const AttentionOptions opts = streaming(rope);
  const AttentionOptions absolute{.window = kWindow, .num_sink_tokens = kSinks};
  std::size_t len = 0;
  while (len < total) {
    const std::size_t n = std::min(kvcache::test::uniform(rng, 1, chunk), total - len);
    std::vector<position_t> rows(n), pos(n);
    for (std::size_t i = 0; i < n; ++i) rows[i] = pos[i] = static_cast<position_t>(len + i);
    const auto k = rotated(rope, raw.k, kKvHeads * kDim, rows, pos);
    const auto v = std::vector<float>(
        raw.v.begin() + static_cast<std::ptrdiff_t>(len * kKvHeads * kDim),
        raw.v.begin() + static_cast<std::ptrdiff_t>((len + n) * kKvHeads * kDim));
    cache.append(0, 0, TokenBlock<const float>{k, n, kKvHeads, kDim},
                 TokenBlock<const float>{v, n, kKvHeads, kDim});
    len += n;
    const auto q = rotated(rope, raw.q, kQHeads * kDim, rows, pos);
    std::vector<float> got(q.size()), plain(q.size());
    attend({q, n, kQHeads, kDim}, cache.view(0, 0), {got, n, kQHeads, kDim}, opts);
    attend({q, n, kQHeads, kDim}, cache.view(0, 0), {plain, n, kQHeads, kDim}, absolute);
    for (std::size_t t = 0; t < n; ++t) {
      const position_t p = pos[t];
      INFO("position " << p << " of a chunk of " << n);
      const std::span<const float> row(got.data() + t * kQHeads * kDim, kQHeads * kDim);
      kvcache::test::require_close(std::vector<float>(row.begin(), row.end()),
                                   streaming_reference(rope, raw, p), Tolerance{3e-5, 3e-5});
      const std::span<const float> abs_row(plain.data() + t * kQHeads * kDim, kQHeads * kDim);
      if (p - static_cast<position_t>(kWindow) + 1 <= static_cast<position_t>(kSinks)) {
        // the window has not moved off the sinks yet: the same positions, the same bits
        REQUIRE(std::ranges::equal(row, abs_row));
      }
      // each row alone gives the same bits as inside the chunk
      std::vector<float> alone(kQHeads * kDim);
      AttentionOptions one = opts;
      one.query_pos = p;
      attend(
          {std::span<const float>(q).subspan(t * kQHeads * kDim, kQHeads * kDim), 1, kQHeads, kDim},
          cache.view(0, 0), {alone, 1, kQHeads, kDim}, one);
      REQUIRE(std::ranges::equal(alone, row));
    }
  }
}

}  // namespace

TEST_CASE(
    "cache-relative attention equals StreamingLLM recomputed from scratch, in every "
    "policy, decode and prefill") {
  auto rng = kvcache::test::make_rng("cache-relative");
  constexpr std::size_t kTotal = 150;
  for (const RopeConfig& config :
       {RopeConfig{}, RopeConfig{.base = 500000.0f, .pairing = RopePairing::neox},
        RopeConfig{.rotary_dims = 16,
        .scaling = RopeScaling::yarn,
        .factor = 4.0f,
        .original_max_position = 32}}) {
    const Rope rope(config, kDim);
    const Raw raw = random_raw(rng, kTotal);
    for (const std::size_t chunk : {std::size_t{1}, std::size_t{9}}) {
      INFO("chunks up to " << chunk << ", pairing " << static_cast<int>(config.pairing));
      SlidingWindowCache<float> sliding({.num_layers = 1,
                                         .num_kv_heads = kKvHeads,
                                         .head_dim = kDim,
                                         .window = kWindow,
                                         .num_sink_tokens = kSinks,
                                         .max_append_len = 9});
      run_stream(sliding, rope, raw, kTotal, chunk, rng);
      StaticCache<float> full(
          {.num_layers = 1, .num_kv_heads = kKvHeads, .head_dim = kDim, .max_seq_len = kTotal});
      run_stream(full, rope, raw, kTotal, chunk, rng);
      PagedCache<float> paged({.num_layers = 1,
                               .num_kv_heads = kKvHeads,
                               .head_dim = kDim,
                               .num_blocks = 20,
                               .block_size = 8});
      run_stream(paged, rope, raw, kTotal, chunk, rng);
    }
  }
}

TEMPLATE_TEST_CASE(
    "cache-relative positions in a half, int8 or fp8 cache and through the reference agree", "",
    half, qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("cache-relative-half");
  const Rope rope({}, kDim);
  const Raw raw = random_raw(rng, 90);
  SlidingWindowCache<TestType> cache({.num_layers = 1,
                                      .num_kv_heads = kKvHeads,
                                      .head_dim = kDim,
                                      .window = kWindow,
                                      .num_sink_tokens = kSinks,
                                      .max_append_len = 90});
  std::vector<position_t> rows(90);
  for (std::size_t i = 0; i < 90; ++i) rows[i] = static_cast<position_t>(i);
  const auto k = rotated(rope, raw.k, kKvHeads * kDim, rows, rows);
  const auto q = rotated(rope, raw.q, kQHeads * kDim, rows, rows);
  cache.append(0, 0, TokenBlock<const float>{k, 90, kKvHeads, kDim},
               TokenBlock<const float>{raw.v, 90, kKvHeads, kDim});
  std::vector<float> fast(q.size()), slow(q.size());
  reference::attend({q, 90, kQHeads, kDim}, cache.view(0, 0), {slow, 90, kQHeads, kDim},
                    streaming(rope));
  for (cpu::Kernel kernel : kvcache::test::cpu_kernels(kDim)) {
    INFO(kvcache::test::kernel_name(kernel) << " kernel");
    cpu::attend({q, 90, kQHeads, kDim}, cache.view(0, 0), {fast, 90, kQHeads, kDim},
                streaming(rope), kernel);
    kvcache::test::require_close(fast, slow, Tolerance{2e-5, 2e-5});
  }
}

TEST_CASE("cache-relative positions without the RoPE, or with another head size, are refused") {
  StaticCache<float> cache(
      {.num_layers = 1, .num_kv_heads = kKvHeads, .head_dim = kDim, .max_seq_len = 8});
  std::vector<float> kv(4 * kKvHeads * kDim, 0.5f), q(kQHeads * kDim, 0.25f), out(q.size());
  cache.append(0, 0, TokenBlock<const float>{kv, 4, kKvHeads, kDim},
               TokenBlock<const float>{kv, 4, kKvHeads, kDim});
  AttentionOptions opts{
      .window = 2, .num_sink_tokens = 1, .positions = PositionMode::cache_relative};
  kvcache::test::require_throws<shape_error>(
      [&] {
        attend({q, 1, kQHeads, kDim}, cache.view(0, 0), {out, 1, kQHeads, kDim}, opts);
      },
      "cache_relative", "rope");
  const Rope other({}, 16);
  opts.rope = &other;
  kvcache::test::require_throws<shape_error>(
      [&] {
        attend({q, 1, kQHeads, kDim}, cache.view(0, 0), {out, 1, kQHeads, kDim}, opts);
      },
      "head_dim 16", "head_dim 32");
  kvcache::test::require_throws<shape_error>(
      [&] {
        reference::attend({q, 1, kQHeads, kDim}, cache.view(0, 0), {out, 1, kQHeads, kDim}, opts);
      },
      "head_dim 16");
}
