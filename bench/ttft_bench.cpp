// SPDX-License-Identifier: Apache-2.0
// Time to first token of the example engine: a request whose 2048-token prefix (or --prefix=N) is
// already cached plus a 64-token suffix, against the same 2112-token request with nothing cached,
// and against prefilling the 64 tokens alone into an empty cache. Synthetic models, one run.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/kvcache.hpp"
#include "llama/forward.hpp"
#include "llama/model.hpp"

namespace {

constexpr std::size_t kSuffix = 64;
std::size_t g_prefix = 2048;  // tokens of the cached prefix (--prefix=N)

// The example shape, and two layers shaped like Llama-3-8B's (dim 4096, 32 heads of 128,
// 8 KV heads, hidden 14336): what fraction of the FLOPs attention takes depends on the shape.
std::vector<std::string> g_specs = {"8L-1024d-16h-4kv", "2L-4096d-32h-8kv-14336ff"};

std::size_t g_threads = std::max(1u, std::thread::hardware_concurrency());
std::size_t threads() { return g_threads; }

/// One model at a time (the large one takes ~1.7 GiB), with its engine and a cache holding the
/// g_prefix-token prefix.
struct Fixture {
  std::string spec;
  std::unique_ptr<kvcache::ThreadPool> pool;
  std::unique_ptr<llama::Model> model;
  std::unique_ptr<llama::Engine> engine;
  std::unique_ptr<kvcache::StaticCache<float>> cache;
  std::vector<llama::token_id> tokens;  // prefix, then suffix
  bool logits_match = false;

  static Fixture& get(const std::string& spec) {
    static Fixture f;
    if (f.spec != spec) {
      f = Fixture{};
      f.spec = spec;
      const auto config = llama::parse_synthetic_spec(spec);
      f.pool = std::make_unique<kvcache::ThreadPool>(threads());
      f.model = std::make_unique<llama::Model>(llama::Model::synthetic(config, 1, f.pool.get()));
      f.engine = std::make_unique<llama::Engine>(*f.model, f.pool.get(), 256);
      f.cache = std::make_unique<kvcache::StaticCache<float>>(
          kvcache::StaticCacheConfig{.num_layers = config.num_layers,
                                     .num_kv_heads = config.num_kv_heads,
                                     .head_dim = config.head_dim(),
                                     .max_seq_len = g_prefix + kSuffix});
      f.tokens.resize(g_prefix + kSuffix);
      for (std::size_t i = 0; i < f.tokens.size(); ++i) {
        f.tokens[i] = static_cast<llama::token_id>(3 + (i * 7919) % (config.vocab_size - 3));
      }
      // The cached request must give exactly the logits of the uncached one.
      const auto u = f.engine->forward(*f.cache, 0, f.tokens);
      const std::vector<float> uncached(u.begin(), u.end());
      f.cache->crop(0, g_prefix);
      const auto c = f.engine->forward(*f.cache, 0, f.suffix());
      f.logits_match = std::memcmp(c.data(), uncached.data(), uncached.size() * 4) == 0;
    }
    return f;
  }
  [[nodiscard]] std::span<const llama::token_id> suffix() const {
    return std::span<const llama::token_id>(tokens).subspan(g_prefix);
  }
};

void report(benchmark::State& state, const Fixture& f, std::size_t tokens_run) {
  state.counters["tokens_run"] = static_cast<double>(tokens_run);
  state.counters["logits_match"] = f.logits_match ? 1 : 0;
}

// The request with nothing cached: all g_prefix + 64 tokens are prefilled.
void uncached(benchmark::State& state, const std::string& spec) {
  Fixture& f = Fixture::get(spec);
  for (auto _ : state) {
    state.PauseTiming();
    f.cache->reset(0);
    state.ResumeTiming();
    benchmark::DoNotOptimize(f.engine->forward(*f.cache, 0, f.tokens).data());
  }
  report(state, f, g_prefix + kSuffix);
}

// The same request with its g_prefix-token prefix cached: only the 64-token suffix runs.
void cached(benchmark::State& state, const std::string& spec) {
  Fixture& f = Fixture::get(spec);
  for (auto _ : state) {
    state.PauseTiming();
    if (f.cache->seq_length(0) < g_prefix) {
      f.cache->reset(0);
      f.engine->forward(*f.cache, 0, std::span<const llama::token_id>(f.tokens).first(g_prefix));
    }
    f.cache->crop(0, g_prefix);
    state.ResumeTiming();
    benchmark::DoNotOptimize(f.engine->forward(*f.cache, 0, f.suffix()).data());
  }
  report(state, f, kSuffix);
}

// The 64-token suffix alone, into an empty cache: the floor a cached request can approach.
void empty64(benchmark::State& state, const std::string& spec) {
  Fixture& f = Fixture::get(spec);
  for (auto _ : state) {
    state.PauseTiming();
    f.cache->reset(0);
    state.ResumeTiming();
    benchmark::DoNotOptimize(f.engine->forward(*f.cache, 0, f.suffix()).data());
  }
  report(state, f, kSuffix);
}

std::string name(const std::string& kind, const std::string& spec) {
  return "TTFT/" + kind + "/" + spec;
}
// The runs' kinds: "uncached_2112" and "cached_2048+64" with the default prefix.
std::string uncached_kind() { return "uncached_" + std::to_string(g_prefix + kSuffix); }
std::string cached_kind() {
  return "cached_" + std::to_string(g_prefix) + "+" + std::to_string(kSuffix);
}

/// FLOPs of one request: linear layers over `n` tokens plus attention of n queries ending at
/// position `end` (causal).
struct Flops {
  double linear = 0, attention = 0;
};
Flops request_flops(const llama::ModelConfig& c, std::size_t n, std::size_t end) {
  const double d = static_cast<double>(c.dim), kv = static_cast<double>(c.kv_dim());
  const double h = static_cast<double>(c.hidden_dim);
  const double per_token = 2 * (d * (d + 2 * kv) + d * d + 2 * d * h + h * d);
  double keys = 0;  // sum over the queries of the keys each sees
  for (std::size_t p = end - n; p < end; ++p) keys += static_cast<double>(p + 1);
  const double layers = static_cast<double>(c.num_layers);
  return {layers * per_token * static_cast<double>(n) + 2 * d * static_cast<double>(c.vocab_size),
          layers * 4 * d * keys};
}

}  // namespace

int main(int argc, char** argv) {
  // --synthetic=SPEC (repeatable) replaces the default model shapes; --threads=N (default: all
  // hardware threads); --prefix=N (default 2048) the cached prefix's length.
  std::vector<char*> args;
  std::vector<std::string> specs;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--synthetic=", 12) == 0) {
      specs.emplace_back(argv[i] + 12);
    } else if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      g_threads = std::max(1, std::atoi(argv[i] + 10));
    } else if (std::strncmp(argv[i], "--prefix=", 9) == 0) {
      g_prefix = static_cast<std::size_t>(std::max(1, std::atoi(argv[i] + 9)));
    } else {
      args.push_back(argv[i]);
    }
  }
  if (!specs.empty()) g_specs = specs;
  for (const std::string& spec : g_specs) {
    (void)llama::parse_synthetic_spec(spec);  // reject a bad spec before anything runs
    benchmark::RegisterBenchmark(name(uncached_kind(), spec).c_str(), uncached, spec)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark(name(cached_kind(), spec).c_str(), cached, spec)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(2.0);
    benchmark::RegisterBenchmark(name("empty_cache_64", spec).c_str(), empty64, spec)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(2.0);
  }
  int n = static_cast<int>(args.size());
  std::printf("TTFT of a request with a %zu-token cached prefix + %zu new tokens, %zu threads\n",
              g_prefix, kSuffix, threads());
  return kvcache::bench::run_with_summary(
      n, args.data(), [](const kvcache::bench::RatioReporter& r) {
        std::printf(
            "ratios measured in this run (targets: speedup >= 10, cached / empty <= 1.3)\n");
        std::printf("%-26s %10s %10s %10s %9s %15s %12s %8s\n", "model", "uncached", "cached",
                    "empty 64", "speedup", "cached / empty", "attn share", "logits");
        for (const std::string& spec : g_specs) {
          // Run names carry decorations (/min_time:..., /real_time): match on the prefix.
          const auto figure = [&](const std::string& kind, const char* counter) {
            for (const auto& [run, figures] : r.all()) {
              if (run.rfind(name(kind, spec) + "/", 0) == 0 && figures.count(counter) != 0) {
                return figures.at(counter);
              }
            }
            return 0.0;
          };
          const double u = figure(uncached_kind(), "real_time_ns");  // in ms: the runs' unit
          const double c = figure(cached_kind(), "real_time_ns");
          const double e = figure("empty_cache_64", "real_time_ns");
          if (u == 0 || c == 0 || e == 0) continue;
          const Flops fc =
              request_flops(llama::parse_synthetic_spec(spec), kSuffix, g_prefix + kSuffix);
          const bool match = figure(cached_kind(), "logits_match") == 1;
          std::printf("%-26s %8.1fms %8.1fms %8.1fms %8.1fx %15.3f %11.0f%% %8s\n", spec.c_str(), u,
                      c, e, u / c, c / e, 100 * fc.attention / (fc.attention + fc.linear),
                      match ? "same" : "DIFFER");
        }
        std::printf(
            "attn share: attention's part of the cached request's FLOPs (its %zu queries see ~%zu "
            "keys);\nthe empty-cache prefill has almost none, so cached / empty >= 1 + that share "
            "over\nthe linear part's. logits: the cached request's logits are bit-identical to the "
            "uncached ones.\n",
            kSuffix, g_prefix + kSuffix / 2);
      });
}
