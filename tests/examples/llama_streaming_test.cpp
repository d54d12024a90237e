// SPDX-License-Identifier: Apache-2.0
// Long generation that stays coherent: on a stream of stories sampled from stories260K itself
// (trained on 512 tokens), a sliding window with attention sinks and cache-relative positions
// (StreamingLLM) keeps the model's perplexity within 10% of each story scored in its own context,
// far past the training length; absolute positions do not. Also: cache-relative decode equals an
// uncached pass with the same window and positions, bit for bit.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/sampler.hpp"
#include "llama/tokenizer.hpp"
#include "support/catch.hpp"

using namespace kvcache;
using llama::token_id;

namespace {

const std::filesystem::path kDir = std::filesystem::path(KVCACHE_SHARED_DIR) / "models/stories260K";

bool have_model() {
  if (std::filesystem::exists(kDir / "stories260K.bin")) return true;
  WARN("SKIPPED: stories260K.bin not found in " << kDir.string() << " (set KVCACHE_SHARED_DIR)");
  return false;
}

constexpr std::size_t kWindow = 256, kSinks = 4, kStoryMax = 200, kStreamMin = 4000;
constexpr std::size_t kScoredFrom = 512;  // the model's training length

// -log p(next | logits), in double.
double nll(std::span<const float> logits, token_id next) {
  double max = logits[0];
  for (float x : logits) max = std::max(max, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return std::log(sum) + max - static_cast<double>(logits[static_cast<std::size_t>(next)]);
}

// Stories sampled from the model (temperature 1, a fixed seed), each BOS then at most kStoryMax
// tokens (ending early at the model's own BOS), joined until the stream holds kStreamMin tokens.
std::vector<std::vector<token_id>> sample_stories(llama::Engine& engine, const llama::Model& m) {
  const auto& c = m.config();
  llama::Sampler sampler({.temperature = 1.0f, .seed = 260});
  std::vector<std::vector<token_id>> stories;
  std::size_t total = 0;
  while (total < kStreamMin) {
    DynamicCache<float> cache(
        {.num_layers = c.num_layers, .num_kv_heads = c.num_kv_heads, .head_dim = c.head_dim()});
    std::vector<token_id> story{llama::kBos};
    while (story.size() < kStoryMax + 1) {
      const token_id next = sampler.sample(engine.forward(cache, 0, {&story.back(), 1}));
      if (next == llama::kBos) break;
      story.push_back(next);
    }
    total += story.size();
    stories.push_back(std::move(story));
  }
  return stories;
}

// Sum of -log p(stream[p] | stream[..p)) over p >= kScoredFrom, decoding the stream token by
// token through `cache`.
template <class Cache>
double stream_nll(llama::Engine& engine, Cache& cache, const std::vector<token_id>& stream) {
  double total = 0.0;
  for (std::size_t p = 0; p + 1 < stream.size(); ++p) {
    const auto logits = engine.forward(cache, 0, {&stream[p], 1});
    if (p + 1 >= kScoredFrom) total += nll(logits, stream[p + 1]);
  }
  return total;
}

}  // namespace

TEST_CASE(
    "a sliding window with sinks and cache-relative positions keeps stories260K's "
    "perplexity within 10% of in-story scoring, thousands of tokens past its training") {
  if (!have_model()) return;
  const llama::Model model =
      llama::Model::from_checkpoint(llama::load_llama2c(kDir / "stories260K.bin"));
  const auto& c = model.config();
  llama::Engine engine(model);
  const auto stories = sample_stories(engine, model);
  std::vector<token_id> stream;
  for (const auto& s : stories) stream.insert(stream.end(), s.begin(), s.end());
  REQUIRE(stream.size() >= kStreamMin);
  const std::size_t scored = stream.size() - kScoredFrom;

  // (a) each story in its own context: the next token after the story's own prefix, positions
  // counted from its BOS (what the model was trained on).
  double in_story = 0.0;
  std::size_t start = 0;
  for (std::size_t s = 0; s < stories.size(); ++s) {
    DynamicCache<float> cache(
        {.num_layers = c.num_layers, .num_kv_heads = c.num_kv_heads, .head_dim = c.head_dim()});
    for (std::size_t i = 0; i < stories[s].size(); ++i) {
      const std::size_t p = start + i;  // the stream position of stories[s][i]
      const auto logits = engine.forward(cache, 0, {&stories[s][i], 1});
      if (p + 1 < stream.size() && p + 1 >= kScoredFrom) in_story += nll(logits, stream[p + 1]);
    }
    start += stories[s].size();
  }
  // (b) one full cache, absolute positions
  DynamicCache<float> full(
      {.num_layers = c.num_layers, .num_kv_heads = c.num_kv_heads, .head_dim = c.head_dim()});
  const double full_abs = stream_nll(engine, full, stream);
  // (c), (d) a sliding window of 256 with 4 sinks, absolute then cache-relative positions
  const SlidingWindowCacheConfig sliding_config{.num_layers = c.num_layers,
                                                .num_kv_heads = c.num_kv_heads,
                                                .head_dim = c.head_dim(),
                                                .window = kWindow,
                                                .num_sink_tokens = kSinks,
                                                .max_append_len = 1};
  SlidingWindowCache<float> sliding_abs(sliding_config);
  const double window_abs = stream_nll(engine, sliding_abs, stream);
  engine.set_positions(PositionMode::cache_relative);
  SlidingWindowCache<float> sliding_rel(sliding_config);
  const double window_rel = stream_nll(engine, sliding_rel, stream);

  const auto ppl = [&](double sum) { return std::exp(sum / static_cast<double>(scored)); };
  const double a = ppl(in_story), b = ppl(full_abs), cc = ppl(window_abs), d = ppl(window_rel);
  std::printf(
      "stories260K, %zu-token stream of %zu sampled stories, perplexity over positions %zu..%zu:\n"
      "  (a) each story in its own context            %8.3f\n"
      "  (b) full cache, absolute positions            %8.3f  (%.3fx)\n"
      "  (c) window %zu + %zu sinks, absolute positions  %8.3f  (%.3fx)\n"
      "  (d) window %zu + %zu sinks, cache-relative      %8.3f  (%.3fx)\n",
      stream.size(), stories.size(), kScoredFrom, stream.size() - 1, a, b, b / a, kWindow, kSinks,
      cc, cc / a, kWindow, kSinks, d, d / a);
  REQUIRE(d / a <= 1.10);
  REQUIRE(d < cc);  // and absolute positions in the window are the worse
}

TEST_CASE(
    "cache-relative sliding decode equals an uncached pass with the same window, bit for "
    "bit") {
  if (!have_model()) return;
  const llama::Model model =
      llama::Model::from_checkpoint(llama::load_llama2c(kDir / "stories260K.bin"));
  const auto& c = model.config();
  llama::Engine engine(model);
  engine.set_positions(PositionMode::cache_relative);
  SlidingWindowCache<float> cache({.num_layers = c.num_layers,
                                   .num_kv_heads = c.num_kv_heads,
                                   .head_dim = c.head_dim(),
                                   .window = 32,
                                   .num_sink_tokens = 4,
                                   .max_append_len = 8});
  llama::Sampler sampler({.temperature = 1.0f, .seed = 7});
  std::vector<token_id> ids{llama::kBos};
  for (std::size_t step = 0; step < 120; ++step) {
    const auto logits = engine.forward(cache, 0, {&ids.back(), 1});
    if (step % 40 == 39) {
      const std::vector<float> cached(logits.begin(), logits.end());
      const auto uncached = engine.forward_uncached(ids, {.window = 32, .num_sink_tokens = 4});
      REQUIRE(std::ranges::equal(cached, uncached));
    }
    ids.push_back(sampler.sample(logits));
  }
}
