// SPDX-License-Identifier: Apache-2.0
// Helpers for the prefix-caching tests: a synthetic model whose K/V at a position depend on the
// layer and on every token id up to it (as a real model's do), so equal prefixes have equal K/V,
// plus prefill and from-scratch reference attention over a sequence of ids.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

namespace kvcache::test {

/// K/V of [layers][positions] as a pure function of (layer, ids[0..p]).
struct SyntheticModel {
  std::size_t layers = 0, heads = 0, dim = 0;

  /// h[p] identifies the prefix ids[0..p] (a 64-bit chained hash; only its determinism matters).
  [[nodiscard]] static std::vector<std::uint64_t> prefix_hashes(std::span<const token_id> ids) {
    std::vector<std::uint64_t> h(ids.size());
    std::uint64_t x = 0x243f6a8885a308d3ull;
    for (std::size_t p = 0; p < ids.size(); ++p) {
      x = mix(x ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(ids[p])) + p * 0x9e37));
      h[p] = x;
    }
    return h;
  }

  /// K and V of positions [first, first + n) of `ids` in `layer`, [n][heads][dim] each, in [-1, 1].
  [[nodiscard]] TokenKV kv(std::size_t layer, std::span<const token_id> ids, std::size_t first,
                           std::size_t n) const {
    const auto h = prefix_hashes(ids.first(first + n));
    TokenKV out{std::vector<float>(n * heads * dim), std::vector<float>(n * heads * dim), n, heads,
                dim};
    for (std::size_t t = 0; t < n; ++t) {
      std::uint64_t s = h[first + t] ^ (0x51ed270b27e5a5dbull * (layer + 1));
      for (std::size_t i = 0; i < heads * dim; ++i) {
        out.k[t * heads * dim + i] = unit(s = mix(s));
        out.v[t * heads * dim + i] = unit(s = mix(s));
      }
    }
    return out;
  }

  /// Appends K/V of positions [first, first + n) of `ids` to every layer of `seq`, in chunks of
  /// at most `chunk` tokens per append.
  template <class Cache>
  void prefill(Cache& cache, std::size_t seq, std::span<const token_id> ids, std::size_t first,
               std::size_t n, std::size_t chunk = 1u << 30) const {
    for (std::size_t l = 0; l < layers; ++l) {
      const TokenKV kvs = kv(l, ids, first, n);
      for (std::size_t done = 0; done < n;) {
        const std::size_t c = std::min(chunk, n - done);
        cache.append(l, seq, kvs.k_block(done, c), kvs.v_block(done, c));
        done += c;
      }
    }
  }

  /// The request flow on the empty sequence `seq`: admit `prompt`, then prefill what is not
  /// cached, `chunk` tokens per append. Returns the admitted (cached) count.
  template <class Cache>
  std::size_t run_prompt(Cache& cache, std::size_t seq, const std::vector<token_id>& prompt,
                         std::size_t chunk = 5) const {
    const std::size_t cached = cache.admit(seq, prompt);
    prefill(cache, seq, prompt, cached, prompt.size() - cached, chunk);
    return cached;
  }

  /// One decode step: appends `next` to `ids`, registers it, then appends its K/V.
  template <class Cache>
  void decode(Cache& cache, std::size_t seq, std::vector<token_id>& ids, token_id next) const {
    ids.push_back(next);
    cache.add_tokens(seq, std::span<const token_id>(&ids.back(), 1));
    prefill(cache, seq, ids, ids.size() - 1, 1);
  }

  /// Attention of the last nq positions of `ids` (queries q) over K/V of all of ids, recomputed
  /// from scratch with the values rounded (or quantized) to T, as a cache of T stores them.
  template <KVElement T>
  [[nodiscard]] std::vector<float> reference(std::size_t layer, std::span<const token_id> ids,
                                             const std::vector<float>& q, std::size_t nq,
                                             std::size_t q_heads,
                                             const AttentionOptions& opts = {}) const {
    const TokenKV all = kv(layer, ids, 0, ids.size());
    return scratch_attention(q, nq, q_heads, rounded<T>(all.k, dim), rounded<T>(all.v, dim),
                             ids.size(), heads, dim, static_cast<position_t>(ids.size() - nq),
                             opts);
  }

  /// REQUIREs that attention over every layer of `seq` (its last nq positions as queries) equals
  /// the from-scratch reference over `ids`, within fp32-accumulation tolerance.
  template <class Cache>
  void require_attention_matches(const Cache& cache, std::size_t seq, std::span<const token_id> ids,
                                 std::mt19937_64& rng, std::size_t group = 2,
                                 std::size_t nq = 3) const {
    using T = typename Cache::value_type;
    REQUIRE(cache.seq_length(seq) == ids.size());
    nq = std::min(nq, ids.size());
    const std::size_t q_heads = heads * group;
    const auto q = normal_floats(rng, nq * q_heads * dim);
    for (std::size_t l = 0; l < layers; ++l) {
      const auto view = cache.view(l, seq);
      check_view_invariants(view);
      std::vector<float> got(q.size());
      attend({q, nq, q_heads, dim}, view, {got, nq, q_heads, dim});
      INFO("sequence " << seq << " layer " << l << " length " << ids.size());
      require_close(got, reference<T>(l, ids, q, nq, q_heads), Tolerance{2e-5, 2e-5});
    }
  }

  static std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  static float unit(std::uint64_t x) {
    return static_cast<float>(static_cast<double>(x >> 11) * 0x1p-52 - 1.0);
  }
};

/// Everything a paged cache exposes, for "unchanged on throw" checks: every (layer, sequence)'s
/// view contents, every sequence's ids and block table, and the pool statistics.
struct PagedState {
  std::vector<std::vector<float>> contents;
  std::vector<std::vector<token_id>> ids;
  std::vector<std::vector<block_id>> tables;
  PrefixCacheStats stats;
  bool operator==(const PagedState&) const = default;
};

template <class Cache>
PagedState paged_state(const Cache& cache) {
  PagedState s{cache_contents(cache), {}, {}, cache.stats()};
  for (std::size_t q = 0; q < cache.max_batch(); ++q) {
    const auto ids = cache.tokens(q);
    const auto table = cache.block_table(q);
    s.ids.emplace_back(ids.begin(), ids.end());
    s.tables.emplace_back(table.begin(), table.end());
  }
  return s;
}

/// n consecutive ids first, first + 1, ...
inline std::vector<token_id> iota_ids(std::size_t n, token_id first) {
  std::vector<token_id> ids(n);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

/// a followed by b.
inline std::vector<token_id> concat(std::vector<token_id> a, const std::vector<token_id>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// A copy of the block table of `seq`.
template <class Cache>
std::vector<block_id> table_of(const Cache& cache, std::size_t seq) {
  const auto t = cache.block_table(seq);
  return {t.begin(), t.end()};
}

/// `n` ids: `prefix` followed by n - prefix.size() ids drawn from [1, vocab].
inline std::vector<token_id> prompt_with_prefix(std::mt19937_64& rng,
                                                const std::vector<token_id>& prefix, std::size_t n,
                                                std::size_t vocab = 50) {
  std::vector<token_id> ids(
      prefix.begin(), prefix.begin() + static_cast<std::ptrdiff_t>(std::min(prefix.size(), n)));
  while (ids.size() < n) ids.push_back(static_cast<token_id>(uniform(rng, 1, vocab)));
  return ids;
}

}  // namespace kvcache::test
