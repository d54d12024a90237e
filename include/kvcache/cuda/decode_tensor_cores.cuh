// SPDX-License-Identifier: Apache-2.0
// Decode attention for fp16/bf16 K/V on tensor cores, block-wide 64-key tiles with wmma
// (DecodeKernel::tensor_cores).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cstdint>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/decode_common.cuh"

namespace kvcache::cuda::detail {

/// Shared memory of decode_attention_mma_kernel<T, D> with kStages K/V buffers (byte offsets,
/// each region 128-byte aligned for the tensor-core loads). Heads are padded to kMaxGroup (the
/// fragments' 16 columns); rows of absent heads stay zero.
template <Element T, int D, int kStages>
struct DecodeMmaLayout {
  using S = typename MmaTraits<T>::storage;
  /// fp32 values are split into this many parts of S (hi + lo: 22 bits for fp16; hi + mid + lo:
  /// 24 bits for bf16), so that tensor-core products keep fp32 accuracy.
  static constexpr int kParts = std::is_same_v<T, kvcache::half> ? 2 : 3;
  static constexpr int kStageCount = kStages;
  static constexpr int kLdKV = D + 8;           // K/V tile rows (tile_row_bytes), elements
  static constexpr int kLdQ = D + 8;            // q parts [kParts][16 heads][D + 8]
  static constexpr int kLdS = kDecodeTile + 4;  // scores [16 heads][64 + 4] (float)
  static constexpr int kLdP = kDecodeTile + 8;  // p parts [kParts][16 heads][64 + 8]
  static constexpr int kLdO = D + 4;            // output accumulator [16 heads][D + 4]
  static constexpr std::size_t align(std::size_t n) { return (n + 127) / 128 * 128; }
  static constexpr std::size_t kTile = sizeof(S) * kDecodeTile * kLdKV;
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = kK + kStages * kTile;
  static constexpr std::size_t kPos = kV + kStages * kTile;
  static constexpr std::size_t kQ = align(kPos + kStages * kDecodeTile * sizeof(std::int64_t));
  static constexpr std::size_t kS = align(kQ + kParts * sizeof(S) * kMaxGroup * kLdQ);
  static constexpr std::size_t kP = align(kS + sizeof(float) * kMaxGroup * kLdS);
  static constexpr std::size_t kO = align(kP + kParts * sizeof(S) * kMaxGroup * kLdP);
  static constexpr std::size_t kStats = align(kO + sizeof(float) * kMaxGroup * kLdO);
  static constexpr std::size_t kBytes =
      kStats + (3 * kMaxGroup + kDecodeThreads / 32) * sizeof(float);  // m, l, corr; warp maxima
  static_assert(tile_row_bytes<T>(D) == kLdKV * static_cast<int>(sizeof(S)));
};

/// The tensor-core decode kernel's layout: K/V double-buffered wherever that fits.
template <Element T, int D>
using DecodeMmaSmem = std::conditional_t<DecodeMmaLayout<T, D, 2>::kBytes <= kMaxSmemBytes,
                                         DecodeMmaLayout<T, D, 2>, DecodeMmaLayout<T, D, 1>>;

/// Decode attention for fp16/bf16 K/V on tensor cores: the grid, tiles, key lists, online
/// softmax and outputs of decode_attention_kernel, with q.k and p.V as 16 x 16 x 16 wmma
/// products in fp32 accumulators. q (times scale and a power of two that puts its largest
/// element near 2^12, undone exactly on the scores) and p are split into kParts fp16/bf16 parts,
/// so the products carry ~22-24 bits of q and p, not 11 or 8. Per tile: warp w computes the
/// scores of keys [16w, 16w + 16) for all (up to 16) heads; one warp per head updates the
/// softmax; warp w rescales and accumulates dims [w D/4, (w + 1) D/4) of p.V for all heads.
template <Element T, int D>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_mma_kernel(DeviceKVView<T> view, DecodeArgs args) {
  namespace wmma = nvcuda::wmma;
  using Traits = MmaTraits<T>;
  using S = typename Traits::storage;
  using L = DecodeMmaSmem<T, D>;
  constexpr int kStages = L::kStageCount;
  constexpr int kParts = L::kParts;
  constexpr int kWarps = kDecodeThreads / 32;
  constexpr int kWarpDims = D / kWarps;  // p.V dims per warp: 16, 32 or 64
  static_assert(kDecodeTile == 16 * kWarps && kWarpDims % 16 == 0);
  static_assert(L::kBytes <= kMaxSmemBytes);
  const DecodeBlockWork work = decode_block_work(view, args);
  const int split = work.split, seq = work.seq, kv_head = work.kv_head, h0 = work.h0, ng = work.ng;
  const std::int64_t qpos = work.qpos, begin = work.begin, end = work.end;
  const KeyRange keys = work.keys;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  extern __shared__ __align__(128) unsigned char smem[];
  auto k_at = [&](int b) { return smem + L::kK + b * L::kTile; };
  auto v_at = [&](int b) { return smem + L::kV + b * L::kTile; };
  auto pos_at = [&](int b) {
    return reinterpret_cast<std::int64_t*>(smem + L::kPos) + b * kDecodeTile;
  };
  S* q_s = reinterpret_cast<S*>(smem + L::kQ);  // [kParts][16][kLdQ]
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  S* p_s = reinterpret_cast<S*>(smem + L::kP);  // [kParts][16][kLdP]
  float* o_s = reinterpret_cast<float*>(smem + L::kO);
  float* m_s = reinterpret_cast<float*>(smem + L::kStats);
  float* l_s = m_s + kMaxGroup;
  float* corr_s = l_s + kMaxGroup;
  float* warp_max_s = corr_s + kMaxGroup;  // [kWarps]

  // q's largest magnitude (times scale) picks the power of two that scales it near 2^12
  // (an inf or NaN in q makes that head NaN: it does not change the other heads' power of two)
  float amax = 0.0f;
  for (int i = tid; i < ng * D; i += kDecodeThreads) {
    const float x =
        args.q[(static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + i / D) * D + i % D];
    const float ax = fabsf(x * args.scale);
    if (is_finite(ax)) amax = fmaxf(amax, ax);
  }
  amax = warp_max(amax);
  if (lane == 0) warp_max_s[warp] = amax;
  // zero what no tile writes: absent heads' q and p rows (their scores and outputs are unused)
  for (int i = tid; i < kParts * kMaxGroup * L::kLdP; i += kDecodeThreads) p_s[i] = S{};
  for (int i = tid; i < kMaxGroup * L::kLdO; i += kDecodeThreads) o_s[i] = 0.0f;
  for (int g = tid; g < kMaxGroup; g += kDecodeThreads) {
    m_s[g] = -INFINITY;
    l_s[g] = 0.0f;
  }
  __syncthreads();
  float block_max = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max_s[w]);
  const Pow2Scale pow2 = pow2_scale_near_4096(block_max);
  const float factor = pow2.factor, unscale = pow2.unscale;
  for (int i = tid; i < kMaxGroup * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    const float x =
        g < ng ? args.q[(static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + g) * D + d] *
                     args.scale * factor
               : 0.0f;
    store_parts<Traits, kParts>(x, q_s + g * L::kLdQ + d, kMaxGroup * L::kLdQ);
  }

  auto load = [&](std::int64_t i, int b) {
    load_kv_tile<T, D, kDecodeThreads, kDecodeTile>(
        view, seq, kv_head, keys, i, end, reinterpret_cast<char*>(k_at(b)),
        reinterpret_cast<char*>(v_at(b)), pos_at(b), tid);
  };
  // q_s, p_s, o_s, m_s, l_s are initialised before the first compute (a barrier precedes it)
  auto compute = [&](std::int64_t, int buf) {
    const S* k_s = reinterpret_cast<const S*>(k_at(buf));
    const S* v_s = reinterpret_cast<const S*>(v_at(buf));
    const std::int64_t* pos_s = pos_at(buf);
    {  // scores of keys [16w, 16w + 16) x 16 heads: s_s[head][key]
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> a;
        wmma::load_matrix_sync(a, k_s + warp * 16 * L::kLdKV + kk, L::kLdKV);
#pragma unroll
        for (int part = 0; part < kParts; ++part) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> b;
          wmma::load_matrix_sync(b, q_s + part * kMaxGroup * L::kLdQ + kk, L::kLdQ);
          wmma::mma_sync(acc, a, b, acc);
        }
      }
      wmma::store_matrix_sync(s_s + warp * 16, acc, L::kLdS, wmma::mem_col_major);
    }
    __syncthreads();
    for (int g = warp; g < ng; g += kWarps) {  // online softmax, warp per head
      float sc[2];
      bool bad = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        const std::int64_t pos = pos_s[j];
        sc[h] =
            transform_score(args.mask.score(s_s[g * L::kLdS + j] * unscale, seq, 0, h0 + g, pos),
                            args.softcap, pos >= 0 && args.mask.visible(qpos, pos), bad);
      }
      float p[2];
      online_softmax_step(sc, p, &m_s[g], &l_s[g], &corr_s[g], lane, bad);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        store_parts<Traits, kParts>(p[h], p_s + g * L::kLdP + lane + 32 * h, kMaxGroup * L::kLdP);
      }
    }
    __syncthreads();
    // rescale this warp's dims of the accumulator, then add p.V for them
    const int d0 = warp * kWarpDims;
    for (int i = lane; i < ng * kWarpDims; i += 32) {
      const int g = i / kWarpDims, d = d0 + i % kWarpDims;
      o_s[g * L::kLdO + d] *= corr_s[g];
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kWarpDims; m += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
      wmma::load_matrix_sync(o, o_s + d0 + m, L::kLdO, wmma::mem_col_major);
#pragma unroll
      for (int kk = 0; kk < kDecodeTile; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::col_major> a;  // V^T: dims x keys
        wmma::load_matrix_sync(a, v_s + kk * L::kLdKV + d0 + m, L::kLdKV);
#pragma unroll
        for (int part = 0; part < kParts; ++part) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> b;  // p^T: keys x heads
          wmma::load_matrix_sync(b, p_s + part * kMaxGroup * L::kLdP + kk, L::kLdP);
          wmma::mma_sync(o, a, b, o);
        }
      }
      wmma::store_matrix_sync(o_s + d0 + m, o, L::kLdO, wmma::mem_col_major);
    }
  };
  // ends after a barrier: o_s, m_s, l_s of every warp (also when this split has no keys)
  for_each_kv_tile<kStages>(
      begin, kDecodeTile, [&](std::int64_t i) { return i < end; }, load, compute);

  // an inf or NaN in a V row of these keys: every head's output is NaN (l = NaN)
  bool v_bad = false;
  for (int i = tid; i < ng * D; i += kDecodeThreads) {
    v_bad = v_bad || !is_finite(o_s[(i / D) * L::kLdO + i % D]);
  }
  v_bad = block_any<kDecodeThreads>(v_bad, warp_max_s);  // read only before the tiles
  for (int i = tid; i < ng * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    const std::int64_t head_row = static_cast<std::int64_t>(seq) * args.num_q_heads + h0 + g;
    store_decode_result<D>(args, head_row, split, d, o_s[g * L::kLdO + d], m_s[g],
                           v_bad ? NAN : l_s[g]);
  }
}

}  // namespace kvcache::cuda::detail
