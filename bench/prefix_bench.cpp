// SPDX-License-Identifier: Apache-2.0
// Paged KV cache and prefix caching: prefix lookup for an 8k-token prompt, decode attention over
// a paged view vs the same context in a StaticCache (4k and 16k, 32 q / 8 kv heads, head_dim 128,
// half), and serving throughput of 64 requests sharing a 1k-token system prompt with and without
// prefix caching, on a small synthetic transformer. Ratios are printed at the end.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

namespace {

using kvcache::half;
using kvcache::token_id;
using kvcache::TokenBlock;

std::vector<token_id> random_ids(std::mt19937& rng, std::size_t n, token_id vocab = 32000) {
  std::uniform_int_distribution<token_id> dist(1, vocab - 1);
  std::vector<token_id> ids(n);
  for (auto& t : ids) t = dist(rng);
  return ids;
}

// ---- Prefix lookup ------------------------------------------------------------------------

constexpr std::size_t kLookupTokens = 8192;

// match_prefix of an 8k-token prompt whose blocks are all cached (16-token blocks: 512 hashes
// and id comparisons), and of one that diverges after 4k tokens.
void BM_PrefixLookup(benchmark::State& state) {
  const bool full_hit = state.range(0) == 1;
  kvcache::PagedCache<half> cache({.num_layers = 1,
                                   .num_kv_heads = 1,
                                   .head_dim = 8,
                                   .num_blocks = kLookupTokens / 16 + 1,
                                   .block_size = 16});
  std::mt19937 rng(7);
  const auto prompt = random_ids(rng, kLookupTokens);
  const std::vector<float> kv(kLookupTokens * 8, 0.5f);
  const TokenBlock<const float> block{kv, kLookupTokens, 1, 8};
  (void)cache.admit(0, prompt);
  cache.append(0, 0, block, block);
  auto probe = prompt;
  if (!full_hit) probe[kLookupTokens / 2] += 1;
  const std::size_t expect = full_hit ? kLookupTokens : kLookupTokens / 2;
  for (auto _ : state) {
    const std::size_t hit = cache.match_prefix(probe);
    if (hit != expect) state.SkipWithError("unexpected prefix length");
    benchmark::DoNotOptimize(hit);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(expect));
  state.counters["us_per_lookup"] =
      benchmark::Counter(1e-6 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// ---- Paged vs static decode attention -----------------------------------------------------

constexpr std::size_t kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr std::size_t kWorkingSetBytes = std::size_t{2} << 30;  // per cache, >> last-level cache

// Both caches at once, each cycling through more K/V than any last-level cache holds, so that
// each decode step reads DRAM as a real one does. The paged cache holds two sequences whose
// 16-token blocks were allocated in random interleaving (as concurrent requests leave them), so
// each sequence's blocks are scattered over the pool.
struct DecodeFixture {
  std::size_t context = 0, static_layers = 0, paged_layers = 0;
  std::unique_ptr<kvcache::StaticCache<half>> fixed;
  std::unique_ptr<kvcache::PagedCache<half>> paged;

  static DecodeFixture& get(std::size_t context) {
    static DecodeFixture f;
    if (f.context == context) return f;
    f.fixed.reset();
    f.paged.reset();
    f.context = context;
    const std::size_t per_layer = kvcache::kv_cache_bytes(1, kKvHeads, kHeadDim, context, 2);
    f.static_layers = std::max<std::size_t>(2, kWorkingSetBytes / per_layer);
    f.paged_layers = std::max<std::size_t>(1, f.static_layers / 2);
    f.fixed = std::make_unique<kvcache::StaticCache<half>>(
        kvcache::StaticCacheConfig{.num_layers = f.static_layers,
                                   .num_kv_heads = kKvHeads,
                                   .head_dim = kHeadDim,
                                   .max_batch = 1,
                                   .max_seq_len = context});
    f.paged = std::make_unique<kvcache::PagedCache<half>>(
        kvcache::PagedCacheConfig{.num_layers = f.paged_layers,
                                  .num_kv_heads = kKvHeads,
                                  .head_dim = kHeadDim,
                                  .num_blocks = 2 * context / 16,
                                  .block_size = 16,
                                  .max_batch = 2});
    std::mt19937 rng(42);
    std::normal_distribution<float> dist;
    std::vector<float> k(1024 * kKvHeads * kHeadDim), v(k.size());
    for (auto& x : k) x = dist(rng);
    for (auto& x : v) x = dist(rng);
    const std::size_t chunk = std::min<std::size_t>(context, 1024);
    for (std::size_t l = 0; l < f.static_layers; ++l) {
      for (std::size_t done = 0; done < context; done += chunk) {
        f.fixed->append(l, 0, TokenBlock<const float>{k, chunk, kKvHeads, kHeadDim},
                        TokenBlock<const float>{v, chunk, kKvHeads, kHeadDim});
      }
    }
    const std::size_t row = kKvHeads * kHeadDim;
    const TokenBlock<const float> kb{std::span<const float>(k).first(16 * row), 16, kKvHeads,
                                     kHeadDim};
    const TokenBlock<const float> vb{std::span<const float>(v).first(16 * row), 16, kKvHeads,
                                     kHeadDim};
    std::size_t len[2] = {0, 0};
    while (len[0] < context || len[1] < context) {
      std::size_t s = rng() % 2;
      if (len[s] >= context) s = 1 - s;
      for (std::size_t l = 0; l < f.paged_layers; ++l) f.paged->append(l, s, kb, vb);
      len[s] += 16;
    }
    return f;
  }
};

// Seconds of CPU time the calling thread has used: unlike wall time, not inflated when other
// processes preempt it (the benchmark machine may be shared).
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Each iteration runs one decode step on the static cache and one on the paged cache (each on
// its next layer), timing both: interleaving makes machine noise hit both sides alike. With one
// thread the two are timed in the thread's CPU time, with more in wall time.
void BM_DecodePagedVsStatic(benchmark::State& state) {
  const auto context = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& f = DecodeFixture::get(context);
  kvcache::ThreadPool pool(threads);
  std::vector<float> q(kQHeads * kHeadDim, 0.1f), out(q.size());
  const kvcache::AttentionOptions opts{.pool = &pool};
  std::size_t si = 0, pi = 0;
  double static_s = 0, paged_s = 0;
  const auto now = [threads] {
    return threads == 1
               ? thread_cpu_seconds()
               : std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
                     .count();
  };
  for (auto _ : state) {
    const double t0 = now();
    kvcache::attend({q, 1, kQHeads, kHeadDim}, f.fixed->view(si, 0), {out, 1, kQHeads, kHeadDim},
                    opts);
    benchmark::DoNotOptimize(out.data());
    const double t1 = now();
    kvcache::attend({q, 1, kQHeads, kHeadDim}, f.paged->view(pi / 2, pi % 2),
                    {out, 1, kQHeads, kHeadDim}, opts);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    const double t2 = now();
    static_s += t1 - t0;
    paged_s += t2 - t1;
    si = (si + 1) % f.static_layers;
    pi = (pi + 1) % (2 * f.paged_layers);
  }
  const double bytes =
      static_cast<double>(kvcache::kv_cache_bytes(1, kKvHeads, kHeadDim, context, 2)) *
      static_cast<double>(state.iterations());
  state.counters["static_GBps"] = bytes / static_s / 1e9;
  state.counters["paged_GBps"] = bytes / paged_s / 1e9;
  state.counters["paged_over_static"] = static_s / paged_s;
}

// ---- Serving throughput with and without prefix caching -----------------------------------

// A small transformer without MLP or norms, real enough that prefill costs what it costs: per
// layer, project the hidden states to q, k, v (matrix products), append k, v to the cache, run
// causal attention over the cache, project back and add. K/V of a token therefore depend on
// everything before it, as in a real model. Embeddings and weights are fixed random numbers.
struct TinyModel {
  static constexpr std::size_t kLayers = 2, kModel = 128, kQHeads = 4, kKvHeads = 1, kDim = 32;
  static constexpr std::size_t kQ = kQHeads * kDim, kKv = kKvHeads * kDim;
  static constexpr token_id kVocab = 4096;
  std::vector<float> wq, wk, wv, wo;  // per layer, row-major [in][out]

  TinyModel() {
    std::mt19937 rng(3);
    std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(kModel)));
    for (auto* w : {&wq, &wk, &wv, &wo}) {
      const std::size_t out = w == &wq ? kQ : w == &wo ? kModel : kKv;
      const std::size_t in = w == &wo ? kQ : kModel;
      w->resize(kLayers * in * out);
      for (auto& x : *w) x = dist(rng);
    }
  }

  // y[n][out] = x[n][in] * w[in][out]
  static void matmul(const float* x, const float* w, float* y, std::size_t n, std::size_t in,
                     std::size_t out) {
    for (std::size_t t = 0; t < n; ++t) {
      float* yr = y + t * out;
      std::fill(yr, yr + out, 0.0f);
      for (std::size_t i = 0; i < in; ++i) {
        const float xi = x[t * in + i];
        const float* wr = w + i * out;
        for (std::size_t o = 0; o < out; ++o) yr[o] += xi * wr[o];
      }
    }
  }

  // Runs tokens ids[first..] at positions first.. through every layer of sequence `seq`;
  // returns the next token (a deterministic function of the last hidden state).
  template <class Cache>
  token_id forward(Cache& cache, std::size_t seq, std::span<const token_id> ids,
                   std::size_t first) const {
    const std::size_t n = ids.size() - first;
    std::vector<float> x(n * kModel), q(n * kQ), k(n * kKv), v(n * kKv), att(n * kQ),
        proj(n * kModel);
    for (std::size_t t = 0; t < n; ++t) {
      std::uint64_t s = static_cast<std::uint64_t>(ids[first + t]) * 0x9e3779b97f4a7c15ull;
      for (std::size_t i = 0; i < kModel; ++i) {
        s ^= s >> 29;
        s *= 0xbf58476d1ce4e5b9ull;
        x[t * kModel + i] = static_cast<float>(static_cast<double>(s >> 40) * 0x1p-24 - 0.5) +
                            0.1f * std::sin(static_cast<float>((first + t) * (i + 1)) * 1e-3f);
      }
    }
    for (std::size_t l = 0; l < kLayers; ++l) {
      matmul(x.data(), wq.data() + l * kModel * kQ, q.data(), n, kModel, kQ);
      matmul(x.data(), wk.data() + l * kModel * kKv, k.data(), n, kModel, kKv);
      matmul(x.data(), wv.data() + l * kModel * kKv, v.data(), n, kModel, kKv);
      cache.append(l, seq, TokenBlock<const float>{k, n, kKvHeads, kDim},
                   TokenBlock<const float>{v, n, kKvHeads, kDim});
      kvcache::attend({q, n, kQHeads, kDim}, cache.view(l, seq), {att, n, kQHeads, kDim});
      matmul(att.data(), wo.data() + l * kQ * kModel, proj.data(), n, kQ, kModel);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += proj[i];
    }
    const float* last = x.data() + (n - 1) * kModel;
    std::size_t best = 0;
    for (std::size_t i = 1; i < kModel; ++i) best = last[i] > last[best] ? i : best;
    return static_cast<token_id>((best * 31 + static_cast<std::size_t>(std::fabs(last[0]) * 1e3)) %
                                 kVocab);
  }
};

constexpr std::size_t kRequests = 64, kSystemTokens = 1024, kUserTokens = 64, kNewTokens = 16;

struct ServingResult {
  double seconds = 0, ttft_s = 0;
  std::uint64_t checksum = 0;  // of every generated token: equal with and without caching
  double hit_rate = 0;
};

// 64 requests, one after another, each: admit the full prompt (1k shared system tokens + 64
// user tokens of its own), prefill what is not cached in one chunk, decode 16 tokens, release.
// The same PagedCache both ways; only enable_prefix_caching differs.
ServingResult serve(bool prefix_caching) {
  static const TinyModel model;
  std::mt19937 rng(11);
  const auto system = random_ids(rng, kSystemTokens, TinyModel::kVocab);
  std::vector<std::vector<token_id>> prompts;
  for (std::size_t r = 0; r < kRequests; ++r) {
    auto p = system;
    const auto user = random_ids(rng, kUserTokens, TinyModel::kVocab);
    p.insert(p.end(), user.begin(), user.end());
    prompts.push_back(std::move(p));
  }
  kvcache::PagedCache<float> cache({.num_layers = TinyModel::kLayers,
                                    .num_kv_heads = TinyModel::kKvHeads,
                                    .head_dim = TinyModel::kDim,
                                    .num_blocks = 256,
                                    .block_size = 16,
                                    .max_batch = 1,
                                    .max_seq_len = kSystemTokens + kUserTokens + kNewTokens,
                                    .enable_prefix_caching = prefix_caching,
                                    .evict_when_full = true});
  ServingResult res;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (auto& ids : prompts) {
    const auto t0 = clock::now();
    const std::size_t cached = cache.admit(0, ids);
    token_id next = model.forward(cache, 0, ids, cached);
    res.ttft_s += std::chrono::duration<double>(clock::now() - t0).count();
    for (std::size_t i = 0; i < kNewTokens; ++i) {
      res.checksum = res.checksum * 1000003u + static_cast<std::uint64_t>(next);
      ids.push_back(next);
      cache.add_tokens(0, std::span<const token_id>(&ids.back(), 1));
      if (i + 1 < kNewTokens) next = model.forward(cache, 0, ids, ids.size() - 1);
    }
    cache.release(0);
  }
  res.seconds = std::chrono::duration<double>(clock::now() - start).count();
  res.ttft_s /= kRequests;
  res.hit_rate = cache.stats().hit_rate();
  return res;
}

std::uint64_t g_checksum[2] = {0, 0};

void BM_Serving(benchmark::State& state) {
  const bool caching = state.range(0) == 1;
  ServingResult last;
  double seconds = 0, ttft = 0;
  for (auto _ : state) {
    last = serve(caching);
    seconds += last.seconds;
    ttft += last.ttft_s;
  }
  const auto iters = static_cast<double>(state.iterations());
  g_checksum[caching ? 1 : 0] = last.checksum;
  state.counters["requests_per_s"] = static_cast<double>(kRequests) * iters / seconds;
  state.counters["ttft_ms"] = 1e3 * ttft / iters;
  state.counters["hit_rate"] = last.hit_rate;
}

BENCHMARK(BM_PrefixLookup)->ArgName("full_hit")->Arg(1)->Arg(0)->UseRealTime();
BENCHMARK(BM_DecodePagedVsStatic)
    ->ArgNames({"context", "threads"})
    ->ArgsProduct({{4096, 16384}, {1, 2}})
    ->UseRealTime();
BENCHMARK(BM_Serving)
    ->ArgName("prefix_caching")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_with_summary(argc, argv, [](const kvcache::bench::RatioReporter& r) {
    const double hit = r.figure("BM_PrefixLookup/full_hit:1/real_time", "us_per_lookup");
    if (hit > 0) {
      std::printf(
          "prefix lookup, %zu-token prompt fully cached: %.2f us per lookup (%.1f ns per "
          "token)\n\n",
          kLookupTokens, hit, 1e3 * hit / static_cast<double>(kLookupTokens));
    }
    std::printf(
        "decode attention, paged (16-token blocks) vs static, half, 32 q / 8 kv heads, "
        "head_dim 128,\ninterleaved in one run; timed in thread CPU time with 1 thread, wall "
        "time with 2\n");
    std::printf("%8s %8s %12s %12s %18s\n", "context", "threads", "static GB/s", "paged GB/s",
                "paged / static");
    for (int ctx : {4096, 16384}) {
      for (int t : {1, 2}) {
        const std::string name = "BM_DecodePagedVsStatic/context:" + std::to_string(ctx) +
                                 "/threads:" + std::to_string(t) + "/real_time";
        const double ratio = r.figure(name, "paged_over_static");
        if (ratio == 0) continue;
        std::printf("%8d %8d %12.2f %12.2f %18.3f\n", ctx, t, r.figure(name, "static_GBps"),
                    r.figure(name, "paged_GBps"), ratio);
      }
    }
    const double off = r.figure("BM_Serving/prefix_caching:0/real_time", "requests_per_s");
    const double on = r.figure("BM_Serving/prefix_caching:1/real_time", "requests_per_s");
    if (off > 0 && on > 0) {
      std::printf(
          "\nserving %zu requests sharing a %zu-token system prompt (+%zu own tokens, %zu "
          "generated), synthetic 2-layer model\n",
          kRequests, kSystemTokens, kUserTokens, kNewTokens);
      std::printf("  without prefix caching: %8.2f requests/s, TTFT %7.2f ms\n", off,
                  r.figure("BM_Serving/prefix_caching:0/real_time", "ttft_ms"));
      std::printf("  with prefix caching:    %8.2f requests/s, TTFT %7.2f ms, hit rate %.3f\n", on,
                  r.figure("BM_Serving/prefix_caching:1/real_time", "ttft_ms"),
                  r.figure("BM_Serving/prefix_caching:1/real_time", "hit_rate"));
      std::printf("  throughput ratio with / without: %.2f; generated tokens identical: %s\n",
                  on / off, g_checksum[0] == g_checksum[1] ? "yes" : "NO");
    }
  });
}
