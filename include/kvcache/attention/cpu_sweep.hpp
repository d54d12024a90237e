// SPDX-License-Identifier: Apache-2.0
// The bodies of the fast CPU attention kernel (kvcache/attention/cpu.hpp is its interface and
// dispatch): the online-softmax sweep over a view's visible keys (Sweep, attend_heads), the walk
// across segments that feeds it (KeyWalker), the plain C++ micro-kernels and the definition of
// Kernels<T>::run_item, which runs them or the SIMD ones (cpu_avx2.hpp, cpu_avx512.hpp,
// cpu_neon.hpp). cpu.hpp includes this header unless KVCACHE_EXTERN_KERNELS is defined (without
// KVCACHE_INSTANTIATE_KERNELS): a translation unit that links the kernels from elsewhere does not
// parse them, nor the intrinsic headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <optional>

#include "kvcache/attention/cpu.hpp"
#include "kvcache/attention/cpu_avx2.hpp"
#include "kvcache/attention/cpu_avx512.hpp"
#include "kvcache/attention/cpu_micro.hpp"
#include "kvcache/attention/cpu_neon.hpp"

namespace kvcache::cpu::detail {

/// Plain C++ micro-kernels (any head_dim, any CPU) for K/V format F.
template <KVFormat F>
struct PortableOps {
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  // Prefetching (ahead, num_ahead) is left to the hardware.
  static void qk(const float* q, std::size_t rows, const K* const* k, std::size_t nk, std::size_t d,
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
  static void pv(const float* p, std::size_t stride, std::size_t rows, const V* const* v,
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
/// and for a quantized side (K or V) its n scales.
template <KVFormat T>
struct KeyRun {
  const key_format_t<T>* k = nullptr;
  const value_format_t<T>* v = nullptr;
  position_t first = 0;
  std::size_t n = 0;
  const scale_type* k_scale = nullptr;
  const scale_type* v_scale = nullptr;
};

/// Segments a KeyWalker fetches from its view at a time.
inline constexpr std::size_t kSegmentBatch = 8;

/// Walks the keys a sweep visits (each segment's visible range), in order and across segment
/// boundaries, handing them out in runs. Tiles and prefetches follow the keys rather than the
/// segments, so views of many short segments (paged blocks) cost no more per key than one long
/// segment does.
template <KVFormat T>
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
    // A quantized side has one scale per row: its index is the row's, over head_dim.
    if constexpr (scaled_v<key_format_t<T>>) run.k_scale = s.k_scale + offset / view_.head_dim();
    if constexpr (scaled_v<value_format_t<T>>) run.v_scale = s.v_scale + offset / view_.head_dim();
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

/// The scales of one side (K or V) of a tile's rows, stored in format T, times kCodeUnit<T>, by
/// slot; empty for the formats without scales.
template <KVElement T>
struct SideScales {
  void set(std::size_t, const scale_type*, std::size_t) noexcept {}
  void clear(std::size_t, std::size_t) noexcept {}
};
template <QuantizedElement T>
struct SideScales<T> {
  float s[kTile];
  /// Slots [at, at + n) take the scales of n consecutive rows.
  void set(std::size_t at, const scale_type* rows, std::size_t n) noexcept {
    for (std::size_t j = 0; j < n; ++j) s[at + j] = static_cast<float>(rows[j]) * kCodeUnit<T>;
  }
  /// Slots [from, to) hold no key (holes): scale 0.
  void clear(std::size_t from, std::size_t to) noexcept { std::fill(s + from, s + to, 0.0f); }
};

/// The scales of a tile's K and V rows, each side as its format stores them (SideScales).
template <KVFormat T>
struct TileScales {
  SideScales<key_format_t<T>> k;
  SideScales<value_format_t<T>> v;
  /// Slots [at, at + run.n) take the run's rows' scales.
  void set(std::size_t at, const KeyRun<T>& run) noexcept {
    k.set(at, run.k_scale, run.n);
    v.set(at, run.v_scale, run.n);
  }
  /// Slots [from, to) hold no key (holes): scale 0.
  void clear(std::size_t from, std::size_t to) noexcept {
    k.clear(from, to);
    v.clear(from, to);
  }
};

/// One online-softmax sweep: up to kRowBlock query rows, all mapped to KV head `kv_head`, over
/// the view's visible keys, one tile of kTile keys per step(). The caller owns the scaled queries
/// and the output accumulators ([num_rows][head_dim] floats each), so that the sweeps of several
/// KV heads can share one stack frame and run in lockstep (attend_heads).
template <class Ops, KVFormat T>
class Sweep {
  using K = key_format_t<T>;
  using V = value_format_t<T>;

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
    const K* krows[kTile];  // the tile's K and V rows, wherever their segments put them
    const V* vrows[kTile];
    TileScales<T> scales;  // quantized sides: the rows' scales
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
                           a.n * d * sizeof(K), a.n * d * sizeof(V)};
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
      if constexpr (scaled_v<K>) {  // a row's dot products with its codes, times its scale
        for (std::size_t r = 0; r < sub; ++r) {
          scale_slots(s_ + r * kTile, scales.k.s, nk, all_slots);
        }
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
        if constexpr (scaled_v<V>) scale_slots(sr, scales.v.s, nk, seen[r]);
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
  void score_sinks(std::size_t r0, std::size_t sub, const TileCover* cover, const K* const* krows,
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
      if constexpr (scaled_v<K>) scale_slots(scores, scales.k.s, num_sinks, ~std::uint32_t{0});
      std::copy(scores, scores + num_sinks, s_ + r * kTile);
    }
  }

  // p.V of a block of `sub` rows over a tile where some row misses some slot (holes, masked
  // keys): a slot no row sees reads a zero row, so that its weight 0 cannot meet an inf or NaN
  // there (0 * inf is NaN). A slot some rows see and others not is read as it is where its V row
  // is finite (0 * finite adds nothing, bit for bit); else each row runs alone over its own
  // slots. A row's arithmetic is the same alone or beside others (each micro-kernel keeps one
  // accumulator per row and adds the keys in order).
  void pv_hidden(std::size_t sub, const std::uint32_t* seen, const V* const* vrows, std::size_t nk,
                 float* acc, const Prefetch* fetch, std::size_t num_fetch) const noexcept {
    const V* zero = zero_row<V>();
    std::uint32_t seen_any = 0, seen_all = ~std::uint32_t{0};
    for (std::size_t r = 0; r < sub; ++r) {
      seen_any |= seen[r];
      seen_all &= seen[r];
    }
    bool alone = false;
    const V* v[kTile];
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

/// Attention of KV heads [head0, head0 + num_heads), `rows_per_head` query rows each (rows of
/// head h at rows + (h - head0) * rows_per_head), over the whole view: one pass over the visible
/// tiles with an online softmax per head. Writes each row's output. Several heads are swept in
/// lockstep: tile i of every head, then tile i + 1. A paged block stores its KV heads one after
/// another, so one step reads the tile's blocks whole (num_heads x 4 KiB runs back to back for
/// 16-token half blocks at head_dim 128) instead of one 4 KiB run per block per pass. Each head's
/// arithmetic is the same whatever num_heads is.
/// @pre num_heads <= kMaxLockstepHeads, rows_per_head <= kRowBlock,
///      num_heads * lockstep_stride(rows_per_head, head_dim) <= kLockstepFloats.
template <class Ops, KVFormat T>
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

template <KVFormat T>
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

}  // namespace kvcache::cpu::detail

// KVCACHE_INSTANTIATE_KERNELS: this translation unit compiles every format's kernels for the
// program (see the end of kvcache/attention/cpu.hpp).
#if defined(KVCACHE_INSTANTIATE_KERNELS)
KVCACHE_DETAIL_EACH_KERNELS(template)
#endif
