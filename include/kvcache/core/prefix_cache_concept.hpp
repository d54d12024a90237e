// SPDX-License-Identifier: Apache-2.0
// PrefixCacheConcept: what a cache with automatic prefix caching adds to CacheConcept (admit a
// prompt and learn how much of it is cached, register token ids, fork, release), and the
// statistics such a cache reports.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>

#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"

namespace kvcache {

/// Counters of a prefix-caching block pool, read at one instant.
/// blocks_total == blocks_used + blocks_cached + blocks_free.
struct PrefixCacheStats {
  std::size_t block_size = 0;
  std::size_t blocks_total = 0;
  /// Blocks held by at least one sequence.
  std::size_t blocks_used = 0;
  /// Blocks held by no sequence but kept in the prefix index: a later prompt with the same prefix
  /// reuses them; eviction (least recently released first) turns them into free blocks.
  std::size_t blocks_cached = 0;
  std::size_t blocks_free = 0;
  /// admit() calls, prompt tokens they brought, and how many of those were found cached.
  std::size_t prompts = 0;
  std::size_t prompt_tokens = 0;
  std::size_t reused_tokens = 0;
  /// Cached blocks evicted, and blocks copied because a sequence wrote into a shared block.
  std::size_t evictions = 0;
  std::size_t cow_copies = 0;

  /// reused_tokens / prompt_tokens (0 before any prompt).
  [[nodiscard]] constexpr double hit_rate() const noexcept {
    return prompt_tokens == 0
               ? 0.0
               : static_cast<double>(reused_tokens) / static_cast<double>(prompt_tokens);
  }
  friend constexpr bool operator==(const PrefixCacheStats&, const PrefixCacheStats&) = default;
};

/// A CacheConcept policy whose sequences share K/V of common prompt prefixes.
///
/// Requirements (for `C c`, `const C cc`, `std::size_t seq, dst`, `std::span<const token_id> ids`),
/// on top of CacheConcept:
///  1. `c.admit(seq, ids)` -> std::size_t: starts the empty sequence `seq` with prompt `ids`:
///     registers the ids and shares the K/V of the longest cached prefix. Returns that prefix's
///     length m (< ids.size() when ids is non-empty, so the last prompt token is always run to
///     produce logits); every layer then holds m tokens and the caller appends K/V for
///     ids[m..] layer by layer.
///  2. `cc.match_prefix(ids)` -> std::size_t: how many leading tokens of ids are cached now
///     (a query; changes nothing).
///  3. `c.add_tokens(seq, ids)`: registers the ids of further tokens (e.g. each sampled token),
///     before their K/V is appended: a token's id comes before (or with) its K/V, so that an
///     append of K/V past the registered ids is refused at once (position_error) rather than
///     leaving ids and K/V to disagree.
///  4. `cc.tokens(seq)` -> std::span<const token_id>: the ids registered for seq.
///  5. `c.fork(seq, dst)`: the empty sequence dst becomes a copy of seq that shares its K/V.
///  6. `c.release(seq)`: forgets seq (as reset); K/V other requests may reuse stays cached.
///  7. `cc.stats()` -> PrefixCacheStats.
///
/// Semantics the compiler cannot check: sharing is exact, never approximate. K/V is shared only
/// for token ids equal to the ones it was computed for, in the same prefix, and only where the ids
/// and the K/V of every layer both cover it; a sequence never sees K/V appended by another
/// sequence for different tokens. A sequence with ids never holds K/V past them.
template <class C>
concept PrefixCacheConcept = CacheConcept<C> &&
    requires(C& c, const C& cc, std::size_t seq, std::size_t dst, std::span<const token_id> ids) {
  { c.admit(seq, ids) } -> std::same_as<std::size_t>;
  { cc.match_prefix(ids) } -> std::same_as<std::size_t>;
  { c.add_tokens(seq, ids) } -> std::same_as<void>;
  { cc.tokens(seq) } -> std::same_as<std::span<const token_id>>;
  { c.fork(seq, dst) } -> std::same_as<void>;
  { c.release(seq) } -> std::same_as<void>;
  { cc.stats() } -> std::same_as<PrefixCacheStats>;
};

}  // namespace kvcache
