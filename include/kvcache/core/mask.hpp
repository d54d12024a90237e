// SPDX-License-Identifier: Apache-2.0
// The mask of an attention call, resolved from its options: one type for the CPU kernels and the
// CUDA kernels (cuda::DeviceMask is this type). Which keys a query sees (causal, sliding window,
// attention sinks) and, under cache-relative positions, how sink scores are formed.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kvcache/core/config.hpp"

namespace kvcache {

class Rope;

/// Key at `pos` is visible to a query at `qpos` iff
/// !causal || (pos <= qpos && (window == 0 || pos > qpos - window || pos < sinks)).
///
/// Cache-relative positions (PositionMode::cache_relative) turn the query back by the window's
/// shift for the sink keys (sink_shift()). The CPU kernels do it themselves with `rope`; the CUDA
/// kernels read the sink scores a pre-pass computed (`sink_scores`, see score()). A mask with
/// neither is one of absolute positions.
struct KVMask {
  bool causal = true;
  std::int64_t window = 0;  ///< 0 = unlimited
  std::int64_t sinks = 0;
  /// Host kernels, PositionMode::cache_relative: the RoPE that turns queries back for the sinks.
  const Rope* rope = nullptr;
  /// CUDA kernels, PositionMode::cache_relative: the scores of the sink keys (q turned back by
  /// sink_shift, times the softmax scale), computed by sink_score_kernel before the attention
  /// kernel, which takes them instead of its own q.k for keys at positions below `sinks`.
  /// Indexed ((seq * sink_rows + row) * sink_heads + head) * sinks + pos for query row `row` of
  /// its sequence. Null for absolute positions.
  const float* sink_scores = nullptr;
  std::int64_t sink_rows = 1;  ///< query rows per sequence in sink_scores (max_q_len)
  int sink_heads = 0;          ///< query heads

  /// Lowest non-sink key position visible to a query at qpos.
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr std::int64_t low(std::int64_t qpos) const {
    return window == 0 ? 0 : qpos - window + 1;
  }
  /// By how many positions a query at qpos is turned back for the sink keys under cache-relative
  /// positions: low(qpos) - sinks when positive and the mask has a window and sinks, else 0.
  /// `relative` says whether the call uses cache-relative positions.
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr std::int64_t sink_shift(std::int64_t qpos,
                                                                             bool relative) const {
    if (!relative || window == 0 || sinks == 0) return 0;
    const std::int64_t shift = low(qpos) - sinks;
    return shift > 0 ? shift : 0;
  }
  /// The host kernels' shift: sink_shift(qpos, rope != nullptr).
  [[nodiscard]] constexpr std::int64_t sink_shift(std::int64_t qpos) const {
    return sink_shift(qpos, rope != nullptr);
  }
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE constexpr bool visible(std::int64_t qpos,
                                                                  std::int64_t pos) const {
    return !causal || (pos <= qpos && (window == 0 || pos > qpos - window || pos < sinks));
  }
  /// The score of key `pos` for query head `head` of row `row` of sequence `seq`: `computed`
  /// (the kernel's own q.k, scaled), or the precomputed one of a sink (sink_scores).
  [[nodiscard]] KVCACHE_HOST_DEVICE_INLINE float score(float computed, int seq, std::int64_t row,
                                                       int head, std::int64_t pos) const {
    if (sink_scores == nullptr || pos < 0 || pos >= sinks) return computed;
    return sink_scores[((seq * sink_rows + row) * sink_heads + head) * sinks + pos];
  }
};

static_assert(std::is_trivially_copyable_v<KVMask>);

}  // namespace kvcache
