// SPDX-License-Identifier: Apache-2.0
// Snapshot save and load throughput for a Llama-3-8B-shaped 2048-token fp16 StaticCache (256 MiB
// of K/V), next to a plain write() / read() of a file of the same size measured in the same run,
// warm (the file is in the page cache) and cold (its pages dropped with POSIX_FADV_DONTNEED).
// Also a load into a DynamicCache that reuses its chunks, next to one into a fresh DynamicCache.
// Files go to $KVCACHE_BENCH_DIR (default: the system temp directory).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"

namespace {

using kvcache::half;
constexpr std::size_t kLayers = 32, kKvHeads = 8, kHeadDim = 128, kTokens = 2048;
const kvcache::ModelId kModel("llama-3-8b-shaped synthetic");

kvcache::StaticCache<half> make_cache() {
  return kvcache::StaticCache<half>({.num_layers = kLayers,
                                     .num_kv_heads = kKvHeads,
                                     .head_dim = kHeadDim,
                                     .max_batch = 1,
                                     .max_seq_len = kTokens});
}

/// The saved cache, its snapshot on disk, a same-sized plain file, and a destination cache.
struct Fixture {
  std::filesystem::path dir;
  std::filesystem::path snapshot, plain;
  std::unique_ptr<kvcache::StaticCache<half>> source, dest;
  std::vector<std::byte> buffer;  // plain-file contents / read target, pre-touched
  std::uint64_t file_bytes = 0;

  static Fixture& get() {
    static Fixture f;
    return f;
  }

  Fixture() {
    const char* env = std::getenv("KVCACHE_BENCH_DIR");
    dir = std::filesystem::path(env ? env : std::filesystem::temp_directory_path().string()) /
          ("kvcache-snapshot-bench-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    snapshot = dir / "prompt.kvs";
    plain = dir / "plain.bin";
    source = std::make_unique<kvcache::StaticCache<half>>(make_cache());
    dest = std::make_unique<kvcache::StaticCache<half>>(make_cache());
    std::mt19937 rng(7);
    std::normal_distribution<float> dist;
    const std::size_t chunk = 256;
    std::vector<float> k(chunk * kKvHeads * kHeadDim), v(k.size());
    for (auto& x : k) x = dist(rng);
    for (auto& x : v) x = dist(rng);
    for (std::size_t l = 0; l < kLayers; ++l) {
      for (std::size_t t = 0; t < kTokens; t += chunk) {
        source->append(l, 0, kvcache::TokenBlock<const float>{k, chunk, kKvHeads, kHeadDim},
                       kvcache::TokenBlock<const float>{v, chunk, kKvHeads, kHeadDim});
      }
    }
    kvcache::save_snapshot(snapshot, *source, kModel);
    file_bytes = std::filesystem::file_size(snapshot);
    buffer.assign(file_bytes, std::byte{0x3c});
    write_plain(false);
  }
  ~Fixture() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  void write_plain(bool durable) const {
    const int fd = ::open(plain.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) std::abort();
    kvcache::detail::write_all(fd, buffer.data(), buffer.size(), plain);
    if (durable) kvcache::detail::fsync_checked(fd, plain);
    ::close(fd);
  }
};

/// Drops a file's pages from the page cache (they are clean: written and fsynced before).
void drop_from_page_cache(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void BM_PlainWrite(benchmark::State& state) {
  auto& f = Fixture::get();
  for (auto _ : state) f.write_plain(state.range(0) != 0);
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

void BM_Save(benchmark::State& state) {
  auto& f = Fixture::get();
  for (auto _ : state) {
    kvcache::save_snapshot(f.snapshot, *f.source, kModel, {}, {.durable = state.range(0) != 0});
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

void BM_PlainRead(benchmark::State& state) {
  auto& f = Fixture::get();
  const bool cold = state.range(0) != 0;
  if (cold) f.write_plain(true);  // clean pages, so that they can be dropped
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      drop_from_page_cache(f.plain);
      state.ResumeTiming();
    }
    const kvcache::detail::UniqueFd fd = kvcache::detail::open_for_reading(f.plain);
    kvcache::detail::read_exact_at(fd.get(), f.buffer.data(), f.buffer.size(), 0, f.plain);
    benchmark::DoNotOptimize(f.buffer.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

void BM_Load(benchmark::State& state) {
  auto& f = Fixture::get();
  const auto method = static_cast<kvcache::LoadMethod>(state.range(0));
  const bool cold = state.range(1) != 0;
  kvcache::save_snapshot(f.snapshot, *f.source, kModel);  // durable: clean pages
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      drop_from_page_cache(f.snapshot);
      state.ResumeTiming();
    }
    (void)kvcache::load_snapshot(f.snapshot, *f.dest, kModel, {.method = method});
    benchmark::ClobberMemory();
  }
  if (f.dest->seq_length(0) != kTokens) state.SkipWithError("the snapshot did not load");
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

/// Load (warm, mmap) into a DynamicCache: a fresh one per iteration, whose chunks are all
/// allocated and first touched by the load, or the same one, whose chunks the load reuses.
void BM_LoadDynamic(benchmark::State& state) {
  auto& f = Fixture::get();
  const bool reuse = state.range(0) != 0;
  const kvcache::DynamicCacheConfig cfg{
      .num_layers = kLayers, .num_kv_heads = kKvHeads, .head_dim = kHeadDim, .max_batch = 1};
  auto dest = std::make_unique<kvcache::DynamicCache<half>>(cfg);
  {  // a snapshot saved by a DynamicCache (a snapshot names its policy), as large
    kvcache::DynamicCache<half> source(cfg);
    const std::vector<float> kv(kTokens * kKvHeads * kHeadDim, 0.5f);
    const kvcache::TokenBlock<const float> block{kv, kTokens, kKvHeads, kHeadDim};
    for (std::size_t l = 0; l < kLayers; ++l) source.append(l, 0, block, block);
    kvcache::save_snapshot(f.dir / "dynamic.kvs", source, kModel);
  }
  for (auto _ : state) {
    if (!reuse) {
      state.PauseTiming();
      dest = std::make_unique<kvcache::DynamicCache<half>>(cfg);
      state.ResumeTiming();
    }
    (void)kvcache::load_snapshot(f.dir / "dynamic.kvs", *dest, kModel);
    benchmark::ClobberMemory();
  }
  if (dest->seq_length(0) != kTokens) state.SkipWithError("the snapshot did not load");
  state.SetBytesProcessed(static_cast<std::int64_t>(f.file_bytes) * state.iterations());
}

void BM_Crc32c(benchmark::State& state) {
  static const std::vector<std::byte> data(std::size_t{256} << 20, std::byte{0x5a});
  const bool sliced = state.range(0) != 0;
  std::uint32_t crc = 0;
  for (auto _ : state) {
    crc = sliced ? ~kvcache::detail::crc32c_raw_sliced(~0u, data.data(), data.size())
                 : kvcache::crc32c(data);
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(data.size()) * state.iterations());
}

void configure(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_PlainWrite)->ArgName("durable")->Arg(0)->Arg(1)->Apply(configure);
BENCHMARK(BM_Save)->ArgName("durable")->Arg(0)->Arg(1)->Apply(configure);
BENCHMARK(BM_PlainRead)->ArgName("cold")->Arg(0)->Arg(1)->Apply(configure);
// method: 1 = mmap, 2 = read (LoadMethod numbering)
BENCHMARK(BM_Load)->ArgNames({"method", "cold"})->ArgsProduct({{1, 2}, {0, 1}})->Apply(configure);
BENCHMARK(BM_LoadDynamic)->ArgName("reuse")->Arg(0)->Arg(1)->Apply(configure);
BENCHMARK(BM_Crc32c)->ArgName("sliced")->Arg(0)->Arg(1)->Apply(configure);

}  // namespace

int main(int argc, char** argv) {
  // Each iteration moves 256 MiB: 2 s per benchmark unless the caller says otherwise.
  std::vector<char*> args(argv, argv + argc);
  static char min_time[] = "--benchmark_min_time=2";
  args.insert(args.begin() + 1, min_time);
  argc = static_cast<int>(args.size());
  argv = args.data();
  return kvcache::bench::run_with_summary(argc, argv, [](const kvcache::bench::RatioReporter& r) {
    auto gbs = [&](const std::string& name) {
      return r.figure(name + "/real_time", "bytes_per_second") / 1e9;
    };
    std::printf(
        "snapshot of %zu layers x %zu KV heads x %zu dims x %zu tokens, fp16 (%.0f MiB)\n", kLayers,
        kKvHeads, kHeadDim, kTokens,
        static_cast<double>(kvcache::kv_cache_bytes(kLayers, kKvHeads, kHeadDim, kTokens, 2)) /
            (1 << 20));
    std::printf("%-34s %10s %10s %7s\n", "", "GB/s", "plain GB/s", "ratio");
    auto line = [&](const char* what, const std::string& a, const std::string& b) {
      const double x = gbs(a), y = gbs(b);
      if (x == 0 || y == 0) return;
      std::printf("%-34s %10.2f %10.2f %7.3f\n", what, x, y, x / y);
    };
    line("save, page cache (vs write)", "BM_Save/durable:0", "BM_PlainWrite/durable:0");
    line("save, fsync (vs write+fsync)", "BM_Save/durable:1", "BM_PlainWrite/durable:1");
    line("load mmap, warm (vs read)", "BM_Load/method:1/cold:0", "BM_PlainRead/cold:0");
    line("load read, warm (vs read)", "BM_Load/method:2/cold:0", "BM_PlainRead/cold:0");
    line("load mmap, cold (vs cold read)", "BM_Load/method:1/cold:1", "BM_PlainRead/cold:1");
    line("load read, cold (vs cold read)", "BM_Load/method:2/cold:1", "BM_PlainRead/cold:1");
    line("load into a DynamicCache, reused", "BM_LoadDynamic/reuse:1", "BM_LoadDynamic/reuse:0");
    std::printf("  (vs a fresh DynamicCache per load: its chunks allocated and first touched)\n");
    std::printf("crc32c: SSE4.2 3-way %.2f GB/s, slicing-by-8 %.2f GB/s\n",
                gbs("BM_Crc32c/sliced:0"), gbs("BM_Crc32c/sliced:1"));
    std::printf(
        "warm = the file is in the page cache (just written); cold = its pages dropped with "
        "posix_fadvise(DONTNEED) before each iteration (no root needed).\n");
  });
}
