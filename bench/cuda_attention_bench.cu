// SPDX-License-Identifier: Apache-2.0
// GPU attention figures, timed with CUDA events (decode: 10 launches back to back per sample, so
// the host's launch work overlaps the device's, as in a decode loop): decode attention (batch 32,
// 32 query / 8 KV heads, head_dim 128, fp16 K/V) over paged (block 16) and contiguous caches at
// 4k/16k/32k context, with each fp16 decode kernel (DecodeKernel; the per-warp one also at 3 and 4
// pipeline stages, its output checked against its default depth's), as achieved bandwidth (K+V
// bytes read / time) next to a device-to-device copy measured in the same run, and next to the
// block kernel's tile loads alone (what its memory pipeline allows without the arithmetic); and
// prefill of 2048 new tokens against a 2048-token
// cached prefix, as TFLOP/s; and batch-1 decode with and without a DecodeSetup (the host's share of
// a short launch).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/cuda/cuda.cuh"

namespace {

namespace kcuda = kvcache::cuda;
using kvcache::half;

constexpr int kBatch = 32, kQHeads = 32, kKvHeads = 8, kDim = 128, kChunk = 256;

__global__ void fill_random(float* x, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = static_cast<float>(h & 0xffffff) / 8388608.0f - 1.0f;  // uniform [-1, 1)
  }
}

kcuda::DeviceBuffer<float> random_floats(std::size_t n, std::uint32_t seed) {
  kcuda::DeviceBuffer<float> b(n);
  fill_random<<<1024, 256>>>(b.data(), n, seed);
  kcuda::check_launch("fill_random");
  return b;
}

/// Median over `reps` of the time in ms of one run of f, each rep timing `batch` runs back to
/// back on the default stream (so that, as in a decode loop, the host's launch work overlaps the
/// device's execution of the previous run), after `warmup` runs.
template <class F>
float time_ms(F&& f, int batch = 1, int warmup = 3, int reps = 15) {
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t start, stop;
  kcuda::check(cudaEventCreate(&start), "cudaEventCreate");
  kcuda::check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    kcuda::check(cudaEventRecord(start), "cudaEventRecord");
    for (int b = 0; b < batch; ++b) f();
    kcuda::check(cudaEventRecord(stop), "cudaEventRecord");
    kcuda::check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    kcuda::check(cudaEventElapsedTime(&ms[i], start, stop), "cudaEventElapsedTime");
    ms[i] /= static_cast<float>(batch);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

/// Device-to-device copy bandwidth, counting bytes read plus bytes written.
double copy_bandwidth() {
  const std::size_t bytes = std::size_t{2} << 30;
  kcuda::DeviceBuffer<unsigned char> a(bytes), b(bytes);
  kcuda::check(cudaMemset(a.data(), 1, bytes), "cudaMemset");
  const float ms = time_ms([&] {
    kcuda::check(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice),
                 "cudaMemcpyAsync");
  });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

/// Fills every sequence of a one-layer cache with `context` tokens, kChunk at a time for the
/// whole batch per append (so paged blocks interleave across sequences, as in serving).
void fill(kcuda::DeviceCache<half>& cache, int batch, int context) {
  const std::size_t n = static_cast<std::size_t>(batch) * kChunk * kKvHeads * kDim;
  auto k = random_floats(n, 1), v = random_floats(n, 2);
  std::vector<std::size_t> seqs(batch), counts(batch, kChunk);
  for (int s = 0; s < batch; ++s) seqs[s] = static_cast<std::size_t>(s);
  for (int done = 0; done < context; done += kChunk)
    cache.append(0, seqs, counts, k.data(), v.data(), nullptr);
  kcuda::check(cudaDeviceSynchronize(), "fill");
}

/// The fp16 decode kernel's memory pipeline without its arithmetic: the same grid, shared-memory
/// layout (DecodeMmaSmem), tiles and cp.async copies (load_kv_tile through for_each_kv_tile), each
/// tile only touched (one element summed, so that the copies must land). Its bandwidth is what
/// decode's loads allow.
template <int D>
__global__ void __launch_bounds__(kcuda::kDecodeThreads)
    tile_loads_kernel(kcuda::DeviceKVView<half> view, std::int64_t keys_per_split, float* sink) {
  namespace kd = kcuda::detail;
  using L = kd::DecodeMmaSmem<half, D>;
  constexpr int kStages = L::kStageCount;
  extern __shared__ __align__(128) unsigned char smem[];
  char* tiles = reinterpret_cast<char*>(smem);
  auto* pos = reinterpret_cast<std::int64_t*>(smem + L::kPos);
  const int seq = blockIdx.z, kv_head = blockIdx.y;
  const kd::KeyRange keys = view.key_range(seq);
  const std::int64_t begin = blockIdx.x * keys_per_split;
  const std::int64_t end =
      keys.count() < begin + keys_per_split ? keys.count() : begin + keys_per_split;
  float touched = 0.0f;
  kd::for_each_kv_tile<kStages>(
      begin, kcuda::kDecodeTile, [&](std::int64_t i) { return i < end; },
      [&](std::int64_t i, int b) {
        kd::load_kv_tile<half, D, kcuda::kDecodeThreads, kcuda::kDecodeTile>(
            view, seq, kv_head, keys, i, end, tiles + L::kK + b * L::kTile,
            tiles + L::kV + b * L::kTile, pos + b * kcuda::kDecodeTile, threadIdx.x);
      },
      [&](std::int64_t, int b) {
        touched += __half2float(
            reinterpret_cast<const __half*>(tiles + L::kK + b * L::kTile)[threadIdx.x]);
      });
  if (threadIdx.x == 0)
    sink[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = touched;
}

struct DecodeResult {
  std::string kernel;
  double bandwidth, ms, loads_bandwidth;  // loads: 0 where not measured
  int splits, blocks_per_sm;
  std::size_t smem_bytes;
  bool valid = true;  // false: its output differs from the same kernel's at the default depth
};

/// One layer's decode: batch sequences of `context` tokens, a paged or contiguous cache.
struct DecodeBench {
  DecodeBench(kcuda::Layout layout, int seqs, int context)
      : batch(seqs),
        cache({.layout = layout,
               .num_layers = 1,
               .num_kv_heads = kKvHeads,
               .head_dim = kDim,
               .max_batch = static_cast<std::size_t>(seqs),
               .max_seq_len = static_cast<std::size_t>(context),
               .block_size = 16,
               .num_blocks = static_cast<std::size_t>(seqs) * context / 16}),
        q(random_floats(static_cast<std::size_t>(seqs) * kQHeads * kDim, 3)),
        out(q.size()),
        setup(kcuda::make_decode_setup<half>(kQHeads, kKvHeads, kDim)) {
    fill(cache, batch, context);
    use(setup.kernel);
  }
  /// Makes run() launch `kernel` (sized by its own setup and workspace).
  void use(kcuda::DecodeKernel kernel) {
    setup = kcuda::make_decode_setup<half>(kQHeads, kKvHeads, kDim, kernel);
    const std::size_t bytes = kcuda::decode_workspace_bytes(cache.view(0), kQHeads, {}, &setup);
    if (ws.bytes() < bytes) ws = kcuda::DeviceBuffer<unsigned char>(bytes);
  }
  /// One launch; `with_setup` false: the device queried in the launch, as without a setup.
  void run(bool with_setup = true) {
    const auto b = static_cast<std::size_t>(batch);
    kvcache::attend(
        kvcache::TokenBlock<const float>{std::span<const float>(q.data(), q.size()), b, kQHeads,
                                         kDim},
        cache.view(0),
        kvcache::TokenBlock<float>{std::span<float>(out.data(), out.size()), b, kQHeads, kDim}, {},
        kcuda::DeviceAttendArgs{.workspace = ws.data(),
                                .workspace_bytes = ws.bytes(),
                                .decode_setup = with_setup ? &setup : nullptr});
  }

  /// tile_loads_kernel over the same cache, grid and shared memory as run() with the
  /// tensor_cores kernel.
  void run_loads() {
    const auto view = cache.view(0);
    const auto plan = kcuda::detail::plan_decode(setup, batch, kKvHeads, view.max_keys);
    const dim3 grid(static_cast<unsigned>(plan.splits), kKvHeads, static_cast<unsigned>(batch));
    if (sink.size() < grid.x * grid.y * grid.z)
      sink = kcuda::DeviceBuffer<float>(grid.x * grid.y * grid.z);
    kcuda::detail::allow_smem(tile_loads_kernel<kDim>, setup.smem_bytes);
    tile_loads_kernel<kDim>
        <<<grid, kcuda::kDecodeThreads, setup.smem_bytes>>>(view, plan.keys_per_split, sink.data());
    kcuda::check_launch("tile_loads_kernel");
  }

  [[nodiscard]] std::vector<float> download_out() const {
    std::vector<float> host(out.size());
    kcuda::check(cudaMemcpy(host.data(), out.data(), out.bytes(), cudaMemcpyDeviceToHost),
                 "download out");
    return host;
  }

  int batch;
  kcuda::DeviceCache<half> cache;
  kcuda::DeviceBuffer<float> q, out;
  kcuda::DecodeSetup setup;
  kcuda::DeviceBuffer<unsigned char> ws;
  kcuda::DeviceBuffer<float> sink;
};

/// decode_attention_warp_kernel with a kStages-deep pipeline instead of its default, launched as
/// launch_decode_attention launches it (planned for its own occupancy, then the merge). Its output
/// must match `reference` (the default depth's), else the figure means nothing (valid = false).
template <int kStages>
DecodeResult warp_variant(DecodeBench& b, double bytes, const std::vector<float>& reference) {
  namespace kd = kcuda::detail;
  constexpr int G = kQHeads / kKvHeads;
  static_assert(G == kd::decode_head_bucket(G));
  auto* kernel = kd::decode_attention_warp_kernel<half, kDim, G, kStages>;
  constexpr std::size_t smem = kd::DecodeWarpLayout<half, kDim, kStages>::kBytes;
  kd::allow_smem(kernel, smem);
  kcuda::DecodeSetup setup = b.setup;
  setup.smem_bytes = smem;
  kcuda::check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&setup.blocks_per_sm, kernel,
                                                             kcuda::kDecodeThreads, smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  const auto view = b.cache.view(0);
  const auto plan = kd::plan_decode(setup, b.batch, kKvHeads, view.max_keys);
  const std::size_t need = plan.workspace_bytes(b.batch, kQHeads, kDim);
  if (b.ws.bytes() < need) b.ws = kcuda::DeviceBuffer<unsigned char>(need);
  float* acc = reinterpret_cast<float*>(b.ws.data());
  float* ml = acc + static_cast<std::size_t>(b.batch) * kQHeads * plan.splits * kDim;
  const dim3 grid(static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(kKvHeads * plan.num_chunks),
                  static_cast<unsigned>(b.batch));
  const kd::DecodeArgs args{.q = b.q.data(),
                            .out = b.out.data(),
                            .partial_acc = acc,
                            .partial_ml = ml,
                            .num_q_heads = kQHeads,
                            .chunk_group = plan.chunk_group,
                            .num_splits = plan.splits,
                            .keys_per_split = plan.keys_per_split,
                            .mask = kd::device_mask({}),
                            .scale = 1.0f / std::sqrt(static_cast<float>(kDim))};
  const auto launch = [&] {
    kernel<<<grid, kcuda::kDecodeThreads, smem>>>(view, args);
    kcuda::check_launch("decode_attention_warp_kernel (bench depth)");
    if (plan.splits > 1) {
      kd::decode_merge_kernel<kDim><<<dim3(static_cast<unsigned>(b.batch), kQHeads), 128>>>(
          acc, ml, b.out.data(), kQHeads, plan.splits);
      kcuda::check_launch("decode_merge_kernel (bench depth)");
    }
  };
  const float ms = time_ms(launch, /*batch=*/10);
  const std::vector<float> got = b.download_out();
  float worst = 0.0f;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - reference[i]));
  }
  if (!(worst <= 1e-4f)) {
    std::printf(
        "decode_attention_warp_kernel with %d stages differs from the default depth by "
        "%g: its figure below is void\n",
        kStages, static_cast<double>(worst));
  }
  return {"  ... with " + std::to_string(kStages) + " stages",
          bytes / (ms * 1e-3),
          ms,
          0.0,
          plan.splits,
          setup.blocks_per_sm,
          smem,
          worst <= 1e-4f};
}

/// Each fp16 decode kernel over one cache (filled once), and the per-warp kernel's other depths.
std::vector<DecodeResult> decode(kcuda::Layout layout, int context) {
  DecodeBench b(layout, kBatch, context);
  const double bytes = 2.0 * kBatch * static_cast<double>(context) * kKvHeads * kDim * sizeof(half);
  std::vector<DecodeResult> results;
  for (const kcuda::DecodeKernel kernel :
       {kcuda::DecodeKernel::tensor_cores, kcuda::DecodeKernel::tensor_cores_per_warp}) {
    b.use(kernel);
    const float ms = time_ms([&] { b.run(); }, /*batch=*/10);
    double loads = 0.0;
    if (kernel == kcuda::DecodeKernel::tensor_cores) {
      loads = bytes / (time_ms([&] { b.run_loads(); }, /*batch=*/10) * 1e-3);
    }
    // the launch's shape, for reading the figure: splits per sequence and resident blocks
    const auto plan =
        kcuda::detail::plan_decode(b.setup, kBatch, kKvHeads, b.cache.view(0).max_keys);
    results.push_back({kcuda::decode_kernel_name(kernel), bytes / (ms * 1e-3), ms, loads,
                       plan.splits, b.setup.blocks_per_sm, b.setup.smem_bytes});
  }
  // the per-warp kernel's other pipeline depths (b.setup is its setup now, b.out its output)
  const std::vector<float> reference = b.download_out();
  const auto depth = [&](auto stages) {
    results.push_back(warp_variant<decltype(stages)::value>(b, bytes, reference));
  };
  depth(std::integral_constant<int, 3>{});
  depth(std::integral_constant<int, 4>{});
  return results;
}

/// Host microseconds to issue one launch (100 issued back to back, then synchronised).
double host_us_per_launch(DecodeBench& b, bool with_setup) {
  constexpr int kLaunches = 100;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kLaunches; ++i) b.run(with_setup);
  const auto t1 = std::chrono::steady_clock::now();
  kcuda::check(cudaDeviceSynchronize(), "host_us_per_launch");
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / kLaunches;
}

/// Small-batch decode, where the kernel is short enough for host work to show: batch 1 at 4k
/// (16 MiB of K+V), each launch with a DecodeSetup and querying the device instead.
void small_batch_decode() {
  DecodeBench b(kcuda::Layout::paged, 1, 4096);
  const float with = time_ms([&] { b.run(true); }, /*batch=*/100);
  const float without = time_ms([&] { b.run(false); }, /*batch=*/100);
  const double host_with = host_us_per_launch(b, true);
  const double host_without = host_us_per_launch(b, false);
  std::printf(
      "\ndecode batch 1, 4k context, paged/16 (100 launches back to back): %.1f us per launch "
      "with a DecodeSetup, %.1f us querying the device in each (%.2fx); host issue %.1f vs %.1f "
      "us\n",
      with * 1e3, without * 1e3, without / with, host_with, host_without);
}

double prefill_tflops(int cached, int fresh, float* ms_out) {
  const int total = cached + fresh;
  kcuda::DeviceCache<half> cache({.num_layers = 1,
                                  .num_kv_heads = kKvHeads,
                                  .head_dim = kDim,
                                  .max_batch = 1,
                                  .max_seq_len = static_cast<std::size_t>(total)});
  const std::size_t n = static_cast<std::size_t>(total) * kKvHeads * kDim;
  auto k = random_floats(n, 4), v = random_floats(n, 5);
  for (int done = 0; done < total; done += 1024) {
    cache.append(0, std::vector<std::size_t>{0}, std::vector<std::size_t>{1024},
                 k.data() + static_cast<std::size_t>(done) * kKvHeads * kDim,
                 v.data() + static_cast<std::size_t>(done) * kKvHeads * kDim, nullptr);
  }
  auto q = random_floats(static_cast<std::size_t>(fresh) * kQHeads * kDim, 6);
  kcuda::DeviceBuffer<float> out(q.size());
  const std::vector<std::int32_t> offsets{0, fresh};
  kcuda::DeviceBuffer<std::int32_t> d_offsets(2);
  kcuda::check(cudaMemcpy(d_offsets.data(), offsets.data(), 8, cudaMemcpyHostToDevice), "offsets");
  const kvcache::TokenBlock<const float> qb{std::span<const float>(q.data(), q.size()),
                                            static_cast<std::size_t>(fresh), kQHeads, kDim};
  const kvcache::TokenBlock<float> ob{std::span<float>(out.data(), out.size()),
                                      static_cast<std::size_t>(fresh), kQHeads, kDim};
  const auto view = cache.view(0);
  const float ms = time_ms([&] {
    kvcache::attend(qb, view, ob, {},
                    kcuda::DeviceAttendArgs{.q_offsets = d_offsets.data(), .max_q_len = fresh});
  });
  // causal: query i (position cached + i) sees cached + i + 1 keys; 2 FLOP per multiply-add,
  // q.k and p.V each head_dim multiply-adds per (query head, key)
  double pairs = 0;
  for (int i = 0; i < fresh; ++i) pairs += cached + i + 1;
  *ms_out = ms;
  return 4.0 * pairs * kQHeads * kDim / (ms * 1e-3) / 1e12;
}

}  // namespace

int main() {
  if (kcuda::device_count() == 0) {
    const char* required = std::getenv("KVCACHE_REQUIRE_CUDA_DEVICE");
    const bool fail = required != nullptr && std::string(required) == "1";
    std::printf("cuda_attention_bench: no CUDA device (%s); nothing to measure%s\n",
                kcuda::no_device_reason().c_str(),
                fail ? " (KVCACHE_REQUIRE_CUDA_DEVICE=1: failing)" : "");
    return fail ? 1 : 0;
  }
  cudaDeviceProp prop{};
  kcuda::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s, %d SMs, %.0f MiB\n", prop.name, prop.multiProcessorCount,
              static_cast<double>(prop.totalGlobalMem) / (1 << 20));
  const double copy = copy_bandwidth();
  std::printf("device-to-device copy: %.0f GB/s (bytes read + written)\n\n", copy / 1e9);
  std::printf("decode attention, batch %d, %d q heads / %d kv heads, head_dim %d, fp16 K/V\n",
              kBatch, kQHeads, kKvHeads, kDim);
  std::printf("%-11s %8s %-22s %9s %8s %10s %11s %12s %7s %10s %9s\n", "layout", "context",
              "kernel", "ms", "GB/s", "/ copy bw", "loads GB/s", "loads / copy", "splits",
              "blocks/SM", "smem KiB");
  bool all_valid = true;
  // per kernel (and depth): its lowest paged ratio over the contexts, against the 0.75 target
  std::vector<std::pair<std::string, double>> paged_floor;
  for (kcuda::Layout layout : {kcuda::Layout::paged, kcuda::Layout::contiguous}) {
    for (int context : {4096, 16384, 32768}) {
      for (const DecodeResult& r : decode(layout, context)) {
        all_valid = all_valid && r.valid;
        if (layout == kcuda::Layout::paged) {
          auto it = std::find_if(paged_floor.begin(), paged_floor.end(),
                                 [&](const auto& f) { return f.first == r.kernel; });
          if (it == paged_floor.end()) it = paged_floor.insert(it, {r.kernel, r.bandwidth / copy});
          it->second = std::min(it->second, r.bandwidth / copy);
        }
        const bool loads = r.loads_bandwidth > 0.0;
        std::printf(
            "%-11s %8d %-22s %9.3f %8.0f %10.3f %11s %12s %7d %10d %9.1f\n",
            layout == kcuda::Layout::paged ? "paged/16" : "contiguous", context, r.kernel.c_str(),
            r.ms, r.bandwidth / 1e9, r.bandwidth / copy,
            loads ? std::to_string(static_cast<long>(r.loads_bandwidth / 1e9)).c_str() : "-",
            loads ? std::to_string(r.loads_bandwidth / copy).substr(0, 5).c_str() : "-", r.splits,
            r.blocks_per_sm, static_cast<double>(r.smem_bytes) / 1024.0);
      }
    }
  }
  std::printf(
      "\npaged decode at 4k/16k/32k, lowest of the three over copy bandwidth (target 0.75):\n");
  for (const auto& [kernel, lowest] : paged_floor) {
    std::printf("  %-22s %.3f %s\n", kernel.c_str(), lowest, lowest >= 0.75 ? "meets it" : "below");
  }
  small_batch_decode();
  float ms = 0;
  const double tflops = prefill_tflops(2048, 2048, &ms);
  std::printf(
      "\nprefill: 2048 new tokens against a 2048-token cached prefix, 32/8 heads, d 128, "
      "fp16: %.3f ms, %.1f TFLOP/s\n",
      ms, tflops);
  if (!all_valid) {
    std::printf("a decode figure above is void: its kernel's output was wrong\n");
    return 1;
  }
  return 0;
}
