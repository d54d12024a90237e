// SPDX-License-Identifier: Apache-2.0
// The four KV-cache scenarios of the demo, each run cached and uncached side by side in one
// process and checked token for token: multi-turn chat, one system prompt serving many requests,
// questions over one long document (RAG), and sliding-window generation past the model's seq_len.
// Chat, system prompt and RAG run on any policy: through a TokenTrackedCache that reuses what its
// sequence already holds, or, with the paged policy, by automatic prefix caching (each request
// submits its whole prompt and the cache finds how much of it is already there).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/policy/sliding_window_cache.hpp"
#include "kvcache/policy/token_tracked_cache.hpp"
#include "llama/caches.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/sampler.hpp"
#include "llama/tokenizer.hpp"

namespace llama {

/// An endless stream of prompt tokens: a built-in English text encoded with the tokenizer and
/// cycled, or (without a tokenizer) seeded pseudo-random ids in [3, vocab) (never BOS/EOS).
class PromptSource {
 public:
  /// @param tokenizer used when non-null and its vocabulary matches the model's.
  PromptSource(const Tokenizer* tokenizer, std::size_t vocab_size, std::uint64_t seed = 1)
      : vocab_(vocab_size), state_(seed * 0x9E3779B97F4A7C15ull | 1) {
    if (tokenizer != nullptr && tokenizer->vocab_size() == vocab_size) {
      text_ = tokenizer->encode(kText, false, false);
    }
  }

  /// True when the tokens come from real text.
  [[nodiscard]] bool is_text() const noexcept { return !text_.empty(); }

  /// The next n tokens of the stream.
  [[nodiscard]] std::vector<token_id> take(std::size_t n) {
    std::vector<token_id> out(n);
    for (auto& t : out) {
      if (!text_.empty()) {
        t = text_[at_++ % text_.size()];
      } else {
        state_ ^= state_ >> 12;
        state_ ^= state_ << 25;
        state_ ^= state_ >> 27;
        const std::uint64_t r = state_ * 0x2545F4914F6CDD1Dull;
        t = vocab_ > 3 ? static_cast<token_id>(3 + (r >> 11) % (vocab_ - 3))
                       : static_cast<token_id>((r >> 11) % vocab_);
      }
    }
    return out;
  }

 private:
  static constexpr std::string_view kText =
      "Tom had a small red boat. Every morning he took it to the pond behind his house and "
      "watched it float on the water. One day the wind was very strong, and the boat sailed far "
      "away to the other side of the pond. Tom ran around the pond as fast as he could. A big "
      "frog sat next to the boat. \"Is this your boat?\" asked the frog. Tom said yes and thanked "
      "the frog. They played together until the sun went down. The next day Sara came to the "
      "pond too. She had a blue kite with a long tail. Tom showed her how the boat could turn "
      "when the wind blew on its sail, and Sara let Tom fly the kite. Their mom called them home "
      "for dinner, and they told her all about the frog, the boat and the kite. ";

  std::vector<token_id> text_;
  std::size_t at_ = 0;
  std::size_t vocab_;
  std::uint64_t state_;
};

/// One request (chat turn, system-prompt request, RAG question) served both ways.
struct RequestRow {
  std::size_t prompt_tokens = 0;    ///< the whole prompt (history, system + user, doc + question)
  std::size_t cached_computed = 0;  ///< prompt tokens the cached path ran (the rest reused)
  double ttft_cached_s = 0, ttft_uncached_s = 0;
  double decode_cached_tps = 0, decode_uncached_tps = 0;
  std::size_t cache_bytes = 0;       ///< the cache's memory_bytes() after the request
  bool identical = false;            ///< the same tokens both ways
  std::vector<token_id> reply = {};  ///< what the cached path generated
};

/// A chat, system-prompt or RAG run.
struct RequestsResult {
  std::string cache = {};         ///< policy name
  std::size_t prefix_tokens = 0;  ///< system prompt / document (0 for chat)
  double prefix_s = 0;            ///< its one-off prefill (0 with automatic prefix caching)
  std::vector<RequestRow> rows = {};
  /// Paged policy only: the prefix cache's counters after the last request, and the blocks the
  /// sequences then alive would hold without sharing (their block tables' entries).
  std::optional<kvcache::PrefixCacheStats> prefix_stats = std::nullopt;
  std::size_t blocks_unshared = 0;

  [[nodiscard]] bool all_identical() const noexcept {
    return std::all_of(rows.begin(), rows.end(), [](const RequestRow& r) { return r.identical; });
  }
};

/// Serves `prompt` cached (on sequence `seq` of `cache`: a TokenTrackedCache, or a prefix cache
/// whose sequence is empty) and uncached, and records both.
template <class TC>
RequestRow serve_both_ways(Engine& engine, TC& cache, std::span<const token_id> prompt,
                           std::size_t reply_tokens, Sampler& cached_sampler,
                           Sampler& uncached_sampler, std::size_t seq = 0) {
  const GenerateLimits limits{.max_new = reply_tokens};
  const Generation c = generate(engine, cache, seq, prompt, limits, cached_sampler);
  // The uncached passes store each pass's K/V in the cache's format, as the cache stores it.
  const ModelConfig& m = engine.model().config();
  kvcache::DynamicCache<typename TC::value_type> scratch({.num_layers = m.num_layers,
                                                          .num_kv_heads = m.num_kv_heads,
                                                          .head_dim = m.head_dim(),
                                                          .chunk_len = 256});
  const Generation u = generate_uncached(engine, prompt, limits, uncached_sampler,
                                         attention_window(cache), &scratch);
  return {.prompt_tokens = prompt.size(),
          .cached_computed = c.prompt_computed,
          .ttft_cached_s = c.ttft_s,
          .ttft_uncached_s = u.ttft_s,
          .decode_cached_tps = c.decode_tokens_per_s(),
          .decode_uncached_tps = u.decode_tokens_per_s(),
          .cache_bytes = cache.memory_bytes(),
          .identical = c.tokens == u.tokens,
          .reply = c.tokens};
}

/// Scenario 1: a chat of `turns` turns. Each turn adds `user_tokens` user tokens and a reply of
/// `reply_tokens`; cached, the cache keeps the history and only the new tokens run; uncached,
/// the whole history is prefilled again every turn.
struct ChatOptions {
  std::size_t turns = 6;
  std::size_t user_tokens = 48;
  std::size_t reply_tokens = 8;
  CacheKind cache = CacheKind::dynamic;
  CacheParams params = {};
  SamplerConfig sampler = {};
};

inline RequestsResult run_chat(Engine& engine, PromptSource& source, const ChatOptions& o,
                               const Progress& progress = {}) {
  CacheParams params = o.params;
  params.max_seq_len = 1 + o.turns * (o.user_tokens + o.reply_tokens);
  // A prefix cache gets each turn's whole history: its sequence is released after a turn, and
  // the next turn's admit() finds the history's full blocks still cached.
  auto turns = [&](auto& cache) {
    Sampler cached_sampler(o.sampler), uncached_sampler(o.sampler);
    RequestsResult result{.cache = std::string(cache_kind_name(o.cache))};
    std::vector<token_id> history{kBos};
    for (std::size_t turn = 0; turn < o.turns; ++turn) {
      if (progress) progress("turn " + std::to_string(turn + 1) + "/" + std::to_string(o.turns));
      const auto user = source.take(o.user_tokens);
      history.insert(history.end(), user.begin(), user.end());
      if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(cache)>>) {
        cache.release(0);
      }
      result.rows.push_back(serve_both_ways(engine, cache, history, o.reply_tokens, cached_sampler,
                                            uncached_sampler));
      const auto& reply = result.rows.back().reply;
      history.insert(history.end(), reply.begin(), reply.end());
    }
    if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(cache)>>) {
      result.prefix_stats = cache.stats();
      result.blocks_unshared = cache.block_table(0).size();
    }
    return result;
  };
  return with_cache(o.cache, engine.model(), params, [&](auto& raw) {
    if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(raw)>>) {
      return turns(raw);
    } else {
      kvcache::TokenTrackedCache tracked(std::move(raw));
      return turns(tracked);
    }
  });
}

/// Scenarios 2 and 3: one shared prefix (a system prompt, a long document), then `requests`
/// requests that each append their own `suffix_tokens` (user message, question) and generate
/// `reply_tokens`. Uncached, each request prefills prefix + suffix from scratch. Cached with a
/// TokenTrackedCache, the prefix is prefilled once up front and every request starts from its
/// K/V (the tracked cache crops the previous request away, never recomputing the prefix). Cached
/// with the paged policy (automatic prefix caching), nothing is prefilled up front: each request
/// submits its whole prompt on a sequence of its own, held until the end; the first computes the
/// prefix, the later ones find it cached and share its blocks. Identical tokens both ways show
/// that no request sees another's K/V.
struct SharedPrefixOptions {
  std::size_t prefix_tokens = 384;
  std::size_t requests = 6;
  std::size_t suffix_tokens = 32;
  std::size_t reply_tokens = 8;
  CacheKind cache = CacheKind::static_cache;
  CacheParams params = {};
  SamplerConfig sampler = {};
};

inline RequestsResult run_shared_prefix(Engine& engine, PromptSource& source,
                                        const SharedPrefixOptions& o,
                                        const Progress& progress = {}) {
  CacheParams params = o.params;
  params.max_seq_len = std::max<std::size_t>(1, o.prefix_tokens) + o.suffix_tokens + o.reply_tokens;
  if (o.cache == CacheKind::paged) params.max_batch = std::max<std::size_t>(1, o.requests);
  std::vector<token_id> prefix{kBos};
  const auto body = source.take(o.prefix_tokens > 1 ? o.prefix_tokens - 1 : 0);
  prefix.insert(prefix.end(), body.begin(), body.end());
  auto requests = [&](auto& cache, RequestsResult& result) {
    constexpr bool kPrefixCache = kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(cache)>>;
    for (std::size_t r = 0; r < o.requests; ++r) {
      if (progress) {
        progress("request " + std::to_string(r + 1) + "/" + std::to_string(o.requests));
      }
      std::vector<token_id> prompt = prefix;
      const auto suffix = source.take(o.suffix_tokens);
      prompt.insert(prompt.end(), suffix.begin(), suffix.end());
      Sampler cached_sampler(o.sampler), uncached_sampler(o.sampler);
      result.rows.push_back(serve_both_ways(engine, cache, prompt, o.reply_tokens, cached_sampler,
                                            uncached_sampler, kPrefixCache ? r : 0));
    }
    if constexpr (kPrefixCache) {
      result.prefix_stats = cache.stats();
      for (std::size_t r = 0; r < o.requests; ++r) {
        result.blocks_unshared += cache.block_table(r).size();
      }
    }
  };
  return with_cache(o.cache, engine.model(), params, [&](auto& raw) {
    RequestsResult result{.cache = std::string(cache_kind_name(o.cache)),
                          .prefix_tokens = prefix.size()};
    if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(raw)>>) {
      requests(raw, result);
    } else {
      kvcache::TokenTrackedCache tracked(std::move(raw));
      if (progress) progress("prefill of the " + std::to_string(prefix.size()) + "-token prefix");
      const double t0 = now_s();
      engine.forward(tracked, 0, prefix);
      tracked.commit(0, prefix);
      result.prefix_s = now_s() - t0;
      requests(tracked, result);
    }
    return result;
  });
}

/// Scenario 4: generation far past the model's seq_len in a SlidingWindowCache (window +
/// attention sinks, constant memory), at absolute or cache-relative positions. At each
/// checkpoint the next-token logits are recomputed without a cache over the whole sequence,
/// attending to the same window and sinks at the same positions, and compared bit for bit with
/// the cached ones (attention gives the same bits over a ring view as over the uncached pass's
/// contiguous K/V, and the engine's GEMMs do not depend on the batch). Whether the text stays
/// coherent is llama/streaming.hpp's measurement.
struct SlidingOptions {
  std::size_t prompt_tokens = 64;
  std::size_t generate_tokens = 0;  ///< 0: three times the model's seq_len
  std::size_t window = 256;
  std::size_t num_sink_tokens = 4;
  std::size_t max_append_len = 64;
  std::size_t checkpoints = 6;
  /// cache_relative: sinks and window at positions within the cache (StreamingLLM).
  kvcache::PositionMode positions = kvcache::PositionMode::absolute;
  SamplerConfig sampler = {};
};

/// One checkpoint of the sliding run.
struct SlidingPoint {
  std::size_t length = 0;            ///< tokens in the sequence
  std::size_t memory_bytes = 0;      ///< the sliding cache's memory_bytes()
  std::size_t full_cache_bytes = 0;  ///< K/V of all `length` tokens (what a full cache holds)
  double uncached_step_s = 0;        ///< one cache-less forward pass over the sequence
  bool identical = false;            ///< the same logits bit for bit, cached and uncached
  bool argmax_match = false;         ///< the same next token (greedy)
  float max_logit_diff = 0;
};

struct SlidingResult {
  std::size_t seq_len = 0, window = 0, num_sink_tokens = 0, generated = 0;
  kvcache::PositionMode positions = kvcache::PositionMode::absolute;
  double ttft_cached_s = 0, ttft_uncached_s = 0;
  double decode_cached_tps = 0;
  std::vector<SlidingPoint> points = {};
  std::vector<token_id> sequence = {};  ///< prompt and generated tokens

  [[nodiscard]] bool all_identical() const noexcept {
    return std::all_of(points.begin(), points.end(),
                       [](const SlidingPoint& p) { return p.identical; });
  }
};

/// @post engine.positions() is as before the call.
inline SlidingResult run_sliding(Engine& engine, PromptSource& source, const SlidingOptions& o,
                                 const Progress& progress = {}) {
  const ScopedPositions scoped(engine, o.positions);
  const Model& model = engine.model();
  const ModelConfig& c = model.config();
  kvcache::SlidingWindowCache<float> cache({.num_layers = c.num_layers,
                                            .num_kv_heads = c.num_kv_heads,
                                            .head_dim = c.head_dim(),
                                            .window = o.window,
                                            .num_sink_tokens = o.num_sink_tokens,
                                            .max_append_len = o.max_append_len});
  {
    SlidingResult result{.seq_len = model.config().seq_len,
                         .window = o.window,
                         .num_sink_tokens = o.num_sink_tokens,
                         .positions = o.positions};
    const std::size_t total =
        o.generate_tokens != 0 ? o.generate_tokens : 3 * model.config().seq_len;
    const AttentionWindow window = attention_window(cache);
    std::vector<token_id> seq{kBos};
    const auto body = source.take(o.prompt_tokens > 1 ? o.prompt_tokens - 1 : 0);
    seq.insert(seq.end(), body.begin(), body.end());
    Sampler sampler(o.sampler);

    auto check_point = [&](std::span<const float> cached_logits) {
      SlidingPoint p{.length = seq.size(),
                     .memory_bytes = cache.memory_bytes(),
                     .full_cache_bytes = kvcache::kv_cache_bytes(cache.shape(), seq.size())};
      const double t0 = now_s();
      const std::span<const float> u = engine.forward_uncached(seq, window);
      p.uncached_step_s = now_s() - t0;
      p.identical = u.size() == cached_logits.size() &&
                    std::memcmp(u.data(), cached_logits.data(), u.size_bytes()) == 0;
      p.argmax_match = Sampler::argmax(u) == Sampler::argmax(cached_logits);
      for (std::size_t i = 0; i < u.size(); ++i) {
        p.max_logit_diff = std::max(p.max_logit_diff, std::abs(u[i] - cached_logits[i]));
      }
      return p;
    };

    double t0 = now_s();
    std::vector<float> logits;
    {
      const auto l = engine.forward(cache, 0, seq);
      logits.assign(l.begin(), l.end());
    }
    token_id next = sampler.sample(logits);
    result.ttft_cached_s = now_s() - t0;
    t0 = now_s();
    {
      const auto u = engine.forward_uncached(seq, window);
      (void)Sampler::argmax(u);
    }
    result.ttft_uncached_s = now_s() - t0;
    result.points.push_back(check_point(logits));

    const std::size_t every =
        std::max<std::size_t>(1, total / std::max<std::size_t>(1, o.checkpoints));
    double decode_s = 0;
    for (std::size_t i = 1; i < total; ++i) {
      seq.push_back(next);
      const double s0 = now_s();
      const auto l = engine.forward(cache, 0, std::span<const token_id>(&seq.back(), 1));
      logits.assign(l.begin(), l.end());
      next = sampler.sample(logits);
      decode_s += now_s() - s0;
      if (i % every == 0 || i + 1 == total) {
        if (progress) {
          progress("token " + std::to_string(i + 1) + "/" + std::to_string(total) + " (position " +
                   std::to_string(seq.size()) + ")");
        }
        result.points.push_back(check_point(logits));
      }
    }
    seq.push_back(next);
    result.generated = total;
    result.sequence = std::move(seq);
    result.decode_cached_tps = total > 1 ? static_cast<double>(total - 1) / decode_s : 0.0;
    return result;
  }
}

}  // namespace llama
