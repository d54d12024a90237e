// SPDX-License-Identifier: Apache-2.0
// Prefill attention on the GPU: many query tokens per sequence against the cached prefix plus the
// new tokens, causal by absolute positions. A tiled flash-attention kernel: 64 query rows x 64 keys
// per step, q.k and p.V on tensor cores (wmma: fp16 and bf16 operands, tf32 for fp32 caches, fp16
// for int8 and fp8 codes with their row scales applied to scores and weights), online softmax and
// the output accumulator in fp32.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_pipeline.h>

#include <cstddef>
#include <cstdint>

#include "kvcache/cuda/decode_common.cuh"
#include "kvcache/cuda/kernels_common.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda {

inline constexpr int kPrefillThreads = 128;  ///< 4 warps, 16 query rows each
inline constexpr int kPrefillRows = 64;      ///< query rows per block
inline constexpr int kPrefillKeys = 64;      ///< keys per step

namespace detail {

/// The tensor-core operand of one side's values: E itself, or fp16 for the int8 and fp8 codes
/// (every code is an fp16 value; the row scales are applied apart).
template <KVElement E>
using side_operand_t = std::conditional_t<scaled_v<E>, kvcache::half, E>;

/// The tensor-core operand type of the prefill kernel over T K/V (both sides' tiles hold it):
/// side_operand_t of its format; for a KVFormats<K, V> pair whose sides differ in it, the type of
/// its unquantized side (int8 and e4m3 codes are bf16 and tf32 values too), or tf32 for two
/// different unquantized types (fp16 and bf16 values are floats).
template <KVFormat T>
using prefill_operand_t = std::conditional_t<
    std::is_same_v<side_operand_t<key_format_t<T>>, side_operand_t<value_format_t<T>>>,
    side_operand_t<key_format_t<T>>,
    std::conditional_t<scaled_v<key_format_t<T>>, value_format_t<T>,
                       std::conditional_t<scaled_v<value_format_t<T>>, key_format_t<T>, float>>>;

/// Shared-memory row strides (elements) and byte offsets of the prefill kernel with kStages K/V
/// buffers; where a side is int8 or fp8 also the tiles' K and V row scales [2][kStages][64] and
/// the largest V scale of each warp's 16 rows [4].
template <KVFormat T, int D, int kStages>
struct PrefillLayout {
  using S = typename MmaTraits<prefill_operand_t<T>>::storage;
  static constexpr int kStageCount = kStages;
  static constexpr int kPadS = 16 / static_cast<int>(sizeof(S));  // 16 bytes
  static constexpr int kLdQ = D + kPadS;             // q, k, v tiles [64][D + pad] (storage)
  static constexpr int kLdP = kPrefillKeys + kPadS;  // p [64][64 + pad] (storage)
  static constexpr int kLdS = kPrefillKeys + 4;      // scores [64][68] (float)
  static constexpr int kLdO = D + 4;                 // output accumulator [64][D + 4] (float)
  static constexpr std::size_t kTile = sizeof(S) * kPrefillKeys * kLdQ;  // one K or V buffer
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = kQ + sizeof(S) * kPrefillRows * kLdQ;  // K[kStages]
  static constexpr std::size_t kV = kK + kStages * kTile;                  // V[kStages]
  static constexpr std::size_t kP = kV + kStages * kTile;
  static constexpr std::size_t kS = kP + sizeof(S) * kPrefillRows * kLdP;
  static constexpr std::size_t kO = kS + sizeof(float) * kPrefillRows * kLdS;
  static constexpr std::size_t kPos = kO + sizeof(float) * kPrefillRows * kLdO;  // [kStages][64]
  static constexpr std::size_t kStats = kPos + kStages * sizeof(std::int64_t) * kPrefillKeys;
  // one bit per V row of the tile holding an inf or NaN: [4 warps] words of 16 rows
  static constexpr std::size_t kVBad = kStats + 3 * sizeof(float) * kPrefillRows;
  static constexpr std::size_t kScales = kVBad + (kPrefillThreads / 32) * sizeof(std::uint32_t);
  static constexpr std::size_t kVMax = kScales + 2 * kStages * sizeof(float) * kPrefillKeys;
  static constexpr std::size_t kBytes =
      kAnyScaled<T> ? kVMax + (kPrefillThreads / 32) * sizeof(float) : kScales;
};

/// True when one of the elements packed in the 32-bit word w (one float, or two fp16/bf16) is inf
/// or NaN (every exponent bit set).
template <Element T>
__device__ __forceinline__ bool nonfinite_word(std::uint32_t w) {
  if constexpr (std::is_same_v<T, float>) {
    return (w & 0x7f800000u) == 0x7f800000u;
  } else {
    constexpr std::uint32_t e = std::is_same_v<T, kvcache::half> ? 0x7c00u : 0x7f80u;
    return (w & e) == e || (w & (e << 16)) == (e << 16);
  }
}

/// The least power of two >= x, for a positive finite x. Dividing by it is exact, so a weight
/// p * scale / pow2_at_least(...) rounds to fp16 alike whichever power the tile's largest scale
/// gives (outside fp16's subnormal range).
__host__ __device__ __forceinline__ float pow2_at_least(float x) {
  const std::uint32_t u = kvcache::detail::float_bits(x);
  return kvcache::detail::bits_float((u & 0x7fffffu) != 0 ? (u & 0x7f800000u) + 0x800000u
                                                          : u & 0x7f800000u);
}

/// The prefill kernel's layout: K/V double-buffered (the next tile's copies in flight while this
/// one is used) wherever that fits, else one buffer (fp16/bf16 at head_dim 256, float at 128).
template <KVFormat T, int D>
using PrefillSmem = std::conditional_t<PrefillLayout<T, D, 2>::kBytes <= kMaxSmemBytes,
                                       PrefillLayout<T, D, 2>, PrefillLayout<T, D, 1>>;

/// One block per (64-row query tile, query head, sequence). Query row r of sequence s sits at
/// position length[s] - q_len(s) + r. Every step takes 64 keys of the visible list (their copies
/// issued a step ahead where two K/V buffers fit), computes the 64 x 64 scores on tensor cores
/// (warp w owns query rows 16w..16w+15), updates the online softmax of its rows, rescales their
/// accumulator rows, and adds p.V on tensor cores. The V rows of a tile that hold an inf or NaN
/// are zeroed in shared memory first and flagged: a row that sees such a key is NaN (its l), and
/// the rows that do not, whose weight for it is 0, add 0 instead of 0 * inf = NaN.
/// int8 and fp8: the codes enter the tiles as fp16 values (plain loads, converted on the way; a
/// KVFormats pair's side that is not in the operand type likewise, prefill_operand_t); each score
/// of int8/fp8 keys is multiplied by its key's K scale, and with int8/fp8 values each weight of a
/// seen key by its V scale
/// over the least power of two at or above the tile's largest (so that it stays within 1 in
/// fp16), the tile's p.V then scaled back by that power in fp32. A V scale that is NaN flags its
/// row like a non-finite V row. So an inf or NaN in a key a row does not see leaves that row's
/// output NaN-free, and moves it at most by rounding (a weight in fp16's subnormal range, if the
/// bad row held the tile's largest scale), where the fp16/bf16 kernel changes no bit.
template <KVFormat T, int D>
__global__ void __launch_bounds__(kPrefillThreads)
    prefill_attention_kernel(DeviceKVView<T> view, const float* __restrict__ q,
                             float* __restrict__ out, const std::int32_t* __restrict__ q_offsets,
                             int num_q_heads, DeviceMask mask, float scale, float softcap) {
  namespace wmma = nvcuda::wmma;
  using O = prefill_operand_t<T>;
  constexpr bool kKScaled = scaled_v<key_format_t<T>>, kVScaled = scaled_v<value_format_t<T>>;
  using Traits = MmaTraits<O>;
  using S = typename Traits::storage;
  using Op = typename Traits::operand;
  using L = PrefillSmem<T, D>;
  constexpr int kK = Traits::kK;
  static_assert(L::kBytes <= kMaxSmemBytes);
  const int tile = blockIdx.x, q_head = blockIdx.y, seq = blockIdx.z;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int group = num_q_heads / view.num_kv_heads;
  const int kv_head = q_head / group;

  const std::int32_t q_begin = q_offsets[seq];
  const int q_len = q_offsets[seq + 1] - q_begin;
  const int row0 = tile * kPrefillRows;
  if (row0 >= q_len) return;
  const int rows = min(kPrefillRows, q_len - row0);
  const std::int64_t length = view.length[seq];
  const std::int64_t first_pos = length - q_len + row0;  // position of this tile's row 0
  const std::int64_t last_pos = first_pos + rows - 1;

  extern __shared__ __align__(128) unsigned char smem[];
  S* q_s = reinterpret_cast<S*>(smem + L::kQ);
  constexpr int kStages = L::kStageCount;
  auto k_at = [&](int b) { return smem + L::kK + b * L::kTile; };
  auto v_at = [&](int b) { return smem + L::kV + b * L::kTile; };
  auto pos_at = [&](int b) {
    return reinterpret_cast<std::int64_t*>(smem + L::kPos) + b * kPrefillKeys;
  };
  S* p_s = reinterpret_cast<S*>(smem + L::kP);
  float* s_s = reinterpret_cast<float*>(smem + L::kS);
  float* o_s = reinterpret_cast<float*>(smem + L::kO);
  float* m_s = reinterpret_cast<float*>(smem + L::kStats);
  float* l_s = m_s + kPrefillRows;
  float* corr_s = l_s + kPrefillRows;
  std::uint32_t* v_bad_s = reinterpret_cast<std::uint32_t*>(smem + L::kVBad);
  // int8/fp8 sides: row scales [kStages][64] of K, then V; the largest V scale of each warp's rows
  float* k_scales = reinterpret_cast<float*>(smem + L::kScales);
  float* v_scales = k_scales + kStages * kPrefillKeys;
  float* v_max_s = reinterpret_cast<float*>(smem + L::kVMax);

  // scaled queries in the operand precision; rows past q_len are zero
  for (int i = tid; i < kPrefillRows * D; i += kPrefillThreads) {
    const int r = i / D, d = i % D;
    const float x =
        r < rows
            ? q[((static_cast<std::int64_t>(q_begin) + row0 + r) * num_q_heads + q_head) * D + d] *
                  scale
            : 0.0f;
    q_s[r * L::kLdQ + d] = Traits::from_float(x);
  }
  for (int i = tid; i < kPrefillRows * D; i += kPrefillThreads)
    o_s[(i / D) * L::kLdO + i % D] = 0.0f;
  for (int r = tid; r < kPrefillRows; r += kPrefillThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.0f;
  }

  const KeyRange keys = visible_keys(view.key_range(seq), mask, first_pos);
  const std::int64_t count = keys.count();
  // Tiles start at every kPrefillKeys-th key of the list, up to the first that starts past every
  // row (positions grow with the index, so causally none of its keys is visible).
  auto wanted = [&](std::int64_t i) {
    return i < count && !(mask.causal && keys.pos(i) > last_pos);
  };
  auto load = [&](std::int64_t i, int b) {
    load_kv_tile<T, D, kPrefillThreads, kPrefillKeys, O, O>(
        view, seq, kv_head, keys, i, count, reinterpret_cast<char*>(k_at(b)),
        reinterpret_cast<char*>(v_at(b)), pos_at(b), tid, k_scales + b * kPrefillKeys,
        v_scales + b * kPrefillKeys);
  };
  // q_s, o_s, m_s, l_s are initialised before the first compute (a barrier precedes it)
  auto compute = [&](std::int64_t, int buf) {
    const S* k_s = reinterpret_cast<const S*>(k_at(buf));
    const S* v_s = reinterpret_cast<const S*>(v_at(buf));
    const std::int64_t* pos_s = pos_at(buf);
    [[maybe_unused]] const float* k_scale = k_scales + buf * kPrefillKeys;
    [[maybe_unused]] const float* v_scale = v_scales + buf * kPrefillKeys;

    {  // V rows [16w, 16w + 16) holding an inf or NaN: zeroed, bit r of v_bad_s[w] set
      constexpr int kChunks = D * static_cast<int>(sizeof(S)) / 16;  // 16-byte chunks per row
      std::uint32_t bad_rows = 0;
      for (int i = lane; i < 16 * kChunks; i += 32) {
        const int r = i / kChunks;
        uint4* chunk =
            reinterpret_cast<uint4*>(v_at(buf) + static_cast<std::size_t>(warp * 16 + r) * L::kLdQ *
                                                     sizeof(S)) +
            i % kChunks;
        const uint4 x = *chunk;
        if (nonfinite_word<O>(x.x) || nonfinite_word<O>(x.y) || nonfinite_word<O>(x.z) ||
            nonfinite_word<O>(x.w)) {
          *chunk = uint4{0u, 0u, 0u, 0u};
          bad_rows |= 1u << r;
        }
      }
      if constexpr (kVScaled) {  // a NaN scale marks a non-finite row; the finite ones' largest
        const float vs = lane < 16 ? v_scale[warp * 16 + lane] : 0.0f;
        if (lane < 16 && !is_finite(vs)) bad_rows |= 1u << lane;
        const float most = warp_max(lane < 16 && is_finite(vs) ? vs : 0.0f);
        if (lane == 0) v_max_s[warp] = most;
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) bad_rows |= __shfl_xor_sync(kFullMask, bad_rows, o);
      if (lane == 0) v_bad_s[warp] = bad_rows;
    }

    // scores: warp rows [16w, 16w + 16) x 64 keys
    {
      wmma::fragment<wmma::accumulator, 16, 16, kK, float> acc[kPrefillKeys / 16];
#pragma unroll
      for (int c = 0; c < kPrefillKeys / 16; ++c) wmma::fill_fragment(acc[c], 0.0f);
#pragma unroll
      for (int kk = 0; kk < D; kk += kK) {
        wmma::fragment<wmma::matrix_a, 16, 16, kK, Op, wmma::row_major> a;
        wmma::load_matrix_sync(a, q_s + warp * 16 * L::kLdQ + kk, L::kLdQ);
        if constexpr (std::is_same_v<O, float>) {
#pragma unroll
          for (int e = 0; e < a.num_elements; ++e) a.x[e] = wmma::__float_to_tf32(a.x[e]);
        }
#pragma unroll
        for (int c = 0; c < kPrefillKeys / 16; ++c) {
          wmma::fragment<wmma::matrix_b, 16, 16, kK, Op, wmma::col_major> b;
          wmma::load_matrix_sync(b, k_s + c * 16 * L::kLdQ + kk, L::kLdQ);
          if constexpr (std::is_same_v<O, float>) {
#pragma unroll
            for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(b.x[e]);
          }
          wmma::mma_sync(acc[c], a, b, acc[c]);
        }
      }
#pragma unroll
      for (int c = 0; c < kPrefillKeys / 16; ++c) {
        wmma::store_matrix_sync(s_s + warp * 16 * L::kLdS + c * 16, acc[c], L::kLdS,
                                wmma::mem_row_major);
      }
    }
    __syncthreads();  // every warp's zeroed V rows, v_bad_s and v_max_s
    // int8/fp8 V: the weights of the codes carry v_scale / v_max, p.V is scaled back by v_max
    [[maybe_unused]] float v_max = 1.0f;
    if constexpr (kVScaled) {
      const float most = fmaxf(fmaxf(v_max_s[0], v_max_s[1]), fmaxf(v_max_s[2], v_max_s[3]));
      if (most > 0.0f) v_max = pow2_at_least(most);  // else every weight is 0 anyway
    }
    // online softmax of the warp's 16 rows; lanes cover keys lane and lane + 32
    for (int rr = 0; rr < 16; ++rr) {
      const int r = warp * 16 + rr;
      const std::int64_t qpos = first_pos + r;
      float sc[2];
      bool bad = false;
      [[maybe_unused]] bool seen[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        const std::int64_t pos = pos_s[j];
        const bool visible = r < rows && pos >= 0 && mask.visible(qpos, pos);
        float raw = s_s[r * L::kLdS + j];
        if constexpr (kKScaled) raw *= k_scale[j];
        sc[h] = transform_score(visible ? mask.score(raw, seq, row0 + r, q_head, pos) : raw,
                                softcap, visible, bad);
        bad = bad || (visible && (v_bad_s[j / 16] >> (j % 16) & 1u) != 0);
        seen[h] = visible;
      }
      float p[2];
      online_softmax_step(sc, p, &m_s[r], &l_s[r], &corr_s[r], lane, bad);
      if constexpr (kVScaled) {
        p[0] = seen[0] ? p[0] * (v_scale[lane] / v_max) : 0.0f;
        p[1] = seen[1] ? p[1] * (v_scale[lane + 32] / v_max) : 0.0f;
      }
      p_s[r * L::kLdP + lane] = Traits::from_float(p[0]);
      p_s[r * L::kLdP + lane + 32] = Traits::from_float(p[1]);
    }
    __syncwarp();
    for (int i = lane; i < 16 * D; i += 32) {  // rescale the warp's accumulator rows
      const int r = warp * 16 + i / D;
      o_s[r * L::kLdO + i % D] *= corr_s[r];
    }
    __syncwarp();
    // o += p.V for the warp's rows
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      wmma::fragment<wmma::accumulator, 16, 16, kK, float> o, pv;  // pv: this tile's p.V
      float* o_tile = o_s + warp * 16 * L::kLdO + c * 16;
      wmma::load_matrix_sync(o, o_tile, L::kLdO, wmma::mem_row_major);
      if constexpr (kVScaled) {
        wmma::fill_fragment(pv, 0.0f);
      } else {
        pv = o;
      }
#pragma unroll
      for (int kk = 0; kk < kPrefillKeys; kk += kK) {
        wmma::fragment<wmma::matrix_a, 16, 16, kK, Op, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, kK, Op, wmma::row_major> b;
        wmma::load_matrix_sync(a, p_s + warp * 16 * L::kLdP + kk, L::kLdP);
        wmma::load_matrix_sync(b, v_s + kk * L::kLdQ + c * 16, L::kLdQ);
        if constexpr (std::is_same_v<O, float>) {
#pragma unroll
          for (int e = 0; e < a.num_elements; ++e) a.x[e] = wmma::__float_to_tf32(a.x[e]);
#pragma unroll
          for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(b.x[e]);
        }
        wmma::mma_sync(pv, a, b, pv);
      }
      if constexpr (kVScaled) {
#pragma unroll
        for (int e = 0; e < o.num_elements; ++e) o.x[e] += v_max * pv.x[e];
      } else {
        o = pv;
      }
      wmma::store_matrix_sync(o_tile, o, L::kLdO, wmma::mem_row_major);
    }
  };
  // ends after a barrier: o_s, l_s of every warp (also when no tile was visited)
  for_each_kv_tile<kStages>(0, kPrefillKeys, wanted, load, compute);
  for (int i = tid; i < rows * D; i += kPrefillThreads) {
    const int r = i / D, d = i % D;
    const float l = l_s[r];  // NaN: the row saw an inf or NaN
    out[((static_cast<std::int64_t>(q_begin) + row0 + r) * num_q_heads + q_head) * D + d] =
        l > 0.0f    ? o_s[r * L::kLdO + d] / l
        : l == 0.0f ? 0.0f
                    : NAN;
  }
}

}  // namespace detail
}  // namespace kvcache::cuda
