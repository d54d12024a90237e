// SPDX-License-Identifier: Apache-2.0
// Decode attention for fp16/bf16 K/V on tensor cores, each warp on its own 16-key tiles with
// mma.sync, q, scores and output in registers (DecodeKernel::tensor_cores_per_warp).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/decode_common.cuh"
#include "kvcache/cuda/warp_mma.cuh"

namespace kvcache::cuda::detail {

/// Blocks of decode_attention_warp_kernel a multiprocessor must hold at once (its launch bound,
/// which caps registers at 168 for 3): 3 where one m-tile of rows serves all heads and head_dim
/// is at most 128 (so 3 blocks' shared memory fits too), else 1 (no cap: its accumulators need
/// the registers).
__host__ __device__ constexpr int warp_decode_min_blocks(bool fp16, int head_dim, int group) {
  const int pairs = fp16 ? 1 : 2;
  return head_dim <= 128 && group * pairs <= 8 ? 3 : 1;
}

/// Shared memory of decode_attention_warp_kernel<T, D>: each warp owns kWarpBytes, kStages
/// stages of a 16-key K tile, V tile (rows padded by 16 bytes: ldmatrix reads 8 rows without bank
/// conflicts) and their positions. After its keys, a warp's bytes hold its output accumulator
/// [G][D] and softmax state m[G], l[G] for the block's merge. Stages: kStagesWanted, or for 0 the
/// deepest pipeline (2 to 4) that keeps the block within 75 KiB, so that 3 blocks fit on a
/// multiprocessor (cuda_attention_bench also times other depths).
template <Element T, int D, int kStagesWanted = 0>
struct DecodeWarpLayout {
  using S = typename MmaTraits<T>::storage;
  static constexpr int kKeys = 16;  // keys per warp tile
  static constexpr int kWarps = kDecodeThreads / 32;
  static constexpr int kLd = D + 8;  // row stride, elements
  static constexpr std::size_t kTile = sizeof(S) * kKeys * kLd;
  static constexpr std::size_t kStageBytes = 2 * kTile + kKeys * sizeof(std::int64_t);
  static constexpr std::size_t kFit = 75 * 1024 / (kWarps * kStageBytes);
  static constexpr int kStages = kStagesWanted > 0      ? kStagesWanted
                                 : kFit<2 ? 2 : kFit> 4 ? 4
                                                        : static_cast<int>(kFit);
  static constexpr std::size_t kWarpBytes = kStages * kStageBytes;
  static constexpr std::size_t kBytes = kWarps * kWarpBytes;
  static_assert(tile_row_bytes<T>(D) == kLd * static_cast<int>(sizeof(S)) && kTile % 16 == 0);
};

/// Two 16-bit operands in one register, lo in the low half.
template <class Traits>
__device__ __forceinline__ std::uint32_t pack2(typename Traits::storage lo,
                                               typename Traits::storage hi) {
  return static_cast<std::uint32_t>(Traits::bits(lo)) | static_cast<std::uint32_t>(Traits::bits(hi))
                                                            << 16;
}

/// parts[j] (unrolled selects, not an indexed load), zero for j >= kParts.
template <class Traits, int kParts>
__device__ __forceinline__ typename Traits::storage part_at(
    const typename Traits::storage (&parts)[kParts], int j) {
  typename Traits::storage r = Traits::from_float(0.0f);
#pragma unroll
  for (int p = 0; p < kParts; ++p) r = p == j ? parts[p] : r;
  return r;
}

/// Decode attention for fp16/bf16 K/V on tensor cores, each warp on its own keys: the grid, key
/// lists, masks and outputs of decode_attention_mma_kernel, without a block-wide barrier per
/// tile. Warp w of a block takes the 16-key tiles w, w + 4, ... of the block's keys through its
/// own kStages-deep cp.async pipeline, and keeps q, its output accumulators and its online
/// softmax in registers (mma.m16n8k16 with documented fragment layouts, warp_mma.cuh); the four
/// warps' partial results are merged once, at the end.
///
/// Rows of the 16-row operands: slot s = 8 mt + (row % 8) of m-tile mt is head s % G, pair s / G;
/// row r < 8 of a slot holds part 2 pair of q (or p), row r + 8 part 2 pair + 1 (q and p are
/// split into kParts fp16/bf16 parts as in decode_attention_mma_kernel). So a lane (rows g and
/// g + 8 of each m-tile) sums its own two rows, the m-tiles of the same head, and, for G = 4,
/// the lane 16 apart (rows 4-7: the bf16 third part, or zero for fp16), to get a head's scores;
/// p.V's rows add up the same way, once, at the end.
template <Element T, int D, int G, int kStagesWanted = 0>
__global__ void __launch_bounds__(kDecodeThreads,
                                  warp_decode_min_blocks(std::is_same_v<T, kvcache::half>, D, G))
    decode_attention_warp_kernel(DeviceKVView<T> view, DecodeArgs args) {
  using Traits = MmaTraits<T>;
  using S = typename Traits::storage;
  using L = DecodeWarpLayout<T, D, kStagesWanted>;
  constexpr bool kHalf = std::is_same_v<T, kvcache::half>;
  constexpr int kParts = kHalf ? 2 : 3;
  constexpr int kPairs = (kParts + 1) / 2;
  constexpr int kTiles = G * kPairs / 8 > 1 ? G * kPairs / 8 : 1;  // m-tiles of 16 rows
  constexpr int kHeadTiles = G >= 8 ? G / 8 : 1;                   // m-tiles per part pair
  constexpr int kKSteps = D / 16, kDimTiles = D / 8, kWarps = L::kWarps, kStages = L::kStages;
  constexpr int kRowBytes = L::kLd * static_cast<int>(sizeof(S));
  static_assert(G == 4 || G == 8 || G == 16);
  static_assert(G <= warp_decode_max_group(kHalf, D) && (G >= 8 || kTiles == 1));
  static_assert(L::kBytes <= kMaxSmemBytes);
  static_assert((G * D + 2 * G) * sizeof(float) <= L::kWarpBytes);
  const DecodeBlockWork work = decode_block_work(view, args);
  const int split = work.split, seq = work.seq, kv_head = work.kv_head, h0 = work.h0, ng = work.ng;
  const std::int64_t qpos = work.qpos, begin = work.begin, end = work.end;
  const KeyRange keys = work.keys;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;

  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const mine = smem + warp * L::kWarpBytes;
  auto k_at = [&](int b) { return mine + b * L::kStageBytes; };
  auto v_at = [&](int b) { return mine + b * L::kStageBytes + L::kTile; };
  auto pos_at = [&](int b) {
    return reinterpret_cast<std::int64_t*>(mine + b * L::kStageBytes + 2 * L::kTile);
  };

  const float* q_block = args.q + (static_cast<std::int64_t>(seq) * args.num_q_heads + h0) * D;

  // q (times scale and a power of two near 2^12), as A fragments: qa[mt][ks] covers dims
  // [16 ks, 16 ks + 16) of m-tile mt's rows
  // (an inf or NaN in q makes that head NaN: it does not change the other heads' power of two)
  float amax = 0.0f;
  for (int i = lane; i < ng * D; i += 32) {
    const float ax = fabsf(q_block[i] * args.scale);
    if (is_finite(ax)) amax = fmaxf(amax, ax);
  }
  const Pow2Scale pow2 = pow2_scale_near_4096(warp_max(amax));
  std::uint32_t qa[kTiles][kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt) {
    const int slot = 8 * mt + g, head = slot % G, pair = slot / G;
    const bool present = head < ng && pair < kPairs;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // r: row g (+ 8 if odd), dims 2t, 2t + 1 (+ 8 if r >= 2)
        const int d = 16 * ks + 2 * t + 8 * (r / 2), part = 2 * pair + r % 2;
        S lo[kParts], hi[kParts];
        split_parts<Traits, kParts>(
            present ? q_block[head * D + d] * args.scale * pow2.factor : 0.0f, lo);
        split_parts<Traits, kParts>(
            present ? q_block[head * D + d + 1] * args.scale * pow2.factor : 0.0f, hi);
        qa[mt][ks][r] = pack2<Traits>(part_at<Traits>(lo, part), part_at<Traits>(hi, part));
      }
    }
  }

  float o[kTiles][kDimTiles][4];
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int nd = 0; nd < kDimTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][nd][e] = 0.0f;
  float m_run[kHeadTiles], l_run[kHeadTiles];  // l_run: this lane's share (its 4 keys per tile)
#pragma unroll
  for (int i = 0; i < kHeadTiles; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.0f;
  }

  auto compute = [&](int buf) {
    const unsigned char* k_s = k_at(buf);
    const unsigned char* v_s = v_at(buf);
    const std::int64_t* pos_s = pos_at(buf);
    // scores: c[mt][nt] = m-tile mt x keys [8 nt, 8 nt + 8) of the tile
    float c[kTiles][2][4];
#pragma unroll
    for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
      for (int e = 0; e < 8; ++e) c[mt][e / 4][e % 4] = 0.0f;
    // ldmatrix rows: lane l addresses key 8 (l / 16) + l % 8, dims + 8 ((l / 8) % 2)
    const unsigned char* k_row = k_s + (8 * (lane / 16) + lane % 8) * kRowBytes +
                                 8 * ((lane / 8) % 2) * static_cast<int>(sizeof(S));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      std::uint32_t kb[4];  // B fragments of keys 0-7 (kb[0], kb[1]) and 8-15 (kb[2], kb[3])
      ldmatrix_x4(kb, k_row + 16 * ks * static_cast<int>(sizeof(S)));
      const std::uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
      for (int mt = 0; mt < kTiles; ++mt) {
        mma_16816<S>(c[mt][0], qa[mt][ks], b0);
        mma_16816<S>(c[mt][1], qa[mt][ks], b1);
      }
    }
    // each lane-head's scores of keys 2t, 2t + 1, 2t + 8, 2t + 9: the sum of its rows
    float sc[kHeadTiles][4];
#pragma unroll
    for (int i = 0; i < kHeadTiles; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[i][j] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        sc[mt % kHeadTiles][j] += c[mt][j / 2][j % 2] + c[mt][j / 2][2 + j % 2];
    if constexpr (G == 4) {
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[0][j] += __shfl_xor_sync(kFullMask, sc[0][j], 16);
    }
    std::uint32_t pa[kTiles][4];
    float corr[kHeadTiles];
#pragma unroll
    for (int i = 0; i < kHeadTiles; ++i) {
      float p[4], tile_max = -INFINITY;
      bool bad = false;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::int64_t pos = pos_s[8 * (j / 2) + 2 * t + j % 2];
        const int head = (8 * i + g) % G;  // this lane's head in head tile i
        const float raw = sc[i][j] * pow2.unscale;
        sc[i][j] = transform_score(head < ng ? args.mask.score(raw, seq, 0, h0 + head, pos) : raw,
                                   args.softcap, pos >= 0 && args.mask.visible(qpos, pos), bad);
        tile_max = fmaxf(tile_max, sc[i][j]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(m_run[i], tile_max);
      corr[i] = softmax_rescale(sc[i], p, m_run[i], m_new);
      m_run[i] = m_new;
      l_run[i] = bad ? NAN : l_run[i] * corr[i] + (p[0] + p[1]) + (p[2] + p[3]);
      S parts[4][kParts];
#pragma unroll
      for (int j = 0; j < 4; ++j) split_parts<Traits, kParts>(p[j], parts[j]);
#pragma unroll
      for (int mt = i; mt < kTiles; mt += kHeadTiles) {  // the m-tiles of this lane-head
        const int pair = G >= 8 ? mt / kHeadTiles : g / 4;
        // A of p (rows x keys): [0] row g keys 2t, 2t+1; [1] row g+8; [2], [3] keys + 8
        pa[mt][0] =
            pack2<Traits>(part_at<Traits>(parts[0], 2 * pair), part_at<Traits>(parts[1], 2 * pair));
        pa[mt][1] = pack2<Traits>(part_at<Traits>(parts[0], 2 * pair + 1),
                                  part_at<Traits>(parts[1], 2 * pair + 1));
        pa[mt][2] =
            pack2<Traits>(part_at<Traits>(parts[2], 2 * pair), part_at<Traits>(parts[3], 2 * pair));
        pa[mt][3] = pack2<Traits>(part_at<Traits>(parts[2], 2 * pair + 1),
                                  part_at<Traits>(parts[3], 2 * pair + 1));
      }
    }
#pragma unroll
    for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
      for (int nd = 0; nd < kDimTiles; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mt][nd][e] *= corr[mt % kHeadTiles];
    // p.V: lane l addresses V row (key) 8 ((l / 8) % 2) + l % 8, dims + 8 (l / 16); transposed,
    // vb[0], vb[1] are the B fragments of dims [16 n, 16 n + 8), vb[2], vb[3] of the next 8
    const unsigned char* v_row = v_s + (8 * ((lane / 8) % 2) + lane % 8) * kRowBytes +
                                 8 * (lane / 16) * static_cast<int>(sizeof(S));
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      std::uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_row + 16 * n * static_cast<int>(sizeof(S)));
      const std::uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
      for (int mt = 0; mt < kTiles; ++mt) {
        mma_16816<S>(o[mt][2 * n], pa[mt], b0);
        mma_16816<S>(o[mt][2 * n + 1], pa[mt], b1);
      }
    }
  };

  // this warp's tiles, kStages - 1 ahead of the one computed on
  const std::int64_t first = begin + L::kKeys * warp, step = L::kKeys * kWarps;
  auto load = [&](std::int64_t i, int b) {
    load_kv_tile<T, D, 32, L::kKeys>(view, seq, kv_head, keys, i, end,
                                     reinterpret_cast<char*>(k_at(b)),
                                     reinterpret_cast<char*>(v_at(b)), pos_at(b), lane);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (first + s * step < end) load(first + s * step, s);
    __pipeline_commit();
  }
  int buf = 0;
  for (std::int64_t i0 = first; i0 < end; i0 += step) {
    const std::int64_t ahead = i0 + (kStages - 1) * step;
    if (ahead < end) load(ahead, buf == 0 ? kStages - 1 : buf - 1);
    __pipeline_commit();
    __pipeline_wait_prior(kStages - 1);  // this lane's copies of tile i0 have landed
    __syncwarp();                        // ... and the warp's
    compute(buf);
    __syncwarp();  // the warp is done with this buffer before it is refilled
    buf = buf + 1 == kStages ? 0 : buf + 1;
  }
  __pipeline_wait_prior(0);
  __syncwarp();

  // an inf or NaN in a V row of this warp's keys (every head sees them all) leaves its
  // accumulators non-finite (0 * inf is NaN too): every head's l is NaN, so is its output
  bool v_bad = false;
#pragma unroll
  for (int mt = 0; mt < kTiles; ++mt)
#pragma unroll
    for (int nd = 0; nd < kDimTiles; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) v_bad = v_bad || !is_finite(o[mt][nd][e]);
  v_bad = warp_max(v_bad ? 1.0f : 0.0f) != 0.0f;

  // this warp's partial result, per head, into its own shared memory: the rows of each head
  // summed (parts, part pairs, and for G = 4 the lanes 16 apart), l over the lane quad
  float* o_w = reinterpret_cast<float*>(mine);  // [G][D]
  float* m_w = o_w + G * D;
  float* l_w = m_w + G;
#pragma unroll
  for (int i = 0; i < kHeadTiles; ++i) {
    l_run[i] += __shfl_xor_sync(kFullMask, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(kFullMask, l_run[i], 2);
  }
#pragma unroll
  for (int nd = 0; nd < kDimTiles; ++nd) {
#pragma unroll
    for (int i = 0; i < kHeadTiles; ++i) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        v[e] = 0.0f;
#pragma unroll
        for (int mt = i; mt < kTiles; mt += kHeadTiles) v[e] += o[mt][nd][e] + o[mt][nd][2 + e];
        if constexpr (G == 4) v[e] += __shfl_xor_sync(kFullMask, v[e], 16);
      }
      const int head = G >= 8 ? 8 * i + g : g;
      if (G >= 8 || g < 4) {
        o_w[head * D + 8 * nd + 2 * t] = v[0];
        o_w[head * D + 8 * nd + 2 * t + 1] = v[1];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kHeadTiles; ++i) {
    const int head = G >= 8 ? 8 * i + g : g;
    if (t == 0 && (G >= 8 || g < 4)) {
      m_w[head] = m_run[i];
      l_w[head] = v_bad ? NAN : l_run[i];
    }
  }
  __syncthreads();

  // the block's result: the warps' partials, each weighted by e^(its max - the block's)
  for (int i = tid; i < ng * D; i += kDecodeThreads) {
    const int head = i / D, d = i % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m = fmaxf(m, reinterpret_cast<const float*>(smem + w * L::kWarpBytes)[G * D + head]);
    }
    const auto part = [&](int w) {
      return reinterpret_cast<const float*>(smem + w * L::kWarpBytes);
    };
    const float2 sums = merge_partials(
        kWarps, m, [&](int w) { return part(w)[G * D + head]; },
        [&](int w) { return part(w)[G * D + G + head]; },
        [&](int w) { return part(w)[head * D + d]; });
    const std::int64_t head_row = static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + head;
    store_decode_result<D>(args, head_row, split, d, sums.x, m, sums.y);
  }
}

}  // namespace kvcache::cuda::detail
