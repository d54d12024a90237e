// SPDX-License-Identifier: Apache-2.0
// The fast CPU attention kernel: one pass over the cached K/V with an online (flash-attention)
// softmax, tiles of kTile keys, all query heads of one KV head sharing every K/V row read, fp16,
// bf16, int8 and fp8 read directly (a quantized row's scale multiplies its scores and weights).
// Work is split into (sequence, KV head, block of query rows) items that the caller's executor
// (AttentionOptions::pool) may run in parallel. Over views of short segments (paged blocks) one
// item sweeps several KV heads in lockstep, so that each block is read whole. The sweeps see every
// view through ErasedView, and queries and output of any element type as untyped rows: they are
// compiled once per K/V format and kernel. This header is the interface and the dispatch;
// the sweeps and micro-kernels are in cpu_sweep.hpp, included at the end.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/cpu_features.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/executor.hpp"
#include "kvcache/core/math.hpp"
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

/// Any view of format T (one format for K and V, or KVFormats<K, V>; a view of KVFormats<T, T>
/// is read as one of T, canonical_format_t), its segments fetched through one function pointer,
/// several at a time: the sweeps below are compiled once per format and kernel, however many
/// view types a program attends over. One indirect call per batch of segments (per 128 keys of a
/// paged view of 16-token blocks) costs nothing next to their K/V reads. Valid while the wrapped
/// view is.
template <KVFormat T>
class ErasedView {
 public:
  using value_type = T;

  template <KVView V>
  requires std::same_as<canonical_format_t<typename V::value_type>, T>
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
    for (std::size_t j = 0; j < n; ++j) {
      const auto s = v.segment(first + j);  // a KVSegment of V's format: the same members
      out[j] = {s.k, s.v, s.head_stride, s.first_pos, s.len, s.k_scale, s.v_scale};
    }
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
  using F = typename V::value_type;
  const std::size_t row_bytes = std::max(sizeof(key_format_t<F>), sizeof(value_format_t<F>)) * d;
  const std::size_t segment_bytes = view_num_tokens(t.view) / segments * row_bytes;
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
/// format, not again per view, query or output type. Valid while the task is.
template <KVFormat T>
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

/// The kernels of K/V format T (one format for both, or KVFormats<K, V>): one class per format so
/// that a program can compile them once (KVCACHE_EXTERN_KERNELS, below). Its member is defined out
/// of the class, which keeps it from being inline, so that an extern declaration of the class
/// suppresses its instantiation.
template <KVFormat T>
struct Kernels {
  /// Runs work item `item` of task `t` split as `split`: KV heads [item / blocks * heads,
  /// + heads), row block item % blocks, with micro-kernels `kernel` (avx512, avx2 or portable).
  /// Rows are ordered token-major (row = token * group + head-in-group).
  static void run_item(Kernel kernel, const ErasedTask<T>& t, const TaskSplit& split,
                       position_t first_pos, std::size_t item, const KVMask& mask, float scale,
                       float softcap) noexcept;
};

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
  using T = canonical_format_t<typename V::value_type>;
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
        opts.scale > 0.0f
            ? opts.scale
            : 1.0f / kvcache::detail::math::sqrt(static_cast<float>(t.view.head_dim()));
    Kernels<T>::run_item(kernel, ErasedTask<T>(t), split, first_pos[i], global, mask, scale,
                         opts.softcap);
  };
  if (parallel) {
    opts.pool.parallel_for(total_items, run);
  } else {
    for (std::size_t i = 0; i < total_items; ++i) run(i);
  }
}

/// True when kernel `k` can run for this head_dim on this CPU (portable: always; automatic:
/// never asked).
[[nodiscard]] inline bool kernel_available(Kernel k, std::size_t head_dim) noexcept {
  switch (k) {
    case Kernel::portable:
      return true;
#if KVCACHE_X86_DISPATCH
    case Kernel::avx2:
      return head_dim % 8 == 0 && kvcache::detail::cpu_has_avx2_fma_f16c();
    case Kernel::avx512:
      return head_dim % 16 == 0 && kvcache::detail::cpu_has_avx512f();
#endif
#if KVCACHE_NEON_KERNELS
    case Kernel::neon:
      return head_dim % 4 == 0;
#endif
    default:
      return false;
  }
}

/// What kernel `k` needs, for the error when it was asked for and cannot run.
[[nodiscard]] inline const char* kernel_requirement(Kernel k) noexcept {
  switch (k) {
    case Kernel::avx2:
      return "the avx2 kernel needs a CPU with AVX2+FMA+F16C and head_dim a multiple of 8";
    case Kernel::avx512:
      return "the avx512 kernel needs a CPU with AVX-512F and head_dim a multiple of 16";
    case Kernel::neon:
      return "the neon kernel needs an AArch64 build and head_dim a multiple of 4";
    default:
      return "";
  }
}

/// The order in which Kernel::automatic tries the SIMD kernels (portable when none can run).
inline constexpr std::array kAutomaticOrder{Kernel::avx512, Kernel::avx2, Kernel::neon};

}  // namespace detail

/// True when Kernel::avx2 can run for this head_dim on this CPU.
[[nodiscard]] inline bool avx2_supported(std::size_t head_dim) noexcept {
  return detail::kernel_available(Kernel::avx2, head_dim);
}

/// True when Kernel::avx512 can run for this head_dim on this CPU.
[[nodiscard]] inline bool avx512_supported(std::size_t head_dim) noexcept {
  return detail::kernel_available(Kernel::avx512, head_dim);
}

/// True when Kernel::neon can run for this head_dim (an AArch64 build and head_dim % 4 == 0).
[[nodiscard]] inline bool neon_supported(std::size_t head_dim) noexcept {
  return detail::kernel_available(Kernel::neon, head_dim);
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
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const auto& t = tasks[i];
    first[i] = kvcache::detail::check_attention(t.q, t.view, t.out, opts, t.query_pos);
    const std::size_t d = t.view.head_dim();
    if (d > kMaxHeadDim) {
      throw shape_error(kvcache::detail::message(
          "attend: head_dim ", d, " exceeds the CPU kernel's maximum ", kMaxHeadDim));
    }
  }
  const auto runs_all = [&](Kernel k) {
    return std::all_of(tasks.begin(), tasks.end(), [k](const auto& t) {
      return detail::kernel_available(k, t.view.head_dim());
    });
  };
  Kernel run = kernel;
  if (kernel == Kernel::automatic) {
    run = Kernel::portable;
    for (const Kernel k : detail::kAutomaticOrder) {
      if (runs_all(k)) {
        run = k;
        break;
      }
    }
  } else if (!runs_all(kernel)) {
    throw shape_error(kvcache::detail::message("attend: ", detail::kernel_requirement(kernel)));
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

// Compiling the kernels once per program. The sweeps of every format (Kernels<T>) are most of
// the compile time of a translation unit that calls attend(): a program whose translation units
// are built with KVCACHE_EXTERN_KERNELS defined does not compile them there (nor parse them and
// the intrinsic headers: cpu_sweep.hpp is not included), and instead defines
// KVCACHE_INSTANTIATE_KERNELS in exactly one .cpp file, before its first kvcache include:
//
//   #define KVCACHE_INSTANTIATE_KERNELS
//   #include <kvcache/kvcache.hpp>
//
// Without that file the program fails to link (undefined Kernels<T>::run_item, and the members of
// ThreadPool, Rope, SequenceTable and BlockManager where it uses them: core/compiled_once.hpp).
// Neither macro changes what any function computes.
//
// KVCACHE_DETAIL_EACH_KERNELS(prefix) declares (extern template) or defines (template) the kernels
// of every K/V format and of the K/V format pairs below: the one list of them both uses. The
// pairs are the common ones, not all twenty: 16-bit keys with 8-bit values (keys have outlier
// channels that per-row scales serve worst), and 8-bit keys with half values (llama.cpp's
// --cache-type-k q8_0 alone). A translation unit built with KVCACHE_EXTERN_KERNELS that attends
// over another pair includes "kvcache/attention/cpu_sweep.hpp" after kvcache.hpp: that pair's
// kernels then compile there (the listed ones stay extern); without it the program does not link.
#define KVCACHE_DETAIL_EACH_KERNELS(prefix)             \
  namespace kvcache::cpu::detail {                      \
  prefix struct Kernels<float>;                         \
  prefix struct Kernels<half>;                          \
  prefix struct Kernels<bfloat16>;                      \
  prefix struct Kernels<qint8>;                         \
  prefix struct Kernels<fp8_e4m3>;                      \
  prefix struct Kernels<KVFormats<half, qint8>>;        \
  prefix struct Kernels<KVFormats<half, fp8_e4m3>>;     \
  prefix struct Kernels<KVFormats<bfloat16, qint8>>;    \
  prefix struct Kernels<KVFormats<bfloat16, fp8_e4m3>>; \
  prefix struct Kernels<KVFormats<qint8, half>>;        \
  prefix struct Kernels<KVFormats<fp8_e4m3, half>>;     \
  }
#if defined(KVCACHE_EXTERN_KERNELS) && !defined(KVCACHE_INSTANTIATE_KERNELS)
KVCACHE_DETAIL_EACH_KERNELS(extern template)
#else
#include "kvcache/attention/cpu_sweep.hpp"
#endif
