// SPDX-License-Identifier: Apache-2.0
// Decode attention on the GPU: a batch of sequences, one query token each, GQA (the query heads of
// one KV head share every K/V tile read), split-KV (flash-decoding) with a merge kernel for long
// contexts, fp32 accumulation, window and sink masks, contiguous, ring and paged layouts. fp16 and
// bf16 K/V: q.k and p.V on tensor cores (decode_attention_mma_kernel); fp32 K/V: on CUDA cores
// (decode_attention_kernel).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_pipeline.h>
#include <mma.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/cuda/kernels_common.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"
#include "kvcache/cuda/warp_mma.cuh"

namespace kvcache::cuda {

inline constexpr int kDecodeThreads = 128;  ///< 4 warps per (sequence, KV head, head chunk, split)
inline constexpr int kDecodeTile = 64;      ///< keys per shared-memory tile
/// Query heads one decode block serves; a KV head with more (MQA, wide GQA) is split into
/// ceil(group / kMaxGroup) equal chunks, one block each (its K/V are read once per chunk).
inline constexpr int kMaxGroup = 16;
inline constexpr int kMinKeysPerSplit = 256;
/// Shared memory a Hopper block may opt into (sm_90: 227 KiB); every kernel instantiation is
/// checked against it at compile time.
inline constexpr std::size_t kMaxSmemBytes = 227 * 1024;

namespace detail {

/// Byte stride of one K or V row in a shared-memory tile: 16 bytes of padding keep consecutive
/// keys' 16-byte loads on different banks.
template <Element T>
__host__ __device__ constexpr int tile_row_bytes(int head_dim) {
  return head_dim * static_cast<int>(sizeof(T)) + 16;
}

/// Shared memory of the decode kernel, in bytes: q [G][D] floats; K and V tiles, one per
/// pipeline stage [stages][kDecodeTile][row]; their positions [stages][kDecodeTile]; partial
/// scores [2][G][kDecodeTile]; per-head m, l, correction.
template <Element T>
__host__ __device__ constexpr std::size_t decode_smem_bytes(int head_dim, int group, int stages) {
  const std::size_t g = static_cast<std::size_t>(group);
  const std::size_t n = static_cast<std::size_t>(stages);
  return g * head_dim * sizeof(float) +
         2 * n * kDecodeTile * static_cast<std::size_t>(tile_row_bytes<T>(head_dim)) +
         n * kDecodeTile * sizeof(std::int64_t) + 2 * g * kDecodeTile * sizeof(float) +
         3 * g * sizeof(float);
}

/// Pipeline stages of the decode kernel: double-buffered K/V tiles (the next tile's copies in
/// flight while this one is used) wherever they fit, else one buffer (float K/V at head_dim 256).
template <Element T, int D>
__host__ __device__ constexpr int decode_stages() {
  return decode_smem_bytes<T>(D, kMaxGroup, 2) <= kMaxSmemBytes ? 2 : 1;
}

/// Tensor-core operand types for a cache element type.
template <Element T>
struct MmaTraits;
template <>
struct MmaTraits<kvcache::half> {
  using storage = __half;  // shared-memory element (bit-identical to kvcache::half)
  using operand = __half;  // wmma fragment element
  static constexpr int kK = 16;
  __device__ static storage from_float(float x) { return __float2half_rn(x); }
  __device__ static float to_float(storage x) { return __half2float(x); }
  __device__ static unsigned short bits(storage x) { return __half_as_ushort(x); }
};
template <>
struct MmaTraits<kvcache::bfloat16> {
  using storage = __nv_bfloat16;
  using operand = __nv_bfloat16;
  static constexpr int kK = 16;
  __device__ static storage from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static float to_float(storage x) { return __bfloat162float(x); }
  __device__ static unsigned short bits(storage x) { return __bfloat16_as_ushort(x); }
};
template <>
struct MmaTraits<float> {
  using storage = float;
  using operand = nvcuda::wmma::precision::tf32;
  static constexpr int kK = 8;
  __device__ static storage from_float(float x) { return x; }
  __device__ static float to_float(storage x) { return x; }
};

/// Splits x into kParts values of Traits::storage: each the rounding of what the earlier ones
/// leave of x, so that their sum carries kParts times the storage type's significand bits of x
/// (tensor-core operands with fp32 accuracy).
template <class Traits, int kParts>
__device__ __forceinline__ void split_parts(float x, typename Traits::storage (&parts)[kParts]) {
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    parts[part] = Traits::from_float(x);
    x -= Traits::to_float(parts[part]);
  }
}

/// Writes split_parts(x) at dst[0], dst[stride], ...
template <class Traits, int kParts>
__device__ __forceinline__ void store_parts(float x, typename Traits::storage* dst, int stride) {
  typename Traits::storage parts[kParts];
  split_parts<Traits, kParts>(x, parts);
#pragma unroll
  for (int part = 0; part < kParts; ++part) dst[part * stride] = parts[part];
}

/// The power of two that scales q (its largest magnitude amax) near 2^12, and its inverse:
/// inside fp16's range, clear of its subnormals, and exact to undo on the scores. 2^(12 - e) for
/// amax in [2^e, 2^(e+1)) (e >= -114, so that both powers are normal floats); 1 for zero,
/// subnormal, inf or NaN.
struct Pow2Scale {
  float factor = 1.0f;
  float unscale = 1.0f;
};
__device__ __forceinline__ Pow2Scale pow2_scale_near_4096(float amax) {
  const int e = max(static_cast<int>((__float_as_uint(amax) >> 23) & 0xff) - 127, -114);
  if (!(amax >= 1.17549435e-38f && amax <= 3.40282347e38f)) return {};
  return {__uint_as_float(static_cast<unsigned>(12 - e + 127) << 23),
          __uint_as_float(static_cast<unsigned>(e - 12 + 127) << 23)};
}

/// The query heads a decode kernel instantiation is unrolled for: the fewest of 4, 8 and 16 that
/// holds a block's `chunk_group` heads. The p.V accumulators are unrolled over them, so a block
/// serving 4 heads does not carry (and step over) the registers and guards of 16.
__host__ __device__ constexpr int decode_head_bucket(int chunk_group) {
  return chunk_group <= 4 ? 4 : chunk_group <= 8 ? 8 : kMaxGroup;
}

/// Calls f(std::integral_constant<int, G>{}) for G = decode_head_bucket(chunk_group).
template <class F>
void dispatch_head_bucket(int chunk_group, F&& f) {
  switch (decode_head_bucket(chunk_group)) {
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 8:
      return f(std::integral_constant<int, 8>{});
    default:
      return f(std::integral_constant<int, kMaxGroup>{});
  }
}

/// The 4 floats at p (16-byte aligned).
__device__ __forceinline__ void load16(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}

/// The 2 floats at p (8-byte aligned).
__device__ __forceinline__ float2 load_pair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}

/// Loads logical keys [i0, i0 + kRows) of (seq, kv_head) into one K and one V tile with 16-byte
/// cp.async copies, kThreads threads; rows at or past `end` are zero-filled (so that p * V stays
/// finite) and get position -1. Each warp loads kRows / warps consecutive rows: lane l first finds
/// the position and element offset of the warp's row l (one block-table lookup and division per
/// row, not per 16-byte chunk), then the warp copies 32 / chunks-per-row rows at a time, each
/// lane reading its row's offset from the lane that found it.
template <Element T, int D, int kThreads, int kRows>
__device__ __forceinline__ void load_kv_tile(const DeviceKVView<T>& view, int seq, int kv_head,
                                             const KeyRange& keys, std::int64_t i0,
                                             std::int64_t end, char* k_tile, char* v_tile,
                                             std::int64_t* pos_tile, int tid) {
  constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // 16-byte chunks per row
  constexpr int kStride = tile_row_bytes<T>(D);
  constexpr int kWarpRows = kRows / (kThreads / 32);
  constexpr int kStepRows = kChunks >= 32 ? 1 : 32 / kChunks;  // rows per warp-wide copy
  static_assert(kThreads % 32 == 0 && kRows % (kThreads / 32) == 0 && kWarpRows <= 32);
  static_assert(kWarpRows % kStepRows == 0 &&
                (kChunks >= 32 ? kChunks % 32 == 0 : 32 % kChunks == 0));
  const int lane = tid % 32, row0 = tid / 32 * kWarpRows;
  std::int64_t my_off = 0;
  int my_valid = 0;
  if (lane < kWarpRows) {
    const std::int64_t i = i0 + row0 + lane;
    my_valid = i < end;
    const std::int64_t pos = my_valid ? keys.pos(i) : -1;
    if (my_valid) my_off = view.row_offset(seq, kv_head, pos);
    pos_tile[row0 + lane] = pos;
  }
  const int sub = kChunks >= 32 ? 0 : lane / kChunks;  // this lane's row within a step
  const int chunk0 = kChunks >= 32 ? lane : lane % kChunks;
#pragma unroll
  for (int r = 0; r < kWarpRows; r += kStepRows) {
    const std::int64_t off = __shfl_sync(kFullMask, my_off, r + sub);
    const int valid = __shfl_sync(kFullMask, my_valid, r + sub);
    const int row = row0 + r + sub;
    const char* ks = reinterpret_cast<const char*>(view.k + off);
    const char* vs = reinterpret_cast<const char*>(view.v + off);
#pragma unroll
    for (int chunk = chunk0; chunk < kChunks; chunk += 32) {
      __pipeline_memcpy_async(k_tile + row * kStride + chunk * 16, ks + chunk * 16, 16,
                              valid ? 0 : 16);
      __pipeline_memcpy_async(v_tile + row * kStride + chunk * 16, vs + chunk * 16, 16,
                              valid ? 0 : 16);
    }
  }
}

/// The K/V tile pipeline of the attention kernels: compute(i0, buf) for i0 = first,
/// first + step, ... while wanted(i0), where load(i, buf) issues the cp.async copies of the tile
/// at i into buffer buf (0 or 1). With kStages == 2 the next tile's copies are issued before this
/// one is computed on; with 1, after. compute runs between two __syncthreads(): on entry every
/// thread's copies of its tile (and whatever the block wrote before the call) are visible; after
/// it, the tile's buffer may be refilled. Returns with every copy landed, after a barrier.
template <int kStages, class Wanted, class Load, class Compute>
__device__ __forceinline__ void for_each_kv_tile(std::int64_t first, std::int64_t step,
                                                 Wanted&& wanted, Load&& load, Compute&& compute) {
  static_assert(kStages == 1 || kStages == 2);
  if (wanted(first)) load(first, 0);
  __pipeline_commit();
  int buf = 0;
  for (std::int64_t i0 = first; wanted(i0); i0 += step) {
    const std::int64_t next = i0 + step;
    if constexpr (kStages == 2) {
      if (wanted(next)) load(next, buf ^ 1);
      __pipeline_commit();
      __pipeline_wait_prior(1);  // this thread's copies of the current tile have landed
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // ... and everybody's
    compute(i0, buf);
    __syncthreads();  // everybody is done with this tile before its buffer is refilled
    if constexpr (kStages == 2) {
      buf ^= 1;
    } else {
      if (wanted(next)) load(next, 0);
      __pipeline_commit();
    }
  }
  __pipeline_wait_prior(0);
  __syncthreads();
}

/// What every decode kernel takes besides the view: one launch's queries, outputs and plan.
struct DecodeArgs {
  const float* q = nullptr;      ///< [num_seqs][num_q_heads][head_dim]
  float* out = nullptr;          ///< like q; written directly when num_splits == 1
  float* partial_acc = nullptr;  ///< [num_seqs][num_q_heads][num_splits][head_dim] (splits > 1)
  float* partial_ml = nullptr;   ///< [num_seqs][num_q_heads][num_splits][2]: max, sum (splits > 1)
  int num_q_heads = 0;
  int chunk_group = 1;  ///< query heads per block (DecodePlan)
  int num_splits = 1;
  std::int64_t keys_per_split = 0;
  DeviceMask mask;
  float scale = 1.0f;  ///< softmax scale, applied to q
  float softcap = 0.0f;
};

/// Writes a block's result for dim d of the query head at head_row (seq * num_q_heads + head):
/// acc / l into out when the launch has one split, else the split's unnormalised partial (acc,
/// and at d == 0 the head's m and l) for decode_merge_kernel. 0 for a head with no key (l = 0);
/// NaN for a head whose l is NaN (it saw an inf or NaN), a mark the partial carries to the merge.
template <int D>
__device__ __forceinline__ void store_decode_result(const DecodeArgs& args, std::int64_t head_row,
                                                    int split, int d, float acc, float m, float l) {
  if (args.num_splits == 1) {
    args.out[head_row * D + d] = l > 0.0f ? acc / l : l == 0.0f ? 0.0f : NAN;
    return;
  }
  const std::int64_t part_row = head_row * args.num_splits + split;
  args.partial_acc[part_row * D + d] = acc;
  if (d == 0) {
    args.partial_ml[part_row * 2] = m;
    args.partial_ml[part_row * 2 + 1] = l;
  }
}

/// What one decode block serves, from its index in the grid (splits, KV heads x head chunks,
/// sequences): keys [begin, end) of sequence seq's visible list `keys` (its query at qpos), and
/// query heads [h0, h0 + ng) of KV head kv_head.
struct DecodeBlockWork {
  int split = 0, seq = 0, kv_head = 0, h0 = 0, ng = 0;
  std::int64_t qpos = 0, begin = 0, end = 0;
  KeyRange keys;
};
template <Element T>
__device__ __forceinline__ DecodeBlockWork decode_block_work(const DeviceKVView<T>& view,
                                                             const DecodeArgs& args) {
  const int num_q_heads = args.num_q_heads, chunk_group = args.chunk_group;
  const int num_splits = args.num_splits;
  const std::int64_t keys_per_split = args.keys_per_split;
  DecodeBlockWork w;
  w.split = static_cast<int>(blockIdx.x);
  w.seq = static_cast<int>(blockIdx.z);
  const int group = num_q_heads / view.num_kv_heads;
  const int num_chunks = (group + chunk_group - 1) / chunk_group;
  const int chunk = static_cast<int>(blockIdx.y) % num_chunks;
  w.kv_head = static_cast<int>(blockIdx.y) / num_chunks;
  w.h0 = w.kv_head * group + chunk * chunk_group;
  w.ng = min(chunk_group, group - chunk * chunk_group);
  w.qpos = view.length[w.seq] - 1;
  w.keys = visible_keys(key_range(view, w.seq), args.mask, w.qpos);
  const std::int64_t count = w.keys.count();
  w.begin = w.split * keys_per_split;
  // the last split takes whatever is left: a view whose max_keys undercounts runs slower, not wrong
  w.end = w.split + 1 == num_splits ? count : min(count, w.begin + keys_per_split);
  return w;
}

/// Decode attention for fp32 K/V on CUDA cores (fp16/bf16 K/V take decode_attention_mma_kernel).
/// One block per (split, KV head x head chunk, sequence), its query token at position
/// length - 1; the block serves query heads [h0, h0 + ng) of the KV head. Per tile: partial q.k
/// for every (query head, key) — thread = (key, half of head_dim) so that a warp reads 32
/// consecutive padded rows without bank conflicts; an online-softmax update per query head (one
/// warp per head); then p.V accumulated in registers by (query head, dim) threads. Writes the
/// normalised output when num_splits == 1, else the unnormalised partial (acc, m, l) that
/// decode_merge_kernel combines. G = decode_head_bucket(chunk_group): the heads the p.V
/// accumulators are unrolled for.
template <Element T, int D, int G>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_kernel(DeviceKVView<T> view, DecodeArgs args) {
  static_assert(std::is_same_v<T, float>, "fp16/bf16 K/V: decode_attention_mma_kernel");
  static_assert(kDecodeThreads == 2 * kDecodeTile, "thread = (key, half of head_dim)");
  constexpr int kStages = decode_stages<T, D>();
  static_assert(decode_smem_bytes<T>(D, kMaxGroup, kStages) <= kMaxSmemBytes);
  constexpr int kRowStride = tile_row_bytes<T>(D);
  static_assert(G <= kMaxGroup && G * (D / 2) % kDecodeThreads == 0);
  constexpr int kPairs = G * (D / 2) / kDecodeThreads;  // float2 accumulators per thread
  constexpr int kElemsPer16 = 16 / static_cast<int>(sizeof(T));
  const DecodeBlockWork work = decode_block_work(view, args);
  const int split = work.split, seq = work.seq, kv_head = work.kv_head, h0 = work.h0, ng = work.ng;
  const std::int64_t qpos = work.qpos, begin = work.begin, end = work.end;
  const KeyRange keys = work.keys;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  extern __shared__ __align__(128) unsigned char smem[];
  char* tiles = reinterpret_cast<char*>(smem);  // K[stages] then V[stages]
  constexpr int kTileBytes = kDecodeTile * kRowStride;
  auto k_tile_at = [&](int b) { return tiles + b * kTileBytes; };
  auto v_tile_at = [&](int b) { return tiles + (kStages + b) * kTileBytes; };
  std::int64_t* pos_tiles =
      reinterpret_cast<std::int64_t*>(tiles + 2 * kStages * kDecodeTile * kRowStride);
  float* q_s = reinterpret_cast<float*>(pos_tiles + kStages * kDecodeTile);  // [ng][D]
  float* s_s = q_s + ng * D;                                                 // [2][ng][tile]
  float* m_s = s_s + 2 * ng * kDecodeTile;
  float* l_s = m_s + ng;
  float* corr_s = l_s + ng;

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
    load_kv_tile<T, D, kDecodeThreads, kDecodeTile>(view, seq, kv_head, keys, i, end, k_tile_at(b),
                                                    v_tile_at(b), pos_tiles + b * kDecodeTile, tid);
  };
  auto compute = [&](std::int64_t, int buf) {
    const char* k_tile = k_tile_at(buf);
    const char* v_tile = v_tile_at(buf);
    const std::int64_t* pos_tile = pos_tiles + buf * kDecodeTile;

    {  // partial q.k over one half of head_dim, four query heads per pass over the row
      const int key = tid % kDecodeTile, part = tid / kDecodeTile;
      const T* krow = reinterpret_cast<const T*>(k_tile + key * kRowStride) + part * (D / 2);
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
      bool bad = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        const std::int64_t pos = pos_tile[j];
        sc[h] = transform_score(args.mask.score(s[j] + s_other[j], seq, 0, h0 + g, pos),
                                args.softcap, pos >= 0 && args.mask.visible(qpos, pos), bad);
      }
      float p[2];
      online_softmax_step(sc, p, &m_s[g], &l_s[g], &corr_s[g], lane, bad);
      s[lane] = p[0];
      s[lane + 32] = p[1];
    }
    __syncthreads();
    // p.V: this thread owns the outputs o = a * kDecodeThreads + tid, each the dims
    // (d, d + 1) of query head o / (D / 2); D / 2 divides kDecodeThreads, so they share the same
    // d and each V pair of the tile is read once for all of them. p is read four keys at a time
    // (broadcast). Accumulators are rescaled by the tile's correction first.
    static_assert(kDecodeThreads % (D / 2) == 0);
    const char* vcol = v_tile + 2 * (tid % (D / 2)) * static_cast<int>(sizeof(T));
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
        vv[jj] = load_pair(reinterpret_cast<const T*>(vcol + (4 * j4 + jj) * kRowStride));
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

/// Query heads one block of decode_attention_warp_kernel serves at most, for fp16 (one pair of
/// part rows per head) or bf16 (two pairs) and head_dim D: its output accumulators live in
/// registers, (m-tiles) x D / 2 floats per lane, which must stay within 128, and its q fragments,
/// (m-tiles) x D / 4: at most 2 m-tiles (bf16 at head_dim 64 with 16 heads, 4 m-tiles, spilled).
__host__ __device__ constexpr int warp_decode_max_group(bool fp16, int head_dim) {
  const int pairs = fp16 ? 1 : 2;
  int g = kMaxGroup;
  for (;;) {
    const int m_tiles = g * pairs / 8 > 1 ? g * pairs / 8 : 1;
    if (g == 4 || (m_tiles * head_dim <= 256 && m_tiles <= 2)) return g;
    g /= 2;
  }
}

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

/// Combines the splits of each (sequence, query head): out = sum_s acc_s e^(m_s - M) / L; NaN
/// throughout where a split's l is NaN (it saw an inf or NaN), 0 where no split has a key.
template <int D>
__global__ void decode_merge_kernel(const float* __restrict__ partial_acc,
                                    const float* __restrict__ partial_ml, float* __restrict__ out,
                                    int num_q_heads, int num_splits) {
  const std::int64_t head_row = static_cast<std::int64_t>(blockIdx.x) * num_q_heads + blockIdx.y;
  const float* ml = partial_ml + head_row * num_splits * 2;
  float m = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m = fmaxf(m, ml[2 * s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const float2 sums = merge_partials(
        num_splits, m, [&](int s) { return ml[2 * s]; }, [&](int s) { return ml[2 * s + 1]; },
        [&](int s) { return partial_acc[(head_row * num_splits + s) * D + d]; });
    out[head_row * D + d] = sums.y > 0.0f ? sums.x / sums.y : sums.y == 0.0f ? 0.0f : NAN;
  }
}

/// How one decode launch covers a batch: grid (splits, num_kv_heads x num_chunks, num_seqs).
struct DecodePlan {
  int chunk_group = 1;              ///< query heads per block
  int num_chunks = 1;               ///< blocks per KV head (ceil(group / max heads per block))
  int splits = 1;                   ///< blocks along each sequence's keys
  std::int64_t keys_per_split = 0;  ///< a multiple of kDecodeTile; splits x it >= max_keys

  /// Partials of every split (0 for one split: the kernel writes the output directly).
  [[nodiscard]] std::size_t workspace_bytes(int num_seqs, int num_q_heads, int head_dim) const {
    if (splits == 1) return 0;
    return static_cast<std::size_t>(num_seqs) * static_cast<std::size_t>(num_q_heads) *
           static_cast<std::size_t>(splits) * static_cast<std::size_t>(head_dim + 2) *
           sizeof(float);
  }
};

/// Splits per sequence for `units` blocks per split when `slots` blocks run at once: the fewest
/// (each split >= kMinKeysPerSplit keys of max_keys) whose blocks fill their waves to >= 90%,
/// else the count with the fullest waves. A partly filled last wave leaves multiprocessors idle
/// and, with them, memory bandwidth (512 blocks on 396 slots run at ~65% of the device).
/// Non-decreasing in max_keys. O(max_keys / kMinKeysPerSplit).
inline int choose_splits(std::int64_t max_keys, std::int64_t units, std::int64_t slots) {
  units = std::max<std::int64_t>(units, 1);
  slots = std::max<std::int64_t>(slots, 1);
  const std::int64_t most =
      std::max<std::int64_t>(1, (max_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  std::int64_t best = 1;
  double best_fill = 0.0;
  for (std::int64_t s = 1; s <= most; ++s) {
    const std::int64_t blocks = units * s;
    const std::int64_t waves = (blocks + slots - 1) / slots;
    const double fill = static_cast<double>(blocks) / static_cast<double>(waves * slots);
    if (fill >= 0.9) return static_cast<int>(s);
    if (fill > best_fill) {
      best = s;
      best_fill = fill;
    }
  }
  return static_cast<int>(best);
}

/// Query heads per decode block: a group split into ceil(group / max_group) equal chunks.
inline int decode_chunk_group(int group, int max_group = kMaxGroup) {
  const int chunks = (group + max_group - 1) / max_group;
  return (group + chunks - 1) / chunks;
}

/// The device-independent part of a plan: head chunks, splits and keys per split, for
/// `slots` resident blocks (multiprocessors x blocks per multiprocessor) serving at most
/// `max_group` query heads each.
inline DecodePlan plan_decode_grid(int num_seqs, int group, int num_kv_heads, std::int64_t max_keys,
                                   std::int64_t slots, int max_group = kMaxGroup) {
  DecodePlan p;
  p.chunk_group = decode_chunk_group(group, max_group);
  p.num_chunks = (group + p.chunk_group - 1) / p.chunk_group;  // as decode_attention_kernel does
  const std::int64_t units =
      static_cast<std::int64_t>(num_seqs) * num_kv_heads * static_cast<std::int64_t>(p.num_chunks);
  p.splits = choose_splits(max_keys, units, slots);
  const std::int64_t per = (max_keys + p.splits - 1) / p.splits;
  p.keys_per_split =
      std::max<std::int64_t>(kDecodeTile, (per + kDecodeTile - 1) / kDecodeTile * kDecodeTile);
  return p;
}

/// Lets `kernel` use `bytes` of dynamic shared memory (beyond the default 48 KiB).
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  }
}

/// Keys a decode query may visit: a sliding window bounds them by window + sinks.
inline std::int64_t decode_keys(std::int64_t max_keys, const AttentionOptions& opts) {
  if (!opts.causal || opts.window == 0) return max_keys;
  return std::min<std::int64_t>(max_keys,
                                static_cast<std::int64_t>(opts.window + opts.num_sink_tokens));
}

}  // namespace detail

/// The decode kernels. fp32 K/V take cuda_cores; fp16/bf16 K/V take either tensor-core kernel,
/// tensor_cores unless a DecodeSetup names the other.
enum class DecodeKernel : int {
  cuda_cores = 0,  ///< fp32 K/V on CUDA cores (decode_attention_kernel)
  /// fp16/bf16: block-wide 64-key tiles, wmma, scores and output in shared memory
  /// (decode_attention_mma_kernel)
  tensor_cores = 1,
  /// fp16/bf16: each warp its own 16-key tiles and pipeline, mma.sync with q, scores and output in
  /// registers, one merge per block (decode_attention_warp_kernel); fewer heads per block for bf16
  /// or head_dim 256 (warp_decode_max_group)
  tensor_cores_per_warp = 2,
};

/// The enumerator's name, as written above.
[[nodiscard]] constexpr const char* decode_kernel_name(DecodeKernel kernel) noexcept {
  switch (kernel) {
    case DecodeKernel::cuda_cores:
      return "cuda_cores";
    case DecodeKernel::tensor_cores:
      return "tensor_cores";
    case DecodeKernel::tensor_cores_per_warp:
      return "tensor_cores_per_warp";
  }
  return "unknown";
}

/// The kernel a DecodeSetup for T K/V takes when none is named.
template <Element T>
inline constexpr DecodeKernel default_decode_kernel =
    std::is_same_v<T, float> ? DecodeKernel::cuda_cores : DecodeKernel::tensor_cores;

/// What a decode launch is sized by on one device, queried once (make_decode_setup) rather than
/// on every launch: the decode kernel's dynamic shared memory for this dtype, head_dim and GQA
/// group (its limit raised past 48 KiB on that device), its resident blocks per multiprocessor
/// at that size, and the multiprocessor count. A decode step of an engine launches once per
/// layer; without a setup each launch first makes four CUDA calls (device, SM count, shared
/// memory limit, occupancy), host time that a short kernel (small batch or context) does not
/// hide. Plain data: copy it, keep one per (device, model).
struct DecodeSetup {
  int device = -1;             ///< the CUDA device it was queried on
  DType dtype = DType::f32;    ///< element type of the K/V it serves
  int head_dim = 0;            ///< 64, 128 or 256
  int group = 0;               ///< query heads per KV head
  std::size_t smem_bytes = 0;  ///< dynamic shared memory per decode block
  int blocks_per_sm = 0;       ///< resident decode blocks per multiprocessor (>= 1)
  int num_sms = 0;             ///< multiprocessors of the device
  DecodeKernel kernel = DecodeKernel::cuda_cores;  ///< the kernel it sizes and launches
};

namespace detail {

/// @throws shape_error unless `kernel` serves T K/V (cuda_cores: float; the others fp16/bf16).
template <Element T>
void check_kernel(DecodeKernel kernel, const char* what) {
  const bool fp32 = std::is_same_v<T, float>;
  const bool ok = kernel == DecodeKernel::cuda_cores
                      ? fp32
                      : !fp32 && (kernel == DecodeKernel::tensor_cores ||
                                  kernel == DecodeKernel::tensor_cores_per_warp);
  if (!ok) {
    throw shape_error(kvcache::detail::message(what, ": decode kernel ", decode_kernel_name(kernel),
                                               " (", static_cast<int>(kernel), ") does not serve ",
                                               dtype_name(dtype_of<T>), " K/V"));
  }
}

/// Query heads one block of `setup`'s kernel serves at most.
inline int decode_max_group(const DecodeSetup& setup) {
  return setup.kernel == DecodeKernel::tensor_cores_per_warp
             ? warp_decode_max_group(setup.dtype == DType::f16, setup.head_dim)
             : kMaxGroup;
}

/// Queries the current device for `kernel` over T K/V and head_dim D (decode_attention_kernel<
/// float, D, G>, decode_attention_mma_kernel<T, D> or decode_attention_warp_kernel<T, D, G>)
/// serving `group` query heads per KV head, raising its shared-memory limit there.
/// @throws cuda_error.
template <Element T, int D>
DecodeSetup query_decode_setup(int group, DecodeKernel kernel) {
  DecodeSetup setup{.dtype = dtype_of<T>, .head_dim = D, .group = group, .kernel = kernel};
  check(cudaGetDevice(&setup.device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&setup.num_sms, cudaDevAttrMultiProcessorCount, setup.device),
        "cudaDeviceGetAttribute(multiProcessorCount)");
  const auto occupancy = [&](auto kernel) {
    allow_smem(kernel, setup.smem_bytes);
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&setup.blocks_per_sm, kernel,
                                                        kDecodeThreads, setup.smem_bytes),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  };
  if constexpr (std::is_same_v<T, float>) {
    const int chunk_group = decode_chunk_group(group);
    setup.smem_bytes = decode_smem_bytes<T>(D, chunk_group, decode_stages<T, D>());
    dispatch_head_bucket(
        chunk_group, [&](auto g) { occupancy(decode_attention_kernel<T, D, decltype(g)::value>); });
  } else if (kernel == DecodeKernel::tensor_cores_per_warp) {
    constexpr int kMax = warp_decode_max_group(std::is_same_v<T, kvcache::half>, D);
    setup.smem_bytes = DecodeWarpLayout<T, D>::kBytes;
    dispatch_head_bucket(decode_chunk_group(group, kMax), [&](auto g) {
      if constexpr (decltype(g)::value <= kMax) {
        occupancy(decode_attention_warp_kernel<T, D, decltype(g)::value>);
      }
    });
  } else {
    setup.smem_bytes = DecodeMmaSmem<T, D>::kBytes;
    occupancy(decode_attention_mma_kernel<T, D>);
  }
  setup.blocks_per_sm = std::max(setup.blocks_per_sm, 1);
  return setup;
}

/// @throws shape_error unless `setup` was made for T, head_dim and group (on any device) and
///         names a kernel for T.
template <Element T>
void check_setup(const DecodeSetup& setup, int head_dim, int group, const char* what) {
  if (setup.dtype != dtype_of<T> || setup.head_dim != head_dim || setup.group != group ||
      setup.blocks_per_sm < 1 || setup.num_sms < 1) {
    throw shape_error(kvcache::detail::message(
        what, ": DecodeSetup for ", dtype_name(setup.dtype), ", head_dim ", setup.head_dim,
        ", group ", setup.group, " (", setup.num_sms, " SMs x ", setup.blocks_per_sm,
        " blocks) used for ", dtype_name(dtype_of<T>), ", head_dim ", head_dim, ", group ", group));
  }
  check_kernel<T>(setup.kernel, what);
}

/// The plan of one launch from a setup (which also gives its shared memory): host arithmetic
/// only, no CUDA call.
inline DecodePlan plan_decode(const DecodeSetup& setup, int num_seqs, int num_kv_heads,
                              std::int64_t max_keys) {
  const std::int64_t slots = static_cast<std::int64_t>(setup.num_sms) * setup.blocks_per_sm;
  return plan_decode_grid(num_seqs, setup.group, num_kv_heads, max_keys, slots,
                          decode_max_group(setup));
}

}  // namespace detail

/// The DecodeSetup of the current device for decode attention over T K/V with this head_dim and
/// num_q_heads / num_kv_heads query heads per KV head, launching `kernel`. Call it once per device
/// and model, after cudaSetDevice; pass it to every decode launch on that device
/// (DeviceAttendArgs::decode_setup).
/// @throws shape_error (head_dim not 64/128/256, num_q_heads not a multiple of num_kv_heads,
///         a kernel that does not serve T), cuda_error.
template <Element T>
[[nodiscard]] DecodeSetup make_decode_setup(int num_q_heads, int num_kv_heads, int head_dim,
                                            DecodeKernel kernel = default_decode_kernel<T>) {
  detail::check_heads("CUDA decode setup", num_q_heads, num_kv_heads);
  detail::check_kernel<T>(kernel, "CUDA decode setup");
  DecodeSetup setup;
  detail::dispatch_head_dim(head_dim, [&](auto d) {
    setup = detail::query_decode_setup<T, decltype(d)::value>(num_q_heads / num_kv_heads, kernel);
  });
  return setup;
}

/// Bytes of workspace launch_decode_attention needs, with `setup`, for a batch of num_seqs
/// sequences whose views hold at most `max_keys` keys (DeviceKVView::max_keys): the partials of
/// every split, 0 when one split suffices. Non-decreasing in max_keys: query it once for the
/// longest context served, allocate, and reuse the buffer for every launch. No CUDA call.
/// @throws shape_error (setup made for another dtype, head_dim or group).
template <Element T>
[[nodiscard]] std::size_t decode_workspace_bytes(const DecodeSetup& setup, int num_seqs,
                                                 int num_q_heads, int num_kv_heads, int head_dim,
                                                 std::int64_t max_keys) {
  detail::check_heads("CUDA decode attention", num_q_heads, num_kv_heads);
  detail::check_setup<T>(setup, head_dim, num_q_heads / num_kv_heads, "CUDA decode attention");
  return detail::plan_decode(setup, num_seqs, num_kv_heads, max_keys)
      .workspace_bytes(num_seqs, num_q_heads, head_dim);
}

/// decode_workspace_bytes for the current device, its setup queried first.
/// @throws shape_error (as launch_decode_attention), cuda_error.
template <Element T>
[[nodiscard]] std::size_t decode_workspace_bytes(int num_seqs, int num_q_heads, int num_kv_heads,
                                                 int head_dim, std::int64_t max_keys) {
  const DecodeSetup setup = make_decode_setup<T>(num_q_heads, num_kv_heads, head_dim);
  return decode_workspace_bytes<T>(setup, num_seqs, num_q_heads, num_kv_heads, head_dim, max_keys);
}

}  // namespace kvcache::cuda
