// SPDX-License-Identifier: Apache-2.0
// The engine on the real stories260K checkpoint: greedy generation from BOS follows llama2.c's
// run.c (compared token for token with an independent reference decoder, and with the text run.c
// prints), through every cache policy; logits after a prompt match the reference.
#include <filesystem>
#include <string>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/tokenizer.hpp"
#include "llama_reference.hpp"
#include "support/catch.hpp"
#include "support/stories.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using llama::token_id;

namespace {

// run.c's loop with -t 0: start from BOS, feed each argmax back, stop at BOS or after `steps`.
std::vector<token_id> reference_greedy(const test::ReferenceModel& m, std::size_t steps,
                                       double& min_margin) {
  test::ReferenceModel::Decoder dec(m);
  std::vector<token_id> out;
  token_id t = llama::kBos;
  min_margin = 1e300;
  for (std::size_t i = 0; i < steps; ++i) {
    const auto logits = dec.step(t);
    min_margin = std::min(min_margin, test::top2_margin(logits));
    t = static_cast<token_id>(test::argmax(logits));
    if (t == llama::kBos) break;
    out.push_back(t);
  }
  return out;
}

}  // namespace

TEST_CASE("greedy stories260K from BOS is what llama2.c's run.c prints, with every cache") {
  if (!test::have_stories()) return;
  const llama::Checkpoint ckpt = llama::load_llama2c(test::kStoriesDir / "stories260K.bin");
  const llama::Tokenizer tok = llama::Tokenizer::load(test::kStoriesDir / "tok512.bin", 512);
  const llama::Model model = llama::Model::from_checkpoint(ckpt);
  const test::ReferenceModel reference(ckpt);
  const std::size_t steps = 256;  // run.c's default -n

  double margin = 0;
  const auto want = reference_greedy(reference, steps, margin);
  INFO("smallest top-2 logit margin along the reference run: " << margin);
  REQUIRE(want.size() >= 100);
  const std::string text = tok.decode(want);
  INFO("reference text: " << text);
  REQUIRE(text.starts_with("Once upon a time, there was a little girl named Lily."));

  ThreadPool pool(2);
  llama::Engine engine(model, &pool);
  const auto& c = model.config();
  const std::vector<token_id> bos{llama::kBos};
  const token_id stop[] = {llama::kBos};
  // run.c -n 256 with the BOS-only prompt runs 256 forward passes, printing each sampled token.
  const llama::GenerateLimits limits{.max_new = steps, .stop = stop};
  auto run = [&](auto cache, const char* name) {
    INFO("policy " << name);
    TokenTrackedCache tracked(std::move(cache));
    llama::Sampler greedy;
    const auto got = llama::generate(engine, tracked, 0, bos, limits, greedy);
    REQUIRE(got.tokens == want);
  };
  const std::size_t L = c.num_layers, H = c.num_kv_heads, D = c.head_dim();
  run(StaticCache<float>({.num_layers = L, .num_kv_heads = H, .head_dim = D, .max_seq_len = 512}),
      "static");
  run(DynamicCache<float>({.num_layers = L, .num_kv_heads = H, .head_dim = D, .chunk_len = 64}),
      "dynamic");
  run(SlidingWindowCache<float>(
          {.num_layers = L, .num_kv_heads = H, .head_dim = D, .window = 512, .max_append_len = 16}),
      "sliding, window = seq_len");
  {
    INFO("policy paged");
    PagedCache<float> paged(
        {.num_layers = L, .num_kv_heads = H, .head_dim = D, .num_blocks = 32, .max_seq_len = 512});
    llama::Sampler greedy;
    const auto got = llama::generate(engine, paged, 0, bos, limits, greedy);
    REQUIRE(got.tokens == want);
  }
  // Without a cache every token reruns the whole sequence (quadratic): the first 64 suffice.
  llama::Sampler greedy;
  const auto uncached = llama::generate_uncached(engine, bos, {.max_new = 64}, greedy).tokens;
  REQUIRE(uncached == std::vector<token_id>(want.begin(), want.begin() + 64));
}

TEST_CASE("stories260K logits after a text prompt match the reference forward pass") {
  if (!test::have_stories()) return;
  const llama::Checkpoint ckpt = llama::load_llama2c(test::kStoriesDir / "stories260K.bin");
  const llama::Tokenizer tok = llama::Tokenizer::load(test::kStoriesDir / "tok512.bin", 512);
  const llama::Model model = llama::Model::from_checkpoint(ckpt);
  const auto prompt = tok.encode("Tom had a small red boat. One day the wind was strong, and");
  llama::Engine engine(model);
  const auto logits = engine.forward_uncached(prompt);
  const auto want = test::ReferenceModel(ckpt).logits(prompt);
  test::require_close(std::vector<float>(logits.begin(), logits.end()),
                      std::vector<float>(want.begin(), want.end()), {.abs = 2e-4, .rel = 2e-4});
}
