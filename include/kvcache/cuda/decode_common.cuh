// SPDX-License-Identifier: Apache-2.0
// What the decode kernels share: tile and shared-memory sizes, tensor-core operand types and
// the splitting of q and p into parts, the cp.async K/V tile loader and pipeline, the launch's
// arguments (DecodeArgs), which keys and heads a block serves, and how it writes its result.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <cuda_pipeline.h>
#include <mma.h>

#include <cstddef>
#include <cstdint>

#include "kvcache/core/dtype.hpp"
#include "kvcache/cuda/decode_plan.hpp"
#include "kvcache/cuda/kernels_common.cuh"
#include "kvcache/cuda/view.cuh"

namespace kvcache::cuda::detail {

/// Byte stride of one K or V row in a shared-memory tile: 16 bytes of padding keep consecutive
/// keys' 16-byte loads on different banks.
template <KVElement T>
__host__ __device__ constexpr int tile_row_bytes(int head_dim) {
  return head_dim * static_cast<int>(sizeof(T)) + 16;
}

/// True when format T stores either side quantized (its tiles carry row scales).
template <KVFormat T>
inline constexpr bool kAnyScaled = scaled_v<key_format_t<T>> || scaled_v<value_format_t<T>>;

/// Shared memory of the decode kernel, in bytes: q [G][D] floats; K tiles then V tiles (each in
/// its side's format), one per pipeline stage [stages][kDecodeTile][row]; their positions
/// [stages][kDecodeTile]; partial scores [2][G][kDecodeTile]; per-head m, l, correction; where a
/// side is quantized the tiles' K and V row scales as floats, [2][stages][kDecodeTile].
template <KVFormat T>
__host__ __device__ constexpr std::size_t decode_smem_bytes(int head_dim, int group, int stages) {
  const std::size_t g = static_cast<std::size_t>(group);
  const std::size_t n = static_cast<std::size_t>(stages);
  const auto rows = static_cast<std::size_t>(tile_row_bytes<key_format_t<T>>(head_dim) +
                                             tile_row_bytes<value_format_t<T>>(head_dim));
  return g * head_dim * sizeof(float) + n * kDecodeTile * rows +
         n * kDecodeTile * sizeof(std::int64_t) + 2 * g * kDecodeTile * sizeof(float) +
         3 * g * sizeof(float) + (kAnyScaled<T> ? 2 * n * kDecodeTile * sizeof(float) : 0);
}

/// Pipeline stages of the decode kernel: double-buffered K/V tiles (the next tile's copies in
/// flight while this one is used) wherever they fit, else one buffer (float K/V at head_dim 256).
template <KVFormat T, int D>
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

/// The code of a quantized format whose bits are the low byte of b.
template <QuantizedElement T>
__device__ __forceinline__ T code_of_byte(unsigned b) {
  if constexpr (std::is_same_v<T, qint8>) {
    return qint8(static_cast<std::int8_t>(static_cast<std::uint8_t>(b & 0xffu)));
  } else {
    return fp8_e4m3::from_bits(static_cast<std::uint8_t>(b & 0xffu));
  }
}

/// Element i of E packed in the 32-bit words `words` (little-endian, as loaded from memory).
template <KVElement E>
__device__ __forceinline__ E element_at(const unsigned* words, int i) {
  constexpr int kBytes = static_cast<int>(sizeof(E));
  const unsigned bits = words[i * kBytes / 4] >> (8 * (i * kBytes % 4));
  if constexpr (kBytes == 1) {
    return code_of_byte<E>(bits);
  } else if constexpr (kBytes == 2) {
    E x;
    x.bits = static_cast<unsigned short>(bits & 0xffffu);
    return x;
  } else {
    return __uint_as_float(bits);
  }
}

/// The values of the 16 / sizeof(T) fp16 or bf16 elements, or int8 or fp8 codes, at p (16-byte
/// aligned); a code's row scale is applied apart.
template <KVElement T>
requires(sizeof(T) < 4) __device__ __forceinline__ void load16(const T* p, float* out) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) {
    out[i] = element_value(element_at<T>(words, i));
  }
}

/// The values of the 2 fp16 or bf16 elements, or int8 or fp8 codes, at p; a code's row scale is
/// applied apart.
template <KVElement T>
requires(sizeof(T) < 4) __device__ __forceinline__ float2 load_pair(const T* p) {
  return make_float2(element_value(p[0]), element_value(p[1]));
}

/// Writes the elements of E in the 16 bytes at src (16-byte aligned; zeros when !valid, src then
/// unread) as values of Tile (fp16, bf16 or float: a tensor-core operand) to dst (16-byte
/// aligned). Exact wherever the kernels use it: int8 and e4m3 codes are fp16, bf16 and float
/// values, fp16 and bf16 values are floats.
template <class Tile, KVElement E>
__device__ __forceinline__ void store_chunk_as(const char* src, bool valid, char* dst) {
  constexpr int kN = 16 / static_cast<int>(sizeof(E));             // elements read
  constexpr int kWords = kN * static_cast<int>(sizeof(Tile)) / 4;  // 32-bit words written
  static_assert(kWords % 4 == 0, "whole 16-byte stores");
  const uint4 w = valid ? *reinterpret_cast<const uint4*>(src) : uint4{0u, 0u, 0u, 0u};
  const unsigned words[4] = {w.x, w.y, w.z, w.w};
  unsigned out[kWords];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float x = element_value(element_at<E>(words, i));
    if constexpr (sizeof(Tile) == 4) {
      out[i] = __float_as_uint(x);
    } else {
      const unsigned b = MmaTraits<Tile>::bits(MmaTraits<Tile>::from_float(x));
      out[i / 2] = i % 2 == 0 ? b : out[i / 2] | (b << 16);
    }
  }
#pragma unroll
  for (int j = 0; j < kWords / 4; ++j) {
    reinterpret_cast<uint4*>(dst)[j] =
        uint4{out[4 * j], out[4 * j + 1], out[4 * j + 2], out[4 * j + 3]};
  }
}

/// Copies (or, when Tile is not E, converts with store_chunk_as) the rows of one side of a K/V
/// tile: the warp's kRows / warps rows from `base` at the element offsets the lanes found
/// (my_off of lane r for row r; my_valid 0 zero-fills), into `tile`, rows
/// tile_row_bytes<Tile>(D) bytes apart. 16-byte cp.async copies, or plain loads and stores.
template <KVElement E, class Tile, int D, int kThreads, int kRows>
__device__ __forceinline__ void load_side_tile(const E* base, char* tile, std::int64_t my_off,
                                               int my_valid, int lane, int row0) {
  constexpr bool kConvert = !std::is_same_v<E, Tile>;
  constexpr int kChunks = D * static_cast<int>(sizeof(E)) / 16;  // 16-byte chunks per row
  constexpr int kStride = tile_row_bytes<Tile>(D);
  constexpr int kChunkOut = 16 * static_cast<int>(sizeof(Tile)) / static_cast<int>(sizeof(E));
  constexpr int kWarpRows = kRows / (kThreads / 32);
  constexpr int kStepRows = kChunks >= 32 ? 1 : 32 / kChunks;  // rows per warp-wide copy
  static_assert(kThreads % 32 == 0 && kRows % (kThreads / 32) == 0 && kWarpRows <= 32);
  static_assert(kWarpRows % kStepRows == 0 &&
                (kChunks >= 32 ? kChunks % 32 == 0 : 32 % kChunks == 0));
  const int sub = kChunks >= 32 ? 0 : lane / kChunks;  // this lane's row within a step
  const int chunk0 = kChunks >= 32 ? lane : lane % kChunks;
#pragma unroll
  for (int r = 0; r < kWarpRows; r += kStepRows) {
    const std::int64_t off = __shfl_sync(kFullMask, my_off, r + sub);
    const int valid = __shfl_sync(kFullMask, my_valid, r + sub);
    const int row = row0 + r + sub;
    const char* src = reinterpret_cast<const char*>(base + off);
#pragma unroll
    for (int chunk = chunk0; chunk < kChunks; chunk += 32) {
      if constexpr (kConvert) {
        store_chunk_as<Tile, E>(src + chunk * 16, valid, tile + row * kStride + chunk * kChunkOut);
      } else {
        __pipeline_memcpy_async(tile + row * kStride + chunk * 16, src + chunk * 16, 16,
                                valid ? 0 : 16);
      }
    }
  }
}

/// Loads logical keys [i0, i0 + kRows) of (seq, kv_head) into one K and one V tile, kThreads
/// threads; rows at or past `end` are zero-filled (so that p * V stays finite) and get position
/// -1. Each warp loads kRows / warps consecutive rows: lane l first finds the position and element
/// offset of the warp's row l (one block-table lookup and division per row, not per 16-byte
/// chunk, shared by both sides), then each side's rows are copied 32 / chunks-per-row at a time
/// (load_side_tile), each lane reading its row's offset from the lane that found it. A quantized
/// side's row scales go (as floats, plain loads, 0 for rows past `end`) to k_scale_tile or
/// v_scale_tile [kRows] (unused, may be null, for a side in f32/f16/bf16). KTile / VTile: what
/// each side's tile holds, its own format (16-byte cp.async copies, rows tile_row_bytes of it) or
/// a tensor-core operand type its values are converted to on the way in (store_chunk_as, plain
/// loads and stores); visible after the caller's next barrier like the copies.
template <KVFormat T, int D, int kThreads, int kRows, class KTile = key_format_t<T>,
          class VTile = value_format_t<T>>
__device__ __forceinline__ void load_kv_tile(const DeviceKVView<T>& view, int seq, int kv_head,
                                             const KeyRange& keys, std::int64_t i0,
                                             std::int64_t end, char* k_tile, char* v_tile,
                                             std::int64_t* pos_tile, int tid,
                                             float* k_scale_tile = nullptr,
                                             float* v_scale_tile = nullptr) {
  using K = key_format_t<T>;
  using V = value_format_t<T>;
  constexpr int kWarpRows = kRows / (kThreads / 32);
  const int lane = tid % 32, row0 = tid / 32 * kWarpRows;
  std::int64_t my_off = 0;
  int my_valid = 0;
  if (lane < kWarpRows) {
    const std::int64_t i = i0 + row0 + lane;
    my_valid = i < end;
    const std::int64_t pos = my_valid ? keys.pos(i) : -1;
    if (my_valid) my_off = view.row_offset(seq, kv_head, pos);
    pos_tile[row0 + lane] = pos;
    if constexpr (scaled_v<K>) {
      k_scale_tile[row0 + lane] = my_valid ? static_cast<float>(view.k_scale[my_off / D]) : 0.0f;
    }
    if constexpr (scaled_v<V>) {
      v_scale_tile[row0 + lane] = my_valid ? static_cast<float>(view.v_scale[my_off / D]) : 0.0f;
    }
  }
  load_side_tile<K, KTile, D, kThreads, kRows>(view.k, k_tile, my_off, my_valid, lane, row0);
  load_side_tile<V, VTile, D, kThreads, kRows>(view.v, v_tile, my_off, my_valid, lane, row0);
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
template <KVFormat T>
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
  w.keys = visible_keys(view.key_range(w.seq), args.mask, w.qpos);
  const std::int64_t count = w.keys.count();
  w.begin = w.split * keys_per_split;
  // the last split takes whatever is left: a view whose max_keys undercounts runs slower, not wrong
  w.end = w.split + 1 == num_splits ? count : min(count, w.begin + keys_per_split);
  return w;
}

}  // namespace kvcache::cuda::detail
