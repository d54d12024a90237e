// SPDX-License-Identifier: Apache-2.0
// PagedCache under concurrency: request threads admit, prefill layer by layer, fork, decode
// (copy-on-write), crop, match and release their own sequences at once over one shared pool with
// shared prompt prefixes and eviction, while another thread reads statistics. Every attention
// equals the from-scratch reference. Run under ThreadSanitizer in CI (ctest label concurrency).
#include <atomic>
#include <thread>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"

using namespace kvcache;
using kvcache::test::uniform;

namespace {

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 8, kBs = 4;
constexpr std::size_t kThreads = 4, kSlotsPerThread = 2, kMaxSeqLen = 64;
const kvcache::test::SyntheticModel kModel{kLayers, kHeads, kDim};

// Appends K/V of positions [first, first + n) layer by layer in random chunks (a chunked
// prefill: every layer gets a chunk before the next chunk starts).
void prefill(PagedCache<half>& cache, std::size_t seq, const std::vector<token_id>& ids,
             std::size_t first, std::size_t n, std::mt19937_64& rng) {
  std::vector<kvcache::test::TokenKV> kv;
  for (std::size_t l = 0; l < kLayers; ++l) kv.push_back(kModel.kv(l, ids, first, n));
  for (std::size_t done = 0; done < n;) {
    const std::size_t c = std::min<std::size_t>(uniform(rng, 1, 9), n - done);
    for (std::size_t l = 0; l < kLayers; ++l) {
      cache.append(l, seq, kv[l].k_block(done, c), kv[l].v_block(done, c));
    }
    done += c;
  }
}

void decode(PagedCache<half>& cache, std::size_t seq, std::vector<token_id>& ids, token_id next,
            std::mt19937_64& rng) {
  ids.push_back(next);
  cache.add_tokens(seq, std::span<const token_id>(&ids.back(), 1));
  prefill(cache, seq, ids, ids.size() - 1, 1, rng);
}

// Attention of the last query over every layer equals the reference; returns mismatches.
std::size_t count_mismatches(const PagedCache<half>& cache, std::size_t seq,
                             const std::vector<token_id>& ids, std::mt19937_64& rng) {
  std::size_t bad = cache.seq_length(seq) == ids.size() ? 0 : 1;
  const std::size_t q_heads = 2 * kHeads;
  const auto q = kvcache::test::normal_floats(rng, q_heads * kDim);
  for (std::size_t l = 0; l < kLayers; ++l) {
    std::vector<float> got(q.size());
    attend({q, 1, q_heads, kDim}, cache.view(l, seq), {got, 1, q_heads, kDim});
    const auto expect = kModel.reference<half>(l, ids, q, 1, q_heads);
    if (!kvcache::test::mismatch_report(got, expect, {2e-5, 2e-5}).empty()) ++bad;
  }
  return bad;
}

}  // namespace

TEST_CASE(
    "request threads share one PagedCache: admit, prefill, fork, decode, crop, match, "
    "release at once; attention stays exact") {
  auto rng = kvcache::test::make_rng("paged-concurrency");
  PagedCache<half> cache({.num_layers = kLayers,
                          .num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .num_blocks = 80,  // below the peak demand: eviction happens
                          .block_size = kBs,
                          .max_batch = kThreads * kSlotsPerThread,
                          .max_seq_len = kMaxSeqLen,
                          .evict_when_full = true});
  std::vector<std::vector<token_id>> system_prompts(3);
  for (auto& p : system_prompts) p = kvcache::test::prompt_with_prefix(rng, {}, 40);
  const std::uint64_t seed = rng();

  std::atomic<std::size_t> mismatches{0}, reused{0}, forks{0}, stats_reads{0}, exhausted{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 r(seed + t);
      const std::size_t a = t * kSlotsPerThread, b = a + 1;
      for (int iter = 0; iter < 400; ++iter) {
        const auto& sys = system_prompts[uniform(r, 0, system_prompts.size() - 1)];
        auto ids = kvcache::test::prompt_with_prefix(
            r, std::vector<token_id>(sys.begin(), sys.begin() + uniform(r, 0, 40)),
            uniform(r, 1, 44));
        const std::size_t probe = cache.match_prefix(ids);
        if (probe % kBs != 0 || probe > ids.size()) ++mismatches;
        try {
          const std::size_t cached = cache.admit(a, ids);
          reused += cached;
          prefill(cache, a, ids, cached, ids.size() - cached, r);
          mismatches += count_mismatches(cache, a, ids, r);
          if (uniform(r, 0, 1) == 0) {  // parallel sampling: fork and decode divergent tokens
            cache.fork(a, b);
            ++forks;
            auto other = ids;
            for (int step = 0; step < 6; ++step) {
              decode(cache, a, ids, static_cast<token_id>(uniform(r, 1, 50)), r);
              decode(cache, b, other, static_cast<token_id>(uniform(r, 1, 50)), r);
            }
            mismatches += count_mismatches(cache, b, other, r);
            cache.release(b);
          }
          if (uniform(r, 0, 2) == 0) {  // speculative rollback
            const std::size_t keep = uniform(r, 0, ids.size());
            cache.crop(a, keep);
            ids.resize(keep);
            decode(cache, a, ids, static_cast<token_id>(uniform(r, 1, 50)), r);
          }
          mismatches += count_mismatches(cache, a, ids, r);
        } catch (const pool_exhausted_error&) {
          // every block is held by a running request: back off (an engine would preempt)
          ++exhausted;
          cache.release(b);
        }
        cache.release(a);
      }
    });
  }
  std::thread observer([&] {
    while (!done.load()) {
      const auto st = cache.stats();
      if (st.blocks_used + st.blocks_cached + st.blocks_free != st.blocks_total ||
          st.reused_tokens > st.prompt_tokens) {
        ++mismatches;
      }
      (void)cache.match_prefix(system_prompts[0]);
      ++stats_reads;
      std::this_thread::yield();
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  observer.join();

  REQUIRE(mismatches.load() == 0);
  REQUIRE(forks.load() > 0);
  REQUIRE(stats_reads.load() > 0);
  const auto st = cache.stats();
  INFO("reused " << reused.load() << " evictions " << st.evictions << " exhausted "
                 << exhausted.load());
  REQUIRE(st.reused_tokens == reused.load());
  REQUIRE(st.reused_tokens > 0);  // the shared system prompts were hit across threads
  REQUIRE(st.evictions > 0);
  REQUIRE(st.cow_copies > 0);
  REQUIRE(st.blocks_used == 0);
  REQUIRE(st.blocks_cached + st.blocks_free == st.blocks_total);
  const std::string problem = cache.check_consistency();
  INFO(problem);
  REQUIRE(problem.empty());
}

TEST_CASE("several threads fork one quiescent sequence at once and write their own copies") {
  auto rng = kvcache::test::make_rng("paged-concurrent-forks");
  PagedCache<half> cache({.num_layers = kLayers,
                          .num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .num_blocks = 64,
                          .block_size = kBs,
                          .max_batch = kThreads + 1,
                          .max_seq_len = kMaxSeqLen,
                          .evict_when_full = true});
  const auto prompt = kvcache::test::prompt_with_prefix(rng, {}, 18);
  REQUIRE(cache.admit(0, prompt) == 0);
  prefill(cache, 0, prompt, 0, prompt.size(), rng);
  const auto source = kvcache::test::cache_contents(cache);
  const std::uint64_t seed = rng();
  std::atomic<std::size_t> mismatches{0};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 r(seed + t);
      const std::size_t dst = t + 1;
      for (int iter = 0; iter < 100; ++iter) {
        cache.fork(0, dst);  // reads sequence 0 while the other threads do too
        auto ids = prompt;
        for (int step = 0; step < 5; ++step) {
          decode(cache, dst, ids, static_cast<token_id>(uniform(r, 1, 50)), r);
        }
        mismatches += count_mismatches(cache, dst, ids, r);
        mismatches += count_mismatches(cache, 0, prompt, r);
        cache.release(dst);
      }
    });
  }
  for (auto& th : threads) th.join();
  REQUIRE(mismatches.load() == 0);
  for (std::size_t l = 0; l < kLayers; ++l) {
    REQUIRE(kvcache::test::view_contents(cache.view(l, 0)) == source[l * (kThreads + 1)]);
  }
  REQUIRE(cache.stats().cow_copies == kThreads * 100);  // each fork's first write copied block 4
  REQUIRE(cache.check_consistency().empty());
}
