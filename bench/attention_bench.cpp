// SPDX-License-Identifier: Apache-2.0
// Decode attention bandwidth: 1 query token, 32 query heads over 8 KV heads, head_dim 128,
// contexts 1k..32k, float, half, int8 and fp8 K/V and half keys with int8 values, 1 and 2 threads,
// each SIMD kernel the CPU has (AVX2, AVX-512), against a memory-read baseline and an FMA-peak
// baseline measured in the same run. Each iteration reads another layer of a cache much larger than
// the last-level cache, as a real decode step does, so the figures are DRAM bandwidth, not cache
// bandwidth. Also: sliding decode with cache-relative positions over absolute ones.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

#if KVCACHE_X86_DISPATCH
#include <immintrin.h>
#endif

namespace {

constexpr std::size_t kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr std::size_t kWorkingSetBytes = std::size_t{3} << 30;  // >> any last-level cache

// A StaticCache of `layers` layers, each holding `context` tokens of random K/V (one 1024-token
// chunk, repeated). @pre context is a multiple of min(context, 1024).
template <class T>
std::unique_ptr<kvcache::StaticCache<T>> random_cache(std::size_t layers, std::size_t context) {
  auto cache =
      std::make_unique<kvcache::StaticCache<T>>(kvcache::StaticCacheConfig{.num_layers = layers,
                                                                           .num_kv_heads = kKvHeads,
                                                                           .head_dim = kHeadDim,
                                                                           .max_seq_len = context});
  std::mt19937 rng(42);
  std::normal_distribution<float> dist;
  const std::size_t chunk = std::min<std::size_t>(context, 1024);
  std::vector<float> k(chunk * kKvHeads * kHeadDim), v(k.size());
  for (auto& x : k) x = dist(rng);
  for (auto& x : v) x = dist(rng);
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t done = 0; done < context; done += chunk) {
      cache->append(l, 0, kvcache::TokenBlock<const float>{k, chunk, kKvHeads, kHeadDim},
                    kvcache::TokenBlock<const float>{v, chunk, kKvHeads, kHeadDim});
    }
  }
  return cache;
}

// Bytes of one layer of `context` tokens in format F (a KVFormats pair: its K half and its V
// half), the int8/fp8 rows' scales included.
template <class F>
std::size_t layer_bytes(std::size_t context) {
  const auto bytes = [&](kvcache::DType t) {
    return kvcache::kv_cache_bytes({1, kKvHeads, kHeadDim, t}, context);
  };
  return (bytes(kvcache::dtype_of<kvcache::key_format_t<F>>) +
          bytes(kvcache::dtype_of<kvcache::value_format_t<F>>)) /
         2;
}

// Half keys with int8 values: the pair attention reads through a KVFormats view.
using HalfKeysInt8Values = kvcache::KVFormats<kvcache::half, kvcache::qint8>;

// One cache at a time (a few GiB), rebuilt when the format or context changes. A KVFormats pair
// keeps its keys in a cache of the key format and its values in one of the value format (the
// same appends), read as one view of the pair.
template <class F>
struct DecodeFixture {
  using K = kvcache::key_format_t<F>;
  using V = kvcache::value_format_t<F>;
  std::size_t context = 0;
  std::size_t layers = 0;
  std::unique_ptr<kvcache::StaticCache<K>> keys;
  std::unique_ptr<kvcache::StaticCache<V>> values;  // pairs only

  static DecodeFixture& get(std::size_t context) {
    static DecodeFixture f;
    if (f.context != context) {
      f.keys.reset();
      f.values.reset();
      f.context = context;
      const std::size_t per_layer = layer_bytes<F>(context);
      f.layers = std::max<std::size_t>(2, kWorkingSetBytes / per_layer);
      f.keys = random_cache<K>(f.layers, context);
      if constexpr (!std::is_same_v<F, K>) f.values = random_cache<V>(f.layers, context);
    }
    return f;
  }

  // The view of one layer: the cache's own, or the pair's keys and values as one segment.
  [[nodiscard]] auto view(std::size_t layer) const {
    if constexpr (std::is_same_v<F, K>) {
      return keys->view(layer, 0);
    } else {
      const auto k = keys->view(layer, 0).segment(0);
      const auto v = values->view(layer, 0).segment(0);
      kvcache::SegmentView<F, 1> pair(kKvHeads, kHeadDim, static_cast<kvcache::position_t>(context),
                                      0, 0);
      pair.push({k.k, v.v, k.head_stride, k.first_pos, k.len, k.k_scale, v.v_scale});
      return pair;
    }
  }
};

// Memory-read baseline: sums the K and V rows of one layer of the cache as 64-bit integers, with
// `threads` threads (KV heads split between them as attention splits them) and 8 independent
// accumulators each (vectorisable). The same bytes, in the same allocation, that an attention call
// over that layer reads (int8/fp8: the codes, not the scales beside them, 1.5% of the bytes), so
// where the pages happen to lie affects both sides alike. Returns the seconds it took.
template <kvcache::KVView V>
double read_layer(kvcache::ThreadPool& pool, std::size_t threads, const V& view) {
  using F = typename V::value_type;
  const auto seg = view.segment(0);  // a StaticCache view (or a pair of them): one segment
  const std::size_t elements = seg.len * view.head_dim();
  const std::size_t heads = view.num_kv_heads();
  std::uint64_t sums[64] = {};
  const auto start = std::chrono::steady_clock::now();
  pool.parallel_for(threads, [&](std::size_t t) {
    std::uint64_t a[8] = {};
    const auto sum = [&a](const void* rows, std::size_t bytes) {
      const auto* p = static_cast<const std::uint64_t*>(rows);
      const std::size_t words = bytes / sizeof(std::uint64_t);
      for (std::size_t i = 0; i + 8 <= words; i += 8) {
        for (std::size_t j = 0; j < 8; ++j) a[j] += p[i + j];
      }
    };
    for (std::size_t h = t; h < heads; h += threads) {
      sum(seg.k + h * seg.head_stride, elements * sizeof(kvcache::key_format_t<F>));
      sum(seg.v + h * seg.head_stride, elements * sizeof(kvcache::value_format_t<F>));
    }
    for (std::uint64_t x : a) sums[t] += x;
  });
  benchmark::DoNotOptimize(sums);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The kernel of a `simd` argument: its vector width in bits.
kvcache::cpu::Kernel kernel_of(std::int64_t simd_bits) {
  return simd_bits == 512 ? kvcache::cpu::Kernel::avx512 : kvcache::cpu::Kernel::avx2;
}

const char* kernel_name(int simd_bits) { return simd_bits == 512 ? "avx512" : "avx2"; }

// contexts x threads x the SIMD widths this CPU runs.
void add_args(benchmark::internal::Benchmark* b, std::initializer_list<std::int64_t> contexts) {
  b->ArgNames({"context", "threads", "simd"});
  for (std::int64_t context : contexts) {
    for (std::int64_t threads : {1, 2}) {
      if (kvcache::cpu::avx2_supported(kHeadDim)) b->Args({context, threads, 256});
      if (kvcache::cpu::avx512_supported(kHeadDim)) b->Args({context, threads, 512});
    }
  }
}

// Each iteration reads one layer through the read baseline (half the cache away from the next),
// then runs the attention call over the next layer; only the latter is the iteration's (manual)
// time. The two alternate within milliseconds, so a noisy neighbour slows both alike and the ratio
// holds where two separately timed benchmarks can disagree by 2x on a shared machine.
template <class F>
void BM_DecodeAttention(benchmark::State& state) {
  const auto context = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const kvcache::cpu::Kernel kernel = kernel_of(state.range(2));
  auto& f = DecodeFixture<F>::get(context);
  kvcache::ThreadPool pool(threads);
  std::vector<float> q(kQHeads * kHeadDim, 0.1f), out(q.size());
  const std::size_t bytes = layer_bytes<F>(context);
  const std::size_t read_bytes =
      context * kKvHeads * kHeadDim *
      (sizeof(kvcache::key_format_t<F>) + sizeof(kvcache::value_format_t<F>));
  std::size_t layer = 0;
  double read_seconds = 0, attend_seconds = 0;
  for (auto _ : state) {
    read_seconds += read_layer(pool, threads, f.view((layer + f.layers / 2) % f.layers));
    const auto start = std::chrono::steady_clock::now();
    kvcache::cpu::attend({q, 1, kQHeads, kHeadDim}, f.view(layer), {out, 1, kQHeads, kHeadDim},
                         {.pool = &pool}, kernel);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    attend_seconds += seconds;
    layer = (layer + 1) % f.layers;
  }
  const double iterations = static_cast<double>(state.iterations());
  const double total = static_cast<double>(bytes) * iterations;
  state.SetBytesProcessed(static_cast<std::int64_t>(total));
  state.counters["read_GBps"] = static_cast<double>(read_bytes) * iterations / read_seconds / 1e9;
  state.counters["ratio"] = total / attend_seconds / 1e9 / state.counters["read_GBps"];
  // 4 query heads share each K/V row: 4 FMAs per K or V element read
  const double elements = 2.0 * kKvHeads * static_cast<double>(context) * kHeadDim;
  state.counters["GFMAps"] = 4.0 * elements * iterations / attend_seconds / 1e9;
}

void decode_args(benchmark::internal::Benchmark* b) { add_args(b, {1024, 4096, 16384, 32768}); }
BENCHMARK(BM_DecodeAttention<float>)->Apply(decode_args)->UseManualTime();
BENCHMARK(BM_DecodeAttention<kvcache::half>)->Apply(decode_args)->UseManualTime();
BENCHMARK(BM_DecodeAttention<kvcache::qint8>)->Apply(decode_args)->UseManualTime();
BENCHMARK(BM_DecodeAttention<kvcache::fp8_e4m3>)->Apply(decode_args)->UseManualTime();
BENCHMARK(BM_DecodeAttention<HalfKeysInt8Values>)->Apply(decode_args)->UseManualTime();

#if KVCACHE_X86_DISPATCH
// FMA-peak baseline: 24 independent chains of vector FMAs per thread (enough to cover the latency
// on two FMA pipes); each returns the fp32 FMAs (lanes) it did. One function per vector width:
// the intrinsics need their target on the function that calls them.
__attribute__((target("avx2,fma"))) double fma_peak_256(std::size_t rounds) {
  const __m256 step = _mm256_set1_ps(0.999999f), seed = _mm256_set1_ps(1.0f);
  __m256 acc[24];
  for (auto& a : acc) a = seed;
  for (std::size_t i = 0; i < rounds; ++i) {
#pragma GCC unroll 24
    for (auto& a : acc) a = _mm256_fmadd_ps(a, step, seed);
  }
  for (std::size_t i = 1; i < 24; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  benchmark::DoNotOptimize(acc[0]);
  return static_cast<double>(rounds) * 24 * 8;
}
__attribute__((target("avx512f"))) double fma_peak_512(std::size_t rounds) {
  const __m512 step = _mm512_set1_ps(0.999999f), seed = _mm512_set1_ps(1.0f);
  __m512 acc[24];
  for (auto& a : acc) a = seed;
  for (std::size_t i = 0; i < rounds; ++i) {
#pragma GCC unroll 24
    for (auto& a : acc) a = _mm512_fmadd_ps(a, step, seed);
  }
  for (std::size_t i = 1; i < 24; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  benchmark::DoNotOptimize(acc[0]);
  return static_cast<double>(rounds) * 24 * 16;
}

void BM_FmaPeak(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(1));
  const bool wide = state.range(2) == 512;
  kvcache::ThreadPool pool(threads);
  double fmas = 0;
  for (auto _ : state) {
    double done[64] = {};
    pool.parallel_for(threads, [&](std::size_t t) {
      done[t] = wide ? fma_peak_512(1u << 20) : fma_peak_256(1u << 20);
    });
    for (std::size_t t = 0; t < threads; ++t) fmas += done[t];
  }
  state.counters["GFMAps"] = benchmark::Counter(fmas / 1e9, benchmark::Counter::kIsRate);
}
void fma_args(benchmark::internal::Benchmark* b) { add_args(b, {0}); }
BENCHMARK(BM_FmaPeak)->Apply(fma_args)->UseRealTime();
#endif

// The kernel's ceiling: the same decode over one layer of 1024 tokens (4 MiB of half K/V),
// attended again and again so that it stays in the last-level cache. Where this rate is close to
// the DRAM read rate, decode is bound by arithmetic, not by memory.
template <class F>
void BM_DecodeInCache(benchmark::State& state) {
  const auto context = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  const kvcache::cpu::Kernel kernel = kernel_of(state.range(2));
  const auto cache = random_cache<F>(1, context);
  kvcache::ThreadPool pool(threads);
  std::vector<float> q(kQHeads * kHeadDim, 0.1f), out(q.size());
  for (auto _ : state) {
    kvcache::cpu::attend({q, 1, kQHeads, kHeadDim}, cache->view(0, 0), {out, 1, kQHeads, kHeadDim},
                         {.pool = &pool}, kernel);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(layer_bytes<F>(context) *
                                                    static_cast<std::size_t>(state.iterations())));
}
void in_cache_args(benchmark::internal::Benchmark* b) { add_args(b, {1024}); }
BENCHMARK(BM_DecodeInCache<kvcache::half>)->Apply(in_cache_args)->UseRealTime();
BENCHMARK(BM_DecodeInCache<kvcache::qint8>)->Apply(in_cache_args)->UseRealTime();
BENCHMARK(BM_DecodeInCache<kvcache::fp8_e4m3>)->Apply(in_cache_args)->UseRealTime();

// Decode over a sliding window (4096 + 4 sinks, wrapped: 16k tokens appended) with absolute or
// cache-relative positions (PositionMode): what turning the query back for the sinks costs.
void BM_SlidingDecode(benchmark::State& state) {
  const bool relative = state.range(0) != 0;
  constexpr std::size_t kWindow = 4096, kSinks = 4, kAppended = 16384, kChunk = 1024;
  kvcache::SlidingWindowCache<kvcache::half> cache({.num_layers = 1,
                                                    .num_kv_heads = kKvHeads,
                                                    .head_dim = kHeadDim,
                                                    .window = kWindow,
                                                    .num_sink_tokens = kSinks,
                                                    .max_append_len = kChunk});
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> kv(kChunk * kKvHeads * kHeadDim);
  for (auto& x : kv) x = dist(rng);
  for (std::size_t done = 0; done < kAppended; done += kChunk) {
    cache.append(0, 0, kvcache::TokenBlock<const float>{kv, kChunk, kKvHeads, kHeadDim},
                 kvcache::TokenBlock<const float>{kv, kChunk, kKvHeads, kHeadDim});
  }
  const kvcache::Rope rope({}, kHeadDim);
  const kvcache::AttentionOptions opts{.window = kWindow,
                                       .num_sink_tokens = kSinks,
                                       .positions = relative ? kvcache::PositionMode::cache_relative
                                                             : kvcache::PositionMode::absolute,
                                       .rope = &rope};
  std::vector<float> q(kQHeads * kHeadDim, 0.1f), out(q.size());
  for (auto _ : state) {
    kvcache::attend({q, 1, kQHeads, kHeadDim}, cache.view(0, 0), {out, 1, kQHeads, kHeadDim}, opts);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_SlidingDecode)->ArgName("relative")->Arg(0)->Arg(1)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_with_summary(argc, argv, [](const kvcache::bench::RatioReporter& r) {
    std::printf(
        "decode attention bandwidth / memory-read bandwidth (same threads, the same bytes "
        "read alternately in one run)\n");
    std::printf(
        "(speed: the half decode's time over this one's, same context, threads and kernel; "
        "FMA: the decode's fp32 FMA rate over the FMA peak measured in this run; f16+i8: half "
        "keys with int8 values, KVFormats<half, qint8>)\n");
    std::printf("%-6s %8s %8s %7s %11s %11s %7s %7s %10s %7s\n", "format", "context", "threads",
                "kernel", "attn GB/s", "read GB/s", "ratio", "speed", "GFMA/s", "FMA");
    const std::pair<const char*, const char*> formats[] = {{"float", "float"},
                                                           {"half", "kvcache::half"},
                                                           {"int8", "kvcache::qint8"},
                                                           {"fp8", "kvcache::fp8_e4m3"},
                                                           {"f16+i8", "HalfKeysInt8Values"}};
    for (const auto& [label, type] : formats) {
      for (int ctx : {1024, 4096, 16384, 32768}) {
        for (int t : {1, 2}) {
          for (int simd : {256, 512}) {
            const std::string tail = ">/context:" + std::to_string(ctx) +
                                     "/threads:" + std::to_string(t) +
                                     "/simd:" + std::to_string(simd) + "/manual_time";
            const std::string name = std::string("BM_DecodeAttention<") + type + tail;
            const double attn = r.figure(name, "bytes_per_second");
            if (attn == 0) continue;
            const double half_time =
                r.figure("BM_DecodeAttention<kvcache::half" + tail, "real_time_ns");
            const double peak = r.figure("BM_FmaPeak/context:0/threads:" + std::to_string(t) +
                                             "/simd:" + std::to_string(simd) + "/real_time",
                                         "GFMAps");
            const double gfma = r.figure(name, "GFMAps");
            std::printf("%-6s %8d %8d %7s %11.2f %11.2f %7.3f %7.3f %10.1f %7.3f\n", label, ctx, t,
                        kernel_name(simd), attn / 1e9, r.figure(name, "read_GBps"),
                        r.figure(name, "ratio"), half_time / r.figure(name, "real_time_ns"), gfma,
                        peak > 0 ? gfma / peak : 0.0);
          }
        }
      }
    }
    std::printf(
        "\nthe kernel's ceiling: 1024 tokens attended over and over from the last-level cache, "
        "over the DRAM read rate of the same format's 16k-token rows\n");
    std::printf("%-6s %8s %7s %16s %12s %7s\n", "format", "threads", "kernel", "in-cache GB/s",
                "read GB/s", "ratio");
    for (const auto& [label, type] : formats) {
      for (int t : {1, 2}) {
        for (int simd : {256, 512}) {
          const std::string tail =
              ">/context:1024/threads:" + std::to_string(t) + "/simd:" + std::to_string(simd);
          const double in_cache = r.figure(
              std::string("BM_DecodeInCache<") + type + tail + "/real_time", "bytes_per_second");
          const double read = r.figure(std::string("BM_DecodeAttention<") + type +
                                           ">/context:16384/threads:" + std::to_string(t) +
                                           "/simd:" + std::to_string(simd) + "/manual_time",
                                       "read_GBps");
          if (in_cache == 0 || read == 0) continue;
          std::printf("%-6s %8d %7s %16.2f %12.2f %7.3f\n", label, t, kernel_name(simd),
                      in_cache / 1e9, read, in_cache / 1e9 / read);
        }
      }
    }
    const double absolute = r.figure("BM_SlidingDecode/relative:0/real_time", "real_time_ns");
    const double relative = r.figure("BM_SlidingDecode/relative:1/real_time", "real_time_ns");
    if (absolute != 0 && relative != 0) {
      std::printf(
          "\nsliding decode (window 4096 + 4 sinks, half, 1 thread): cache-relative / absolute "
          "positions time %.3f\n",
          relative / absolute);
    }
  });
}
