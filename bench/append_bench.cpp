// SPDX-License-Identifier: Apache-2.0
// Append throughput per policy: a 512-token chunk (prefill) and single tokens (decode), float
// input stored as half, 8 KV heads x head_dim 128. Reported as tokens/s and bytes stored/s, next
// to a memcpy of the same bytes measured in the same run.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"

namespace {

using kvcache::half;
constexpr std::size_t kHeads = 8, kDim = 128, kCapacity = 16384;

kvcache::StaticCache<half> make(kvcache::StaticCache<half>*) {
  return kvcache::StaticCache<half>(
      {.num_layers = 1, .num_kv_heads = kHeads, .head_dim = kDim, .max_seq_len = kCapacity});
}
kvcache::DynamicCache<half> make(kvcache::DynamicCache<half>*) {
  return kvcache::DynamicCache<half>(
      {.num_layers = 1, .num_kv_heads = kHeads, .head_dim = kDim, .max_seq_len = kCapacity});
}
kvcache::SlidingWindowCache<half> make(kvcache::SlidingWindowCache<half>*) {
  return kvcache::SlidingWindowCache<half>({.num_layers = 1,
                                            .num_kv_heads = kHeads,
                                            .head_dim = kDim,
                                            .window = 4096,
                                            .num_sink_tokens = 4,
                                            .max_append_len = 512});
}

template <class Cache>
void BM_Append(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  Cache cache = make(static_cast<Cache*>(nullptr));
  std::vector<float> k(n * kHeads * kDim, 0.5f), v(k.size(), -0.5f);
  const kvcache::TokenBlock<const float> kb{k, n, kHeads, kDim}, vb{v, n, kHeads, kDim};
  for (auto _ : state) {
    if (cache.seq_length(0) + n > kCapacity) cache.reset(0);  // static/dynamic: start over
    cache.append(0, 0, kb, vb);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(n) * state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(2 * n * kHeads * kDim * sizeof(half)) *
                          state.iterations());
}

// Baseline: memcpy of the bytes an append stores, into a 16k-token destination like the caches'.
void BM_Memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::size_t bytes = 2 * n * kHeads * kDim * sizeof(half);
  std::vector<char> src(bytes, 1), dst(2 * kCapacity * kHeads * kDim * sizeof(half));
  std::size_t offset = 0;
  for (auto _ : state) {
    if (offset + bytes > dst.size()) offset = 0;
    std::memcpy(dst.data() + offset, src.data(), bytes);
    offset += bytes;
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

BENCHMARK(BM_Memcpy)->ArgName("tokens")->Arg(512)->Arg(1);
BENCHMARK(BM_Append<kvcache::StaticCache<half>>)->ArgName("tokens")->Arg(512)->Arg(1);
BENCHMARK(BM_Append<kvcache::DynamicCache<half>>)->ArgName("tokens")->Arg(512)->Arg(1);
BENCHMARK(BM_Append<kvcache::SlidingWindowCache<half>>)->ArgName("tokens")->Arg(512)->Arg(1);

}  // namespace

int main(int argc, char** argv) {
  return kvcache::bench::run_with_summary(argc, argv, [](const kvcache::bench::RatioReporter& r) {
    std::printf("append (float -> half) bytes/s over memcpy of the same bytes (same run)\n");
    std::printf("%-52s %14s %10s %8s\n", "run", "tokens/s", "GB/s", "ratio");
    for (const auto& [name, figures] : r.all()) {
      if (name.rfind("BM_Append<", 0) != 0) continue;
      const std::string tokens = name.substr(name.rfind('/') + 1);  // "tokens:N"
      const double memcpy_bw = r.figure("BM_Memcpy/" + tokens, "bytes_per_second");
      const double bw = figures.at("bytes_per_second");
      std::printf("%-52s %14.0f %10.2f %8.3f\n", name.c_str(), figures.at("items_per_second"),
                  bw / 1e9, memcpy_bw > 0 ? bw / memcpy_bw : 0.0);
    }
  });
}
