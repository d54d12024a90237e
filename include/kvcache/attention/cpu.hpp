// SPDX-License-Identifier: Apache-2.0
// The fast CPU attention kernel: one pass over the cached K/V with an online (flash-attention)
// softmax, tiles of kTile keys, all query heads of one KV head sharing every K/V row read, fp16,
// bf16, int8 and fp8 read directly (a quantized row's scale multiplies its scores and weights).
// Work is split into (sequence, KV head, block of query rows) items that the caller's executor
// (AttentionOptions::pool) may run in parallel. Over views of short segments (paged blocks) one
// item sweeps several KV heads in lockstep, so that each block is read whole. The sweeps see every
// view through ErasedView, and queries and output of any element type as untyped rows: they are
// compiled once per K/V element type and kernel.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/attention/cpu_avx2.hpp"
#include "kvcache/attention/cpu_avx512.hpp"
#include "kvcache/attention/cpu_micro.hpp"
#include "kvcache/attention/cpu_neon.hpp"
#include "kvcache/attention/options.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/executor.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache::cpu {

/// Largest head_dim the fast kernel handles (its per-task state lives on the stack).
inline constexpr std::size_t kMaxHeadDim = 512;
/// Keys per online-softmax tile.
inline constexpr std::size_t kTile = 32;
/// Query rows (query tokens x query heads of one KV head) that share one sweep over K/V.
inline constexpr std::size_t kRowBlock = 16;
/// Query rows per micro-kernel call.
inline constexpr std::size_t kSubRows = 4;
/// How many tiles ahead of the one being computed K/V rows are prefetched (into L2, see qk_rows
/// in cpu_simd_ops.inc). Zen 5, 16k-token decode, half K/V: two tiles ahead gives 0.68-0.71 of the
/// read bandwidth with AVX-512 and 0.50-0.56 with AVX2, four tiles 0.57-0.64 and 0.46-0.48.
inline constexpr std::size_t kPrefetchTiles = 2;

/// Which implementation of the micro-kernels to run.
enum class Kernel {
  automatic,  ///< the first of avx512, avx2, neon, portable that the CPU and head_dim allow
  portable,   ///< plain C++ loops
  avx2,       ///< AVX2+FMA+F16C intrinsics, head_dim % 8 == 0 (shape_error where unavailable)
  avx512,     ///< AVX-512F intrinsics, head_dim % 16 == 0 (shape_error where unavailable)
  neon,       ///< AArch64 NEON intrinsics, head_dim % 4 == 0 (shape_error where unavailable)
};

namespace detail {

/// Plain C++ micro-kernels (any head_dim, any CPU).
template <KVElement T>
struct PortableOps {
  // Prefetching (ahead, num_ahead) is left to the hardware.
  static void qk(const float* q, std::size_t rows, const T* const* k, std::size_t nk, std::size_t d,
                 float* s, std::size_t stride, const Prefetch* /*ahead*/,
                 std::size_t /*num_ahead*/) noexcept {
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t j = 0; j < nk; ++j) {
        float lanes[8] = {};
        std::size_t x = 0;
        for (; x + 8 <= d; x += 8) {
          for (std::size_t l = 0; l < 8; ++l) {
            lanes[l] += q[r * d + x + l] * code_value(k[j][x + l]);
          }
        }
        float acc = 0.0f;
        for (; x < d; ++x) acc += q[r * d + x] * code_value(k[j][x]);
        for (float l : lanes) acc += l;
        s[r * stride + j] = acc;
      }
    }
  }
  static void pv(const float* p, std::size_t stride, std::size_t rows, const T* const* v,
                 std::size_t nk, std::size_t d, float* acc, const Prefetch* /*ahead*/,
                 std::size_t /*num_ahead*/) noexcept {
    // No skip for p == 0: a weight that underflowed must still turn an inf or NaN of V into
    // NaN (slots a row does not see read a zero row instead, see Sweep::pv_hidden).
    for (std::size_t j = 0; j < nk; ++j) {
      for (std::size_t r = 0; r < rows; ++r) {
        const float pr = p[r * stride + j];
        for (std::size_t x = 0; x < d; ++x) acc[r * d + x] += pr * code_value(v[j][x]);
      }
    }
  }
  static float max(const float* x, std::size_t n) noexcept { return *std::max_element(x, x + n); }
  /// max(x, n), and sets `found` when some x[i] is inf or NaN.
  static float max_nonfinite(const float* x, std::size_t n, bool& found) noexcept {
    found = found || nonfinite(x, n);
    return max(x, n);
  }
  /// True when some x[i] is inf or NaN.
  static bool nonfinite(const float* x, std::size_t n) noexcept {
    bool any = false;
    for (std::size_t i = 0; i < n; ++i) {
      any = any || (std::bit_cast<std::uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
    }
    return any;
  }
  static float exp_sum(float* x, std::size_t n, float shift) noexcept {
    float total = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = std::exp(x[i] - shift);  // exp(-inf) == 0
      total += x[i];
    }
    return total;
  }
  static void scale(float* x, std::size_t n, float c) noexcept {
    for (std::size_t i = 0; i < n; ++i) x[i] *= c;
  }
};

/// One query row: head_dim elements of q and where its head_dim outputs go, each float, half or
/// bfloat16 (q_type, out_type), and the row's absolute position. A sweep converts q to fp32 once
/// when it starts and rounds the output once when it finishes (load_row, store_row), so that the
/// sweeps are compiled once whatever the query and output types.
struct Row {
  const void* q;
  void* out;
  position_t pos;
  DType q_type = DType::f32;
  DType out_type = DType::f32;
};

/// The n elements of type `type` at `in`, converted to float into out (exact).
inline void load_row(const void* in, DType type, float* out, std::size_t n) noexcept {
  switch (type) {
    case DType::f16:
      convert_to_float(std::span(static_cast<const half*>(in), n), out);
      return;
    case DType::bf16:
      convert_to_float(std::span(static_cast<const bfloat16*>(in), n), out);
      return;
    case DType::f32:
    case DType::i8:  // not a query or output type
    case DType::e4m3:
      break;
  }
  convert_to_float(std::span(static_cast<const float*>(in), n), out);
}

/// The n floats at `in`, rounded to type `type` (nearest even; inf beyond the range, NaN kept)
/// into out.
inline void store_row(const float* in, DType type, void* out, std::size_t n) noexcept {
  switch (type) {
    case DType::f16:
      convert_from_float(std::span(in, n), static_cast<half*>(out));
      return;
    case DType::bf16:
      convert_from_float(std::span(in, n), static_cast<bfloat16*>(out));
      return;
    case DType::f32:
    case DType::i8:  // not a query or output type
    case DType::e4m3:
      break;
  }
  convert_from_float(std::span(in, n), static_cast<float*>(out));
}

/// How a tile of keys relates to one query row under the mask.
enum class TileCover { none, partial, full };

[[nodiscard]] inline TileCover tile_cover(const KVMask& mask, position_t qpos, position_t first,
                                          position_t last) noexcept {
  if (!mask.causal) return TileCover::full;
  if (first > qpos) return TileCover::none;
  const position_t lo = mask.low(qpos);
  const bool all_seen = last <= qpos && (first >= lo || last < mask.sinks);
  if (all_seen) return TileCover::full;
  const bool none_seen = last < lo && first >= mask.sinks;
  return none_seen ? TileCover::none : TileCover::partial;
}

/// Which keys a sweep visits: every key up to the rows' largest position, except the non-sink
/// keys below all of the rows' windows. Both bounds of the skipped range are whole tiles of
/// absolute positions ([k * kTile, (k + 1) * kTile)), so that a sweep's tiles are those cells,
/// each read whole or not at all, whatever the view's segments and whichever rows share the
/// sweep: attention is batch-invariant and equal bit for bit across cache layouts.
struct VisibleRange {
  bool causal = false;
  position_t pos_max = 0;   // the rows' largest position
  position_t sink_end = 0;  // the tiles holding sinks end here
  position_t skip_to = 0;   // keys in [sink_end, skip_to) are skipped (the rows' lowest window
                            // start, rounded down to a whole tile)

  VisibleRange(const KVMask& mask, position_t max_pos, position_t low_min) noexcept
      : causal(mask.causal), pos_max(max_pos) {
    constexpr auto tile = static_cast<position_t>(kTile);
    sink_end = (mask.sinks + tile - 1) / tile * tile;
    skip_to = low_min > 0 ? low_min / tile * tile : 0;
  }

  /// The first run of visited keys in [from, end): [begin, end) is set to it (empty if none).
  /// A run stops at sink_end where keys after it are skipped.
  void clip(position_t from, position_t& begin, position_t& end) const noexcept {
    begin = from;
    if (!causal) return;
    end = std::min(end, pos_max + 1);
    if (skip_to <= sink_end) return;
    if (begin >= sink_end) {
      begin = std::max(begin, skip_to);
    } else {
      end = std::min(end, sink_end);
    }
  }
};

/// A run of keys consecutive in one segment: the K and V rows of one KV head, [n][head_dim] each,
/// and for a quantized format their n scales each.
template <KVElement T>
struct KeyRun {
  const T* k = nullptr;
  const T* v = nullptr;
  position_t first = 0;
  std::size_t n = 0;
  const scale_type* k_scale = nullptr;
  const scale_type* v_scale = nullptr;
};

/// Segments a KeyWalker fetches from its view at a time.
inline constexpr std::size_t kSegmentBatch = 8;

/// Any view of element type T, its segments fetched through one function pointer, several at a
/// time: the sweeps below are compiled once per element type and kernel, however many view types
/// a program attends over. One indirect call per kSegmentBatch segments (per 128 keys of a paged
/// view of 16-token blocks) costs nothing next to their K/V reads. Valid while the wrapped view is.
template <KVElement T>
class ErasedView {
 public:
  using value_type = T;

  template <KVView V>
  requires std::same_as<typename V::value_type, T>
  explicit ErasedView(const V& view) noexcept
      : view_(&view),
        fetch_(&fetch_from<V>),
        num_segments_(view.num_segments()),
        num_kv_heads_(view.num_kv_heads()),
        head_dim_(view.head_dim()),
        length_(view.length()),
        sink_end_(view.sink_end()),
        recent_begin_(view.recent_begin()) {}

  [[nodiscard]] std::size_t num_kv_heads() const noexcept { return num_kv_heads_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] position_t length() const noexcept { return length_; }
  [[nodiscard]] position_t sink_end() const noexcept { return sink_end_; }
  [[nodiscard]] position_t recent_begin() const noexcept { return recent_begin_; }
  [[nodiscard]] std::size_t num_segments() const noexcept { return num_segments_; }
  [[nodiscard]] KVSegment<T> segment(std::size_t i) const noexcept {
    KVSegment<T> s;
    fetch_(view_, i, 1, &s);
    return s;
  }

  /// Copies segments [first, first + n) to out, n = min(max, num_segments() - first); returns n.
  /// @pre first < num_segments().
  std::size_t segments(std::size_t first, std::size_t max, KVSegment<T>* out) const noexcept {
    const std::size_t n = std::min(max, num_segments_ - first);
    fetch_(view_, first, n, out);
    return n;
  }

 private:
  template <KVView V>
  static void fetch_from(const void* view, std::size_t first, std::size_t n,
                         KVSegment<T>* out) noexcept {
    const auto& v = *static_cast<const V*>(view);
    for (std::size_t j = 0; j < n; ++j) out[j] = v.segment(first + j);
  }

  const void* view_;
  void (*fetch_)(const void*, std::size_t, std::size_t, KVSegment<T>*) noexcept;
  std::size_t num_segments_;
  std::size_t num_kv_heads_;
  std::size_t head_dim_;
  position_t length_;
  position_t sink_end_;
  position_t recent_begin_;
};

/// Walks the keys a sweep visits (each segment's visible range), in order and across segment
/// boundaries, handing them out in runs. Tiles and prefetches follow the keys rather than the
/// segments, so views of many short segments (paged blocks) cost no more per key than one long
/// segment does.
template <KVElement T>
class KeyWalker {
 public:
  KeyWalker(const ErasedView<T>& view, std::size_t kv_head, const VisibleRange& visible) noexcept
      : view_(view), kv_head_(kv_head), visible_(visible) {
    if (view_.num_segments() != 0) {
      load(0);
      settle(seg().first_pos);
    }
  }

  [[nodiscard]] bool done() const noexcept { return seg_index_ >= view_.num_segments(); }

  /// Position of the next key. @pre !done().
  [[nodiscard]] position_t position() const noexcept { return pos_; }

  /// The next min(n, keys left in the current run) keys; moves past them. @pre !done().
  [[nodiscard]] KeyRun<T> next(std::size_t n) noexcept {
    const KVSegment<T>& s = seg();
    const std::size_t keys = std::min(n, static_cast<std::size_t>(end_ - pos_));
    const std::size_t offset =
        s.head_stride * kv_head_ + static_cast<std::size_t>(pos_ - s.first_pos) * view_.head_dim();
    KeyRun<T> run{s.k + offset, s.v + offset, pos_, keys};
    if constexpr (scaled_v<T>) {  // one scale per row: its index is the row's, over head_dim
      const std::size_t row = offset / view_.head_dim();
      run.k_scale = s.k_scale + row;
      run.v_scale = s.v_scale + row;
    }
    pos_ += static_cast<position_t>(keys);
    if (pos_ == end_) settle(pos_);
    return run;
  }

  /// A walker at the same key over KV head `kv_head`.
  [[nodiscard]] KeyWalker for_head(std::size_t kv_head) const noexcept {
    KeyWalker w(*this);
    w.kv_head_ = kv_head;
    return w;
  }

  /// Moves n keys on, across segments.
  void skip(std::size_t n) noexcept {
    while (n != 0 && !done()) n -= next(n).n;
  }

 private:
  [[nodiscard]] const KVSegment<T>& seg() const noexcept { return batch_[seg_index_ - first_]; }

  // Fetches the batch of segments starting at segment i.
  void load(std::size_t i) noexcept {
    first_ = i;
    view_.segments(i, kSegmentBatch, batch_);
  }

  // Moves to the first visited key at or after `from` in the current segment, else in the
  // following ones.
  void settle(position_t from) noexcept {
    for (;;) {
      end_ = seg().first_pos + static_cast<position_t>(seg().len);
      visible_.clip(from, pos_, end_);
      if (pos_ < end_) return;
      if (++seg_index_ >= view_.num_segments()) return;
      if (seg_index_ - first_ == kSegmentBatch) load(seg_index_);
      from = seg().first_pos;
    }
  }

  const ErasedView<T>& view_;
  std::size_t kv_head_;
  VisibleRange visible_;
  std::size_t seg_index_ = 0;
  std::size_t first_ = 0;  // the index of batch_[0]
  KVSegment<T> batch_[kSegmentBatch];
  position_t pos_ = 0;
  position_t end_ = 0;
};

static_assert(kTile <= 32, "Sweep keeps a tile's visible slots in a 32-bit mask");

/// kMaxHeadDim zero elements: the V row that slots no query row of a tile sees read.
template <KVElement T>
[[nodiscard]] const T* zero_row() noexcept {
  alignas(64) static const T zeros[kMaxHeadDim] = {};
  return zeros;
}

/// True when every element of row[0, d) is finite.
template <KVElement T>
[[nodiscard]] bool finite_row(const T* row, std::size_t d) noexcept {
  bool finite = true;
  for (std::size_t x = 0; x < d; ++x) finite = finite && std::isfinite(code_value(row[x]));
  return finite;
}

/// The scales of a tile's K and V rows (quantized formats), times kCodeUnit, by slot; empty for
/// the other formats.
template <KVElement T>
struct TileScales {
  void set(std::size_t, const KeyRun<T>&) noexcept {}
  void clear(std::size_t, std::size_t) noexcept {}
};
template <QuantizedElement T>
struct TileScales<T> {
  float k[kTile];
  float v[kTile];
  /// Slots [at, at + run.n) take the run's rows' scales.
  void set(std::size_t at, const KeyRun<T>& run) noexcept {
    for (std::size_t j = 0; j < run.n; ++j) {
      k[at + j] = static_cast<float>(run.k_scale[j]) * kCodeUnit<T>;
      v[at + j] = static_cast<float>(run.v_scale[j]) * kCodeUnit<T>;
    }
  }
  /// Slots [from, to) hold no key (holes): scale 0.
  void clear(std::size_t from, std::size_t to) noexcept {
    std::fill(k + from, k + to, 0.0f);
    std::fill(v + from, v + to, 0.0f);
  }
};

/// One online-softmax sweep: up to kRowBlock query rows, all mapped to KV head `kv_head`, over
/// the view's visible keys, one tile of kTile keys per step(). The caller owns the scaled queries
/// and the output accumulators ([num_rows][head_dim] floats each), so that the sweeps of several
/// KV heads can share one stack frame and run in lockstep (attend_heads).
template <class Ops, KVElement T>
class Sweep {
 public:
  /// Each step prefetches the keys of KV head `ahead_head`, `lead_tiles` tiles after the step's
  /// own: the sweep's own keys further on when it runs alone, the next head's keys of the same
  /// tile when sweeps run in lockstep.
  /// @pre 1 <= num_rows <= kRowBlock; qs and acc hold num_rows * head_dim floats, 64-byte aligned;
  /// view, rows and mask outlive the sweep.
  Sweep(const ErasedView<T>& view, std::size_t kv_head, const Row* rows, std::size_t num_rows,
        const KVMask& mask, float scale, float softcap, float* qs, float* acc,
        std::size_t ahead_head, std::size_t lead_tiles) noexcept
      : rows_(rows),
        num_rows_(num_rows),
        d_(view.head_dim()),
        mask_(mask),
        softcap_(softcap),
        qs_(qs),
        acc_(acc),
        keys_(view, kv_head, visible_range(rows, num_rows, mask)),
        ahead_(keys_.for_head(ahead_head)) {
    for (std::size_t r = 0; r < num_rows; ++r) {
      float* q = qs_ + r * d_;
      load_row(rows[r].q, rows[r].q_type, q, d_);
      for (std::size_t x = 0; x < d_; ++x) q[x] *= scale;
      std::fill(acc_ + r * d_, acc_ + (r + 1) * d_, 0.0f);
      row_max_[r] = -std::numeric_limits<float>::infinity();
      row_sum_[r] = 0.0f;
      row_bad_[r] = false;
    }
    ahead_.skip(lead_tiles * kTile);
  }

  [[nodiscard]] bool done() const noexcept { return keys_.done(); }

  /// Attends the rows over the next tile. @pre !done().
  void step() noexcept {
    // One tile: the visited keys of one cell of kTile positions, in several runs where segments
    // are shorter than a tile. The key at position p takes slot p - cell of the tile, as in every
    // other view of the same tokens: the kernels' lane sums then add the same numbers in the same
    // order whatever the layout. Slots no key holds (a ring's evicted positions, in the cell of
    // its oldest key or of the last sinks) are holes: they take a real row and a -inf score.
    KeyRun<T> runs[kTile];
    Prefetch fetch[kTile];
    const T* krows[kTile];  // the tile's K and V rows, wherever their segments put them
    const T* vrows[kTile];
    TileScales<T> scales;  // quantized formats: the rows' scales
    const std::size_t d = d_;
    std::size_t num_runs = 0, nk = 0;
    bool holes = false;
    constexpr auto tile = static_cast<position_t>(kTile);
    const position_t cell = keys_.position() / tile * tile;
    while (!keys_.done() && keys_.position() < cell + tile) {
      const KeyRun<T> run = keys_.next(static_cast<std::size_t>(cell + tile - keys_.position()));
      fetch[num_runs] = {};
      if (!ahead_.done()) {
        const KeyRun<T> a = ahead_.next(run.n);
        ahead_.skip(run.n - a.n);  // keep the lead where segment boundaries do not line up
        fetch[num_runs] = {reinterpret_cast<const char*>(a.k), reinterpret_cast<const char*>(a.v),
                           a.n * d * sizeof(T)};
      }
      const auto at = static_cast<std::size_t>(run.first - cell);
      for (std::size_t j = nk; j < at; ++j) {
        krows[j] = run.k;
        vrows[j] = run.v;
      }
      for (std::size_t j = 0; j < run.n; ++j) {
        krows[at + j] = run.k + j * d;
        vrows[at + j] = run.v + j * d;
      }
      scales.clear(nk, at);
      scales.set(at, run);
      holes = holes || at != nk;
      runs[num_runs++] = run;
      nk = at + run.n;
    }
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const position_t t0 = runs[0].first;
    const position_t t_last =
        runs[num_runs - 1].first + static_cast<position_t>(runs[num_runs - 1].n) - 1;
    const std::uint32_t all_slots = nk == kTile ? ~std::uint32_t{0} : (std::uint32_t{1} << nk) - 1;
    for (std::size_t r0 = 0; r0 < num_rows_; r0 += kSubRows) {
      const std::size_t sub = std::min(kSubRows, num_rows_ - r0);
      TileCover cover[kSubRows];
      bool any = false, hidden = holes;  // hidden: some row of the block misses some slot
      for (std::size_t r = 0; r < sub; ++r) {
        cover[r] = tile_cover(mask_, rows_[r0 + r].pos, t0, t_last);
        any = any || cover[r] != TileCover::none;
        hidden = hidden || cover[r] != TileCover::full;
      }
      if (!any) continue;
      // The first row block fetches the rows ahead; later ones find them already coming.
      const std::size_t num_fetch = r0 == 0 ? num_runs : 0;
      Ops::qk(qs_ + r0 * d, sub, krows, nk, d, s_, kTile, fetch, num_fetch);
      if constexpr (scaled_v<T>) {  // a row's dot products with its codes, times its scale
        for (std::size_t r = 0; r < sub; ++r) scale_slots(s_ + r * kTile, scales.k, nk, all_slots);
      }
      if (mask_.rope != nullptr && cell < mask_.sinks) {
        score_sinks(r0, sub, cover, krows, nk, cell, scales);
      }
      std::uint32_t seen[kSubRows];  // bit j: slot j holds a key row r may see
      for (std::size_t r = 0; r < sub; ++r) {
        float* sr = s_ + r * kTile;
        if (cover[r] == TileCover::none) {
          seen[r] = 0;
          std::fill(sr, sr + nk, 0.0f);
          continue;
        }
        // q or a key it sees not finite: the raw score (before the soft-cap, which would make
        // an inf finite) is not finite either, and the row's output will be NaN (finish()).
        bool bad = false;
        float tile_max = neg_inf;
        if (cover[r] == TileCover::full && !holes) {  // every slot a key the row sees
          seen[r] = all_slots;
          if (softcap_ > 0.0f) {
            bad = Ops::nonfinite(sr, nk);
            for (std::size_t j = 0; j < nk; ++j) sr[j] = softcap_ * std::tanh(sr[j] / softcap_);
            tile_max = Ops::max(sr, nk);
          } else {
            tile_max = Ops::max_nonfinite(sr, nk, bad);  // one pass: the max and the check
          }
        } else {
          seen[r] = 0;
          for (std::size_t i = 0; i < num_runs; ++i) {
            const auto at = static_cast<std::size_t>(runs[i].first - cell);
            for (std::size_t j = 0; j < runs[i].n; ++j) {
              const position_t pos = runs[i].first + static_cast<position_t>(j);
              if (cover[r] == TileCover::partial && !mask_.visible(rows_[r0 + r].pos, pos)) {
                continue;
              }
              seen[r] |= std::uint32_t{1} << (at + j);
              bad = bad || !std::isfinite(sr[at + j]);
            }
          }
          for (std::size_t j = 0; j < nk; ++j) {  // holes and masked keys: -inf
            if ((seen[r] >> j & 1u) == 0) {
              sr[j] = neg_inf;
            } else if (softcap_ > 0.0f) {
              sr[j] = softcap_ * std::tanh(sr[j] / softcap_);
            }
          }
          tile_max = Ops::max(sr, nk);
        }
        row_bad_[r0 + r] = row_bad_[r0 + r] || bad;
        if (tile_max == neg_inf) {
          std::fill(sr, sr + nk, 0.0f);
          continue;
        }
        float& m = row_max_[r0 + r];
        const float m_new = std::max(m, tile_max);
        if (m != neg_inf && m_new != m) {
          const float correction = std::exp(m - m_new);
          row_sum_[r0 + r] *= correction;
          Ops::scale(acc_ + (r0 + r) * d, d, correction);
        }
        m = m_new;
        row_sum_[r0 + r] += Ops::exp_sum(sr, nk, m_new);
        // Quantized V: each seen slot's weight times its row's scale. Unseen slots keep weight 0,
        // which a NaN scale (a non-finite row, zero codes) would turn into NaN.
        if constexpr (scaled_v<T>) scale_slots(sr, scales.v, nk, seen[r]);
      }
      if (!hidden) {
        Ops::pv(s_, kTile, sub, vrows, nk, d, acc_ + r0 * d, fetch, num_fetch);
      } else {
        pv_hidden(sub, seen, vrows, nk, acc_ + r0 * d, fetch, num_fetch);
      }
    }
  }

  /// Writes each row's output: zeros for a row that saw no key; NaN throughout for a row that
  /// saw an inf or NaN (in q, or in a key's K or V row). A half or bfloat16 output is the fp32
  /// row rounded once.
  void finish() const noexcept {
    alignas(64) float staged[kMaxHeadDim];
    for (std::size_t r = 0; r < num_rows_; ++r) {
      const bool direct = rows_[r].out_type == DType::f32;
      float* out = direct ? static_cast<float*>(rows_[r].out) : staged;
      // A seen V row's inf or NaN has left the accumulator non-finite (0 * inf is NaN too). The
      // check reads the accumulator, not the output just stored (store forwarding stalls).
      if (row_bad_[r] || Ops::nonfinite(acc_ + r * d_, d_)) {
        std::fill(out, out + d_, std::numeric_limits<float>::quiet_NaN());
      } else {
        const float inv = row_sum_[r] > 0.0f ? 1.0f / row_sum_[r] : 0.0f;
        for (std::size_t x = 0; x < d_; ++x) out[x] = acc_[r * d_ + x] * inv;
      }
      if (!direct) store_row(staged, rows_[r].out_type, rows_[r].out, d_);
    }
  }

 private:
  static VisibleRange visible_range(const Row* rows, std::size_t num_rows,
                                    const KVMask& mask) noexcept {
    position_t pos_max = std::numeric_limits<position_t>::min();
    position_t low_min = std::numeric_limits<position_t>::max();
    for (std::size_t r = 0; r < num_rows; ++r) {
      pos_max = std::max(pos_max, rows[r].pos);
      low_min = std::min(low_min, mask.low(rows[r].pos));
    }
    return {mask, pos_max, low_min};
  }

  // Cache-relative positions (PositionMode::cache_relative): the scores of the tile's sink slots
  // (positions cell + j < sinks) for each row whose window has moved off the sinks, from its q
  // turned back by the row's sink_shift. One row at a time, so a row's scores are the same bits
  // whichever rows share its block.
  void score_sinks(std::size_t r0, std::size_t sub, const TileCover* cover, const T* const* krows,
                   std::size_t nk, position_t cell, const TileScales<T>& scales) noexcept {
    alignas(64) float turned[kMaxHeadDim];
    alignas(64) float scores[kTile];
    const auto num_sinks = static_cast<std::size_t>(
        std::min<position_t>(static_cast<position_t>(nk), mask_.sinks - cell));
    for (std::size_t r = 0; r < sub; ++r) {
      const position_t shift = mask_.sink_shift(rows_[r0 + r].pos);
      if (cover[r] == TileCover::none || shift == 0) continue;
      const float* q = qs_ + (r0 + r) * d_;
      std::copy(q, q + d_, turned);
      mask_.rope->turn(turned, 1, -static_cast<double>(shift));
      Ops::qk(turned, 1, krows, num_sinks, d_, scores, kTile, nullptr, 0);
      if constexpr (scaled_v<T>) scale_slots(scores, scales.k, num_sinks, ~std::uint32_t{0});
      std::copy(scores, scores + num_sinks, s_ + r * kTile);
    }
  }

  // p.V of a block of `sub` rows over a tile where some row misses some slot (holes, masked
  // keys): a slot no row sees reads a zero row, so that its weight 0 cannot meet an inf or NaN
  // there (0 * inf is NaN). A slot some rows see and others not is read as it is where its V row
  // is finite (0 * finite adds nothing, bit for bit); else each row runs alone over its own
  // slots. A row's arithmetic is the same alone or beside others (each micro-kernel keeps one
  // accumulator per row and adds the keys in order).
  void pv_hidden(std::size_t sub, const std::uint32_t* seen, const T* const* vrows, std::size_t nk,
                 float* acc, const Prefetch* fetch, std::size_t num_fetch) const noexcept {
    const T* zero = zero_row<T>();
    std::uint32_t seen_any = 0, seen_all = ~std::uint32_t{0};
    for (std::size_t r = 0; r < sub; ++r) {
      seen_any |= seen[r];
      seen_all &= seen[r];
    }
    bool alone = false;
    const T* v[kTile];
    for (std::size_t j = 0; j < nk; ++j) {
      const std::uint32_t bit = std::uint32_t{1} << j;
      v[j] = (seen_any & bit) != 0 ? vrows[j] : zero;
      if ((seen_any & ~seen_all & bit) != 0 && !alone) alone = !finite_row(vrows[j], d_);
    }
    if (!alone) {
      Ops::pv(s_, kTile, sub, v, nk, d_, acc, fetch, num_fetch);
      return;
    }
    for (std::size_t r = 0; r < sub; ++r) {
      if (seen[r] == 0) continue;
      for (std::size_t j = 0; j < nk; ++j) v[j] = (seen[r] >> j & 1u) != 0 ? vrows[j] : zero;
      Ops::pv(s_ + r * kTile, kTile, 1, v, nk, d_, acc + r * d_, fetch, r == 0 ? num_fetch : 0);
    }
  }

  // x[j] *= scale[j] for the slots j < n whose bit is set in `slots`.
  static void scale_slots(float* x, const float* scale, std::size_t n,
                          std::uint32_t slots) noexcept {
    if (slots == ~std::uint32_t{0} || (n < kTile && slots == (std::uint32_t{1} << n) - 1)) {
      for (std::size_t j = 0; j < n; ++j) x[j] *= scale[j];
      return;
    }
    for (std::size_t j = 0; j < n; ++j) {
      if ((slots >> j & 1u) != 0) x[j] *= scale[j];
    }
  }

  const Row* rows_;
  std::size_t num_rows_;
  std::size_t d_;
  const KVMask& mask_;
  float softcap_;
  float* qs_;
  float* acc_;
  alignas(64) float s_[kSubRows * kTile];
  float row_max_[kRowBlock];
  float row_sum_[kRowBlock];
  bool row_bad_[kRowBlock];  // the row saw a non-finite score: its output is NaN
  KeyWalker<T> keys_;
  // The K/V rows fetched while this tile computes. The micro-kernel spreads the prefetches over
  // its loop: one burst would stall on the line-fill buffers, and the V tile's column-wise reads
  // leave the hardware prefetchers behind.
  KeyWalker<T> ahead_;
};

/// Most KV heads one lockstep work item sweeps together.
inline constexpr std::size_t kMaxLockstepHeads = 16;
/// Floats of queries (and as many of accumulators) all sweeps of one item share: a row block at
/// the largest head_dim.
inline constexpr std::size_t kLockstepFloats = kRowBlock * kMaxHeadDim;
/// Views whose segments hold at most this many bytes of one KV head's K (or V) on average are
/// swept in lockstep over KV heads.
inline constexpr std::size_t kLockstepSegmentBytes = std::size_t{8} << 10;

/// Floats between the queries (and accumulators) of consecutive heads of a lockstep item: whole
/// cache lines, so that every head's start stays 64-byte aligned.
[[nodiscard]] constexpr std::size_t lockstep_stride(std::size_t rows,
                                                    std::size_t head_dim) noexcept {
  return (rows * head_dim + 15) / 16 * 16;
}

/// Attention of KV heads [head0, head0 + num_heads), `rows_per_head` query rows each (rows of
/// head h at rows + (h - head0) * rows_per_head), over the whole view: one pass over the visible
/// tiles with an online softmax per head. Writes each row's output. Several heads are swept in
/// lockstep: tile i of every head, then tile i + 1. A paged block stores its KV heads one after
/// another, so one step reads the tile's blocks whole (num_heads x 4 KiB runs back to back for
/// 16-token half blocks at head_dim 128) instead of one 4 KiB run per block per pass. Each head's
/// arithmetic is the same whatever num_heads is.
/// @pre num_heads <= kMaxLockstepHeads, rows_per_head <= kRowBlock,
///      num_heads * lockstep_stride(rows_per_head, head_dim) <= kLockstepFloats.
template <class Ops, KVElement T>
void attend_heads(const ErasedView<T>& view, std::size_t head0, std::size_t num_heads,
                  const Row* rows, std::size_t rows_per_head, const KVMask& mask, float scale,
                  float softcap) noexcept {
  alignas(64) float qs[kLockstepFloats];
  alignas(64) float acc[kLockstepFloats];
  std::optional<Sweep<Ops, T>> sweeps[kMaxLockstepHeads];
  const std::size_t floats = lockstep_stride(rows_per_head, view.head_dim());
  for (std::size_t h = 0; h < num_heads; ++h) {
    // Each step prefetches the next head's keys of the same tile; the last head the first head's
    // next tile, or, sweeping alone, its own keys kPrefetchTiles tiles on.
    const bool last = h + 1 == num_heads;
    const std::size_t lead = !last ? 0 : num_heads == 1 ? kPrefetchTiles : 1;
    sweeps[h].emplace(view, head0 + h, rows + h * rows_per_head, rows_per_head, mask, scale,
                      softcap, qs + h * floats, acc + h * floats, last ? head0 : head0 + h + 1,
                      lead);
  }
  for (bool more = true; more;) {
    more = false;
    for (std::size_t h = 0; h < num_heads; ++h) {
      if (sweeps[h]->done()) continue;
      sweeps[h]->step();
      more = true;
    }
  }
  for (std::size_t h = 0; h < num_heads; ++h) sweeps[h]->finish();
}

/// How one task's work is cut into items: `heads` KV heads per item (more than one only for
/// lockstep sweeps) x `blocks` blocks of kRowBlock rows per KV head.
struct TaskSplit {
  std::size_t heads = 1;
  std::size_t blocks = 1;
  [[nodiscard]] std::size_t items(std::size_t num_kv_heads) const noexcept {
    return (num_kv_heads + heads - 1) / heads * blocks;
  }
};

/// Query rows per KV head of a task: its tokens x the query heads of one KV head.
template <KVView V, Element Q, Element O>
[[nodiscard]] std::size_t rows_per_head(const AttentionTask<V, Q, O>& t) noexcept {
  return t.q.num_tokens * (t.q.num_heads / t.view.num_kv_heads());
}

/// The most KV heads of task `t` one lockstep item can sweep: 1 unless its view is made of short
/// segments (a paged view) and its rows fit one row block.
template <KVView V, Element Q, Element O>
[[nodiscard]] std::size_t lockstep_heads(const AttentionTask<V, Q, O>& t) noexcept {
  const std::size_t rows = rows_per_head(t);
  const std::size_t segments = t.view.num_segments();
  if (rows == 0 || rows > kRowBlock || segments < 2) return 1;
  const std::size_t d = t.view.head_dim();
  const std::size_t segment_bytes =
      view_num_tokens(t.view) / segments * d * sizeof(typename V::value_type);
  if (segment_bytes > kLockstepSegmentBytes) return 1;
  return std::max<std::size_t>(1, std::min({kMaxLockstepHeads, t.view.num_kv_heads(),
                                            kLockstepFloats / lockstep_stride(rows, d)}));
}

/// The split of task `t` when lockstep items hold at most `width` KV heads.
template <KVView V, Element Q, Element O>
[[nodiscard]] TaskSplit task_split(const AttentionTask<V, Q, O>& t, std::size_t width) noexcept {
  const std::size_t heads = std::min(width, lockstep_heads(t));
  if (heads > 1) return {heads, 1};
  return {1, (rows_per_head(t) + kRowBlock - 1) / kRowBlock};
}

/// Work items of one task: KV heads x blocks of kRowBlock rows.
template <KVView V, Element Q, Element O>
[[nodiscard]] std::size_t task_items(const AttentionTask<V, Q, O>& t) noexcept {
  return task_split(t, 1).items(t.view.num_kv_heads());
}

/// One task as run_item sees it: its view erased (ErasedView) and its queries and output untyped,
/// with their element types (see Row), so that run_item and the sweeps are compiled once per K/V
/// element type, not again per view, query or output type. Valid while the task is.
template <KVElement T>
struct ErasedTask {
  ErasedView<T> view;
  const void* q;  // [num_tokens][num_q_heads][head_dim] elements of q_type
  void* out;      // the same shape, of out_type
  DType q_type;
  DType out_type;
  std::size_t num_tokens;
  std::size_t num_q_heads;

  template <KVView V, Element Q, Element O>
  explicit ErasedTask(const AttentionTask<V, Q, O>& t) noexcept
      : view(t.view),
        q(t.q.data.data()),
        out(t.out.data.data()),
        q_type(dtype_of<Q>),
        out_type(dtype_of<O>),
        num_tokens(t.q.num_tokens),
        num_q_heads(t.q.num_heads) {}

  /// Byte offset of row (token, q_head) in a block of element type `type`.
  [[nodiscard]] std::size_t offset(std::size_t token, std::size_t q_head,
                                   DType type) const noexcept {
    return (token * num_q_heads + q_head) * view.head_dim() * dtype_bytes(type);
  }
  /// Row (token, q_head) of the queries and of the output.
  [[nodiscard]] Row row(std::size_t token, std::size_t q_head, position_t pos) const noexcept {
    return {static_cast<const std::byte*>(q) + offset(token, q_head, q_type),
            static_cast<std::byte*>(out) + offset(token, q_head, out_type), pos, q_type, out_type};
  }
};

/// The kernels of K/V format T: one class per format so that a program can compile them once
/// (KVCACHE_EXTERN_KERNELS, below). Its member is defined out of the class, which keeps it from
/// being inline, so that an extern declaration of the class suppresses its instantiation.
template <KVElement T>
struct Kernels {
  /// Runs work item `item` of task `t` split as `split`: KV heads [item / blocks * heads,
  /// + heads), row block item % blocks, with micro-kernels `kernel` (avx512, avx2 or portable).
  /// Rows are ordered token-major (row = token * group + head-in-group).
  static void run_item(Kernel kernel, const ErasedTask<T>& t, const TaskSplit& split,
                       position_t first_pos, std::size_t item, const KVMask& mask, float scale,
                       float softcap) noexcept;
};

template <KVElement T>
void Kernels<T>::run_item(Kernel kernel, const ErasedTask<T>& t, const TaskSplit& split,
                          position_t first_pos, std::size_t item, const KVMask& mask, float scale,
                          float softcap) noexcept {
  const std::size_t heads = t.view.num_kv_heads();
  const std::size_t group = t.num_q_heads / heads;
  const std::size_t rows_per = t.num_tokens * group;
  const std::size_t head0 = item / split.blocks * split.heads;
  const std::size_t row0 = (item % split.blocks) * kRowBlock;
  const std::size_t num_rows = std::min(kRowBlock, rows_per - row0);
  const std::size_t num_heads = std::min(split.heads, heads - head0);
  Row rows[kMaxLockstepHeads * kRowBlock];
  for (std::size_t h = 0; h < num_heads; ++h) {
    for (std::size_t r = 0; r < num_rows; ++r) {
      const std::size_t token = (row0 + r) / group;
      const std::size_t q_head = (head0 + h) * group + (row0 + r) % group;
      rows[h * num_rows + r] = t.row(token, q_head, first_pos + static_cast<position_t>(token));
    }
  }
  switch (kernel) {
#if KVCACHE_X86_DISPATCH
    case Kernel::avx512:
      attend_heads<Avx512Ops<T>>(t.view, head0, num_heads, rows, num_rows, mask, scale, softcap);
      return;
    case Kernel::avx2:
      attend_heads<Avx2Ops<T>>(t.view, head0, num_heads, rows, num_rows, mask, scale, softcap);
      return;
#endif
#if KVCACHE_NEON_KERNELS
    case Kernel::neon:
      attend_heads<NeonOps<T>>(t.view, head0, num_heads, rows, num_rows, mask, scale, softcap);
      return;
#endif
    default:
      attend_heads<PortableOps<T>>(t.view, head0, num_heads, rows, num_rows, mask, scale, softcap);
  }
}

// Compiling the kernels once per program. The sweeps of every format (Kernels<T>) are most of
// the compile time of a translation unit that calls attend(): a program whose translation units
// are built with KVCACHE_EXTERN_KERNELS defined does not compile them there, and instead defines
// KVCACHE_INSTANTIATE_KERNELS in exactly one .cpp file, before its first kvcache include:
//
//   #define KVCACHE_INSTANTIATE_KERNELS
//   #include <kvcache/kvcache.hpp>
//
// Without that file the program fails to link (undefined Kernels<T>::run_item). Neither macro
// changes what any function computes.
#if defined(KVCACHE_INSTANTIATE_KERNELS)
#define KVCACHE_DETAIL_KERNELS template
#elif defined(KVCACHE_EXTERN_KERNELS)
#define KVCACHE_DETAIL_KERNELS extern template
#endif
#if defined(KVCACHE_DETAIL_KERNELS)
KVCACHE_DETAIL_KERNELS struct Kernels<float>;
KVCACHE_DETAIL_KERNELS struct Kernels<half>;
KVCACHE_DETAIL_KERNELS struct Kernels<bfloat16>;
KVCACHE_DETAIL_KERNELS struct Kernels<qint8>;
KVCACHE_DETAIL_KERNELS struct Kernels<fp8_e4m3>;
#undef KVCACHE_DETAIL_KERNELS
#endif

/// The lockstep width of a call: the widest that still gives every thread its share. Items of
/// `width` heads take about `width` head sweeps each; among widths with the shortest critical
/// path (items per thread x width) the widest wins.
template <KVView V, Element Q, Element O>
[[nodiscard]] std::size_t lockstep_width(std::span<const AttentionTask<V, Q, O>> tasks,
                                         std::size_t threads) noexcept {
  std::size_t widest = 1;
  for (const auto& t : tasks) widest = std::max(widest, lockstep_heads(t));
  std::size_t best = 1, best_path = std::numeric_limits<std::size_t>::max();
  for (std::size_t w = 1; w <= widest; ++w) {
    std::size_t items = 0, path_width = 1;
    for (const auto& t : tasks) {
      const TaskSplit split = task_split(t, w);
      items += split.items(t.view.num_kv_heads());
      path_width = std::max(path_width, split.heads);
    }
    const std::size_t path = (items + threads - 1) / threads * path_width;
    if (path <= best_path) {
      best = w;
      best_path = path;
    }
  }
  return best;
}

/// Runs every task with micro-kernels `kernel` (avx512, avx2 or portable), on opts.pool's threads
/// when the call is large enough.
template <KVView V, Element Q, Element O>
void run_tasks(Kernel kernel, std::span<const AttentionTask<V, Q, O>> tasks,
               std::span<const position_t> first_pos, const AttentionOptions& opts) {
  using T = typename V::value_type;
  const KVMask mask = kvcache::detail::mask_of(opts);
  std::size_t total_work = 0;  // K/V elements swept, to decide whether threads pay off
  for (const auto& t : tasks) {
    total_work += task_items(t) * view_num_tokens(t.view) * t.view.head_dim();
  }
  constexpr std::size_t kMinParallelWork = std::size_t{1} << 16;
  const bool parallel = opts.pool != nullptr && total_work >= kMinParallelWork;
  const std::size_t width = lockstep_width(tasks, parallel ? opts.pool.num_threads() : 1);
  std::size_t total_items = 0;
  for (const auto& t : tasks) total_items += task_split(t, width).items(t.view.num_kv_heads());
  auto run = [&](std::size_t global) noexcept {
    std::size_t i = 0;
    TaskSplit split;
    for (;; ++i) {
      split = task_split(tasks[i], width);
      const std::size_t items = split.items(tasks[i].view.num_kv_heads());
      if (global < items) break;
      global -= items;
    }
    const auto& t = tasks[i];
    const float scale =
        opts.scale > 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(t.view.head_dim()));
    Kernels<T>::run_item(kernel, ErasedTask<T>(t), split, first_pos[i], global, mask, scale,
                         opts.softcap);
  };
  if (parallel) {
    opts.pool.parallel_for(total_items, run);
  } else {
    for (std::size_t i = 0; i < total_items; ++i) run(i);
  }
}

[[nodiscard]] inline bool avx2_available(std::size_t head_dim) noexcept {
#if KVCACHE_X86_DISPATCH
  return head_dim % 8 == 0 && kvcache::detail::cpu_has_avx2_fma_f16c();
#else
  (void)head_dim;
  return false;
#endif
}

[[nodiscard]] inline bool avx512_available(std::size_t head_dim) noexcept {
#if KVCACHE_X86_DISPATCH
  return head_dim % 16 == 0 && cpu_has_avx512f();
#else
  (void)head_dim;
  return false;
#endif
}

[[nodiscard]] inline bool neon_available(std::size_t head_dim) noexcept {
#if KVCACHE_NEON_KERNELS
  return head_dim % 4 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

}  // namespace detail

/// True when Kernel::avx2 can run for this head_dim on this CPU.
[[nodiscard]] inline bool avx2_supported(std::size_t head_dim) noexcept {
  return detail::avx2_available(head_dim);
}

/// True when Kernel::avx512 can run for this head_dim on this CPU.
[[nodiscard]] inline bool avx512_supported(std::size_t head_dim) noexcept {
  return detail::avx512_available(head_dim);
}

/// True when Kernel::neon can run for this head_dim (an AArch64 build and head_dim % 4 == 0).
[[nodiscard]] inline bool neon_supported(std::size_t head_dim) noexcept {
  return detail::neon_available(head_dim);
}

/// Fast attention for a batch of sequences, each task's queries against its own view
/// (see kvcache::attend for the semantics; queries and output float, half or bfloat16). Parallel
/// over (task, KV head, row block) on opts.pool when it is set and the call is large enough to
/// pay for waking the workers; the result is the same bits with or without it.
/// Never allocates (up to 256 tasks). O(sum over tasks of visible keys x num_q_heads x head_dim).
/// @throws shape_error, position_error as kvcache::attend; shape_error when head_dim exceeds
///         kMaxHeadDim, or when `kernel` is avx2, avx512 or neon and the CPU or head_dim (% 8,
///         % 16, % 4) does not allow it.
template <KVView V, Element Q, Element O>
void attend_batch(std::span<const AttentionTask<V, Q, O>> tasks, const AttentionOptions& opts = {},
                  Kernel kernel = Kernel::automatic) {
  constexpr std::size_t kMaxStackTasks = 256;
  position_t first_small[kMaxStackTasks];
  std::vector<position_t> first_large;  // only for batches beyond kMaxStackTasks
  std::span<position_t> first(first_small, std::min(tasks.size(), kMaxStackTasks));
  if (tasks.size() > kMaxStackTasks) {
    first_large.resize(tasks.size());
    first = first_large;
  }
  bool all_avx2 = true, all_avx512 = true, all_neon = true;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const auto& t = tasks[i];
    first[i] = kvcache::detail::check_attention(t.q, t.view, t.out, opts, t.query_pos);
    const std::size_t d = t.view.head_dim();
    if (d > kMaxHeadDim) {
      throw shape_error(kvcache::detail::message(
          "attend: head_dim ", d, " exceeds the CPU kernel's maximum ", kMaxHeadDim));
    }
    all_avx2 = all_avx2 && detail::avx2_available(d);
    all_avx512 = all_avx512 && detail::avx512_available(d);
    all_neon = all_neon && detail::neon_available(d);
  }
  if (kernel == Kernel::avx2 && !all_avx2) {
    throw shape_error(
        "attend: the avx2 kernel needs a CPU with AVX2+FMA+F16C and head_dim a multiple of 8");
  }
  if (kernel == Kernel::avx512 && !all_avx512) {
    throw shape_error(
        "attend: the avx512 kernel needs a CPU with AVX-512F and head_dim a multiple of 16");
  }
  if (kernel == Kernel::neon && !all_neon) {
    throw shape_error(
        "attend: the neon kernel needs an AArch64 build and head_dim a multiple of 4");
  }
  Kernel run = Kernel::portable;
  if ((kernel == Kernel::automatic || kernel == Kernel::avx512) && all_avx512) {
    run = Kernel::avx512;
  } else if ((kernel == Kernel::automatic || kernel == Kernel::avx2) && all_avx2) {
    run = Kernel::avx2;
  } else if ((kernel == Kernel::automatic || kernel == Kernel::neon) && all_neon) {
    run = Kernel::neon;
  }
  detail::run_tasks(run, tasks, first, opts);
}

/// attend_batch() for one sequence.
template <KVView V>
void attend(TokenBlock<const float> q, const V& view, TokenBlock<float> out,
            const AttentionOptions& opts = {}, Kernel kernel = Kernel::automatic) {
  const AttentionTask<V> task{q, view, out, opts.query_pos};
  attend_batch(std::span<const AttentionTask<V>>(&task, 1), opts, kernel);
}

/// attend_batch() for one sequence, queries (QT: [const] float, half or bfloat16) and output (O)
/// of any element type: q is converted to fp32 once per row and the output rounded once (nearest
/// even), so the result equals the float attend of q converted to float, rounded to O.
template <class QT, KVView V, Element O>
requires Element<std::remove_const_t<QT>>
void attend(TokenBlock<QT> q, const V& view, TokenBlock<O> out, const AttentionOptions& opts = {},
            Kernel kernel = Kernel::automatic) {
  using Task = AttentionTask<V, std::remove_const_t<QT>, O>;
  const Task task{q, view, out, opts.query_pos};
  attend_batch(std::span<const Task>(&task, 1), opts, kernel);
}

}  // namespace kvcache::cpu
