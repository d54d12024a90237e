// SPDX-License-Identifier: Apache-2.0
// What an attention call takes besides its tensors (scale, causal mask by absolute positions,
// sliding window, sinks, soft-cap, executor), the mask predicate both CPU implementations share,
// and the argument checks done once at the API boundary.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>

#include "kvcache/attention/rope.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/executor.hpp"
#include "kvcache/core/mask.hpp"
#include "kvcache/core/math.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// Which positions q . k sees for the sinks of a sliding window (AttentionOptions::positions).
enum class PositionMode {
  /// The positions q and K were rotated at (their absolute positions): a sink at p_k is seen
  /// from a query at p at distance p - p_k, however far the window has moved.
  absolute,
  /// StreamingLLM: positions are taken within the cache, the sinks at 0 .. S - 1 and the
  /// window right after them. For a query at p whose window starts at lo = max(S, p - W + 1),
  /// a window key at p_k stays at distance p - p_k, and a sink at p_k is seen at distance
  /// S + (p - lo) - p_k, as if the window followed the sinks without a gap; so the distances a
  /// query sees never exceed S + W - 1, and a model trained on that many tokens stays in its
  /// regime for as long as the sequence grows. q and K are stored rotated at their absolute
  /// positions as usual (the engine's RoPE, given in AttentionOptions::rope); the kernel turns q
  /// back by lo - S for the sink keys only (O(head_dim) per query row). Identical to absolute
  /// without a window or sinks, and while lo == S. Not on the CUDA backend yet (shape_error).
  cache_relative,
};

/// Options of an attention call. The defaults give plain causal softmax attention.
struct AttentionOptions {
  /// Multiplier of q.k before softmax; 0 means 1 / sqrt(head_dim).
  float scale = 0.0f;
  /// Causal by absolute positions: a query at position p sees keys with position <= p.
  /// Non-causal attention sees every key of the view (window and sinks must then be 0).
  bool causal = true;
  /// Sliding window W: a query at p sees only keys with p - W < pos <= p (0 = unlimited).
  std::size_t window = 0;
  /// With a window: keys at positions < num_sink_tokens stay visible to every query.
  std::size_t num_sink_tokens = 0;
  /// Logit soft-cap c (Gemma 2 style): s -> c * tanh(s / c), applied after scaling (0 = off).
  float softcap = 0.0f;
  /// Position of the first query token (queries are consecutive). Default: the last
  /// q.num_tokens positions of the view, i.e. view.length() - q.num_tokens.
  std::optional<position_t> query_pos = std::nullopt;
  /// The threads the fast CPU kernel may use, borrowed for the call: `&pool` for a ThreadPool
  /// (core/thread_pool.hpp) or any other ExecutorConcept type, or an Executor made from a function
  /// pointer (an OpenMP loop, say). nullptr: the calling thread only.
  Executor pool = nullptr;
  /// How the sinks' positions enter q . k (see PositionMode).
  PositionMode positions = PositionMode::absolute;
  /// The RoPE q and K were rotated with, for head_dim of the call; needed by cache_relative
  /// positions (borrowed for the call).
  const Rope* rope = nullptr;
};

/// One sequence of a batched attention call: queries [n][num_q_heads][head_dim] against one
/// view, output of the same shape as the queries. Queries and output may be float, half or
/// bfloat16 (Q and O, independently; see kvcache::attend).
template <KVView V, Element Q = float, Element O = float>
struct AttentionTask {
  TokenBlock<const Q> q;
  V view;
  TokenBlock<O> out;
  /// As AttentionOptions::query_pos, for this task.
  std::optional<position_t> query_pos = std::nullopt;
};

namespace detail {

/// The mask of an attention call's options (KVMask; the RoPE only under cache_relative).
[[nodiscard]] inline KVMask mask_of(const AttentionOptions& opts) noexcept {
  return {.causal = opts.causal,
          .window = static_cast<position_t>(opts.window),
          .sinks = static_cast<position_t>(opts.num_sink_tokens),
          .rope = opts.positions == PositionMode::cache_relative ? opts.rope : nullptr};
}

/// The option half of check_attention(). @throws shape_error for a negative or non-finite
/// scale or softcap, and for a window or sinks without causal masking.
inline void check_options(const AttentionOptions& opts) {
  if (!(opts.scale >= 0.0f) || !detail::math::isfinite(opts.scale) || !(opts.softcap >= 0.0f) ||
      !detail::math::isfinite(opts.softcap)) {
    throw shape_error(detail::message("attend: scale (", opts.scale, ") and softcap (",
                                      opts.softcap, ") must be finite and >= 0"));
  }
  if (!opts.causal && (opts.window != 0 || opts.num_sink_tokens != 0)) {
    throw shape_error(detail::message("attend: window ", opts.window, " / num_sink_tokens ",
                                      opts.num_sink_tokens, " need causal attention"));
  }
  if (opts.positions == PositionMode::cache_relative && opts.rope == nullptr) {
    throw shape_error(
        "attend: cache_relative positions need the RoPE q and K were rotated with "
        "(AttentionOptions::rope)");
  }
}

/// The position half of check_attention(): n consecutive queries starting at `query_pos`
/// (default length - n) against a view holding [0, sink_end) and [recent_begin, length).
/// Returns the first query position. @throws position_error.
inline position_t check_query_positions(position_t n, std::optional<position_t> query_pos,
                                        position_t length, position_t sink_end,
                                        position_t recent_begin, const AttentionOptions& opts) {
  const position_t first = query_pos.value_or(length - n);
  if (first < 0) {
    throw position_error(
        detail::message("attend: ", n, " queries but the view holds only ", length, " positions"));
  }
  const position_t gap_begin = sink_end, gap_end = recent_begin;
  if (!opts.causal) {
    if (length == 0 || gap_begin < gap_end) {
      throw position_error(detail::message(
          "attend: non-causal attention needs every position of the sequence, but the view "
          "holds [0, ",
          gap_begin, ") and [", gap_end, ", ", length, ")"));
    }
    return first;
  }
  const KVMask mask{.causal = true,
                    .window = static_cast<position_t>(opts.window),
                    .sinks = static_cast<position_t>(opts.num_sink_tokens)};
  for (position_t p = first; p < first + n; ++p) {
    if (p >= length) {
      throw position_error(detail::message("attend: query at position ", p,
                                           " but the view ends at position ", length - 1,
                                           " (append the token's K/V before attending)"));
    }
    if (gap_begin >= gap_end) continue;
    const position_t lo = std::max<position_t>(0, mask.low(p));
    const bool recent_ok = p < gap_begin || lo >= gap_end;
    const bool sinks_ok = std::min(mask.sinks, lo) <= gap_begin;
    if (!recent_ok || !sinks_ok) {
      throw position_error(detail::message(
          "attend: query at position ", p, " needs keys [", lo, ", ", p, "] (window ", opts.window,
          ", sinks ", opts.num_sink_tokens, ") but the view evicted [", gap_begin, ", ", gap_end,
          "); pass the cache's window and num_sink_tokens in AttentionOptions"));
    }
  }
  return first;
}

/// Checks one attention call and returns the position of its first query.
/// @throws shape_error (buffer sizes, head_dim, head counts, bad scale/softcap/window use),
///         position_error (a query needs a key position the view does not hold).
template <Element Q, KVView V, Element O>
position_t check_attention(const TokenBlock<const Q>& q, const V& view, const TokenBlock<O>& out,
                           const AttentionOptions& opts, std::optional<position_t> query_pos) {
  q.validate("attend: queries");
  out.validate("attend: output");
  if (q.head_dim != view.head_dim()) {
    throw shape_error(detail::message("attend: queries have head_dim ", q.head_dim,
                                      " but the cache has head_dim ", view.head_dim()));
  }
  if (view.num_kv_heads() == 0 || q.num_heads == 0 || q.num_heads % view.num_kv_heads() != 0) {
    throw shape_error(detail::message("attend: num_q_heads ", q.num_heads,
                                      " is not a positive multiple of num_kv_heads ",
                                      view.num_kv_heads()));
  }
  if (out.num_tokens != q.num_tokens || out.num_heads != q.num_heads ||
      out.head_dim != q.head_dim) {
    throw shape_error(detail::message("attend: output shape [", out.num_tokens, "][", out.num_heads,
                                      "][", out.head_dim, "] differs from the queries' [",
                                      q.num_tokens, "][", q.num_heads, "][", q.head_dim, "]"));
  }
  check_options(opts);
  if (opts.positions == PositionMode::cache_relative && opts.rope->head_dim() != q.head_dim) {
    throw shape_error(detail::message("attend: cache_relative positions with a RoPE for head_dim ",
                                      opts.rope->head_dim(), " but the queries have head_dim ",
                                      q.head_dim));
  }
  return check_query_positions(static_cast<position_t>(q.num_tokens), query_pos, view.length(),
                               view.sink_end(), view.recent_begin(), opts);
}

}  // namespace detail
}  // namespace kvcache
