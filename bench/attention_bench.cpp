// SPDX-License-Identifier: Apache-2.0
// Decode attention bandwidth: 1 query token, 32 query heads over 8 KV heads, head_dim 128,
// contexts 1k..32k, float and half K/V, 1 and 2 threads, against a memory-read baseline measured
// in the same run. Each iteration reads another layer of a cache much larger than the last-level
// cache, as a real decode step does, so the figures are DRAM bandwidth, not cache bandwidth.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

namespace {

constexpr std::size_t kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr std::size_t kWorkingSetBytes = std::size_t{3} << 30;  // >> any last-level cache

// One cache at a time (a few GiB), rebuilt when the dtype or context changes.
template <class T>
struct DecodeFixture {
  std::size_t context = 0;
  std::size_t layers = 0;
  std::unique_ptr<kvcache::StaticCache<T>> cache;

  static DecodeFixture& get(std::size_t context) {
    static DecodeFixture f;
    if (f.context != context) {
      f.cache.reset();
      f.context = context;
      const std::size_t per_layer =
          kvcache::kv_cache_bytes(1, kKvHeads, kHeadDim, context, sizeof(T));
      f.layers = std::max<std::size_t>(2, kWorkingSetBytes / per_layer);
      f.cache = std::make_unique<kvcache::StaticCache<T>>(
          kvcache::StaticCacheConfig{.num_layers = f.layers,
                                     .num_kv_heads = kKvHeads,
                                     .head_dim = kHeadDim,
                                     .max_batch = 1,
                                     .max_seq_len = context});
      std::mt19937 rng(42);
      std::normal_distribution<float> dist;
      const std::size_t chunk = std::min<std::size_t>(context, 1024);
      std::vector<float> k(chunk * kKvHeads * kHeadDim), v(k.size());
      for (auto& x : k) x = dist(rng);
      for (auto& x : v) x = dist(rng);
      for (std::size_t l = 0; l < f.layers; ++l) {
        for (std::size_t done = 0; done < context; done += chunk) {
          f.cache->append(l, 0, kvcache::TokenBlock<const float>{k, chunk, kKvHeads, kHeadDim},
                          kvcache::TokenBlock<const float>{v, chunk, kKvHeads, kHeadDim});
        }
      }
    }
    return f;
  }
};

template <class T>
void BM_DecodeAttention(benchmark::State& state) {
  const auto context = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& f = DecodeFixture<T>::get(context);
  kvcache::ThreadPool pool(threads);
  std::vector<float> q(kQHeads * kHeadDim, 0.1f), out(q.size());
  std::size_t layer = 0;
  for (auto _ : state) {
    kvcache::attend({q, 1, kQHeads, kHeadDim}, f.cache->view(layer, 0), {out, 1, kQHeads, kHeadDim},
                    {.pool = &pool});
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    layer = (layer + 1) % f.layers;
  }
  const double bytes =
      static_cast<double>(kvcache::kv_cache_bytes(1, kKvHeads, kHeadDim, context, sizeof(T)));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(bytes * static_cast<double>(state.iterations())));
}

// Memory-read baseline: sum a buffer much larger than the last-level cache with `threads`
// threads, 4 independent accumulators each (vectorisable).
void BM_MemoryRead(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  static std::vector<float> buffer(kWorkingSetBytes / sizeof(float), 1.0f);
  kvcache::ThreadPool pool(threads);
  const std::size_t per = buffer.size() / threads;
  std::vector<float> sums(threads);
  for (auto _ : state) {
    pool.parallel_for(threads, [&](std::size_t t) {
      const float* p = buffer.data() + t * per;
      float a[16] = {};
      for (std::size_t i = 0; i + 16 <= per; i += 16) {
        for (std::size_t j = 0; j < 16; ++j) a[j] += p[i + j];
      }
      float s = 0;
      for (float x : a) s += x;
      sums[t] = s;
    });
    benchmark::DoNotOptimize(sums.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(per * threads * sizeof(float)) *
                          state.iterations());
}

BENCHMARK(BM_MemoryRead)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_DecodeAttention<float>)
    ->ArgNames({"context", "threads"})
    ->ArgsProduct({{1024, 4096, 16384, 32768}, {1, 2}})
    ->UseRealTime();
BENCHMARK(BM_DecodeAttention<kvcache::half>)
    ->ArgNames({"context", "threads"})
    ->ArgsProduct({{1024, 4096, 16384, 32768}, {1, 2}})
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_with_summary(argc, argv, [](const kvcache::bench::RatioReporter& r) {
    std::printf("decode attention bandwidth / memory-read bandwidth (same threads, same run)\n");
    std::printf("%-8s %8s %8s %12s %12s %7s\n", "dtype", "context", "threads", "attn GB/s",
                "read GB/s", "ratio");
    for (const char* dtype : {"float", "kvcache::half"}) {
      for (int ctx : {1024, 4096, 16384, 32768}) {
        for (int t : {1, 2}) {
          const std::string name = std::string("BM_DecodeAttention<") + dtype +
                                   ">/context:" + std::to_string(ctx) +
                                   "/threads:" + std::to_string(t) + "/real_time";
          const double attn = r.figure(name, "bytes_per_second");
          const double read = r.figure("BM_MemoryRead/threads:" + std::to_string(t) + "/real_time",
                                       "bytes_per_second");
          if (attn == 0 || read == 0) continue;
          std::printf("%-8s %8d %8d %12.2f %12.2f %7.3f\n", dtype[0] == 'f' ? "float" : "half", ctx,
                      t, attn / 1e9, read / 1e9, attn / read);
        }
      }
    }
  });
}
