// SPDX-License-Identifier: Apache-2.0
// Long generation that stays coherent, measured: the perplexity of a stream of stories that a
// model samples itself, scored past its training length four ways (each story in its own
// context; one full cache; a sliding window with sinks at absolute positions; the same window at
// cache-relative positions, StreamingLLM). One algorithm for the demo and the tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/policy/dynamic_cache.hpp"
#include "kvcache/policy/sliding_window_cache.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/sampler.hpp"
#include "llama/tokenizer.hpp"

namespace llama {

/// The stream and the caches it is scored through.
struct StreamingOptions {
  std::size_t window = 256;
  std::size_t num_sink_tokens = 4;
  std::size_t story_max_tokens = 200;  ///< sampled after each story's BOS (fewer at a BOS)
  std::size_t stream_min_tokens = 4000;
  std::size_t scored_from = 0;  ///< the first position scored (0: the model's seq_len)
  /// How the stories are sampled (temperature 1: the model's own distribution).
  SamplerConfig sampler = {.temperature = 1.0f, .seed = 260};
  /// After the stream, a new story (BOS, then at most this many tokens, stopping at BOS) is
  /// sampled with `sampler` through (c) and through (d), from where each left off.
  std::size_t continuation_tokens = 0;
};

/// Perplexities over the stream's positions [scored_from, stream_tokens), named (a) to (d) as
/// in the demo; (a) is the reference.
struct StreamingResult {
  std::size_t stream_tokens = 0, num_stories = 0, scored_from = 0;
  std::size_t window = 0, num_sink_tokens = 0;
  double in_story = 0;         ///< (a) each story in its own context, positions from its BOS
  double full_absolute = 0;    ///< (b) one full cache, absolute positions
  double window_absolute = 0;  ///< (c) sliding window + sinks, absolute positions
  double window_relative = 0;  ///< (d) sliding window + sinks, cache-relative positions
  /// BOS and the tokens sampled after the stream through (c) and (d) (continuation_tokens).
  std::vector<token_id> continuation_absolute = {}, continuation_relative = {};
  double seconds = 0;  ///< wall time of the whole evaluation
};

/// -log p(next | logits), in double.
[[nodiscard]] inline double next_token_nll(std::span<const float> logits, token_id next) {
  double max = logits[0];
  for (float x : logits) max = std::max(max, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return std::log(sum) + max - static_cast<double>(logits[static_cast<std::size_t>(next)]);
}

namespace detail {

/// Sum of -log p(stream[p] | stream[..p)) over p >= scored_from, decoding the stream token by
/// token through sequence 0 of `cache`.
template <class Cache>
double stream_nll(Engine& engine, Cache& cache, const std::vector<token_id>& stream,
                  std::size_t scored_from) {
  double total = 0.0;
  for (std::size_t p = 0; p + 1 < stream.size(); ++p) {
    const auto logits = engine.forward(cache, 0, {&stream[p], 1});
    if (p + 1 >= scored_from) total += next_token_nll(logits, stream[p + 1]);
  }
  return total;
}

/// Feeds `last` (the stream's last token, not yet in `cache`), then BOS, and samples at most
/// `max_tokens` more, stopping at BOS. @return BOS and the tokens sampled.
template <class Cache>
std::vector<token_id> continue_stream(Engine& engine, Cache& cache, token_id last,
                                      std::size_t max_tokens, const SamplerConfig& config) {
  Sampler sampler(config);
  engine.forward(cache, 0, {&last, 1});
  std::vector<token_id> out{kBos};
  while (out.size() <= max_tokens) {
    const token_id next = sampler.sample(engine.forward(cache, 0, {&out.back(), 1}));
    if (next == kBos) break;
    out.push_back(next);
  }
  return out;
}

}  // namespace detail

/// Samples stories from `engine`'s model (each in a fresh cache: BOS, then at most
/// story_max_tokens, ending early at the model's own BOS) until they hold stream_min_tokens,
/// joins them into one stream and scores every position >= scored_from (a) story by story, (b)
/// through one DynamicCache, (c) and (d) through a SlidingWindowCache (window, num_sink_tokens;
/// one token per step), (c) at absolute and (d) at cache-relative positions. The engine's
/// position mode is restored on return.
/// O(stream_tokens x forward step) five times over; stories260K: a few seconds on one core.
/// @throws usage_error when stream_min_tokens does not exceed the first position scored, or for
///         a bad sampler config; as Engine::forward.
inline StreamingResult evaluate_streaming(Engine& engine, const StreamingOptions& o,
                                          const Progress& progress = {}) {
  const double t0 = now_s();
  const ModelConfig& c = engine.model().config();
  const std::size_t scored_from = o.scored_from != 0 ? o.scored_from : c.seq_len;
  if (o.stream_min_tokens <= scored_from) {
    throw usage_error("evaluate_streaming: stream_min_tokens " +
                      std::to_string(o.stream_min_tokens) + " must exceed the first position " +
                      "scored, " + std::to_string(scored_from));
  }
  const kvcache::DynamicCacheConfig dynamic_config{
      .num_layers = c.num_layers, .num_kv_heads = c.num_kv_heads, .head_dim = c.head_dim()};
  const ScopedPositions restore(engine, kvcache::PositionMode::absolute);
  StreamingResult r{
      .scored_from = scored_from, .window = o.window, .num_sink_tokens = o.num_sink_tokens};
  auto say = [&](const std::string& what) {
    if (progress) progress(what);
  };
  say("sampling a stream of stories");
  Sampler sampler(o.sampler);
  std::vector<std::vector<token_id>> stories;
  std::vector<token_id> stream;
  while (stream.size() < o.stream_min_tokens) {
    kvcache::DynamicCache<float> cache(dynamic_config);
    std::vector<token_id> story{kBos};
    while (story.size() <= o.story_max_tokens) {
      const token_id next = sampler.sample(engine.forward(cache, 0, {&story.back(), 1}));
      if (next == kBos) break;
      story.push_back(next);
    }
    stream.insert(stream.end(), story.begin(), story.end());
    stories.push_back(std::move(story));
  }
  r.stream_tokens = stream.size();
  r.num_stories = stories.size();

  say("(a) each story in its own context");
  double in_story = 0.0;
  std::size_t start = 0;  // the stream position of the story's BOS
  for (const auto& story : stories) {
    kvcache::DynamicCache<float> cache(dynamic_config);
    for (std::size_t i = 0; i < story.size(); ++i) {
      const std::size_t p = start + i;
      const auto logits = engine.forward(cache, 0, {&story[i], 1});
      if (p + 1 < stream.size() && p + 1 >= r.scored_from) {
        in_story += next_token_nll(logits, stream[p + 1]);
      }
    }
    start += story.size();
  }
  say("(b) one full cache, absolute positions");
  kvcache::DynamicCache<float> full(dynamic_config);
  const double full_absolute = detail::stream_nll(engine, full, stream, r.scored_from);

  const kvcache::SlidingWindowCacheConfig sliding_config{.num_layers = c.num_layers,
                                                         .num_kv_heads = c.num_kv_heads,
                                                         .head_dim = c.head_dim(),
                                                         .window = o.window,
                                                         .num_sink_tokens = o.num_sink_tokens,
                                                         .max_append_len = 1};
  say("(c) sliding window, absolute positions");
  kvcache::SlidingWindowCache<float> sliding_absolute(sliding_config);
  const double window_absolute =
      detail::stream_nll(engine, sliding_absolute, stream, r.scored_from);
  if (o.continuation_tokens > 0) {
    r.continuation_absolute = detail::continue_stream(engine, sliding_absolute, stream.back(),
                                                      o.continuation_tokens, o.sampler);
  }
  say("(d) sliding window, cache-relative positions");
  engine.set_positions(kvcache::PositionMode::cache_relative);
  kvcache::SlidingWindowCache<float> sliding_relative(sliding_config);
  const double window_relative =
      detail::stream_nll(engine, sliding_relative, stream, r.scored_from);
  if (o.continuation_tokens > 0) {
    r.continuation_relative = detail::continue_stream(engine, sliding_relative, stream.back(),
                                                      o.continuation_tokens, o.sampler);
  }

  const auto scored = static_cast<double>(stream.size() - r.scored_from);
  const auto ppl = [&](double sum) { return std::exp(sum / scored); };
  r.in_story = ppl(in_story);
  r.full_absolute = ppl(full_absolute);
  r.window_absolute = ppl(window_absolute);
  r.window_relative = ppl(window_relative);
  r.seconds = now_s() - t0;
  return r;
}

}  // namespace llama
