// SPDX-License-Identifier: Apache-2.0
// SlidingWindowCache: constant memory, absolute positions after any number of wrap-arounds,
// attention equal to the from-scratch reference restricted to window + sinks, exact crop rules.
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

TEST_CASE("sliding window attention equals the windowed reference across many wrap-arounds") {
  auto rng = kvcache::test::make_rng("sliding-wrap");
  for (std::size_t sinks : {0, 1, 4}) {
    for (std::size_t max_append : {1, 5, 16}) {
      const std::size_t window = 24, heads = 2, group = 2, dim = 16, total = 400;
      SlidingWindowCache<float> cache({.num_layers = 2,
                                       .num_kv_heads = heads,
                                       .head_dim = dim,
                                       .max_batch = 2,
                                       .window = window,
                                       .num_sink_tokens = sinks,
                                       .max_append_len = max_append});
      const std::size_t bytes = cache.memory_bytes();
      const auto kv = kvcache::test::random_kv(rng, total, heads, dim);
      const AttentionOptions opts{.window = window, .num_sink_tokens = sinks};
      std::size_t len = 0;
      while (len < total) {
        const std::size_t n = std::min(kvcache::test::uniform(rng, 1, max_append), total - len);
        for (std::size_t l = 0; l < 2; ++l)
          cache.append(l, 1, kv.k_block(len, n), kv.v_block(len, n));
        len += n;
        const auto view = cache.view(1, 1);
        const auto positions = kvcache::test::check_view_invariants(view);
        REQUIRE(view.length() == static_cast<position_t>(len));
        REQUIRE(positions.size() <= sinks + cache.ring_len());
        // the n new tokens attend, each to its own window + sinks
        const auto q = kvcache::test::normal_floats(rng, n * heads * group * dim);
        std::vector<float> got(q.size());
        attend({q, n, heads * group, dim}, view, {got, n, heads * group, dim}, opts);
        const auto expect =
            kvcache::test::scratch_attention(q, n, heads * group, kv.k, kv.v, len, heads, dim,
                                             static_cast<position_t>(len - n), opts);
        INFO("sinks " << sinks << " max_append " << max_append << " length " << len);
        kvcache::test::require_close(got, expect, Tolerance{2e-5, 2e-5});
        REQUIRE(cache.memory_bytes() == bytes);
      }
      REQUIRE(cache.seq_length(0) == 0);  // the other sequence saw nothing
    }
  }
}

TEST_CASE("sliding window views report absolute positions and the evicted gap") {
  SlidingWindowCache<float> cache({.num_layers = 1,
                                   .num_kv_heads = 1,
                                   .head_dim = 1,
                                   .window = 4,
                                   .num_sink_tokens = 2,
                                   .max_append_len = 1});
  std::vector<float> x{0.0f};
  for (int p = 0; p < 11; ++p) {
    x[0] = static_cast<float>(p);
    cache.append(0, 0, TokenBlock<const float>{x, 1, 1, 1}, TokenBlock<const float>{x, 1, 1, 1});
  }
  const auto view = cache.view(0, 0);
  REQUIRE(view.length() == 11);
  REQUIRE(view.sink_end() == 2);
  REQUIRE(view.recent_begin() == 7);
  std::vector<float> k, v;
  std::vector<position_t> pos;
  reference::gather_view(view, k, v, pos);
  REQUIRE(pos == std::vector<position_t>{0, 1, 7, 8, 9, 10});
  REQUIRE(k == std::vector<float>{0, 1, 7, 8, 9, 10});  // each slot holds its own token
}

TEST_CASE("attention over an evicted window without the window option is refused") {
  SlidingWindowCache<float> cache({.num_layers = 1, .num_kv_heads = 1, .head_dim = 2, .window = 3});
  std::vector<float> x(2, 1.0f), out(2);
  for (int p = 0; p < 6; ++p) {
    cache.append(0, 0, TokenBlock<const float>{x, 1, 1, 2}, TokenBlock<const float>{x, 1, 1, 2});
  }
  kvcache::test::require_throws<position_error>(
      [&] {
        attend({x, 1, 1, 2}, cache.view(0, 0), {out, 1, 1, 2});
      },
      "position 5", "evicted [0, 3)");
  attend({x, 1, 1, 2}, cache.view(0, 0), {out, 1, 1, 2}, {.window = 3});
  // a larger window than the cache keeps is refused too
  kvcache::test::require_throws<position_error>(
      [&] {
        attend({x, 1, 1, 2}, cache.view(0, 0), {out, 1, 1, 2}, {.window = 4});
      },
      "window 4");
}

TEST_CASE("sliding window append longer than max_append_len is refused, cache unchanged") {
  SlidingWindowCache<float> cache(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 2, .window = 8, .max_append_len = 4});
  std::vector<float> x(10, 1.0f);
  cache.append(0, 0, TokenBlock<const float>{std::span<const float>(x).first(6), 3, 1, 2},
               TokenBlock<const float>{std::span<const float>(x).first(6), 3, 1, 2});
  const auto before = kvcache::test::cache_contents(cache);
  kvcache::test::require_throws<capacity_error>(
      [&] {
        cache.append(0, 0, TokenBlock<const float>{x, 5, 1, 2},
                     TokenBlock<const float>{x, 5, 1, 2});
      },
      "append of 5 tokens", "max_append_len 4", "window 8");
  REQUIRE(kvcache::test::cache_contents(cache) == before);
}

TEST_CASE(
    "sliding window crop: rollbacks up to max_append_len always work, deeper ones only "
    "where nothing needed was evicted") {
  auto rng = kvcache::test::make_rng("sliding-crop");
  const std::size_t window = 8, sinks = 2, max_append = 3, dim = 4;
  SlidingWindowCache<float> cache({.num_layers = 2,
                                   .num_kv_heads = 1,
                                   .head_dim = dim,
                                   .window = window,
                                   .num_sink_tokens = sinks,
                                   .max_append_len = max_append});
  const auto kv = kvcache::test::random_kv(rng, 200, 1, dim);
  const AttentionOptions opts{.window = window, .num_sink_tokens = sinks};
  std::size_t len = 0;
  for (int round = 0; round < 60; ++round) {
    const std::size_t n = kvcache::test::uniform(rng, 1, max_append);
    for (std::size_t l = 0; l < 2; ++l) cache.append(l, 0, kv.k_block(len, n), kv.v_block(len, n));
    len += n;
    // speculative rollback of up to max_append tokens: always allowed
    const std::size_t back = kvcache::test::uniform(rng, 0, std::min(max_append, len));
    REQUIRE(cache.can_crop(0, len - back));
    cache.crop(0, len - back);
    len -= back;
    // re-append the same tokens and check attention of the last one against the reference
    if (back > 0) {
      for (std::size_t l = 0; l < 2; ++l)
        cache.append(l, 0, kv.k_block(len, back), kv.v_block(len, back));
      len += back;
    }
    const auto q = kvcache::test::normal_floats(rng, dim);
    std::vector<float> got(dim);
    attend({q, 1, 1, dim}, cache.view(1, 0), {got, 1, 1, dim}, opts);
    const auto expect = kvcache::test::scratch_attention(q, 1, 1, kv.k, kv.v, len, 1, dim,
                                                         static_cast<position_t>(len - 1), opts);
    kvcache::test::require_close(got, expect, Tolerance{2e-5, 2e-5});
  }
  // rolling back far past the ring is refused by name, and changes nothing
  REQUIRE(len > 40);
  REQUIRE_FALSE(cache.can_crop(0, len - 20));
  const auto before = kvcache::test::cache_contents(cache);
  kvcache::test::require_throws<position_error>([&] { cache.crop(0, len - 20); },
                                                "crop of sequence 0", "evicted everything before");
  REQUIRE(kvcache::test::cache_contents(cache) == before);
  // back into the sinks is always possible
  REQUIRE(cache.can_crop(0, sinks));
  cache.crop(0, 1);
  REQUIRE(cache.seq_length(0) == 1);
  REQUIRE(cache.view(0, 0).recent_begin() == 1);
  REQUIRE_FALSE(cache.can_crop(0, 2));  // beyond the length
}

TEST_CASE(
    "sliding window crop guarantee: back to peak - max_append_len always, one further never; "
    "re-attending the last kept token needs one rollback less") {
  auto rng = kvcache::test::make_rng("sliding-crop-boundary");
  const std::size_t window = 8, sinks = 2, max_append = 4, dim = 4, total = 300;
  SlidingWindowCache<float> cache({.num_layers = 2,
                                   .num_kv_heads = 1,
                                   .head_dim = dim,
                                   .window = window,
                                   .num_sink_tokens = sinks,
                                   .max_append_len = max_append});
  const auto kv = kvcache::test::random_kv(rng, total, 1, dim);
  const AttentionOptions opts{.window = window, .num_sink_tokens = sinks};
  const auto append = [&](std::size_t from, std::size_t n) {
    for (std::size_t l = 0; l < 2; ++l)
      cache.append(l, 0, kv.k_block(from, n), kv.v_block(from, n));
  };
  const auto attend_last = [&](std::size_t len) {  // a query at position len - 1
    const auto q = kvcache::test::normal_floats(rng, dim);
    std::vector<float> got(dim);
    attend({q, 1, 1, dim}, cache.view(1, 0), {got, 1, 1, dim}, opts);
    const auto expect = kvcache::test::scratch_attention(q, 1, 1, kv.k, kv.v, len, 1, dim,
                                                         static_cast<position_t>(len - 1), opts);
    kvcache::test::require_close(got, expect, Tolerance{2e-5, 2e-5});
  };

  // Speculative decoding: draft up to max_append tokens, keep some, never roll back below the
  // length before the draft. Round after round every rollback is allowed.
  std::size_t len = 0, peak = 0;
  for (int round = 0; round < 60; ++round) {
    const std::size_t draft = kvcache::test::uniform(rng, 1, max_append);
    append(len, draft);
    peak = std::max(peak, len + draft);
    const std::size_t keep = kvcache::test::uniform(rng, 0, draft);
    REQUIRE(cache.can_crop(0, len + keep));
    cache.crop(0, len + keep);
    len += keep;
    if (keep < draft) {  // the corrected token: appended at len, attends its whole window
      append(len, 1);
      ++len;
    }
    attend_last(len);
  }
  REQUIRE(len > 4 * window);

  // The boundary, both sides: peak - max_append_len is the deepest guaranteed target.
  append(len, max_append);
  len += max_append;
  peak = len;
  for (std::size_t n = peak - max_append; n <= peak; ++n) REQUIRE(cache.can_crop(0, n));
  REQUIRE_FALSE(cache.can_crop(0, peak - max_append - 1));
  REQUIRE(cache.can_crop(0, sinks));

  // Rolled back exactly max_append_len: the next token attends fine, re-attending the last
  // kept one (position n - 1) needs position n - window, which the ring overwrote.
  cache.crop(0, peak - max_append);
  len = peak - max_append;
  {
    const auto q = kvcache::test::normal_floats(rng, dim);
    std::vector<float> out(dim);
    kvcache::test::require_throws<position_error>(
        [&] {
          attend({q, 1, 1, dim}, cache.view(1, 0), {out, 1, 1, dim}, opts);
        },
        "query at position " + std::to_string(len - 1),
        "needs keys [" + std::to_string(len - window) + ", ");
  }
  append(len, 1);
  ++len;
  attend_last(len);

  // Crop back max_append_len, append 1, crop back max_append_len again: past the guarantee
  // (peak - 2 * max_append_len + 1), refused by name, nothing changed.
  REQUIRE(len == peak - max_append + 1);
  REQUIRE_FALSE(cache.can_crop(0, len - max_append));
  const auto before = kvcache::test::cache_contents(cache);
  kvcache::test::require_throws<position_error>([&] { cache.crop(0, len - max_append); },
                                                "crop of sequence 0", "evicted everything before");
  REQUIRE(kvcache::test::cache_contents(cache) == before);

  // Rolled back max_append_len - 1 from a new peak: re-attending the last kept token works.
  append(len, max_append);
  len += max_append;
  cache.crop(0, len - (max_append - 1));
  len -= max_append - 1;
  attend_last(len);
}
