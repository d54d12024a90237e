// SPDX-License-Identifier: Apache-2.0
// The same tokens' K/V held by every built-in policy, for attention properties that must hold on
// every view type: static (one segment), dynamic (chunks), sliding window (a ring with sinks and
// an evicted gap) and paged (blocks, swept in lockstep over KV heads).
#pragma once

#include <cstddef>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"

namespace kvcache::test {

/// Where the keys sit: one sequence of `len` tokens, `kv_heads` x `dim`; the ring keeps
/// `window` tokens (and `sinks` sinks) for queries among the last `max_append` positions.
struct PolicySetup {
  std::size_t kv_heads = 2;
  std::size_t dim = 16;
  std::size_t len = 90;
  std::size_t window = 20;
  std::size_t sinks = 3;
  std::size_t max_append = 8;
};

/// Layer 0 of sequence 0 of one cache per policy, each filled with `kv` in its own chunks.
template <Element T>
class EveryPolicy {
 public:
  EveryPolicy(const TokenKV& kv, const PolicySetup& s)
      : setup_(s),
        fixed_(
            {.num_layers = 1, .num_kv_heads = s.kv_heads, .head_dim = s.dim, .max_seq_len = s.len}),
        dynamic_({.num_layers = 1,
                  .num_kv_heads = s.kv_heads,
                  .head_dim = s.dim,
                  .max_seq_len = s.len,
                  .chunk_len = 24}),
        ring_({.num_layers = 1,
               .num_kv_heads = s.kv_heads,
               .head_dim = s.dim,
               .window = s.window,
               .num_sink_tokens = s.sinks,
               .max_append_len = s.max_append}),
        paged_({.num_layers = 1,
                .num_kv_heads = s.kv_heads,
                .head_dim = s.dim,
                .num_blocks = (s.len + 15) / 16,
                .block_size = 16}) {
    append_in_chunks(fixed_, 0, 0, kv, 0, s.len, {s.len});
    append_in_chunks(dynamic_, 0, 0, kv, 0, s.len, {7, 30});
    append_in_chunks(ring_, 0, 0, kv, 0, s.len, {s.max_append, 3});
    append_in_chunks(paged_, 0, 0, kv, 0, s.len, {5, 16, 1});
  }

  /// Calls f(name, view, windowed) for each policy's view; windowed: the view must be read with
  /// AttentionOptions{.window = setup.window, .num_sink_tokens = setup.sinks} (the ring).
  template <class F>
  void for_each_view(F&& f) const {
    f("static", fixed_.view(0, 0), false);
    f("dynamic", dynamic_.view(0, 0), false);
    f("sliding_window", ring_.view(0, 0), true);
    f("paged", paged_.view(0, 0), false);
  }

  [[nodiscard]] const PolicySetup& setup() const noexcept { return setup_; }

 private:
  PolicySetup setup_;
  StaticCache<T> fixed_;
  DynamicCache<T> dynamic_;
  SlidingWindowCache<T> ring_;
  PagedCache<T> paged_;
};

}  // namespace kvcache::test
