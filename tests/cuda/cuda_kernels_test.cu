// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels against the CPU: appends must store bit-identical rows (every dtype, layout,
// block boundary), and decode and prefill attention must equal kvcache::reference over the same
// cached tokens (random data, odd sizes, GQA groups, windows, sinks, soft-caps, splits); context
// shifts, restores and row reads of every layout leave what the host caches do. Every test skips
// with a message when no CUDA device is present.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <typeinfo>
#include <vector>

#include "kvcache/cuda/cuda.cuh"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

// No `using namespace kvcache`: CUDA's headers declare a global `half` and namespace `cuda`.
namespace kcuda = kvcache::cuda;
using kvcache::AttentionOptions;
using kvcache::bfloat16;
using kvcache::Element;
using kvcache::position_t;
using kvcache::SlidingWindowCache;
using kvcache::SlidingWindowCacheConfig;
using kvcache::StaticCache;
using kvcache::StaticCacheConfig;
using kvcache::TokenBlock;
namespace reference = kvcache::reference;
using kvcache::test::Tolerance;

namespace {

// True when a CUDA device is present. Otherwise the test is skipped with CUDA's reason, or
// fails when KVCACHE_REQUIRE_CUDA_DEVICE is 1 (scripts/gpu-check.sh sets it: on a GPU machine a
// missing device, such as a driver older than the runtime, must not pass as a skip).
bool have_device() {
  if (kcuda::device_count() > 0) return true;
  const std::string reason = kcuda::no_device_reason();
  const char* required = std::getenv("KVCACHE_REQUIRE_CUDA_DEVICE");
  if (required != nullptr && std::string(required) == "1") {
    FAIL("no CUDA device (" << reason << ") and KVCACHE_REQUIRE_CUDA_DEVICE=1");
  }
  WARN("skipped: no CUDA device (" << reason
                                   << "); run scripts/gpu-check.sh on a machine with a GPU");
  return false;
}

template <class T>
std::vector<T> download(const T* device, std::size_t n) {
  std::vector<T> host(n);
  kcuda::check(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return host;
}

template <class T>
kcuda::DeviceBuffer<T> upload(const std::vector<T>& host) {
  kcuda::DeviceBuffer<T> d(host.size());
  kcuda::check(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
               "upload");
  return d;
}

// Host copy of DeviceKVView::row_offset (same formula, for reading downloaded storage).
template <kvcache::KVFormat T>
std::int64_t host_row_offset(const kcuda::DeviceKVView<T>& v,
                             const std::vector<kvcache::block_id>& table, int seq, int head,
                             std::int64_t pos) {
  if (v.layout == kcuda::Layout::paged) {
    const kvcache::block_id block =
        table[static_cast<std::size_t>(seq) * v.max_blocks + pos / v.block_size];
    return block * v.block_stride + head * v.head_stride + (pos % v.block_size) * v.head_dim;
  }
  std::int64_t slot = pos;
  if (v.layout == kcuda::Layout::ring && pos >= v.num_sinks) {
    slot = v.num_sinks + (pos - v.num_sinks) % v.ring_len;
  }
  return seq * v.seq_stride + head * v.head_stride + slot * v.head_dim;
}

// A CPU cache holding the same tokens as a DeviceCache, for the reference.
struct Twin {
  kcuda::Layout layout;
  std::size_t layers, heads, dim, batch, capacity, window, sinks, max_append;
};

kcuda::DeviceCacheConfig device_config(const Twin& t) {
  return {.layout = t.layout,
          .num_layers = t.layers,
          .num_kv_heads = t.heads,
          .head_dim = t.dim,
          .max_batch = t.batch,
          .max_seq_len = t.capacity,
          .window = t.window,
          .num_sink_tokens = t.sinks,
          .max_append_len = t.max_append,
          .block_size = 16,
          .num_blocks = t.batch * ((t.capacity + 15) / 16)};
}

// The values of the device row at element offset `off` of `base`: its elements, or for int8/fp8
// its codes times the row's scale (from `scales`, one per head_dim elements).
template <kvcache::KVElement T>
std::vector<float> stored_row(const T* base, const kvcache::scale_type* scales, std::int64_t off,
                              std::size_t dim) {
  const auto raw = download(base + off, dim);
  std::vector<kvcache::scale_type> scale;
  if constexpr (kvcache::scaled_v<T>) {
    scale = download(scales + off / static_cast<std::int64_t>(dim), 1);
  }
  std::vector<float> out(dim);
  kvcache::dequantize_row(raw.data(), scale.empty() ? nullptr : scale.data(), dim, out.data());
  return out;
}

// The CPU counterpart: a sliding window for ring, a static cache otherwise (paged storage holds
// the same logical tokens as a contiguous one).
template <kvcache::KVFormat T>
struct CpuTwin {
  // unique_ptr rather than optional: g++ 12 at -O1 warns (maybe-uninitialized) about the latter
  std::unique_ptr<StaticCache<T>> flat;
  std::unique_ptr<SlidingWindowCache<T>> ring;
  explicit CpuTwin(const Twin& t) {
    if (t.layout == kcuda::Layout::ring) {
      ring = std::make_unique<SlidingWindowCache<T>>(
          SlidingWindowCacheConfig{.num_layers = t.layers,
                                   .num_kv_heads = t.heads,
                                   .head_dim = t.dim,
                                   .max_batch = t.batch,
                                   .window = t.window,
                                   .num_sink_tokens = t.sinks,
                                   .max_append_len = t.max_append});
    } else {
      flat = std::make_unique<StaticCache<T>>(StaticCacheConfig{.num_layers = t.layers,
                                                                .num_kv_heads = t.heads,
                                                                .head_dim = t.dim,
                                                                .max_batch = t.batch,
                                                                .max_seq_len = t.capacity});
    }
  }
  void append(std::size_t l, std::size_t s, const kvcache::test::TokenKV& kv, std::size_t first,
              std::size_t n) {
    if (ring) ring->append(l, s, kv.k_block(first, n), kv.v_block(first, n));
    if (flat) flat->append(l, s, kv.k_block(first, n), kv.v_block(first, n));
  }
  template <class F>
  void with_view(std::size_t l, std::size_t s, F&& f) const {
    if (ring) f(ring->view(l, s));
    if (flat) f(flat->view(l, s));
  }
};

// Fills both caches with the same random tokens for every sequence (random lengths, appended in
// random chunks batched over sequences), returning each sequence's token data per layer.
template <kvcache::KVFormat T>
std::vector<std::vector<kvcache::test::TokenKV>> fill(kcuda::DeviceCache<T>& dev, CpuTwin<T>& cpu,
                                                      const Twin& t, std::mt19937_64& rng,
                                                      const std::vector<std::size_t>& lengths) {
  std::vector<std::vector<kvcache::test::TokenKV>> data(t.batch);
  for (std::size_t s = 0; s < t.batch; ++s) {
    for (std::size_t l = 0; l < t.layers; ++l) {
      data[s].push_back(
          kvcache::test::random_kv(rng, std::max<std::size_t>(lengths[s], 1), t.heads, t.dim));
    }
  }
  std::vector<std::size_t> done(t.batch, 0);
  for (;;) {
    std::vector<std::size_t> seqs, counts;
    for (std::size_t s = 0; s < t.batch; ++s) {
      if (done[s] == lengths[s]) continue;
      seqs.push_back(s);
      counts.push_back(
          std::min(kvcache::test::uniform(rng, 1, t.max_append), lengths[s] - done[s]));
    }
    if (seqs.empty()) break;
    for (std::size_t l = 0; l < t.layers; ++l) {
      std::vector<float> k, v;
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        const auto& kv = data[seqs[i]][l];
        const std::size_t row = t.heads * t.dim;
        k.insert(k.end(), kv.k.begin() + done[seqs[i]] * row,
                 kv.k.begin() + (done[seqs[i]] + counts[i]) * row);
        v.insert(v.end(), kv.v.begin() + done[seqs[i]] * row,
                 kv.v.begin() + (done[seqs[i]] + counts[i]) * row);
        cpu.append(l, seqs[i], kv, done[seqs[i]], counts[i]);
      }
      auto dk = upload(k), dv = upload(v);
      dev.append(l, seqs, counts, dk.data(), dv.data(), nullptr);
      kcuda::check(cudaDeviceSynchronize(), "append");
    }
    for (std::size_t i = 0; i < seqs.size(); ++i) done[seqs[i]] += counts[i];
  }
  return data;
}

// K/V format pairs: the quantized side V or K, a 16-bit side in its own operand, codes on both
// sides, and two 16-bit types (prefill on tf32 tiles).
using HalfInt8 = kvcache::KVFormats<kvcache::half, kvcache::qint8>;
using Fp8Bf16 = kvcache::KVFormats<kvcache::fp8_e4m3, bfloat16>;
using Int8Fp8 = kvcache::KVFormats<kvcache::qint8, kvcache::fp8_e4m3>;
using HalfBf16 = kvcache::KVFormats<kvcache::half, bfloat16>;

// int8, fp8 and the pairs: decode reads them on the CUDA-core kernel, whose arithmetic the
// float cases check; fewer cases add the reading of their codes, scales and sides.
template <class T>
inline constexpr bool kQuantizedOrPair = kcuda::kCudaCoreDecode<T> && !std::is_same_v<T, float>;

const kcuda::Layout kLayouts[] = {kcuda::Layout::contiguous, kcuda::Layout::ring,
                                  kcuda::Layout::paged};

template <class T>
Tolerance decode_tolerance() {
  return {1e-4, 1e-4};  // fp32 accumulation with __expf vs double, same stored K/V
}
template <class T>
Tolerance prefill_tolerance() {
  // q and p are rounded to the tensor-core operand type (fp16, bf16, or tf32 for float; fp16
  // for int8 and fp8, whose codes are fp16 values; a pair's: prefill_operand_t)
  if constexpr (std::is_same_v<kcuda::detail::prefill_operand_t<T>, bfloat16>) return {3e-2, 3e-2};
  return {1e-2, 1e-2};
}

}  // namespace

// Compares every stored K/V element of `dev` with the CPU twin's; returns how many differ and
// describes the first.
template <kvcache::KVFormat T>
std::size_t count_mismatches(const kcuda::DeviceCache<T>& dev, const CpuTwin<T>& cpu, const Twin& t,
                             std::string& first_mismatch) {
  std::size_t mismatches = 0;
  for (std::size_t l = 0; l < t.layers; ++l) {
    const auto view = dev.view(l);
    std::vector<kvcache::block_id> table;
    if (t.layout == kcuda::Layout::paged) {
      table = download(view.block_table, t.batch * static_cast<std::size_t>(view.max_blocks));
    }
    for (std::size_t s = 0; s < t.batch; ++s) {
      cpu.with_view(l, s, [&](const auto& cv) {
        std::vector<float> ck, cvv;
        std::vector<position_t> pos;
        reference::gather_view(cv, ck, cvv, pos);
        for (std::size_t i = 0; i < pos.size(); ++i) {
          for (std::size_t h = 0; h < t.heads; ++h) {
            const std::int64_t off =
                host_row_offset(view, table, static_cast<int>(s), static_cast<int>(h), pos[i]);
            const auto krow = stored_row(view.k, view.k_scale, off, t.dim);
            const auto vrow = stored_row(view.v, view.v_scale, off, t.dim);
            for (std::size_t d = 0; d < t.dim; ++d) {
              const std::size_t at = (i * t.heads + h) * t.dim + d;
              if (krow[d] == ck[at] && vrow[d] == cvv[at]) continue;
              if (mismatches++ == 0) {
                first_mismatch = "layer " + std::to_string(l) + " seq " + std::to_string(s) +
                                 " pos " + std::to_string(pos[i]) + " head " + std::to_string(h) +
                                 " dim " + std::to_string(d) + ": K " + std::to_string(krow[d]) +
                                 " vs " + std::to_string(ck[at]) + ", V " +
                                 std::to_string(vrow[d]) + " vs " + std::to_string(cvv[at]);
              }
            }
          }
        }
      });
    }
  }
  return mismatches;
}

// Fills a DeviceCache and its CPU twin with the same tokens and CHECKs (so that the other
// layouts are still compared and reported) that every stored element matches.
template <kvcache::KVFormat T>
void check_append(const Twin& t, const std::vector<std::size_t>& lengths, std::mt19937_64& rng) {
  kcuda::DeviceCache<T> dev(device_config(t));
  CpuTwin<T> cpu(t);
  fill(dev, cpu, t, rng, lengths);
  std::string first_mismatch;
  const std::size_t mismatches = count_mismatches(dev, cpu, t, first_mismatch);
  INFO("layout " << static_cast<int>(t.layout) << ": " << mismatches
                 << " elements differ; first: " << first_mismatch);
  CHECK(mismatches == 0);
}

TEMPLATE_TEST_CASE("CUDA append stores exactly what the CPU cache stores", "[cuda]", float,
                   kvcache::half, bfloat16, kvcache::qint8, kvcache::fp8_e4m3, HalfInt8, Fp8Bf16) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-append");
  for (kcuda::Layout layout : kLayouts) {
    // ring wraps; paged crosses blocks
    check_append<TestType>({layout, 2, 3, 64, 4, 100, 40, 3, 17}, {100, 1, 37, 64}, rng);
  }
}

TEST_CASE("CUDA append of a batch wider than one launch stores every sequence", "[cuda]") {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-append-wide");
  const std::size_t batch = kcuda::kMaxSeqsPerLaunch + 88;  // two append launches per round
  for (kcuda::Layout layout : kLayouts) {
    std::vector<std::size_t> lengths(batch);
    for (auto& n : lengths) n = kvcache::test::uniform(rng, 1, 40);
    check_append<kvcache::half>({layout, 1, 2, 64, batch, 40, 8, 2, 5}, lengths, rng);
  }
}

TEMPLATE_TEST_CASE("CUDA decode attention equals the CPU reference", "[cuda][decode]", float,
                   kvcache::half, bfloat16, kvcache::qint8, kvcache::fp8_e4m3, HalfInt8, Fp8Bf16) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-decode");
  struct Case {
    std::size_t dim, group, kv_heads;
    AttentionOptions opts;
  };
  // group 32 and 20: more query heads than one block serves (head chunks of 16 and 10)
  const std::vector<Case> all_cases{{64, 1, 2, {}},
                                    {256, 2, 1, {.softcap = 30.0f}},
                                    {128, 8, 1, {.scale = 0.05f}},
                                    {128, 20, 2, {}},
                                    {128, 4, 2, {}},
                                    {64, 16, 1, {}},
                                    {128, 3, 2, {}},
                                    {64, 32, 1, {}}};
  // Under AddressSanitizer (kernels emulated on the CPU, 5x slower) cases 0, 1 and 3: every
  // head_dim, chunked and unchunked groups, both position modes on the ring, every layout and
  // length; the memory errors it looks for do not depend on the other groups' arithmetic, which
  // the plain build checks.
  // int8, fp8 and the pairs run on the fp32 kernel (its other cases check its arithmetic); these
  // cases add the reading of codes, scales and sides at every head_dim, group chunking and
  // position mode.
#if defined(__SANITIZE_ADDRESS__)
  const std::vector<std::size_t> picked{0, 1, 3};
#else
  std::vector<std::size_t> picked(all_cases.size());
  for (std::size_t i = 0; i < picked.size(); ++i) picked[i] = i;
  if constexpr (kQuantizedOrPair<TestType>) picked = {0, 1, 3};
#endif
  // long: several splits (and sequences with no keys in most of them), 1 and odd lengths, a
  // block boundary; short: one split, the output written without the merge kernel
  const std::vector<std::size_t> long_lengths{3000, 1, 17, 513, 2049};
  const std::vector<std::size_t> short_lengths{200, 1, 64, 17, 129};
  // every kernel that serves TestType; the default one sized by a DecodeSetup made once (not
  // queried) every other launch, the others always (a setup is how they are chosen)
  std::vector<kcuda::DecodeKernel> kernels{kcuda::default_decode_kernel<TestType>};
  if constexpr (!kcuda::kCudaCoreDecode<TestType>) {
    kernels.push_back(kcuda::DecodeKernel::tensor_cores_per_warp);
  }
  bool with_setup = false;
  for (kcuda::Layout layout : kLayouts) {
    for (const std::size_t case_index : picked) {
      const Case& c = all_cases[case_index];
      for (const auto* lengths_ptr : {&long_lengths, &short_lengths}) {
        const std::vector<std::size_t>& lengths = *lengths_ptr;
        const Twin t{layout, 1, c.kv_heads, c.dim, 5, 3000, 500, 4, 300};
        kcuda::DeviceCache<TestType> dev(device_config(t));
        CpuTwin<TestType> cpu(t);
        fill(dev, cpu, t, rng, lengths);
        AttentionOptions opts = c.opts;
        const kvcache::Rope rope({}, c.dim);
        if (layout == kcuda::Layout::ring) {
          opts.window = t.window;
          opts.num_sink_tokens = t.sinks;
          if (case_index % 2 == 1) {  // every other case: StreamingLLM positions
            opts.positions = kvcache::PositionMode::cache_relative;
            opts.rope = &rope;
          }
        }
        const bool relative = opts.positions == kvcache::PositionMode::cache_relative;
        const std::size_t q_heads = c.kv_heads * c.group;
        const auto view = dev.view(0);
        dev.check_attention(0, std::vector<std::size_t>(t.batch, 1), opts);
        for (const kcuda::DecodeKernel kernel : kernels) {
          const auto q = kvcache::test::normal_floats(rng, t.batch * q_heads * c.dim);
          auto dq = upload(q);
          kcuda::DeviceBuffer<float> dout(q.size());
          kcuda::check(cudaMemset(dout.data(), 0xff, dout.bytes()), "poison");  // NaN everywhere
          const bool default_kernel = kernel == kcuda::default_decode_kernel<TestType>;
          if (default_kernel) with_setup = !with_setup;
          std::optional<kcuda::DecodeSetup> setup;
          if (with_setup || !default_kernel) {
            setup = kcuda::make_decode_setup<TestType>(static_cast<int>(q_heads),
                                                       static_cast<int>(c.kv_heads),
                                                       static_cast<int>(c.dim), kernel);
          }
          const kcuda::DecodeSetup* setup_ptr = setup ? &*setup : nullptr;
          const std::size_t ws_bytes =
              kcuda::decode_workspace_bytes(view, static_cast<int>(q_heads), opts, setup_ptr);
          if (default_kernel) {
            REQUIRE(ws_bytes ==
                    kcuda::decode_workspace_bytes(view, static_cast<int>(q_heads), opts));
          }
          // one split: nothing to merge (but cache_relative's sink scores)
          if (lengths_ptr == &short_lengths) REQUIRE((ws_bytes == 0) == !relative);
          if (lengths_ptr == &long_lengths) REQUIRE(ws_bytes > 0);
          kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
          kvcache::attend(
              TokenBlock<const float>{std::span<const float>(dq.data(), q.size()), t.batch, q_heads,
                                      c.dim},
              view,
              TokenBlock<float>{std::span<float>(dout.data(), q.size()), t.batch, q_heads, c.dim},
              opts,
              kcuda::DeviceAttendArgs{
                  .workspace = ws.data(), .workspace_bytes = ws_bytes, .decode_setup = setup_ptr});
          kcuda::check(cudaDeviceSynchronize(), "decode");
          const auto got = download(dout.data(), q.size());
          for (std::size_t s = 0; s < t.batch; ++s) {
            std::vector<float> expect(q_heads * c.dim);
            cpu.with_view(0, s, [&](const auto& cv) {
              reference::attend(
                  {std::span<const float>(q).subspan(s * q_heads * c.dim, q_heads * c.dim), 1,
                   q_heads, c.dim},
                  cv, {expect, 1, q_heads, c.dim}, opts);
            });
            INFO("layout " << static_cast<int>(layout) << " dim " << c.dim << " group " << c.group
                           << " seq " << s << " length " << lengths[s] << " kernel "
                           << static_cast<int>(kernel) << " setup " << setup.has_value()
                           << " cache_relative " << relative);
            kvcache::test::check_close(
                std::span<const float>(got).subspan(s * q_heads * c.dim, q_heads * c.dim), expect,
                decode_tolerance<TestType>());
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("CUDA decode on tensor cores keeps q's low bits", "[cuda]", kvcache::half,
                   bfloat16) {
  if (!have_device()) return;
  // Every score rests on q's bits below 2^-16: q = (1 + 2^-9 + 2^-17, -(1 + 2^-9), 0, ...) 2^h
  // for head h, K row j = (c, c, 0, ...) with c = 2^11 (j % 16), so q.k = 2^h j / 64 exactly,
  // and is 0 for every key once q is cut to 16 bits (two bf16 parts, or one fp16 part). The
  // expected output is the softmax-weighted V in double.
  constexpr std::size_t kDim = 64, kKeys = 40, kHeads = 4;
  std::vector<TestType> k(kKeys * kDim, TestType(0.0f)), v(kKeys * kDim);
  for (std::size_t j = 0; j < kKeys; ++j) {
    k[j * kDim] = k[j * kDim + 1] = TestType(2048.0f * static_cast<float>(j % 16));
    for (std::size_t d = 0; d < kDim; ++d) {
      v[j * kDim + d] = TestType(static_cast<float>((7 * j + 3 * d) % 13) / 13.0f - 0.5f);
    }
  }
  std::vector<float> q(kHeads * kDim, 0.0f), expect(kHeads * kDim, 0.0f);
  for (std::size_t h = 0; h < kHeads; ++h) {
    const float pow2 = static_cast<float>(1u << h);
    q[h * kDim] = (1.0f + 0x1p-9f + 0x1p-17f) * pow2;
    q[h * kDim + 1] = -(1.0f + 0x1p-9f) * pow2;
    double sum = 0.0;
    std::vector<double> acc(kDim, 0.0);
    for (std::size_t j = 0; j < kKeys; ++j) {
      const double w = std::exp(static_cast<double>(pow2) * static_cast<double>(j % 16) / 64.0);
      sum += w;
      for (std::size_t d = 0; d < kDim; ++d) {
        acc[d] += w * static_cast<double>(kvcache::to_float(v[j * kDim + d]));
      }
    }
    for (std::size_t d = 0; d < kDim; ++d) {
      expect[h * kDim + d] = static_cast<float>(acc[d] / sum);
    }
  }
  auto dk = upload(k), dv = upload(v);
  auto dq = upload(q);
  auto dlen = upload(std::vector<std::int64_t>{static_cast<std::int64_t>(kKeys)});
  const kcuda::DeviceKVView<TestType> view{.k = dk.data(),
                                           .v = dv.data(),
                                           .num_seqs = 1,
                                           .num_kv_heads = 1,
                                           .head_dim = static_cast<int>(kDim),
                                           .seq_stride = static_cast<std::int64_t>(kKeys * kDim),
                                           .head_stride = static_cast<std::int64_t>(kKeys * kDim),
                                           .length = dlen.data(),
                                           .max_keys = static_cast<std::int64_t>(kKeys)};
  const AttentionOptions opts{.scale = 1.0f};
  for (const kcuda::DecodeKernel kernel :
       {kcuda::DecodeKernel::tensor_cores, kcuda::DecodeKernel::tensor_cores_per_warp}) {
    const auto setup = kcuda::make_decode_setup<TestType>(kHeads, 1, kDim, kernel);
    const std::size_t ws_bytes =
        kcuda::decode_workspace_bytes(view, static_cast<int>(kHeads), opts, &setup);
    kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
    kcuda::DeviceBuffer<float> dout(q.size());
    kcuda::launch_decode_attention(view, dq.data(), dout.data(), static_cast<int>(kHeads), opts,
                                   ws.data(), ws_bytes, nullptr, &setup);
    kcuda::check(cudaDeviceSynchronize(), "decode");
    INFO("kernel " << kcuda::decode_kernel_name(kernel));
    kvcache::test::check_close(download(dout.data(), q.size()), expect,
                               decode_tolerance<TestType>());
  }
}

TEMPLATE_TEST_CASE("CUDA prefill attention equals the CPU reference", "[cuda][prefill]", float,
                   kvcache::half, bfloat16, kvcache::qint8, kvcache::fp8_e4m3, HalfInt8, Fp8Bf16,
                   Int8Fp8, HalfBf16) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-prefill");
  using Operand = kcuda::detail::prefill_operand_t<TestType>;
  for (kcuda::Layout layout : kLayouts) {
#if defined(__SANITIZE_ADDRESS__)
    // int8/fp8 under AddressSanitizer (5x slower): the paged layout; the plain build runs all
    if (kQuantizedOrPair<TestType> && layout != kcuda::Layout::paged) continue;
#endif
    // 256: one K/V buffer for fp16/bf16 (tf32 tiles reject it), as for tf32 tiles at 128
    const std::vector<std::size_t> dims = std::is_same_v<Operand, float>
                                              ? std::vector<std::size_t>{64, 128}
                                              : std::vector<std::size_t>{64, 128, 256};
    for (std::size_t dim : dims) {
      const std::size_t kv_heads = 2, group = 2, q_heads = kv_heads * group;
      const Twin t{layout, 1, kv_heads, dim, 3, 700, 300, 2, 200};
      kcuda::DeviceCache<TestType> dev(device_config(t));
      CpuTwin<TestType> cpu(t);
      const std::vector<std::size_t> cached{300, 0, 129};  // prefix already in the cache
      const std::vector<std::size_t> fresh{130, 65, 200};  // then this many new tokens each
      std::vector<std::size_t> total(3);
      for (std::size_t s = 0; s < 3; ++s) total[s] = cached[s] + fresh[s];
      fill(dev, cpu, t, rng, total);  // K/V of all tokens, new ones included, are appended
      AttentionOptions opts;
      const kvcache::Rope rope({.pairing = kvcache::RopePairing::neox}, dim);
      if (layout == kcuda::Layout::ring) {
        opts.window = t.window;
        opts.num_sink_tokens = t.sinks;
        if (dim == 128) {  // StreamingLLM positions: the sinks' scores with q turned back
          opts.positions = kvcache::PositionMode::cache_relative;
          opts.rope = &rope;
        }
      }
      std::vector<std::int32_t> offsets{0};
      for (std::size_t s = 0; s < 3; ++s)
        offsets.push_back(offsets.back() + static_cast<std::int32_t>(fresh[s]));
      const std::size_t rows = static_cast<std::size_t>(offsets.back());
      const auto q = kvcache::test::normal_floats(rng, rows * q_heads * dim);
      auto dq = upload(q);
      auto doff = upload(offsets);
      kcuda::DeviceBuffer<float> dout(q.size());
      kcuda::check(cudaMemset(dout.data(), 0xff, dout.bytes()), "poison");
      dev.check_attention(0, fresh, opts);
      const std::size_t ws_bytes =
          kcuda::prefill_workspace_bytes(dev.view(0), static_cast<int>(q_heads), 200, opts);
      REQUIRE((ws_bytes == 0) == (opts.positions == kvcache::PositionMode::absolute));
      kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
      kvcache::attend(
          TokenBlock<const float>{std::span<const float>(dq.data(), q.size()), rows, q_heads, dim},
          dev.view(0),
          TokenBlock<float>{std::span<float>(dout.data(), q.size()), rows, q_heads, dim}, opts,
          kcuda::DeviceAttendArgs{.workspace = ws.data(),
                                  .workspace_bytes = ws_bytes,
                                  .q_offsets = doff.data(),
                                  .max_q_len = 200});
      kcuda::check(cudaDeviceSynchronize(), "prefill");
      const auto got = download(dout.data(), q.size());
      for (std::size_t s = 0; s < 3; ++s) {
        const std::size_t n = fresh[s], first = static_cast<std::size_t>(offsets[s]);
        std::vector<float> expect(n * q_heads * dim);
        cpu.with_view(0, s, [&](const auto& cv) {
          reference::attend(
              {std::span<const float>(q).subspan(first * q_heads * dim, n * q_heads * dim), n,
               q_heads, dim},
              cv, {expect, n, q_heads, dim}, opts);
        });
        INFO("layout " << static_cast<int>(layout) << " dim " << dim << " seq " << s
                       << " cache_relative "
                       << (opts.positions == kvcache::PositionMode::cache_relative));
        kvcache::test::check_close(
            std::span<const float>(got).subspan(first * q_heads * dim, n * q_heads * dim), expect,
            prefill_tolerance<TestType>());
      }
    }
  }
}

TEST_CASE("CUDA cache_relative positions refuse a RoPE of another head_dim and short workspace",
          "[cuda]") {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-cache-relative-errors");
  const Twin t{kcuda::Layout::ring, 1, 1, 64, 2, 400, 32, 2, 64};
  kcuda::DeviceCache<kvcache::half> dev(device_config(t));
  CpuTwin<kvcache::half> cpu(t);
  fill(dev, cpu, t, rng, {100, 70});
  const kvcache::Rope wrong({}, 32), right({}, 64);
  AttentionOptions opts{.window = 32,
                        .num_sink_tokens = 2,
                        .positions = kvcache::PositionMode::cache_relative,
                        .rope = &wrong};
  const auto q = kvcache::test::normal_floats(rng, 2 * 2 * 64);
  auto dq = upload(q);
  kcuda::DeviceBuffer<float> dout(q.size());
  const TokenBlock<const float> qb{std::span<const float>(dq.data(), q.size()), 2, 2, 64};
  const TokenBlock<float> ob{std::span<float>(dout.data(), q.size()), 2, 2, 64};
  kcuda::DeviceBuffer<unsigned char> ws(1 << 20);
  using kvcache::test::require_throws;
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(
            qb, dev.view(0), ob, opts,
            kcuda::DeviceAttendArgs{.workspace = ws.data(), .workspace_bytes = 1 << 20});
      },
      "RoPE for head_dim 32", "head_dim 64");
  opts.rope = &right;
  const std::size_t need = kcuda::decode_workspace_bytes(dev.view(0), 2, opts);
  REQUIRE(need >= 2 * 2 * 2 * sizeof(float));  // the sink scores at least
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(
            qb, dev.view(0), ob, opts,
            kcuda::DeviceAttendArgs{.workspace = ws.data(), .workspace_bytes = need - 1});
      },
      "workspace of " + std::to_string(need - 1) + " bytes, needs " + std::to_string(need));
  const std::vector<std::int32_t> offsets{0, 1, 2};
  auto doff = upload(offsets);
  const std::size_t prefill_need = kcuda::prefill_workspace_bytes(dev.view(0), 2, 1, opts);
  REQUIRE(prefill_need > 0);
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(qb, dev.view(0), ob, opts,
                        kcuda::DeviceAttendArgs{.q_offsets = doff.data(), .max_q_len = 1});
      },
      "CUDA prefill attention: workspace of 0 bytes, needs " + std::to_string(prefill_need));
}

TEST_CASE("CUDA launchers and DeviceCache reject bad input with the numbers", "[cuda]") {
  if (!have_device()) return;
  using kvcache::test::require_throws;
  kcuda::DeviceCache<kvcache::half> dev({.layout = kcuda::Layout::paged,
                                         .num_layers = 1,
                                         .num_kv_heads = 1,
                                         .head_dim = 64,
                                         .max_batch = 2,
                                         .max_seq_len = 64,
                                         .block_size = 16,
                                         .num_blocks = 3});
  kcuda::DeviceBuffer<float> kv(64 * 64);
  const std::vector<std::size_t> seq0{0}, seq1{1}, n40{40}, n20{20}, n70{70};
  dev.append(0, seq0, n40, kv.data(), kv.data(), nullptr);  // 3 blocks: pool now empty
  require_throws<kvcache::capacity_error>(
      [&] { dev.append(0, seq1, n20, kv.data(), kv.data(), nullptr); }, "needs 2 blocks",
      "has 0 free");
  require_throws<kvcache::capacity_error>(
      [&] { dev.append(0, seq0, n70, kv.data(), kv.data(), nullptr); }, "max_seq_len 64",
      "holds 40");
  require_throws<kvcache::batch_error>(
      [&] { dev.append(0, std::vector<std::size_t>{2}, n20, kv.data(), kv.data(), nullptr); },
      "sequence 2");
  REQUIRE(dev.seq_length(0) == 40);
  dev.crop(0, 16, nullptr);
  REQUIRE(dev.free_blocks() == 2);
  dev.reset(0, nullptr);
  REQUIRE(dev.free_blocks() == 3);
  kcuda::DeviceCache<kvcache::half> odd(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 96, .max_seq_len = 8});
  dev.append(0, seq0, std::vector<std::size_t>{1}, kv.data(), kv.data(), nullptr);
  odd.append(0, seq0, std::vector<std::size_t>{1}, kv.data(), kv.data(), nullptr);
  kcuda::DeviceBuffer<float> q(96), out(96);
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(TokenBlock<const float>{std::span<const float>(q.data(), 96), 1, 1, 96},
                        odd.view(0), TokenBlock<float>{std::span<float>(out.data(), 96), 1, 1, 96},
                        AttentionOptions{}, kcuda::DeviceAttendArgs{});
      },
      "head_dim 96", "64, 128, 256");
  // a DecodeSetup serves only the dtype, head_dim, group and device it was made for
  const auto setup = kcuda::make_decode_setup<kvcache::half>(2, 1, 64);
  kcuda::DeviceBuffer<float> q2(2 * 2 * 64), out2(2 * 2 * 64);  // 2 sequences x up to 2 heads
  kcuda::check(cudaMemset(q2.data(), 0, q2.bytes()), "zero q");
  const auto decode = [&](int q_heads, const kcuda::DecodeSetup& s) {
    kcuda::launch_decode_attention(dev.view(0), q2.data(), out2.data(), q_heads, AttentionOptions{},
                                   nullptr, 0, nullptr, &s);
  };
  decode(2, setup);
  require_throws<kvcache::shape_error>([&] { decode(1, setup); }, "group 2", "used for f16",
                                       "group 1");
  require_throws<kvcache::shape_error>(
      [&] { decode(1, kcuda::make_decode_setup<kvcache::bfloat16>(1, 1, 64)); }, "for bf16",
      "used for f16");
  require_throws<kvcache::shape_error>(
      [&] { decode(1, kcuda::make_decode_setup<kvcache::half>(1, 1, 128)); }, "head_dim 128",
      "used for f16, head_dim 64");
  require_throws<kvcache::shape_error>([&] { decode(1, kcuda::DecodeSetup{}); }, "0 SMs");
  auto elsewhere = setup;
  elsewhere.device += 7;
  require_throws<kvcache::shape_error>([&] { decode(2, elsewhere); }, "DecodeSetup of device",
                                       "used on device");
  // int8 and fp8 decode on CUDA cores only
  require_throws<kvcache::shape_error>(
      [&] {
        (void)kcuda::make_decode_setup<kvcache::qint8>(2, 1, 64, kcuda::DecodeKernel::tensor_cores);
      },
      "tensor_cores", "does not serve int8");
  kcuda::check(cudaDeviceSynchronize(), "errors");
}

// The host-side pieces of the kernels' logic run here, on the CPU, also where no device is.

TEST_CASE("visible_keys lists every present key a validated mask lets the queries see", "[cuda]") {
  auto rng = kvcache::test::make_rng("cuda-visible-keys");
  int checked = 0, evicted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const auto length = static_cast<std::int64_t>(kvcache::test::uniform(rng, 0, 300));
    const auto cache_sinks = static_cast<std::int64_t>(kvcache::test::uniform(rng, 0, 8));
    kcuda::detail::KeyRange present;
    present.length = length;
    present.sink_end = std::min(length, cache_sinks);
    const bool keep_all = kvcache::test::uniform(rng, 0, 2) == 0;  // else a random gap
    present.recent_begin =
        keep_all || length <= cache_sinks
            ? present.sink_end
            : present.sink_end + static_cast<std::int64_t>(kvcache::test::uniform(
                                     rng, 0, static_cast<std::size_t>(length - present.sink_end)));
    if (length == 0) continue;
    const auto n =
        static_cast<position_t>(kvcache::test::uniform(rng, 1, static_cast<std::size_t>(length)));
    AttentionOptions opts;
    opts.causal = kvcache::test::uniform(rng, 0, 9) != 0;
    if (opts.causal && kvcache::test::uniform(rng, 0, 2) != 0) {
      const std::int64_t first = length - n;
      if (present.recent_begin > present.sink_end && first >= present.recent_begin &&
          kvcache::test::uniform(rng, 0, 3) != 0) {
        // a window the evicted gap allows (what a sliding-window cache is used with)
        opts.window = kvcache::test::uniform(
            rng, 1, static_cast<std::size_t>(first - present.recent_begin + 1));
        opts.num_sink_tokens =
            kvcache::test::uniform(rng, 0, static_cast<std::size_t>(present.sink_end));
      } else {
        opts.window = kvcache::test::uniform(rng, 1, 320);
        opts.num_sink_tokens = kvcache::test::uniform(rng, 0, 10);
      }
    }
    try {
      kvcache::detail::check_query_positions(n, std::nullopt, length, present.sink_end,
                                             present.recent_begin, opts);
    } catch (const kvcache::position_error&) {
      continue;  // the launchers' callers check first (DeviceCache::check_attention)
    }
    const kcuda::DeviceMask mask{opts.causal, static_cast<std::int64_t>(opts.window),
                                 static_cast<std::int64_t>(opts.num_sink_tokens)};
    const std::int64_t first = length - n;
    const kcuda::detail::KeyRange list = kcuda::detail::visible_keys(present, mask, first);
    INFO("length " << length << " present [0, " << present.sink_end << ") + ["
                   << present.recent_begin << ", " << length << "), causal " << opts.causal
                   << " window " << opts.window << " sinks " << opts.num_sink_tokens
                   << ", queries from " << first << "; list [0, " << list.sink_end << ") + ["
                   << list.recent_begin << ", " << list.length << ")");
    auto is_present = [&](std::int64_t p) {
      return p >= 0 && p < length && (p < present.sink_end || p >= present.recent_begin);
    };
    std::vector<bool> listed(static_cast<std::size_t>(length), false);
    std::int64_t prev = -1;
    for (std::int64_t i = 0; i < list.count(); ++i) {
      const std::int64_t p = list.pos(i);
      if (!is_present(p) || p <= prev) {  // increasing: kernels stop at the first key past a query
        INFO("listed key " << p << " after " << prev);
        REQUIRE((is_present(p) && p > prev));
      }
      prev = p;
      listed[static_cast<std::size_t>(p)] = true;
    }
    for (std::int64_t qpos = first; qpos < length; ++qpos) {
      for (std::int64_t p = 0; p < length; ++p) {
        if (is_present(p) && mask.visible(qpos, p) && !listed[static_cast<std::size_t>(p)]) {
          INFO("query " << qpos << " sees key " << p);
          REQUIRE(listed[static_cast<std::size_t>(p)]);
        }
      }
    }
    ++checked;
    if (present.recent_begin > present.sink_end && opts.window > 0) ++evicted;
  }
  INFO(checked << " checked, " << evicted << " with a window over an evicted gap");
  REQUIRE(checked > 8000);
  REQUIRE(evicted > 2000);
}

TEST_CASE("CUDA launchers reject bad shapes before touching the device", "[cuda]") {
  using kvcache::test::require_throws;
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::decode_workspace_bytes<kvcache::half>(4, 6, 4, 128, 1000); },
      "num_q_heads 6", "num_kv_heads 4");
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::decode_workspace_bytes<kvcache::half>(4, 8, 4, 96, 1000); }, "head_dim 96",
      "64, 128, 256");
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::make_decode_setup<kvcache::half>(6, 4, 128); }, "num_q_heads 6");
  require_throws<kvcache::shape_error>([] { (void)kcuda::make_decode_setup<float>(8, 4, 80); },
                                       "head_dim 80", "64, 128, 256");
  require_throws<kvcache::shape_error>(
      [] {
        (void)kcuda::make_decode_setup<float>(8, 4, 128,
                                              kcuda::DecodeKernel::tensor_cores_per_warp);
      },
      "decode kernel tensor_cores_per_warp (2) does not serve f32");
}

// ---- inf and NaN in q, K and V -----------------------------------------------------------------

namespace {

// The test's own mask: may a query at qpos see the key at kpos?
bool sees(const AttentionOptions& o, std::int64_t qpos, std::int64_t kpos) {
  if (!o.causal) return true;
  if (kpos > qpos) return false;
  return o.window == 0 || kpos > qpos - static_cast<std::int64_t>(o.window) ||
         kpos < static_cast<std::int64_t>(o.num_sink_tokens);
}

// K/V of a batch in format F (one element type or a K/V pair) put in device memory by hand,
// contiguous ([seq][head][slot][dim]) or paged (16-token blocks, the pool's blocks in reverse
// order and block 0 unused), so that a test can plant an inf or NaN in any one element. Every
// slot no key occupies holds NaN (an int8 or fp8 side: a NaN scale). Rows are written as the
// caches write them (quantize_row, each side in its format).
template <kvcache::KVFormat F>
struct HandKV {
  using K = kvcache::key_format_t<F>;
  using V = kvcache::value_format_t<F>;
  kcuda::DeviceBuffer<K> k;
  kcuda::DeviceBuffer<V> v;
  kcuda::DeviceBuffer<kvcache::scale_type> k_scale, v_scale;
  kcuda::DeviceBuffer<kvcache::block_id> table;
  kcuda::DeviceBuffer<std::int64_t> length;
  kcuda::DeviceKVView<F> view;
};

// keys[s] and values[s]: [lengths[s]][heads][dim] floats of sequence s.
template <kvcache::KVFormat T>
std::unique_ptr<HandKV<T>> hand_kv(kcuda::Layout layout,
                                   const std::vector<std::vector<float>>& keys,
                                   const std::vector<std::vector<float>>& values,
                                   const std::vector<std::int64_t>& lengths, int heads, int dim) {
  const int batch = static_cast<int>(lengths.size());
  const std::int64_t cap = std::max<std::int64_t>(
      16, (*std::max_element(lengths.begin(), lengths.end()) + 15) / 16 * 16);
  auto h = std::make_unique<HandKV<T>>();
  kcuda::DeviceKVView<T>& v = h->view;
  v.num_seqs = batch;
  v.num_kv_heads = heads;
  v.head_dim = dim;
  v.layout = layout;
  v.max_keys = *std::max_element(lengths.begin(), lengths.end());
  std::vector<kvcache::block_id> table;
  std::size_t elements = 0;
  if (layout == kcuda::Layout::paged) {
    v.max_blocks = static_cast<int>(cap / 16);
    v.block_size = 16;
    v.head_stride = 16 * dim;
    v.block_stride = v.head_stride * heads;
    const int num_blocks = batch * v.max_blocks + 1;
    for (int i = 0; i < batch * v.max_blocks; ++i)
      table.push_back(static_cast<kvcache::block_id>(num_blocks - 1 - i));
    elements = static_cast<std::size_t>(num_blocks * v.block_stride);
  } else {
    v.head_stride = cap * dim;
    v.seq_stride = v.head_stride * heads;
    elements = static_cast<std::size_t>(batch * v.seq_stride);
  }
  using K = typename HandKV<T>::K;
  using V = typename HandKV<T>::V;
  constexpr bool k_scaled = kvcache::scaled_v<K>, v_scaled = kvcache::scaled_v<V>;
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  std::vector<K> k(elements);
  std::vector<V> val(elements);
  if constexpr (Element<K>) std::fill(k.begin(), k.end(), kvcache::from_float<K>(kNan));
  if constexpr (Element<V>) std::fill(val.begin(), val.end(), kvcache::from_float<V>(kNan));
  const auto d = static_cast<std::size_t>(dim);
  std::vector<kvcache::scale_type> ks(k_scaled ? elements / d : 0, kvcache::scale_type(kNan));
  std::vector<kvcache::scale_type> vs(v_scaled ? elements / d : 0, kvcache::scale_type(kNan));
  for (int s = 0; s < batch; ++s) {
    for (std::int64_t p = 0; p < lengths[static_cast<std::size_t>(s)]; ++p) {
      for (int head = 0; head < heads; ++head) {
        const auto at = static_cast<std::size_t>(host_row_offset(v, table, s, head, p));
        const auto from = static_cast<std::size_t>((p * heads + head) * dim);
        kvcache::quantize_row(keys[static_cast<std::size_t>(s)].data() + from, d, k.data() + at,
                              k_scaled ? ks.data() + at / d : nullptr);
        kvcache::quantize_row(values[static_cast<std::size_t>(s)].data() + from, d, val.data() + at,
                              v_scaled ? vs.data() + at / d : nullptr);
      }
    }
  }
  h->k = upload(k);
  h->v = upload(val);
  h->length = upload(lengths);
  v.k = h->k.data();
  v.v = h->v.data();
  if constexpr (k_scaled) {
    h->k_scale = upload(ks);
    v.k_scale = h->k_scale.data();
  }
  if constexpr (v_scaled) {
    h->v_scale = upload(vs);
    v.v_scale = h->v_scale.data();
  }
  v.length = h->length.data();
  if (!table.empty()) {
    h->table = upload(table);
    v.block_table = h->table.data();
  }
  return h;
}

// Output rows [rows][heads][dim]: row r, head h NaN throughout when nan(r, h), else the same bits
// as in `base` (with `rounding` > 0: finite, and within rounding x (|base| + 1) of it).
template <class Nan>
void require_nan_rows(const std::vector<float>& got, const std::vector<float>& base,
                      std::size_t rows, std::size_t heads, std::size_t dim, Nan&& nan,
                      float rounding = 0.0f) {
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t at = (r * heads + h) * dim;
      INFO("row " << r << " head " << h << ": first element " << got[at] << ", finite run "
                  << base[at]);
      if (nan(r, h)) {
        for (std::size_t x = 0; x < dim; ++x) REQUIRE(std::isnan(got[at + x]));
      } else if (rounding == 0.0f) {
        REQUIRE(std::memcmp(got.data() + at, base.data() + at, dim * sizeof(float)) == 0);
      } else {
        for (std::size_t x = 0; x < dim; ++x) {
          REQUIRE(std::abs(got[at + x] - base[at + x]) <= rounding * (std::abs(base[at + x]) + 1));
        }
      }
    }
  }
}

// One planted value: `value` at element x of the K (or V) row of (seq, kv_head, pos).
struct Plant {
  bool value_side;
  std::size_t seq, kv_head;
  std::int64_t pos;
  std::size_t x;
  float value;
};

}  // namespace

TEMPLATE_TEST_CASE(
    "CUDA decode and prefill: inf or NaN in q, or in a seen key's K or V, makes exactly the rows "
    "that see it NaN; unseen ones change no bit",
    "[cuda][nonfinite]", float, kvcache::half, bfloat16, kvcache::qint8, kvcache::fp8_e4m3,
    HalfInt8, Fp8Bf16) {
  if (!have_device()) return;
  using T = TestType;
  auto rng = kvcache::test::make_rng("cuda-nonfinite");
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
  constexpr std::size_t dim = 64, kv_heads = 2, group = 4, q_heads = kv_heads * group;
  const auto tokens = [&](std::int64_t n) {  // values exact in every element type
    return kvcache::test::rounded<bfloat16>(
        kvcache::test::normal_floats(rng, static_cast<std::size_t>(n) * kv_heads * dim));
  };
  // Under AddressSanitizer (kernels emulated on the CPU, 5x slower) the paged layout, decode
  // with the default options and prefill with a window only: the memory errors it looks for do
  // not depend on the masks (the plain build runs every case).
#if defined(__SANITIZE_ADDRESS__)
  constexpr bool kQuick = true;
#else
  constexpr bool kQuick = false;
#endif
  const auto planted = [](std::vector<std::vector<float>> kv, const Plant& p) {
    kv[p.seq][(static_cast<std::size_t>(p.pos) * kv_heads + p.kv_head) * dim + p.x] = p.value;
    return kv;
  };
  for (kcuda::Layout layout : {kcuda::Layout::paged, kcuda::Layout::contiguous}) {
    if (kQuick && layout != kcuda::Layout::paged) continue;
    // Decode: 600 keys (split-K: the merge sees the NaN partial), an empty sequence whose q is
    // NaN (zeros: it sees no key), 77 keys (keys in the first split only).
    const std::vector<std::int64_t> lengths{600, 0, 77};
    std::vector<std::vector<float>> keys, values;
    for (std::int64_t n : lengths) {
      keys.push_back(tokens(n));
      values.push_back(tokens(n));
    }
    auto q = kvcache::test::normal_floats(rng, lengths.size() * q_heads * dim);
    std::fill(q.begin() + q_heads * dim, q.begin() + 2 * q_heads * dim, kNan);
    std::vector<kcuda::DecodeKernel> kernels{kcuda::default_decode_kernel<T>};
    if constexpr (!kcuda::kCudaCoreDecode<T>) {
      kernels.push_back(kcuda::DecodeKernel::tensor_cores_per_warp);
    }
    for (const AttentionOptions& opts :
         {AttentionOptions{}, AttentionOptions{.window = 100, .num_sink_tokens = 4},
          AttentionOptions{.scale = 0.2f, .softcap = 5.0f}}) {
      if (kQuick && (opts.window != 0 || opts.softcap != 0.0f)) continue;
      for (const kcuda::DecodeKernel kernel : kernels) {
        INFO("decode, layout " << static_cast<int>(layout) << " kernel "
                               << kcuda::decode_kernel_name(kernel) << " window " << opts.window
                               << " softcap " << opts.softcap);
        const auto setup = kcuda::make_decode_setup<T>(q_heads, kv_heads, dim, kernel);
        const auto run = [&](const std::vector<float>& qq,
                             const std::vector<std::vector<float>>& kk,
                             const std::vector<std::vector<float>>& vv, std::size_t* ws_out) {
          const auto hk = hand_kv<T>(layout, kk, vv, lengths, kv_heads, dim);
          const std::size_t ws_bytes =
              kcuda::decode_workspace_bytes(hk->view, static_cast<int>(q_heads), opts, &setup);
          if (ws_out != nullptr) *ws_out = ws_bytes;
          kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
          auto dq = upload(qq);
          kcuda::DeviceBuffer<float> dout(qq.size());
          kcuda::launch_decode_attention(hk->view, dq.data(), dout.data(),
                                         static_cast<int>(q_heads), opts, ws.data(), ws_bytes,
                                         nullptr, &setup);
          kcuda::check(cudaDeviceSynchronize(), "decode");
          return download(dout.data(), qq.size());
        };
        std::size_t ws_bytes = 0;
        const auto base = run(q, keys, values, &ws_bytes);
        if (opts.window == 0) REQUIRE(ws_bytes > 0);  // split-K, merged by decode_merge_kernel
        for (std::size_t i = 0; i < base.size(); ++i) {
          if (i / (q_heads * dim) == 1) {
            REQUIRE(base[i] == 0.0f);  // the empty sequence, NaN q
          } else {
            REQUIRE(std::isfinite(base[i]));
          }
        }
        // q: that head only
        for (const auto& [s, h, bad] : {std::tuple{std::size_t{0}, std::size_t{5}, kInfinity},
                                        std::tuple{std::size_t{2}, std::size_t{0}, kNan},
                                        std::tuple{std::size_t{0}, std::size_t{2}, -kInfinity}}) {
          auto bad_q = q;
          bad_q[(s * q_heads + h) * dim + 7] = bad;
          INFO("q[" << s << "][" << h << "] = " << bad);
          require_nan_rows(run(bad_q, keys, values, nullptr), base, lengths.size(), q_heads, dim,
                           [&](std::size_t r, std::size_t rh) { return r == s && rh == h; });
        }
        // K and V: seen keys (the first, the last, one mid-split, a sink), keys outside the
        // window
        const std::vector<Plant> plants{
            {false, 0, 0, 0, 3, kInfinity},     {true, 0, 1, 0, 60, kNan},
            {false, 0, 1, 250, 5, kNan},        {true, 0, 0, 300, 0, -kInfinity},
            {false, 0, 0, 599, 63, -kInfinity}, {true, 0, 1, 599, 1, kInfinity},
            {true, 0, 0, 2, 9, kInfinity},      {false, 2, 1, 40, 2, kNan},
            {true, 2, 0, 76, 8, kNan}};
        for (const Plant& p : plants) {
          INFO((p.value_side ? "V" : "K") << " of seq " << p.seq << " head " << p.kv_head << " pos "
                                          << p.pos << " = " << p.value);
          const auto got = run(q, p.value_side ? keys : planted(keys, p),
                               p.value_side ? planted(values, p) : values, nullptr);
          require_nan_rows(got, base, lengths.size(), q_heads, dim,
                           [&](std::size_t r, std::size_t h) {
                             return r == p.seq && h / group == p.kv_head &&
                                    sees(opts, lengths[p.seq] - 1, p.pos);
                           });
        }
      }
    }

    // Prefill: sequence 0 holds 70 cached tokens and 60 new ones (positions 70..129), sequence
    // 1 20 new ones; causal, so a value planted at a later token of the chunk touches none of
    // the earlier rows.
    const std::vector<std::int64_t> total{130, 20};
    const std::vector<std::int32_t> offsets{0, 60, 80};
    std::vector<std::vector<float>> pk, pv;
    for (std::int64_t n : total) {
      pk.push_back(tokens(n));
      pv.push_back(tokens(n));
    }
    const auto pq = kvcache::test::normal_floats(rng, 80 * q_heads * dim);
    auto doff = upload(offsets);
    const auto row_pos = [&](std::size_t r, std::size_t& seq) {
      seq = r < 60 ? 0 : 1;
      const std::int64_t first = total[seq] - (offsets[seq + 1] - offsets[seq]);
      return first + static_cast<std::int64_t>(r) - offsets[seq];
    };
    for (const AttentionOptions& opts :
         {AttentionOptions{}, AttentionOptions{.window = 20, .num_sink_tokens = 2},
          AttentionOptions{.scale = 0.2f, .softcap = 5.0f}, AttentionOptions{.causal = false}}) {
      if (kQuick && opts.window == 0) continue;
      INFO("prefill, layout " << static_cast<int>(layout) << " window " << opts.window
                              << " softcap " << opts.softcap << " causal " << opts.causal);
      const auto run = [&](const std::vector<float>& qq, const std::vector<std::vector<float>>& kk,
                           const std::vector<std::vector<float>>& vv) {
        const auto hk = hand_kv<T>(layout, kk, vv, total, kv_heads, dim);
        auto dq = upload(qq);
        kcuda::DeviceBuffer<float> dout(qq.size());
        kcuda::launch_prefill_attention(hk->view, dq.data(), dout.data(), static_cast<int>(q_heads),
                                        doff.data(), 60, opts, nullptr);
        kcuda::check(cudaDeviceSynchronize(), "prefill");
        return download(dout.data(), qq.size());
      };
      const auto base = run(pq, pk, pv);
      for (float x : base) REQUIRE(std::isfinite(x));
      for (const auto& [r, h, bad] : {std::tuple{std::size_t{10}, std::size_t{2}, kNan},
                                      std::tuple{std::size_t{65}, std::size_t{7}, kInfinity}}) {
        auto bad_q = pq;
        bad_q[(r * q_heads + h) * dim + 1] = bad;
        INFO("q row " << r << " head " << h << " = " << bad);
        require_nan_rows(run(bad_q, pk, pv), base, 80, q_heads, dim,
                         [&](std::size_t rr, std::size_t rh) { return rr == r && rh == h; });
      }
      // a later token of the chunk (100, 129), the cached prefix (5, 1), the first new token,
      // a sink
      const std::vector<Plant> plants{
          {true, 0, 0, 100, 4, kNan},        {false, 0, 1, 100, 4, kInfinity},
          {true, 0, 1, 129, 63, -kInfinity}, {false, 0, 0, 5, 0, -kInfinity},
          {true, 0, 0, 1, 17, kInfinity},    {true, 0, 1, 70, 2, kNan},
          {false, 1, 1, 10, 30, kNan},       {true, 1, 0, 19, 3, kInfinity}};
      for (const Plant& p : plants) {
        INFO((p.value_side ? "V" : "K") << " of seq " << p.seq << " head " << p.kv_head << " pos "
                                        << p.pos << " = " << p.value);
        const auto got =
            run(pq, p.value_side ? pk : planted(pk, p), p.value_side ? planted(pv, p) : pv);
        // V in int8/fp8: a bad V row may move the unseen rows of its tile by rounding
        // (prefill.cuh)
        const float rounding =
            kvcache::scaled_v<kvcache::value_format_t<T>> && p.value_side ? 1e-5f : 0.0f;
        require_nan_rows(
            got, base, 80, q_heads, dim,
            [&](std::size_t r, std::size_t h) {
              std::size_t seq = 0;
              const std::int64_t qpos = row_pos(r, seq);
              return seq == p.seq && h / group == p.kv_head && sees(opts, qpos, p.pos);
            },
            rounding);
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "context_shift, restore and read_rows of a DeviceCache equal the host cache's, every "
    "layout",
    "[cuda]", float, kvcache::qint8, kvcache::fp8_e4m3) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("device_context_shift");
  const kvcache::Rope rope({.base = 10000.0f}, 16);
  for (const kcuda::Layout layout : kLayouts) {
    // layers, heads, dim, batch, capacity, window, sinks, max_append: ring_len 11
    const Twin t{layout, 2, 2, 16, 3, 40, 8, 2, 4};
    INFO("layout " << static_cast<int>(layout));
    kcuda::DeviceCacheConfig config = device_config(t);
    config.num_blocks *= 2;  // paged: room for a shifted sequence's blocks beside its old ones
    kcuda::DeviceCache<TestType> dev(config);
    CpuTwin<TestType> cpu(t);
    fill(dev, cpu, t, rng, {30, 6, 17});
    int shifted = 0, refused = 0;
    for (int round = 0; round < 16; ++round) {
      const std::size_t s = kvcache::test::uniform(rng, 0, t.batch - 1);
      const std::size_t len = dev.seq_length(s);
      // past the end at times; for the ring, mostly n_keep = the sinks (what a window allows)
      const std::size_t keep =
          layout == kcuda::Layout::ring && kvcache::test::uniform(rng, 0, 3) != 0
              ? std::min(t.sinks, len)
              : kvcache::test::uniform(rng, 0, len);
      // round 0: one past the end, refused by both
      const std::size_t discard =
          round == 0 ? len - keep + 1 : kvcache::test::uniform(rng, 0, len - keep + 1);
      INFO("round " << round << ": sequence " << s << " of " << len << ", keep " << keep
                    << ", discard " << discard);
      std::string host_error, dev_error;
      try {
        if (cpu.ring) kvcache::context_shift(*cpu.ring, s, keep, discard, rope);
        if (cpu.flat) kvcache::context_shift(*cpu.flat, s, keep, discard, rope);
      } catch (const kvcache::error& e) {
        host_error = typeid(e).name();
      }
      try {
        kcuda::context_shift(dev, s, keep, discard, rope, nullptr);
      } catch (const kvcache::error& e) {
        dev_error = typeid(e).name();
      }
      REQUIRE(dev_error == host_error);
      (host_error.empty() ? shifted : refused) += 1;
      // the same positions and rows everywhere (read_rows against the host view, packed)
      for (std::size_t l = 0; l < t.layers; ++l) {
        for (std::size_t q = 0; q < t.batch; ++q) {
          cpu.with_view(l, q, [&](const auto& cv) {
            const kvcache::KeyRange r = dev.keys(l, q);
            REQUIRE(r.length == cv.length());
            REQUIRE(r.sink_end == cv.sink_end());
            REQUIRE(r.recent_begin == cv.recent_begin());
            const std::size_t rows = kvcache::view_num_tokens(cv) * t.heads, n = rows * t.dim;
            std::vector<TestType> hk(n), hv(n), dk(n), dv(n);
            // int8/fp8: the rows' scales too, packed as the rows
            const std::size_t scales = kvcache::scaled_v<TestType> ? rows : 0;
            std::vector<kvcache::scale_type> hks(scales), hvs(scales), dks(scales), dvs(scales);
            kvcache::detail::pack_view_rows(cv, hk.data(), hv.data(), hks.data(), hvs.data());
            if constexpr (kvcache::scaled_v<TestType>) {
              dev.read_rows(l, q, dk, dv, dks, dvs, nullptr);
            } else {
              dev.read_rows(l, q, dk, dv, nullptr);
            }
            REQUIRE(dk == hk);
            REQUIRE(dv == hv);
            REQUIRE(dks == hks);
            REQUIRE(dvs == hvs);
          });
        }
      }
      // and appends go on alike
      std::vector<std::size_t> more(t.batch);
      for (std::size_t q = 0; q < t.batch; ++q) {
        more[q] = layout == kcuda::Layout::ring
                      ? 3
                      : std::min<std::size_t>(3, t.capacity - dev.seq_length(q));
      }
      fill(dev, cpu, t, rng, more);
    }
    INFO(shifted << " shifts, " << refused << " refused alike");
    CHECK(shifted >= 3);
    CHECK(refused >= 1);
    std::string first_mismatch;
    CHECK(count_mismatches(dev, cpu, t, first_mismatch) == 0);
    if (layout != kcuda::Layout::paged) {
      const kvcache::SequenceTokens ids[] = {{.seq = 0, .ids = {}}};
      kvcache::test::require_throws<kvcache::shape_error>([&] { dev.restore({}, ids, nullptr); },
                                                          "only the paged layout keeps token ids");
    }
  }
}
