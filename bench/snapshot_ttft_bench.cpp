// SPDX-License-Identifier: Apache-2.0
// Loading a 2048-token system prompt's snapshot against recomputing it, on the synthetic model
// 8L-1024d-16h-4kv: load_snapshot (mmap and read; warm page cache, and cold after
// POSIX_FADV_DONTNEED) vs its prefill, and the TTFT of a 64-token request on top of each.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "llama/forward.hpp"
#include "llama/from_disk.hpp"
#include "llama/model.hpp"

namespace {

constexpr std::size_t kPrefix = 2048, kSuffix = 64;
std::string g_spec = "8L-1024d-16h-4kv";
std::size_t g_threads = std::max(1u, std::thread::hardware_concurrency());

using Cache = kvcache::TokenTrackedCache<kvcache::StaticCache<float>>;

/// The model, a cache holding the 2048-token prompt, its snapshot on disk, and a destination.
struct Fixture {
  std::filesystem::path dir, snapshot;
  std::unique_ptr<kvcache::ThreadPool> pool;
  std::unique_ptr<llama::Model> model;
  std::unique_ptr<llama::Engine> engine;
  std::unique_ptr<Cache> dest;
  kvcache::ModelId id;
  std::vector<llama::token_id> tokens;   // prefix, then suffix
  std::vector<float> recomputed_logits;  // after prefix + suffix, all prefilled
  std::uint64_t file_bytes = 0;
  bool logits_match = false;

  static Fixture& get() {
    static Fixture f;
    return f;
  }

  Fixture() {
    const char* env = std::getenv("KVCACHE_BENCH_DIR");
    dir = std::filesystem::path(env ? env : std::filesystem::temp_directory_path().string()) /
          ("kvcache-snapshot-ttft-bench-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    snapshot = dir / "system.kvs";
    const llama::ModelConfig config = llama::parse_synthetic_spec(g_spec);
    pool = std::make_unique<kvcache::ThreadPool>(g_threads);
    model = std::make_unique<llama::Model>(llama::Model::synthetic(config, 1, pool.get()));
    engine = std::make_unique<llama::Engine>(*model, pool.get(), 256);
    id = llama::synthetic_model_id(config, 1);
    tokens.resize(kPrefix + kSuffix);
    tokens[0] = llama::kBos;
    for (std::size_t i = 1; i < tokens.size(); ++i) {
      tokens[i] = static_cast<llama::token_id>(3 + (i * 7919) % (config.vocab_size - 3));
    }
    dest = std::make_unique<Cache>(make_cache());
    Cache source = make_cache();
    engine->forward(source, 0, prefix());
    source.commit(0, prefix());
    kvcache::save_snapshot(snapshot, source, id);  // durable: its pages are clean
    file_bytes = std::filesystem::file_size(snapshot);
    // The request from disk must give exactly the logits of the recomputed one.
    const auto u = engine->forward(source, 0, suffix());
    recomputed_logits.assign(u.begin(), u.end());
    (void)kvcache::load_snapshot(snapshot, *dest, id);
    const auto c = engine->forward(*dest, 0, suffix());
    logits_match = std::memcmp(c.data(), recomputed_logits.data(), c.size() * sizeof(float)) == 0;
  }
  ~Fixture() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  Fixture(const Fixture&) = delete;
  Fixture& operator=(const Fixture&) = delete;

  [[nodiscard]] Cache make_cache() const {
    const auto& c = model->config();
    return Cache(kvcache::StaticCache<float>({.num_layers = c.num_layers,
                                              .num_kv_heads = c.num_kv_heads,
                                              .head_dim = c.head_dim(),
                                              .max_seq_len = kPrefix + kSuffix}));
  }
  [[nodiscard]] std::span<const llama::token_id> prefix() const {
    return std::span<const llama::token_id>(tokens).first(kPrefix);
  }
  [[nodiscard]] std::span<const llama::token_id> suffix() const {
    return std::span<const llama::token_id>(tokens).subspan(kPrefix);
  }
};

/// Drops the snapshot's pages from the page cache (clean: fsynced by save_snapshot) and returns
/// the fraction of its pages still resident afterwards (mincore): 0 when the drop worked.
double drop_from_page_cache(const std::filesystem::path& path, std::uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t pages = (bytes + page - 1) / page;
  double resident = 1.0;
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  if (p != MAP_FAILED) {
    std::vector<unsigned char> in_core(pages);
    if (::mincore(p, bytes, in_core.data()) == 0) {
      std::size_t n = 0;
      for (unsigned char c : in_core) n += c & 1u;
      resident = static_cast<double>(n) / static_cast<double>(pages);
    }
    ::munmap(p, bytes);
  }
  ::close(fd);
  return resident;
}

// The 2048-token system prompt prefilled into an empty cache.
void BM_Recompute(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) {
    state.PauseTiming();
    f.dest->reset(0);
    state.ResumeTiming();
    benchmark::DoNotOptimize(f.engine->forward(*f.dest, 0, f.prefix()).data());
  }
  state.counters["file_bytes"] = static_cast<double>(f.file_bytes);
}

// The same K/V (and token ids) loaded from the snapshot into the same cache.
void BM_Load(benchmark::State& state) {
  Fixture& f = Fixture::get();
  const auto method = static_cast<kvcache::LoadMethod>(state.range(0));
  const bool cold = state.range(1) != 0;
  double resident = 0;
  for (auto _ : state) {
    state.PauseTiming();
    f.dest->reset(0);
    if (cold) resident = std::max(resident, drop_from_page_cache(f.snapshot, f.file_bytes));
    state.ResumeTiming();
    (void)kvcache::load_snapshot(f.snapshot, *f.dest, f.id, {.method = method});
    benchmark::ClobberMemory();
  }
  if (f.dest->seq_length(0) != kPrefix) state.SkipWithError("the snapshot did not load");
  state.counters["resident_after_drop"] = resident;
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

// TTFT of a request of the system prompt + 64 tokens: loaded from disk (warm, mmap) then the 64
// tokens prefilled, vs all 2112 tokens prefilled.
void BM_TtftFromDisk(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) {
    state.PauseTiming();
    f.dest->reset(0);
    state.ResumeTiming();
    (void)kvcache::load_snapshot(f.snapshot, *f.dest, f.id);
    benchmark::DoNotOptimize(f.engine->forward(*f.dest, 0, f.suffix()).data());
  }
  state.counters["logits_match"] = f.logits_match ? 1 : 0;
}

void BM_TtftRecompute(benchmark::State& state) {
  Fixture& f = Fixture::get();
  for (auto _ : state) {
    state.PauseTiming();
    f.dest->reset(0);
    state.ResumeTiming();
    benchmark::DoNotOptimize(f.engine->forward(*f.dest, 0, f.tokens).data());
  }
}

void configure(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Recompute)->Apply(configure);
// method: 1 = mmap, 2 = read (LoadMethod numbering)
BENCHMARK(BM_Load)->ArgNames({"method", "cold"})->ArgsProduct({{1, 2}, {0, 1}})->Apply(configure);
BENCHMARK(BM_TtftFromDisk)->Apply(configure);
BENCHMARK(BM_TtftRecompute)->Apply(configure);

}  // namespace

int main(int argc, char** argv) {
  // --synthetic=SPEC replaces the model shape; --threads=N (default: all hardware threads).
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--synthetic=", 12) == 0) {
      g_spec = argv[i] + 12;
      (void)llama::parse_synthetic_spec(g_spec);  // reject a bad spec before anything runs
    } else if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      g_threads = static_cast<std::size_t>(std::max(1, std::atoi(argv[i] + 10)));
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  std::printf(
      "snapshot load vs recompute of a %zu-token system prompt, synthetic %s, %zu threads\n",
      kPrefix, g_spec.c_str(), g_threads);
  return kvcache::bench::run_with_summary(
      n, args.data(), [](const kvcache::bench::RatioReporter& r) {
        const auto ms = [&](const std::string& run) {
          return r.figure(run + "/real_time", "real_time_ns");  // in ms: the runs' unit
        };
        const double recompute = ms("BM_Recompute");
        if (recompute == 0) return;
        const llama::ModelConfig c = llama::parse_synthetic_spec(g_spec);
        const double file_mib = r.figure("BM_Recompute/real_time", "file_bytes") / (1 << 20);
        std::printf(
            "snapshot: %.1f MiB (%zu layers x %zu KV heads x head_dim %zu x %zu tokens, fp32 "
            "K and V, plus token ids)\n",
            file_mib, c.num_layers, c.num_kv_heads, c.head_dim(), kPrefix);
        std::printf("%-44s %10s %9s %12s\n", "", "time", "GB/s", "recompute /");
        std::printf("%-44s %8.1fms %9s %12s\n", "recompute: prefill of the 2048 tokens", recompute,
                    "", "1.0x");
        const struct {
          const char* what;
          const char* run;
        } loads[] = {{"load, mmap, warm page cache", "BM_Load/method:1/cold:0"},
                     {"load, read(), warm page cache", "BM_Load/method:2/cold:0"},
                     {"load, mmap, cold (pages dropped)", "BM_Load/method:1/cold:1"},
                     {"load, read(), cold (pages dropped)", "BM_Load/method:2/cold:1"}};
        double worst_resident = 0;
        for (const auto& l : loads) {
          const double t = ms(l.run);
          if (t == 0) continue;
          std::printf("%-44s %8.2fms %9.2f %11.0fx\n", l.what, t,
                      r.figure(std::string(l.run) + "/real_time", "bytes_per_second") / 1e9,
                      recompute / t);
          worst_resident = std::max(
              worst_resident, r.figure(std::string(l.run) + "/real_time", "resident_after_drop"));
        }
        const double disk = ms("BM_TtftFromDisk"), full = ms("BM_TtftRecompute");
        if (disk != 0 && full != 0) {
          std::printf(
              "TTFT of system prompt + %zu tokens: from disk (warm load + %zu-token prefill) "
              "%.1f ms, recomputed (%zu tokens) %.1f ms: %.0fx\n",
              kSuffix, kSuffix, disk, kPrefix + kSuffix, full, full / disk);
          std::printf("logits of the request from disk vs recomputed: %s\n",
                      r.figure("BM_TtftFromDisk/real_time", "logits_match") == 1 ? "bit-identical"
                                                                                 : "DIFFER");
        }
        std::printf(
            "target: load >= 20x faster than recompute. warm = the snapshot is in the page cache "
            "(just written);\ncold = its pages dropped with posix_fadvise(DONTNEED) before each "
            "load (at most %.0f%% of them still resident\nafterwards, by mincore: 0%% means every "
            "cold load read the device).\n",
            100 * worst_resident);
      });
}
