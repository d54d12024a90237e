// SPDX-License-Identifier: Apache-2.0
// Long generation that stays coherent: on a stream of stories sampled from stories260K itself
// (trained on 512 tokens), a sliding window with attention sinks and cache-relative positions
// (StreamingLLM) keeps the model's perplexity within 10% of each story scored in its own context,
// far past the training length; absolute positions do not (llama/streaming.hpp measures it, as
// the demo's sliding scenario does). Also: cache-relative decode equals an uncached pass with the
// same window and positions, bit for bit.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "llama/forward.hpp"
#include "llama/sampler.hpp"
#include "llama/streaming.hpp"
#include "llama/tokenizer.hpp"
#include "support/catch.hpp"
#include "support/stories.hpp"

using namespace kvcache;
using llama::token_id;

TEST_CASE(
    "a sliding window with sinks and cache-relative positions keeps stories260K's "
    "perplexity within 10% of in-story scoring, thousands of tokens past its training") {
  if (!test::have_stories({"stories260K.bin"})) return;
  const llama::Model model =
      llama::Model::from_checkpoint(llama::load_llama2c(test::kStoriesDir / "stories260K.bin"));
  llama::Engine engine(model);
  const llama::StreamingOptions o{};  // window 256 + 4 sinks, >= 4000 tokens, scored from 512
  const llama::StreamingResult r = llama::evaluate_streaming(engine, o);
  REQUIRE(r.stream_tokens >= 4000);
  REQUIRE(r.scored_from == 512);                          // the model's training length
  REQUIRE(engine.positions() == PositionMode::absolute);  // restored
  const double a = r.in_story, b = r.full_absolute, c = r.window_absolute, d = r.window_relative;
  std::printf(
      "stories260K, %zu-token stream of %zu sampled stories, perplexity over positions %zu..%zu "
      "(%.2f s):\n"
      "  (a) each story in its own context            %8.3f\n"
      "  (b) full cache, absolute positions            %8.3f  (%.3fx)\n"
      "  (c) window %zu + %zu sinks, absolute positions  %8.3f  (%.3fx)\n"
      "  (d) window %zu + %zu sinks, cache-relative      %8.3f  (%.3fx)\n",
      r.stream_tokens, r.num_stories, r.scored_from, r.stream_tokens - 1, r.seconds, a, b, b / a,
      r.window, r.num_sink_tokens, c, c / a, r.window, r.num_sink_tokens, d, d / a);
  REQUIRE(d / a <= 1.10);
  REQUIRE(d < c);  // and absolute positions in the window are the worse
}

TEST_CASE(
    "while the window has not slid, the four streaming evaluations agree, and sampling is "
    "seeded") {
  // A synthetic model (no download). The window holds the whole stream, so nothing is evicted
  // and (b), (c) and (d) attend to the same keys at the same positions, bit for bit; (a) differs
  // (each story sees only itself).
  ThreadPool pool(2);
  const llama::Model model = llama::Model::synthetic(
      llama::parse_synthetic_spec("2L-64d-4h-2kv-96ff-97v-64ctx"), 3, &pool);
  llama::Engine engine(model, &pool, 16);
  engine.set_positions(PositionMode::cache_relative);
  const llama::StreamingOptions o{.window = 200,
                                  .num_sink_tokens = 2,
                                  .story_max_tokens = 30,
                                  .stream_min_tokens = 120,
                                  .scored_from = 20,
                                  .continuation_tokens = 8};
  const llama::StreamingResult r = llama::evaluate_streaming(engine, o);
  REQUIRE(engine.positions() == PositionMode::cache_relative);  // the caller's mode, restored
  REQUIRE(r.stream_tokens >= 120);
  REQUIRE(r.stream_tokens < o.window);
  REQUIRE(r.num_stories >= 4);
  REQUIRE(r.full_absolute == r.window_absolute);
  REQUIRE(r.window_absolute == r.window_relative);
  REQUIRE(r.in_story != r.full_absolute);
  REQUIRE(std::isfinite(r.in_story));
  REQUIRE(r.continuation_absolute == r.continuation_relative);
  REQUIRE(r.continuation_absolute.front() == llama::kBos);
  REQUIRE(r.continuation_absolute.size() <= 9);
  const llama::StreamingResult again = llama::evaluate_streaming(engine, o);
  REQUIRE(again.stream_tokens == r.stream_tokens);
  REQUIRE(again.in_story == r.in_story);
  REQUIRE(again.window_relative == r.window_relative);
}

TEST_CASE(
    "cache-relative sliding decode equals an uncached pass with the same window, bit for "
    "bit") {
  if (!test::have_stories({"stories260K.bin"})) return;
  const llama::Model model =
      llama::Model::from_checkpoint(llama::load_llama2c(test::kStoriesDir / "stories260K.bin"));
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
