// SPDX-License-Identifier: Apache-2.0
// The layout descriptor: one plain, trivially copyable struct saying where the K/V row of
// (sequence, KV head, position) of one layer lives — contiguous, ring (sliding window with sinks)
// or paged. CUDA kernels take it by value (cuda::DeviceKVView is this type); the host caches build
// their views from it (LayoutView, core/view.hpp), so the mapping is written once for both.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/format.hpp"

namespace kvcache {

/// How a layout maps (sequence, KV head, absolute position) to memory.
enum class LayoutKind : int {
  contiguous = 0,  ///< [seq][head][slot][head_dim], slot = position
  ring = 1,   ///< as contiguous, slot = p < num_sinks ? p : num_sinks + (p - num_sinks) % ring_len
  paged = 2,  ///< block_table[seq][p / block_size] names a block; slot p % block_size within it
};

/// The positions a sequence holds, as one logical list: [0, sink_end) then [recent_begin, length),
/// 0 <= sink_end <= recent_begin <= length (sink_end == recent_begin == 0: nothing dropped).
/// Logical index i maps to position pos(i).
struct KeyRange {
  std::int64_t sink_end = 0;
  std::int64_t recent_begin = 0;
  std::int64_t length = 0;
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE std::int64_t count() const {
    return sink_end + (length - recent_begin);
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE std::int64_t pos(std::int64_t i) const {
    return i < sink_end ? i : recent_begin + (i - sink_end);
  }
};

/// One layer of a batch of sequences: the K and V bases, the row shape, and the mapping of
/// positions to rows. Pointers are device pointers for CUDA kernels (DeviceCache::view() builds
/// it; engines may fill one by hand for K/V in their own buffers) and host pointers for the CPU
/// caches. Rows are head_dim elements of F; V rows sit at the same element offsets from `v` as K
/// rows from `k`. A quantized format (int8, fp8) keeps one scale per row beside the codes: the
/// scale of the row at element offset o from k is k_scale[o / head_dim] (v_scale likewise); null
/// for f32/f16/bf16. F = KVFormats<K, V> describes K rows of K and V rows of V in storage of the
/// engine's own (two arrays, since the rows' sizes differ): k_scale is set when K is quantized,
/// v_scale when V is; host attention reads it through LayoutView (the caches and the CUDA kernels
/// use one format).
///
/// `length`, `sink_end` and `recent_begin` are per-sequence arrays (KeyRange of each sequence)
/// read by kernels; sink_end/recent_begin may be null (= 0). A host LayoutView is given its
/// sequence's KeyRange directly and reads none of them.
template <KVFormat F>
struct KVLayout {
  const key_format_t<F>* k = nullptr;    ///< K base of the layer
  const value_format_t<F>* v = nullptr;  ///< V base of the layer
  const scale_type* k_scale = nullptr;   ///< quantized K: the K rows' scales, else null
  const scale_type* v_scale = nullptr;   ///< quantized V: the V rows' scales, else null
  int num_seqs = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  LayoutKind layout = LayoutKind::contiguous;
  std::int64_t seq_stride = 0;   ///< contiguous/ring: elements from one sequence to the next
  std::int64_t head_stride = 0;  ///< elements from one KV head to the next (in a sequence/block)
  int num_sinks = 0;             ///< ring only
  int ring_len = 1;              ///< ring only
  const block_id* block_table = nullptr;       ///< paged: [num_seqs][max_blocks] block ids
  int max_blocks = 0;                          ///< paged: row length of block_table
  int block_size = 1;                          ///< paged: tokens per block
  std::int64_t block_stride = 0;               ///< paged: elements from one block to the next
  const std::int64_t* length = nullptr;        ///< [num_seqs]: positions appended
  const std::int64_t* sink_end = nullptr;      ///< [num_seqs] or null (= 0)
  const std::int64_t* recent_begin = nullptr;  ///< [num_seqs] or null (= 0)
  /// Host-side: the most keys any sequence's view holds, sink_end + length - recent_begin (sizes
  /// grids, splits and workspace; not read by kernels: an undercount costs speed, not results).
  std::int64_t max_keys = 0;

  /// Element offset of the head_dim-long row of (seq, head, pos) from k (or v). Paged layouts
  /// hold positions below 2^31 (the caches check their capacity), so the block index takes a
  /// 32-bit division; so does the ring slot until 2^32 tokens have passed through the ring.
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE std::int64_t row_offset(int seq, int head,
                                                                   std::int64_t pos) const {
    if (layout == LayoutKind::paged) {
      const auto p = static_cast<std::uint32_t>(pos);
      const auto bs = static_cast<std::uint32_t>(block_size);
      const std::uint32_t index = p / bs;
      const block_id block = block_table[static_cast<std::int64_t>(seq) * max_blocks + index];
      return static_cast<std::int64_t>(block) * block_stride + head * head_stride +
             static_cast<std::int64_t>(p - index * bs) * head_dim;
    }
    std::int64_t slot = pos;
    if (layout == LayoutKind::ring && pos >= num_sinks) {
      const std::int64_t r = pos - num_sinks;
      slot = num_sinks + (r <= 0xffffffffLL
                              ? static_cast<std::int64_t>(static_cast<std::uint32_t>(r) %
                                                          static_cast<std::uint32_t>(ring_len))
                              : r % ring_len);
    }
    return seq * seq_stride + head * head_stride + slot * head_dim;
  }

  /// Index of the run of consecutive positions whose rows are consecutive in memory that holds
  /// `pos`: contiguous layouts are one run, a ring is its sinks (run 0) then one run per lap, a
  /// paged layout one run per block.
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE std::int64_t run_of(std::int64_t pos) const {
    switch (layout) {
      case LayoutKind::paged:
        return pos / block_size;
      case LayoutKind::ring:
        return pos < num_sinks ? 0 : 1 + (pos - num_sinks) / ring_len;
      default:
        return 0;
    }
  }
  /// First position of run `run` (see run_of); run_begin(run + 1) is one past its last.
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE std::int64_t run_begin(std::int64_t run) const {
    switch (layout) {
      case LayoutKind::paged:
        return run * block_size;
      case LayoutKind::ring:
        return run == 0 ? 0 : num_sinks + (run - 1) * ring_len;
      default:
        return run == 0 ? 0 : INT64_MAX;
    }
  }

  /// The KeyRange of sequence `seq` from the per-sequence arrays (device memory in kernels).
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE KeyRange key_range(int seq) const {
    KeyRange r;
    r.length = length[seq];
    r.sink_end = sink_end != nullptr ? sink_end[seq] : 0;
    r.recent_begin = recent_begin != nullptr ? recent_begin[seq] : 0;
    return r;
  }
};

/// Where one layer's K and V rows start, in storage made of slabs (one per sequence, or one per
/// block) whose K rows and V rows are laid out alike: the V row of the K row at element offset o
/// from k is at o from v, and each side's slabs are slab_stride elements apart. k_scale / v_scale:
/// the row scales of a quantized side, indexed as its rows (the scale of the row at o is
/// k_scale[o / head_dim]); null for a side in f32/f16/bf16. KVRows::bases() (core/buffer.hpp)
/// gives them for the host caches' storage.
template <KVFormat F>
struct KVBases {
  const key_format_t<F>* k = nullptr;
  const value_format_t<F>* v = nullptr;
  const scale_type* k_scale = nullptr;
  const scale_type* v_scale = nullptr;
  std::int64_t slab_stride = 0;
};

/// The layout of K/V kept as one slab per sequence, [seq][kv_head][slots][head_dim] on each side
/// (StaticCache, SlidingWindowCache, DeviceCache's contiguous and ring layouts), from `at`, the
/// bases of sequence 0: contiguous when ring_len == 0, else num_sinks sink slots then a ring of
/// ring_len (slots = their sum). The per-sequence arrays are left null.
template <KVFormat F>
[[nodiscard]] constexpr KVLayout<F> slab_layout(const KVBases<F>& at, int num_seqs,
                                                int num_kv_heads, int head_dim, std::int64_t slots,
                                                int num_sinks = 0, int ring_len = 0) noexcept {
  KVLayout<F> out;
  out.k = at.k;
  out.v = at.v;
  out.k_scale = at.k_scale;
  out.v_scale = at.v_scale;
  out.num_seqs = num_seqs;
  out.num_kv_heads = num_kv_heads;
  out.head_dim = head_dim;
  out.head_stride = slots * head_dim;
  out.seq_stride = at.slab_stride;
  if (ring_len > 0) {
    out.layout = LayoutKind::ring;
    out.num_sinks = num_sinks;
    out.ring_len = ring_len;
  }
  return out;
}

/// The bases of one format's K and V in one allocation whose slabs are `slab_rows` K rows of
/// head_dim elements, then as many V rows ([K, V][kv_head][...][head_dim]), from `base`; `scales`
/// (a quantized format's, laid out as the rows) or null.
template <KVElement T>
[[nodiscard]] constexpr KVBases<T> interleaved_bases(const T* base, std::int64_t slab_rows,
                                                     int head_dim,
                                                     const scale_type* scales) noexcept {
  const std::int64_t half = slab_rows * head_dim;
  return {base, base + half, scales, scales != nullptr ? scales + slab_rows : nullptr, 2 * half};
}

/// slab_layout() of one format's slabs [seq][K, V][kv_head][slots][head_dim] from `base` (K then V
/// in each sequence's slab: StaticCache's and SlidingWindowCache's layout for one format,
/// DeviceCache's contiguous and ring layouts). `scales`: a quantized format's row scales, laid
/// out as the rows (one per row, the first for the row at `base`); null for f32/f16/bf16.
template <KVElement T>
[[nodiscard]] constexpr KVLayout<T> slab_layout(const T* base, int num_seqs, int num_kv_heads,
                                                int head_dim, std::int64_t slots, int num_sinks = 0,
                                                int ring_len = 0,
                                                const scale_type* scales = nullptr) noexcept {
  return slab_layout(interleaved_bases(base, num_kv_heads * slots, head_dim, scales), num_seqs,
                     num_kv_heads, head_dim, slots, num_sinks, ring_len);
}

/// The layout of a block pool, [block][kv_head][block_size][head_dim] on each side with blocks
/// at.slab_stride elements apart (PagedCache, DeviceCache's paged layout), from `at`, the bases of
/// block 0, read through `table`, [num_seqs][max_blocks] block ids. The per-sequence arrays are
/// left null.
template <KVFormat F>
[[nodiscard]] constexpr KVLayout<F> paged_layout(const KVBases<F>& at, int num_kv_heads,
                                                 int head_dim, int block_size,
                                                 const block_id* table, int num_seqs,
                                                 int max_blocks) noexcept {
  KVLayout<F> out;
  out.k = at.k;
  out.v = at.v;
  out.k_scale = at.k_scale;
  out.v_scale = at.v_scale;
  out.num_seqs = num_seqs;
  out.num_kv_heads = num_kv_heads;
  out.head_dim = head_dim;
  out.layout = LayoutKind::paged;
  out.block_size = block_size;
  out.head_stride = static_cast<std::int64_t>(block_size) * head_dim;
  out.block_stride = at.slab_stride;
  out.block_table = table;
  out.max_blocks = max_blocks;
  return out;
}

/// paged_layout() of one format's pool, one allocation per layer of blocks [K, V][kv_head]
/// [block_size][head_dim], `block_stride` elements apart (>= the block's K and V), from `base`.
/// `scales`: a quantized format's row scales laid out as the rows; null for f32/f16/bf16.
template <KVElement T>
[[nodiscard]] constexpr KVLayout<T> paged_layout(const T* base, int num_kv_heads, int head_dim,
                                                 int block_size, std::int64_t block_stride,
                                                 const block_id* table, int num_seqs,
                                                 int max_blocks,
                                                 const scale_type* scales = nullptr) noexcept {
  KVBases<T> at = interleaved_bases(base, static_cast<std::int64_t>(num_kv_heads) * block_size,
                                    head_dim, scales);
  at.slab_stride = block_stride;
  return paged_layout(at, num_kv_heads, head_dim, block_size, table, num_seqs, max_blocks);
}

static_assert(std::is_trivially_copyable_v<KVLayout<float>>);
static_assert(std::is_trivially_copyable_v<KVLayout<KVFormats<half, qint8>>>);
static_assert(std::is_trivially_copyable_v<KeyRange>);

}  // namespace kvcache
