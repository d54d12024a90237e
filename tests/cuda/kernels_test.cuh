// SPDX-License-Identifier: Apache-2.0
// What the CUDA kernels' tests share (cuda_decode_test.cu and cuda_prefill_test.cu, two
// translation units of one executable, test.cuda.cuda_kernels_test, so that the compiler builds
// the decode and the prefill kernels side by side): a DeviceCache's CPU twin filled with the same
// tokens, host copies of the device's rows, K/V views made by hand so that a test can plant an inf
// or NaN in any element, and the tolerances.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "device_support.cuh"
#include "kvcache/cuda/cuda.cuh"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/sanitizers.hpp"
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

namespace kvcache::test::cuda_kernels {

// for the test files, which use this namespace
using test::download;
using test::have_device;
using test::upload;

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

inline kcuda::DeviceCacheConfig device_config(const Twin& t) {
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

// The formats the append, decode and nonfinite tests run (KVCACHE_TEST_CUDA_FORMATS) and the
// prefill test (KVCACHE_TEST_CUDA_PREFILL_FORMATS: also the pairs whose prefill operands are
// neither side's type). Under AddressSanitizer (kernels emulated on the CPU, 5x slower) one format
// of each storage arrangement: 32-bit, 16-bit (half; bf16 rows are laid out alike), 8-bit codes
// with row scales (int8; fp8 alike) and a pair each way (quantized V, quantized K). The memory
// errors it looks for are in where rows are read and written, which the formats of one
// arrangement share; the plain build runs every format.
#if KVCACHE_TEST_ASAN
#define KVCACHE_TEST_CUDA_FORMATS float, kvcache::half, kvcache::qint8, HalfInt8, Fp8Bf16
#define KVCACHE_TEST_CUDA_PREFILL_FORMATS KVCACHE_TEST_CUDA_FORMATS
#else
#define KVCACHE_TEST_CUDA_FORMATS \
  float, kvcache::half, bfloat16, kvcache::qint8, kvcache::fp8_e4m3, HalfInt8, Fp8Bf16
#define KVCACHE_TEST_CUDA_PREFILL_FORMATS KVCACHE_TEST_CUDA_FORMATS, Int8Fp8, HalfBf16
#endif

// int8, fp8 and the pairs: decode reads them on the CUDA-core kernel, whose arithmetic the
// float cases check; fewer cases add the reading of their codes, scales and sides.
template <class T>
inline constexpr bool kQuantizedOrPair = kcuda::kCudaCoreDecode<T> && !std::is_same_v<T, float>;

inline const kcuda::Layout kLayouts[] = {kcuda::Layout::contiguous, kcuda::Layout::ring,
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

// ---- inf and NaN in q, K and V -----------------------------------------------------------------

// Under AddressSanitizer (kernels emulated on the CPU, 5x slower) the nonfinite cases run the
// paged layout, decode with the default options and prefill with a window only: the memory
// errors it looks for do not depend on the masks (the plain build runs every case).
#if KVCACHE_TEST_ASAN
inline constexpr bool kQuickNonfinite = true;
#else
inline constexpr bool kQuickNonfinite = false;
#endif

// The test's own mask: may a query at qpos see the key at kpos?
inline bool sees(const AttentionOptions& o, std::int64_t qpos, std::int64_t kpos) {
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

// The decode and prefill nonfinite cases' shape: 2 KV heads of 64 dims, 4 query heads each; their
// planted values; the layouts they run; their K/V rows.
namespace nonfinite {

inline constexpr std::size_t dim = 64, kv_heads = 2, group = 4, q_heads = kv_heads * group;
inline constexpr float kInfinity = std::numeric_limits<float>::infinity();
inline constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// Paged and contiguous; paged only under AddressSanitizer (kQuickNonfinite).
inline std::vector<kcuda::Layout> layouts() {
  if (kQuickNonfinite) return {kcuda::Layout::paged};
  return {kcuda::Layout::paged, kcuda::Layout::contiguous};
}

// One planted value: `value` at element x of the K (or V) row of (seq, kv_head, pos).
struct Plant {
  bool value_side;
  std::size_t seq, kv_head;
  std::int64_t pos;
  std::size_t x;
  float value;
};

// n tokens' K or V rows ([n][kv_heads][dim]), with values exact in every element type.
inline std::vector<float> exact_tokens(std::mt19937_64& rng, std::int64_t n) {
  return rounded<bfloat16>(normal_floats(rng, static_cast<std::size_t>(n) * kv_heads * dim));
}

// kv ([seq][pos][kv_heads][dim] floats) with p planted.
inline std::vector<std::vector<float>> planted(std::vector<std::vector<float>> kv, const Plant& p) {
  kv[p.seq][(static_cast<std::size_t>(p.pos) * kv_heads + p.kv_head) * dim + p.x] = p.value;
  return kv;
}

}  // namespace nonfinite

}  // namespace kvcache::test::cuda_kernels
