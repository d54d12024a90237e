// SPDX-License-Identifier: Apache-2.0
// Decode attention for fp32, int8 and fp8 K/V and K/V format pairs on CUDA cores
// (DecodeKernel::cuda_cores).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstdint>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/decode_common.cuh"

namespace kvcache::cuda::detail {

/// Decode attention for fp32 K/V, for int8 and fp8 codes read directly, and for a KVFormats<K, V>
/// pair (each side read in its own format), on CUDA cores (fp16/bf16 K/V take
/// decode_attention_mma_kernel). A quantized row's K scale multiplies its q.k, and its V scale
/// the softmax weight of a key the query sees (a key it does not see keeps weight 0, whatever its
/// scale).
/// One block per (split, KV head x head chunk, sequence), its query token at position
/// length - 1; the block serves query heads [h0, h0 + ng) of the KV head. Per tile: partial q.k
/// for every (query head, key) — thread = (key, half of head_dim) so that a warp reads 32
/// consecutive padded rows without bank conflicts; an online-softmax update per query head (one
/// warp per head); then p.V accumulated in registers by (query head, dim) threads. Writes the
/// normalised output when num_splits == 1, else the unnormalised partial (acc, m, l) that
/// decode_merge_kernel combines. G = decode_head_bucket(chunk_group): the heads the p.V
/// accumulators are unrolled for.
template <KVFormat T, int D, int G>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(DeviceKVView<T> view, DecodeArgs args) {
  using K = key_format_t<T>;
  using V = value_format_t<T>;
  static_assert(kCudaCoreDecode<T>, "fp16/bf16 K/V: decode_attention_mma_kernel");
  static_assert(kDecodeThreads == 2 * kDecodeTile, "thread = (key, half of head_dim)");
  constexpr int kStages = decode_stages<T, D>();
  static_assert(decode_smem_bytes<T>(D, kMaxGroup, kStages) <= kMaxSmemBytes);
  constexpr int kKStride = tile_row_bytes<K>(D), kVStride = tile_row_bytes<V>(D);
  static_assert(G <= kMaxGroup && G * (D / 2) % kDecodeThreads == 0);
  constexpr int kPairs = G * (D / 2) / kDecodeThreads;  // float2 accumulators per thread
  constexpr int kElemsPer16 = 16 / static_cast<int>(sizeof(K));
  const DecodeBlockWork work = decode_block_work(view, args);
  const int split = work.split, seq = work.seq, kv_head = work.kv_head, h0 = work.h0, ng = work.ng;
  const std::int64_t qpos = work.qpos, begin = work.begin, end = work.end;
  const KeyRange keys = work.keys;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  extern __shared__ __align__(128) unsigned char smem[];
  char* tiles = reinterpret_cast<char*>(smem);  // K[stages] then V[stages]
  constexpr int kKTileBytes = kDecodeTile * kKStride, kVTileBytes = kDecodeTile * kVStride;
  auto k_tile_at = [&](int b) { return tiles + b * kKTileBytes; };
  auto v_tile_at = [&](int b) { return tiles + kStages * kKTileBytes + b * kVTileBytes; };
  std::int64_t* pos_tiles =
      reinterpret_cast<std::int64_t*>(tiles + kStages * (kKTileBytes + kVTileBytes));
  float* q_s = reinterpret_cast<float*>(pos_tiles + kStages * kDecodeTile);  // [ng][D]
  float* s_s = q_s + ng * D;                                                 // [2][ng][tile]
  float* m_s = s_s + 2 * ng * kDecodeTile;
  float* l_s = m_s + ng;
  float* corr_s = l_s + ng;
  float* k_scales = corr_s + ng;  // a quantized side: [stages][tile] K, then V, row scales
  float* v_scales = k_scales + kStages * kDecodeTile;

  for (int i = tid; i < ng * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    q_s[i] =
        args.q[(static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + g) * D + d] * args.scale;
  }
  for (int g = tid; g < ng; g += kDecodeThreads) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.0f;
  }
  float2 acc[kPairs];
#pragma unroll
  for (int a = 0; a < kPairs; ++a) acc[a] = make_float2(0.0f, 0.0f);
  const int num_pairs = (ng * (D / 2) + kDecodeThreads - 1) / kDecodeThreads;

  auto load = [&](std::int64_t i, int b) {
    load_kv_tile<T, D, kDecodeThreads, kDecodeTile>(
        view, seq, kv_head, keys, i, end, k_tile_at(b), v_tile_at(b), pos_tiles + b * kDecodeTile,
        tid, k_scales + b * kDecodeTile, v_scales + b * kDecodeTile);
  };
  auto compute = [&](std::int64_t, int buf) {
    const char* k_tile = k_tile_at(buf);
    const char* v_tile = v_tile_at(buf);
    const std::int64_t* pos_tile = pos_tiles + buf * kDecodeTile;
    [[maybe_unused]] const float* k_scale = k_scales + buf * kDecodeTile;
    [[maybe_unused]] const float* v_scale = v_scales + buf * kDecodeTile;

    {  // partial q.k over one half of head_dim, four query heads per pass over the row
      const int key = tid % kDecodeTile, part = tid / kDecodeTile;
      const K* krow = reinterpret_cast<const K*>(k_tile + key * kKStride) + part * (D / 2);
      const float* qrow = q_s + part * (D / 2);
      for (int g0 = 0; g0 < ng; g0 += 4) {
        float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (int d = 0; d < D / 2; d += kElemsPer16) {
          float kd[kElemsPer16];
          load16(krow + d, kd);
#pragma unroll
          for (int g = 0; g < 4; ++g) {
            if (g0 + g < ng) {
              const float4* qv = reinterpret_cast<const float4*>(qrow + (g0 + g) * D + d);
#pragma unroll
              for (int e = 0; e < kElemsPer16 / 4; ++e) {
                const float4 qq = qv[e];
                dot[g] += qq.x * kd[4 * e] + qq.y * kd[4 * e + 1] + qq.z * kd[4 * e + 2] +
                          qq.w * kd[4 * e + 3];
              }
            }
          }
        }
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          if (g0 + g < ng) s_s[(part * ng + g0 + g) * kDecodeTile + key] = dot[g];
        }
      }
    }
    __syncthreads();
    for (int g = warp; g < ng; g += kDecodeThreads / 32) {  // online softmax, warp per head
      float* s = s_s + g * kDecodeTile;
      const float* s_other = s_s + (ng + g) * kDecodeTile;
      float sc[2];
      bool bad = false, seen[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        const std::int64_t pos = pos_tile[j];
        float dot = s[j] + s_other[j];
        if constexpr (scaled_v<K>) dot *= k_scale[j];
        seen[h] = pos >= 0 && args.mask.visible(qpos, pos);
        sc[h] =
            transform_score(args.mask.score(dot, seq, 0, h0 + g, pos), args.softcap, seen[h], bad);
      }
      float p[2];
      online_softmax_step(sc, p, &m_s[g], &l_s[g], &corr_s[g], lane, bad);
      if constexpr (scaled_v<V>) {  // weights of the codes: the V scale folded in
        p[0] = seen[0] ? p[0] * v_scale[lane] : 0.0f;
        p[1] = seen[1] ? p[1] * v_scale[lane + 32] : 0.0f;
      }
      s[lane] = p[0];
      s[lane + 32] = p[1];
    }
    __syncthreads();
    // p.V: this thread owns the outputs o = a * kDecodeThreads + tid, each the dims
    // (d, d + 1) of query head o / (D / 2); D / 2 divides kDecodeThreads, so they share the same
    // d and each V pair of the tile is read once for all of them. p is read four keys at a time
    // (broadcast). Accumulators are rescaled by the tile's correction first.
    static_assert(kDecodeThreads % (D / 2) == 0);
    const char* vcol = v_tile + 2 * (tid % (D / 2)) * static_cast<int>(sizeof(V));
#pragma unroll
    for (int a = 0; a < kPairs; ++a) {
      const int g = (a * kDecodeThreads + tid) / (D / 2);
      if (a < num_pairs && g < ng) {
        const float c = corr_s[g];
        acc[a].x *= c;
        acc[a].y *= c;
      }
    }
#pragma unroll 2
    for (int j4 = 0; j4 < kDecodeTile / 4; ++j4) {
      float2 vv[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        vv[jj] = load_pair(reinterpret_cast<const V*>(vcol + (4 * j4 + jj) * kVStride));
      }
#pragma unroll
      for (int a = 0; a < kPairs; ++a) {
        const int g = (a * kDecodeThreads + tid) / (D / 2);
        if (a < num_pairs && g < ng) {
          const float4 p = reinterpret_cast<const float4*>(s_s + g * kDecodeTile)[j4];
          acc[a].x += p.x * vv[0].x + p.y * vv[1].x + p.z * vv[2].x + p.w * vv[3].x;
          acc[a].y += p.x * vv[0].y + p.y * vv[1].y + p.z * vv[2].y + p.w * vv[3].y;
        }
      }
    }
  };
  // ends after a barrier: m_s, l_s of every warp (also when this split has no keys)
  for_each_kv_tile<kStages>(
      begin, kDecodeTile, [&](std::int64_t i) { return i < end; }, load, compute);

  // An inf or NaN in a V row of these keys (every head sees them all) leaves the accumulators
  // non-finite (0 * inf is NaN too): every head's output is NaN, marked by l = NaN.
  bool v_bad = false;
#pragma unroll
  for (int a = 0; a < kPairs; ++a) {
    if (a < num_pairs && a * kDecodeThreads + tid < ng * (D / 2)) {
      v_bad = v_bad || !is_finite(acc[a].x) || !is_finite(acc[a].y);
    }
  }
  v_bad = block_any<kDecodeThreads>(v_bad, s_s);  // the scores are no longer read
#pragma unroll
  for (int a = 0; a < kPairs; ++a) {
    const int o = a * kDecodeThreads + tid;
    if (a < num_pairs && o < ng * (D / 2)) {
      const int g = o / (D / 2), d = 2 * (o % (D / 2));
      const std::int64_t head_row = static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + g;
      const float l = v_bad ? NAN : l_s[g];
      if (args.num_splits == 1) {
        const float inv = l > 0.0f ? 1.0f / l : l == 0.0f ? 0.0f : NAN;
        args.out[head_row * D + d] = acc[a].x * inv;
        args.out[head_row * D + d + 1] = acc[a].y * inv;
      } else {
        const std::int64_t part_row = head_row * args.num_splits + split;
        args.partial_acc[part_row * D + d] = acc[a].x;
        args.partial_acc[part_row * D + d + 1] = acc[a].y;
        if (d == 0) {
          args.partial_ml[part_row * 2] = m_s[g];
          args.partial_ml[part_row * 2 + 1] = l;
        }
      }
    }
  }
}

}  // namespace kvcache::cuda::detail
