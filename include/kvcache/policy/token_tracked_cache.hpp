// SPDX-License-Identifier: Apache-2.0
// TokenTrackedCache: wraps any policy and remembers which token ids each sequence holds, so a
// cache reused across chat turns or prompts is cropped to the longest common prefix before the new
// prompt is prefilled. A caller can then never attend to K/V of tokens that are not in its prompt.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/restore.hpp"

namespace kvcache {

/// A CacheConcept policy plus the token ids of each sequence's committed K/V.
///
/// Use per request: `std::size_t reused = c.reuse_prefix(seq, prompt);` then run the model on
/// prompt[reused..] (appending to every layer as usual) and `c.commit(seq, those ids)`; the
/// same for each generated token. Tokens appended but never committed are dropped by the next
/// reuse_prefix, so an aborted request cannot leak into the next one.
template <CacheConcept C>
class TokenTrackedCache {
 public:
  using value_type = typename C::value_type;
  using view_type = typename C::view_type;
  using cache_type = C;

  /// Wraps a cache; every sequence must be empty. @throws position_error otherwise.
  explicit TokenTrackedCache(C cache) : cache_(std::move(cache)), tokens_(cache_.max_batch()) {
    for (std::size_t s = 0; s < cache_.max_batch(); ++s) {
      if (cache_.seq_length(s) != 0) {
        throw position_error(detail::message("TokenTrackedCache: sequence ", s, " already holds ",
                                             cache_.seq_length(s), " untracked tokens"));
      }
    }
  }

  /// The wrapped cache, read-only (mutate through this wrapper so the ids stay in step).
  [[nodiscard]] const C& cache() const noexcept { return cache_; }

  /// Token ids committed for `seq`. @throws batch_error.
  [[nodiscard]] std::span<const token_id> tokens(std::size_t seq) const {
    detail::check_seq(kName, seq, tokens_.size());
    return tokens_[seq];
  }

  /// Length of the longest common prefix of tokens(seq) and `prompt`. O(prefix).
  [[nodiscard]] std::size_t common_prefix(std::size_t seq, std::span<const token_id> prompt) const {
    const auto held = tokens(seq);
    const auto [a, b] = std::mismatch(held.begin(), held.end(), prompt.begin(), prompt.end());
    return static_cast<std::size_t>(a - held.begin());
  }

  /// Prepares `seq` for `prompt`: crops it to the longest prefix of its committed tokens that
  /// `prompt` starts with, capped at prompt.size() - 1 so that at least one prompt token is left
  /// to run (its logits start the reply). Where the policy cannot crop there (a sliding window
  /// that already evicted what the new length needs), the sequence is reset instead.
  /// @return the number of leading prompt tokens whose K/V are cached and must not be recomputed.
  /// @post seq_length(seq) == tokens(seq).size() == the returned count.
  /// @throws batch_error.
  [[nodiscard]] std::size_t reuse_prefix(std::size_t seq, std::span<const token_id> prompt) {
    std::size_t keep = common_prefix(seq, prompt);
    if (!prompt.empty()) keep = std::min(keep, prompt.size() - 1);
    if (cache_.can_crop(seq, keep)) {
      crop(seq, keep);
    } else {
      reset(seq);
      keep = 0;
    }
    return keep;
  }

  /// Records the ids of tokens whose K/V were just appended to every layer of `seq`.
  /// @throws batch_error; position_error unless every layer holds exactly
  ///         tokens(seq).size() + ids.size() tokens (nothing is recorded then).
  void commit(std::size_t seq, std::span<const token_id> ids) {
    detail::check_seq(kName, seq, tokens_.size());
    const std::size_t want = tokens_[seq].size() + ids.size();
    for (std::size_t l = 0; l < cache_.shape().num_layers; ++l) {
      if (cache_.layer_length(l, seq) != want) {
        throw position_error(detail::message(
            kName, ": commit of ", ids.size(), " ids to sequence ", seq, " (", tokens_[seq].size(),
            " committed) but layer ", l, " holds ", cache_.layer_length(l, seq), " tokens"));
      }
    }
    tokens_[seq].insert(tokens_[seq].end(), ids.begin(), ids.end());
  }

  // CacheConcept, forwarded. crop and reset also trim the recorded ids.
  template <class U>
  void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
    cache_.append(layer, seq, k, v);
  }
  [[nodiscard]] view_type view(std::size_t layer, std::size_t seq) const {
    return cache_.view(layer, seq);
  }
  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    return cache_.layer_length(layer, seq);
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return cache_.seq_length(seq); }
  [[nodiscard]] std::size_t capacity() const noexcept { return cache_.capacity(); }
  [[nodiscard]] std::size_t max_batch() const noexcept { return cache_.max_batch(); }
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return cache_.memory_bytes(); }
  /// Frees the wrapped cache's spare storage (DynamicCache's spare chunks; nothing for a
  /// policy without spares). No token changes.
  void shrink_to_fit() noexcept {
    if constexpr (requires { cache_.shrink_to_fit(); }) cache_.shrink_to_fit();
  }
  [[nodiscard]] CacheShape shape() const noexcept { return cache_.shape(); }
  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const {
    return cache_.can_crop(seq, n);
  }
  void crop(std::size_t seq, std::size_t n) {
    cache_.crop(seq, n);
    auto& ids = tokens_[seq];
    ids.resize(std::min(ids.size(), n));
  }
  void reset(std::size_t seq) {
    cache_.reset(seq);
    tokens_[seq].clear();
  }

  /// Snapshot restore hook: restores the listed layers through the wrapped policy's
  /// restore(entries) and sets the committed ids of each sequence in `tokens`; other sequences
  /// are untouched. Strong guarantee: the ids are copied before the policy is touched, and the
  /// policy's restore changes nothing when it throws.
  /// @pre every sequence named by `entries` appears in `tokens` exactly once.
  /// @post tokens(t.seq) equals t.ids for each t in `tokens`.
  /// @throws batch_error, shape_error (a sequence of `entries` without ids, or named twice),
  ///         position_error (more ids than a layer of the sequence holds after the restore),
  ///         whatever C::restore throws, std::bad_alloc.
  void restore(std::span<const LayerRestore<value_type>> entries,
               std::span<const SequenceTokens> tokens) requires
      requires(C& c, std::span<const LayerRestore<value_type>> e) {
    c.restore(e);
  }
  {
    const std::size_t num_layers = cache_.shape().num_layers;
    std::vector<const SequenceTokens*> ids_of(tokens_.size(), nullptr);
    for (const SequenceTokens& t : tokens) {
      detail::check_seq(kName, t.seq, tokens_.size());
      if (ids_of[t.seq] != nullptr) {
        throw shape_error(
            detail::message(kName, ": restore names the ids of sequence ", t.seq, " twice"));
      }
      ids_of[t.seq] = &t;
    }
    // Each layer's length after the restore: the entry's, else the current one.
    std::vector<std::size_t> length(num_layers * tokens_.size());
    for (const SequenceTokens& t : tokens) {
      for (std::size_t l = 0; l < num_layers; ++l) {
        length[l * tokens_.size() + t.seq] = cache_.layer_length(l, t.seq);
      }
    }
    for (const auto& e : entries) {
      if (e.seq >= tokens_.size() || e.layer >= num_layers) continue;  // C::restore refuses it
      if (ids_of[e.seq] == nullptr) {
        throw shape_error(
            detail::message(kName, ": restore of sequence ", e.seq, " without its token ids"));
      }
      if (e.length >= 0) {
        length[e.layer * tokens_.size() + e.seq] = static_cast<std::size_t>(e.length);
      }
    }
    for (const SequenceTokens& t : tokens) {
      for (std::size_t l = 0; l < num_layers; ++l) {
        const std::size_t len = length[l * tokens_.size() + t.seq];
        if (t.ids.size() > len) {
          throw position_error(detail::message(kName, ": restore of ", t.ids.size(),
                                               " token ids into sequence ", t.seq, " but layer ", l,
                                               " will hold ", len, " tokens"));
        }
      }
    }
    std::vector<std::vector<token_id>> copies;
    copies.reserve(tokens.size());
    for (const SequenceTokens& t : tokens) copies.emplace_back(t.ids.begin(), t.ids.end());
    cache_.restore(entries);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens_[tokens[i].seq].swap(copies[i]);
  }

 private:
  static constexpr const char* kName = "TokenTrackedCache";

  C cache_;
  std::vector<std::vector<token_id>> tokens_;
};

}  // namespace kvcache
