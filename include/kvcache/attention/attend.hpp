// SPDX-License-Identifier: Apache-2.0
// kvcache::attend: the one attention entry point. It takes queries and a view of any cache policy
// (never a cache) and runs the fast CPU kernel.
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/attention/cpu.hpp"
#include "kvcache/attention/options.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// Softmax attention of new queries over one layer of one cached sequence.
///
/// out[t][h] = sum_i softmax_i(s_ti) v_i over the keys i the mask lets query t see, where
/// s_ti = scale * q[t][h] . k_i (then soft-capped if opts.softcap > 0), and query head h reads
/// KV head h / (num_q_heads / num_kv_heads) (GQA/MQA). Query t sits at absolute position
/// opts.query_pos (default view.length() - n) + t; causal masking, the window and the sinks
/// compare that with each key's absolute position from the view. Accumulates in fp32.
/// Each query's output is the same bits whatever other queries share the call, with or without a
/// window and sinks (a token decoded alone and the same token inside a prefill chunk agree
/// exactly), and whether the keys sit in a static, dynamic, paged or sliding-window cache.
///
/// Inf and NaN, for each output row out[t][h] (the same in reference::attend, every CPU kernel
/// and the CUDA kernels):
///  1. A row that sees no key (none visible under the mask) is all zeros, whatever q[t][h] holds.
///  2. Otherwise, if q[t][h], or the K or V row (of KV head h / group) of any key the row may see
///     holds an inf or NaN, every element of the row is a quiet NaN. The soft-cap does not hide
///     an inf score: the test looks at the raw scores.
///  3. Inf and NaN in keys the row cannot see (later positions under causal masking, outside the
///     window, other KV heads' rows, slots the view does not hold) change none of its bits.
///  4. Rows with finite inputs are computed exactly as without rule 2 and 3's checks. Scores are
///     fp32: finite q and K whose scaled dot product overflows float (or values whose weighted sum
///     does) are outside this contract (the row may come out NaN or inf).
/// A float beyond half's or bfloat16's range appended to such a cache is stored as inf (see
/// CacheConcept), so the rows that see it are NaN.
///
/// Shapes: q and out [n][num_q_heads][head_dim]; num_q_heads a multiple of the view's
/// num_kv_heads; head_dim equal to the view's (at most cpu::kMaxHeadDim).
/// @pre every key position a query may see is in the view (checked: views of a sliding window
///      must be read with the cache's window and num_sink_tokens).
/// @throws shape_error, position_error naming the numbers; nothing is written on throw.
template <KVView V>
void attend(TokenBlock<const float> q, const V& view, TokenBlock<float> out,
            const AttentionOptions& opts = {}) {
  cpu::attend(q, view, out, opts);
}

/// attend() with queries (QT: [const] float, half or bfloat16) and output (O: float, half or
/// bfloat16) of any element type, for engines whose activations are half: each q row is
/// converted to fp32 once, in the kernel's own per-row buffer (no allocation), and each output
/// row is rounded once at the end (nearest even; beyond the type's range inf, NaN stays NaN).
/// The result is exactly that of attend() on q converted to float, rounded to O.
template <class QT, KVView V, Element O>
requires Element<std::remove_const_t<QT>>
void attend(TokenBlock<QT> q, const V& view, TokenBlock<O> out, const AttentionOptions& opts = {}) {
  cpu::attend(q, view, out, opts);
}

/// attend() returning a new [n][num_q_heads][head_dim] output (allocates it).
template <KVView V>
[[nodiscard]] std::vector<float> attend(TokenBlock<const float> q, const V& view,
                                        const AttentionOptions& opts = {}) {
  std::vector<float> out(q.num_tokens * q.num_heads * q.head_dim);
  attend(q, view, TokenBlock<float>{out, q.num_tokens, q.num_heads, q.head_dim}, opts);
  return out;
}

/// attend() for many sequences in one call (e.g. batched decode): with opts.pool set, the work
/// is spread over (sequence, KV head, query-row block) on its threads (the same bits as without).
/// Each task carries its own query_pos; opts.query_pos is ignored. Queries (Q) and output (O)
/// float, half or bfloat16, as in attend().
template <KVView V, Element Q, Element O>
void attend_batch(std::span<const AttentionTask<V, Q, O>> tasks,
                  const AttentionOptions& opts = {}) {
  cpu::attend_batch(tasks, opts);
}

}  // namespace kvcache
