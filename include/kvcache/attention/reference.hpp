// SPDX-License-Identifier: Apache-2.0
// The reference attention: plain loops in double precision, written to be obviously right rather
// than fast. Tests compare every cache and every fast kernel against it.
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/math.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache::reference {

/// Attention over dense, from-scratch inputs: query token t (position q_pos[t]) attends to every
/// key i (position k_pos[i]) that the options' mask allows, with a numerically stable softmax
/// computed in double. Query head h uses KV head h / (num_q_heads / num_kv_heads).
/// Shapes: q, out [n][num_q_heads][head_dim]; k, v [num_keys][num_kv_heads][head_dim].
/// With PositionMode::cache_relative (opts.rope set), a sink key is scored against q turned back
/// by the query's sink_shift (see PositionMode). Non-finite inputs, as kvcache::attend: a query
/// that sees no key gets a zero output (whatever its q holds); else, if its q, or the K or V row of
/// any key it sees, holds an inf or NaN, its whole output row is NaN; inf and NaN in keys it does
/// not see change nothing. O(n * num_keys * num_q_heads * head_dim).
/// @throws shape_error when shapes disagree.
inline void attend_dense(TokenBlock<const float> q, std::span<const position_t> q_pos,
                         TokenBlock<const float> k, TokenBlock<const float> v,
                         std::span<const position_t> k_pos, TokenBlock<float> out,
                         const AttentionOptions& opts = {}) {
  q.validate("reference: q");
  k.validate("reference: k");
  v.validate("reference: v");
  out.validate("reference: out");
  if (q_pos.size() != q.num_tokens || k_pos.size() != k.num_tokens ||
      v.num_tokens != k.num_tokens || v.num_heads != k.num_heads || k.head_dim != q.head_dim ||
      v.head_dim != q.head_dim || k.num_heads == 0 || q.num_heads % k.num_heads != 0 ||
      out.num_tokens != q.num_tokens || out.num_heads != q.num_heads ||
      out.head_dim != q.head_dim) {
    throw shape_error("reference::attend_dense: inconsistent shapes");
  }
  const std::size_t d = q.head_dim;
  const std::size_t group = q.num_heads / k.num_heads;
  const double scale = opts.scale > 0.0f
                           ? static_cast<double>(opts.scale)
                           : 1.0 / kvcache::detail::math::sqrt(static_cast<double>(d));
  const KVMask mask = detail::mask_of(opts);
  if (mask.rope != nullptr && mask.rope->head_dim() != d) {
    throw shape_error(
        detail::message("reference::attend_dense: cache_relative positions with a "
                        "RoPE for head_dim ",
                        mask.rope->head_dim(), " but head_dim ", d));
  }
  std::vector<double> scores(k.num_tokens);
  std::vector<double> acc(d);
  std::vector<float> turned(d);  // q turned back for the sinks (cache-relative positions)
  for (std::size_t t = 0; t < q.num_tokens; ++t) {
    const position_t shift = mask.sink_shift(q_pos[t]);
    for (std::size_t h = 0; h < q.num_heads; ++h) {
      const std::size_t kvh = h / group;
      const float* q_window = q.row(t, h);
      if (shift != 0) {
        std::copy(q_window, q_window + d, turned.begin());
        mask.rope->turn(turned.data(), 1, -static_cast<double>(shift));
      }
      double max_score = -std::numeric_limits<double>::infinity();
      bool bad = false;  // q, or a seen key's K or V row, holds an inf or NaN
      for (std::size_t i = 0; i < k.num_tokens; ++i) {
        if (!mask.visible(q_pos[t], k_pos[i])) {
          scores[i] = -std::numeric_limits<double>::infinity();
          continue;
        }
        const float* kr = k.row(i, kvh);
        const float* vr = v.row(i, kvh);
        const float* qr = shift != 0 && k_pos[i] < mask.sinks ? turned.data() : q_window;
        double s = 0.0;
        for (std::size_t j = 0; j < d; ++j) {
          s += static_cast<double>(qr[j]) * static_cast<double>(kr[j]);
          bad = bad || !kvcache::detail::math::isfinite(qr[j]) ||
                !kvcache::detail::math::isfinite(kr[j]) || !kvcache::detail::math::isfinite(vr[j]);
        }
        if (bad) break;  // the output is NaN whatever the other keys hold
        s *= scale;
        if (opts.softcap > 0.0f) {
          const auto cap = static_cast<double>(opts.softcap);
          s = cap * kvcache::detail::math::tanh(s / cap);
        }
        scores[i] = s;
        max_score = std::max(max_score, s);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double sum = 0.0;
      if (!bad && max_score > -std::numeric_limits<double>::infinity()) {
        for (std::size_t i = 0; i < k.num_tokens; ++i) {
          if (scores[i] == -std::numeric_limits<double>::infinity()) continue;
          const double p = kvcache::detail::math::exp(scores[i] - max_score);
          sum += p;
          const float* vr = v.row(i, kvh);
          for (std::size_t j = 0; j < d; ++j) acc[j] += p * static_cast<double>(vr[j]);
        }
      }
      float* o = out.row(t, h);
      for (std::size_t j = 0; j < d; ++j) {
        o[j] = bad         ? std::numeric_limits<float>::quiet_NaN()
               : sum > 0.0 ? static_cast<float>(acc[j] / sum)
                           : 0.0f;
      }
    }
  }
}

/// Copies a view's slots into dense float arrays [num_tokens][num_kv_heads][head_dim] with
/// their positions, walking the segments in order (quantized rows as code x scale). Allocates; for
/// tests and the reference.
template <KVView V>
void gather_view(const V& view, std::vector<float>& k, std::vector<float>& v,
                 std::vector<position_t>& pos) {
  const std::size_t heads = view.num_kv_heads(), d = view.head_dim();
  const std::size_t n = view_num_tokens(view);
  k.assign(n * heads * d, 0.0f);
  v.assign(n * heads * d, 0.0f);
  pos.assign(n, 0);
  std::size_t slot = 0;
  for (std::size_t s = 0; s < view.num_segments(); ++s) {
    const auto seg = view.segment(s);
    for (std::size_t j = 0; j < seg.len && slot < n; ++j, ++slot) {
      pos[slot] = seg.first_pos + static_cast<position_t>(j);
      for (std::size_t h = 0; h < heads; ++h) {
        const std::size_t at = h * seg.head_stride + j * d, row = at / d;
        dequantize_row(seg.k + at, seg.k_scale != nullptr ? seg.k_scale + row : nullptr, d,
                       k.data() + (slot * heads + h) * d);
        dequantize_row(seg.v + at, seg.v_scale != nullptr ? seg.v_scale + row : nullptr, d,
                       v.data() + (slot * heads + h) * d);
      }
    }
  }
}

/// Reference attention over a cache view: validates exactly like kvcache::attend, gathers the
/// view, then runs attend_dense. Allocates O(view tokens).
template <KVView V>
void attend(TokenBlock<const float> q, const V& view, TokenBlock<float> out,
            const AttentionOptions& opts = {}) {
  const position_t first = detail::check_attention(q, view, out, opts, opts.query_pos);
  std::vector<float> k, v;
  std::vector<position_t> k_pos;
  gather_view(view, k, v, k_pos);
  std::vector<position_t> q_pos(q.num_tokens);
  for (std::size_t t = 0; t < q.num_tokens; ++t) q_pos[t] = first + static_cast<position_t>(t);
  const std::size_t nk = k_pos.size();
  attend_dense(q, q_pos, {k, nk, view.num_kv_heads(), view.head_dim()},
               {v, nk, view.num_kv_heads(), view.head_dim()}, k_pos, out, opts);
}

}  // namespace kvcache::reference
