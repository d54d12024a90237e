// SPDX-License-Identifier: Apache-2.0
// Timed generation loops over the Engine: with a KV cache (a TokenTrackedCache sequence that
// reuses whatever prefix of the prompt it already holds, or a prefix-caching cache that finds
// the longest cached prefix of the prompt among all earlier requests) and without one (every
// token from a full forward pass over the whole sequence). All report TTFT and decode time.
// Also what the scenarios built on them share: the progress callback, a scoped position mode.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/policy/token_tracked_cache.hpp"
#include "llama/forward.hpp"
#include "llama/sampler.hpp"

namespace llama {

/// Called with a short status line while a scenario works ("chat: turn 3/6").
using Progress = std::function<void(const std::string&)>;

/// Seconds on a monotonic clock.
[[nodiscard]] inline double now_s() noexcept {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Sets an engine's position mode for a scope and restores the previous one on exit.
class ScopedPositions {
 public:
  ScopedPositions(Engine& engine, kvcache::PositionMode mode) noexcept
      : engine_(engine), previous_(engine.positions()) {
    engine.set_positions(mode);
  }
  ScopedPositions(const ScopedPositions&) = delete;
  ScopedPositions& operator=(const ScopedPositions&) = delete;
  ~ScopedPositions() { engine_.set_positions(previous_); }

 private:
  Engine& engine_;
  kvcache::PositionMode previous_;
};

/// What one request produced, and how long it took.
struct Generation {
  std::vector<token_id> tokens;     ///< generated tokens (a stop token is not included)
  std::size_t prompt_tokens = 0;    ///< tokens in the prompt
  std::size_t prompt_computed = 0;  ///< prompt tokens run through the model (the rest reused)
  double ttft_s = 0.0;              ///< prompt processing up to the first token sampled
  double decode_s = 0.0;            ///< every later token
  std::vector<float> first_logits;  ///< logits the first token was sampled from

  /// Tokens per second after the first (0 when there were none).
  [[nodiscard]] double decode_tokens_per_s() const noexcept {
    return tokens.size() > 1 && decode_s > 0 ? static_cast<double>(tokens.size() - 1) / decode_s
                                             : 0.0;
  }
};

/// Generation limits: at most max_new tokens; stops early (excluding it) at a token of `stop`.
struct GenerateLimits {
  std::size_t max_new = 16;
  std::span<const token_id> stop = {};
  [[nodiscard]] bool stops(token_id t) const noexcept {
    return std::find(stop.begin(), stop.end(), t) != stop.end();
  }
};

namespace detail {

/// The timed loop every generate variant shares. `prefill(g)` runs what is needed of the prompt,
/// sets g.prompt_computed and returns the logits after it; `feed(t)` runs the sampled token t
/// (the latest of g.tokens) and returns the logits after it. TTFT covers prefill and the first
/// sample; decode covers the rest. Stops at limits.max_new tokens (the last is sampled, never
/// fed) or before a stop token.
template <class Prefill, class Feed>
Generation timed_generation(std::span<const token_id> prompt, const GenerateLimits& limits,
                            Sampler& sampler, Prefill&& prefill, Feed&& feed) {
  Generation g;
  g.prompt_tokens = prompt.size();
  const double t0 = now_s();
  std::span<const float> logits = prefill(g);
  g.first_logits.assign(logits.begin(), logits.end());
  token_id next = sampler.sample(logits);
  g.ttft_s = now_s() - t0;
  const double t1 = now_s();
  while (limits.max_new > 0 && !limits.stops(next)) {
    g.tokens.push_back(next);
    if (g.tokens.size() == limits.max_new) break;
    logits = feed(next);
    next = sampler.sample(logits);
  }
  g.decode_s = now_s() - t1;
  return g;
}

}  // namespace detail

/// Serves `prompt` on sequence `seq` of a token-tracked cache: keeps the longest prefix of the
/// prompt the sequence already holds (TokenTrackedCache::reuse_prefix: tokens of an earlier
/// request that the prompt does not start with are dropped first), runs the rest as one
/// prefill, then decodes one token at a time, committing every token it appends.
/// @pre !prompt.empty(). @throws as Engine::forward.
template <kvcache::CacheConcept C>
Generation generate(Engine& engine, kvcache::TokenTrackedCache<C>& cache, std::size_t seq,
                    std::span<const token_id> prompt, const GenerateLimits& limits,
                    Sampler& sampler) {
  return detail::timed_generation(
      prompt, limits, sampler,
      [&](Generation& g) {
        const auto fresh = prompt.subspan(cache.reuse_prefix(seq, prompt));
        g.prompt_computed = fresh.size();
        const std::span<const float> logits = engine.forward(cache, seq, fresh);
        cache.commit(seq, fresh);
        return logits;
      },
      [&](const token_id& t) {
        const std::span<const token_id> one(&t, 1);
        const std::span<const float> logits = engine.forward(cache, seq, one);
        cache.commit(seq, one);
        return logits;
      });
}

/// Serves `prompt` on the empty sequence `seq` of a prefix-caching cache (PagedCache):
/// admit() shares the K/V of the longest cached prefix of the prompt, whichever earlier request
/// computed it (confirmed token by token), the rest runs as one prefill, then one token at a
/// time, each sampled token's id registered before its K/V so that the blocks it completes are
/// indexed for later prompts too. The sequence is left holding the prompt and the reply (all
/// but its last token); release() it when the request is over.
/// @pre !prompt.empty(). @throws as admit() (position_error when seq is not empty,
///      capacity_error) and Engine::forward.
template <kvcache::PrefixCacheConcept C>
Generation generate(Engine& engine, C& cache, std::size_t seq, std::span<const token_id> prompt,
                    const GenerateLimits& limits, Sampler& sampler) {
  return detail::timed_generation(
      prompt, limits, sampler,
      [&](Generation& g) {
        const std::size_t reused = cache.admit(seq, prompt);
        g.prompt_computed = prompt.size() - reused;
        return engine.forward(cache, seq, prompt.subspan(reused));
      },
      [&](const token_id& t) {
        const std::span<const token_id> one(&t, 1);
        cache.add_tokens(seq, one);
        return engine.forward(cache, seq, one);
      });
}

/// The same request without a KV cache: the first token from a forward pass over the prompt,
/// each later one from a forward pass over prompt + everything generated so far (attending with
/// `window` where given, so it can stand in for a sliding window cache).
/// @pre !prompt.empty(). @throws as Engine::forward.
/// Each pass's K/V is held in float (the engine's scratch cache), or in `scratch`, a cache of the
/// storage format to recompute.
template <class Scratch = void>
Generation generate_uncached(Engine& engine, std::span<const token_id> prompt,
                             const GenerateLimits& limits, Sampler& sampler,
                             const AttentionWindow& window = {}, Scratch* scratch = nullptr) {
  std::vector<token_id> all(prompt.begin(), prompt.end());
  auto pass = [&] {
    if constexpr (std::is_void_v<Scratch>) {
      return engine.forward_uncached(all, window);
    } else {
      return engine.forward_uncached(*scratch, all, window);
    }
  };
  return detail::timed_generation(
      prompt, limits, sampler,
      [&](Generation& g) {
        g.prompt_computed = prompt.size();
        return pass();
      },
      [&](token_id t) {
        all.push_back(t);
        return pass();
      });
}

}  // namespace llama
