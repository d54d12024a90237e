// SPDX-License-Identifier: Apache-2.0
// The demo's scenarios on a small synthetic model: RAG and system-prompt requests served from a
// cached prefix produce exactly the tokens of from-scratch runs of the concatenated prompt (and
// skipping the crop would not), chat turns match re-prefilled history, the sliding run gives
// the logits of uncached windowed attention bit for bit at every checkpoint, in constant memory,
// at absolute and at cache-relative positions.
// The paged policy serves the same scenarios by automatic prefix caching.
#include <vector>

#include "kvcache/kvcache.hpp"
#include "llama/scenarios.hpp"
#include "support/catch.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using llama::token_id;

namespace {

const char* const kSpec = "2L-64d-4h-2kv-96ff-97v-64ctx";

}  // namespace

TEST_CASE("RAG and system-prompt answers equal from-scratch runs of the concatenated prompt") {
  ThreadPool pool(2);
  const llama::Model model = llama::Model::synthetic(llama::parse_synthetic_spec(kSpec), 2, &pool);
  llama::Engine engine(model, &pool, 16);
  for (llama::CacheKind kind :
       {llama::CacheKind::static_cache, llama::CacheKind::dynamic, llama::CacheKind::paged}) {
    INFO("cache " << llama::cache_kind_name(kind));
    const bool paged = kind == llama::CacheKind::paged;
    const llama::SharedPrefixOptions o{.prefix_tokens = 70,
                                       .requests = 3,
                                       .suffix_tokens = 9,
                                       .reply_tokens = 6,
                                       .cache = kind,
                                       .params = {.block_size = 16}};
    llama::PromptSource source(nullptr, model.config().vocab_size, 5);
    const auto result = llama::run_shared_prefix(engine, source, o);
    REQUIRE(result.prefix_tokens == 70);
    REQUIRE(result.rows.size() == 3);
    REQUIRE(result.all_identical());

    // Rebuild the same prompts and run each from scratch in a fresh cache, independently of the
    // scenario's own uncached path.
    llama::PromptSource again(nullptr, model.config().vocab_size, 5);
    std::vector<token_id> prefix{llama::kBos};
    const auto body = again.take(69);
    prefix.insert(prefix.end(), body.begin(), body.end());
    std::vector<token_id> previous_request;
    for (std::size_t r = 0; r < result.rows.size(); ++r) {
      const auto& row = result.rows[r];
      if (!paged) {
        REQUIRE(row.cached_computed == 9);  // the prefix was never recomputed
      } else if (r == 0) {
        REQUIRE(row.cached_computed == 79);  // nothing cached yet: the whole prompt
      } else {
        REQUIRE(row.cached_computed == 79 - 64);  // the prefix's 4 full blocks were found
      }
      std::vector<token_id> prompt = prefix;
      const auto suffix = again.take(9);
      prompt.insert(prompt.end(), suffix.begin(), suffix.end());
      DynamicCache<float> fresh({.num_layers = 2, .num_kv_heads = 2, .head_dim = 16});
      TokenTrackedCache tracked(std::move(fresh));
      llama::Sampler greedy;
      const auto scratch = llama::generate(engine, tracked, 0, prompt, {.max_new = 6}, greedy);
      REQUIRE(row.reply == scratch.tokens);

      // Without the crop the question would see the previous request's K/V and (here) answer
      // differently: the equality above is a real check.
      if (!previous_request.empty()) {
        DynamicCache<float> dirty({.num_layers = 2, .num_kv_heads = 2, .head_dim = 16});
        engine.forward(dirty, 0, previous_request);
        const auto d = engine.forward(dirty, 0, suffix);
        const std::vector<float> dirty_logits(d.begin(), d.end());
        const auto u = engine.forward_uncached(prompt);
        const std::vector<float> clean(u.begin(), u.end());
        REQUIRE(!test::mismatch_report(dirty_logits, clean, {.abs = 1e-3}).empty());
      }
      previous_request = prompt;
      previous_request.insert(previous_request.end(), row.reply.begin(), row.reply.end() - 1);
    }
    if (paged) {
      // Three live sequences of 79 + 5 tokens (6 blocks each) share the prefix's 4 full blocks.
      REQUIRE(result.prefix_stats.has_value());
      REQUIRE(result.blocks_unshared == 3 * 6);
      REQUIRE(result.prefix_stats->blocks_used == 3 * 6 - 2 * 4);
      REQUIRE(result.prefix_stats->reused_tokens == 2 * 64);
      REQUIRE(result.prefix_stats->prompt_tokens == 3 * 79);
    } else {
      REQUIRE(!result.prefix_stats.has_value());
    }
  }
}

TEST_CASE("cached chat turns equal re-prefilling the whole history") {
  ThreadPool pool(2);
  const llama::Model model = llama::Model::synthetic(llama::parse_synthetic_spec(kSpec), 4, &pool);
  llama::Engine engine(model, &pool, 16);
  for (llama::CacheKind kind : {llama::CacheKind::dynamic, llama::CacheKind::static_cache,
                                llama::CacheKind::sliding, llama::CacheKind::paged}) {
    INFO("cache " << llama::cache_kind_name(kind));
    llama::PromptSource source(nullptr, model.config().vocab_size, 8);
    const llama::ChatOptions o{.turns = 4,
                               .user_tokens = 11,
                               .reply_tokens = 5,
                               .cache = kind,
                               .params = {.window = 24, .num_sink_tokens = 2, .max_append_len = 8}};
    const auto result = llama::run_chat(engine, source, o);
    REQUIRE(result.rows.size() == 4);
    REQUIRE(result.all_identical());
    for (std::size_t t = 0; t < result.rows.size(); ++t) {
      REQUIRE(result.rows[t].prompt_tokens == 1 + t * 16 + 11);
      // Turn 1 runs BOS + 11 user tokens; each later turn only the last reply token (sampled,
      // not yet fed) and its 11 new user tokens. (Paged, 16-token blocks: each turn's history
      // of 12 + 16 t tokens plus 4 fed reply tokens fills whole blocks, all found next turn.)
      REQUIRE(result.rows[t].cached_computed == 12);
    }
    REQUIRE(result.prefix_stats.has_value() == (kind == llama::CacheKind::paged));
  }
}

TEST_CASE(
    "the sliding scenario gives the logits of uncached windowed attention, bit for bit, in "
    "constant memory, at absolute and at cache-relative positions") {
  ThreadPool pool(2);
  const llama::Model model = llama::Model::synthetic(llama::parse_synthetic_spec(kSpec), 6, &pool);
  llama::Engine engine(model, &pool, 16);
  std::vector<token_id> absolute_sequence;
  for (const PositionMode mode : {PositionMode::absolute, PositionMode::cache_relative}) {
    INFO("positions " << (mode == PositionMode::absolute ? "absolute" : "cache-relative"));
    llama::PromptSource source(nullptr, model.config().vocab_size, 9);
    const llama::SlidingOptions o{.prompt_tokens = 10,
                                  .generate_tokens = 150,  // past seq_len 64
                                  .window = 20,
                                  .num_sink_tokens = 3,
                                  .max_append_len = 8,
                                  .checkpoints = 5,
                                  .positions = mode};
    const auto r = llama::run_sliding(engine, source, o);
    REQUIRE(engine.positions() == PositionMode::absolute);  // restored
    REQUIRE(r.positions == mode);
    REQUIRE(r.generated == 150);
    REQUIRE(r.sequence.size() == 10 + 150);
    REQUIRE(r.points.size() >= 5);
    REQUIRE(r.all_identical());
    REQUIRE(r.points.back().length > 2 * r.seq_len);
    for (const auto& p : r.points) {
      REQUIRE(p.memory_bytes == r.points.front().memory_bytes);
      REQUIRE(p.argmax_match);
      REQUIRE(p.max_logit_diff == 0.0f);
    }
    REQUIRE(r.points.back().full_cache_bytes > r.points.back().memory_bytes);
    if (mode == PositionMode::absolute) {
      absolute_sequence = r.sequence;
    } else {
      REQUIRE(r.sequence != absolute_sequence);  // the positions mode took effect
    }
  }
}
