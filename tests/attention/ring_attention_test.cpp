// SPDX-License-Identifier: Apache-2.0
// Attention over ring views (SlidingWindowCache): at every ring offset, with sinks shorter and
// longer than a tile, whatever the append sizes, every query's output must be the same bits as
// over the same tokens in a StaticCache attended with the same window and sinks, and match the
// reference. Engines rely on it: moving a model from a static to a sliding-window cache must not
// change one generated token.
#include <algorithm>
#include <span>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;

namespace {

struct Shape {
  std::size_t kv_heads, group, dim;
};

struct Ring {
  std::size_t window, sinks, max_append;
};

// One KV head; an odd head_dim (portable kernel only); a typical GQA layer.
constexpr Shape kShapes[] = {{1, 1, 24}, {2, 4, 64}, {8, 4, 128}};
// Rings whose oldest position moves through every offset within a tile: sinks that end mid-tile,
// sinks longer than a tile (40), sinks of exactly one tile (32), no sinks; one-token decode
// appends and multi-token prefill chunks.
constexpr Ring kRings[] = {{33, 3, 37}, {40, 0, 1}, {20, 40, 7}, {64, 32, 16}, {5, 1, 3}};
constexpr std::size_t kLength = 230;

}  // namespace

TEMPLATE_TEST_CASE(
    "attention over a ring view equals, bit for bit, attention over the same tokens in a static "
    "cache with the same window and sinks",
    "", float, half, bfloat16) {
  auto rng = kvcache::test::make_rng("ring-bits");
  ThreadPool pool(3);
  for (const Shape& shape : kShapes) {
    const std::size_t q_heads = shape.kv_heads * shape.group, dim = shape.dim;
    const auto kv = kvcache::test::random_kv(rng, kLength, shape.kv_heads, dim);
    for (const Ring& ring : kRings) {
      SlidingWindowCache<TestType> sliding({.num_layers = 1,
                                            .num_kv_heads = shape.kv_heads,
                                            .head_dim = dim,
                                            .window = ring.window,
                                            .num_sink_tokens = ring.sinks,
                                            .max_append_len = ring.max_append});
      StaticCache<TestType> contiguous({.num_layers = 1,
                                        .num_kv_heads = shape.kv_heads,
                                        .head_dim = dim,
                                        .max_seq_len = kLength});
      const AttentionOptions mask{.window = ring.window, .num_sink_tokens = ring.sinks};
      // Chunk sizes cycle through 1..max_append, so the ring's offset visits every residue.
      std::size_t done = 0;
      for (std::size_t step = 0; done < kLength; ++step) {
        const std::size_t c = std::min(1 + step * 5 % ring.max_append, kLength - done);
        sliding.append(0, 0, kv.k_block(done, c), kv.v_block(done, c));
        contiguous.append(0, 0, kv.k_block(done, c), kv.v_block(done, c));
        done += c;
        // The last token alone (decode) and the whole chunk (prefill), once if they are the same.
        const std::size_t counts[] = {1, c};
        for (std::size_t n : std::span(counts, c == 1 ? 1 : 2)) {
          INFO("kv_heads " << shape.kv_heads << " group " << shape.group << " dim " << dim
                           << " window " << ring.window << " sinks " << ring.sinks << " max_append "
                           << ring.max_append << " length " << done << " (ring holds ["
                           << sliding.view(0, 0).recent_begin() << ", " << done << ")) queries "
                           << n);
          // One query and (every third length: it is slow) one reference for every kernel.
          const auto q = kvcache::test::normal_floats(rng, n * q_heads * dim);
          const TokenBlock<const float> qb{q, n, q_heads, dim};
          std::vector<float> expect;
          if (done % 3 == 0) {
            expect.resize(q.size());
            reference::attend(qb, sliding.view(0, 0), {expect, n, q_heads, dim}, mask);
          }
          for (cpu::Kernel kernel : kvcache::test::cpu_kernels(dim)) {
            INFO("kernel " << kvcache::test::kernel_name(kernel));
            std::vector<float> flat(q.size());
            cpu::attend(qb, contiguous.view(0, 0), {flat, n, q_heads, dim}, mask, kernel);
            for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
              INFO("threads " << (p == nullptr ? 1 : p->num_threads()));
              AttentionOptions opts = mask;
              opts.pool = p;
              std::vector<float> got(q.size(), -1.0f);
              cpu::attend(qb, sliding.view(0, 0), {got, n, q_heads, dim}, opts, kernel);
              REQUIRE(kvcache::test::same_bits(got, flat));
            }
            if (!expect.empty()) {
              kvcache::test::require_close(flat, expect, {2e-5, 2e-5});
            }
          }
        }
      }
    }
  }
}
