// SPDX-License-Identifier: Apache-2.0
// Quantized K/V on the real stories260K checkpoint: greedy generation with int8, fp8 and f16 keys
// with int8 values against the same generation with an f32 cache, from several prompts: the steps
// whose next token agrees when fed the same tokens, and where a free run first diverges. Also the
// demo's format switch: with_cache() builds the format asked for, and the memory it reports.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <string>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "llama/caches.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/tokenizer.hpp"
#include "support/catch.hpp"
#include "support/stories.hpp"

using namespace kvcache;
using llama::token_id;

namespace {

// Tokens equal before the first difference.
std::size_t first_divergence(const std::vector<token_id>& a, const std::vector<token_id>& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

}  // namespace

// Two measures per format, over 5 prompts x 200 greedy tokens of the f32 cache's run:
//  - teacher-forced top-1 agreement: the format's cache is fed the f32 run's tokens, and each
//    step's argmax is compared with the f32 run's next token (no cascade: one flip costs one
//    step). Measured: f16 1000 of 1000, bf16 997, int8 979, fp8 956, f16 keys + int8 values 999
//    (the same values as int8, keys kept in f16: most of int8's flips come from the keys).
//  - free-running first divergence: the format generates on its own; where it first differs.
//    stories260K's top-2 logits are often within a rounding of each other, so even bf16 leaves
//    the f32 path after 3..200 tokens (measured 200, 39, 200, 3, 78 over the prompts; int8 118,
//    24, 15, 14, 42; fp8 27, 17, 0, 0, 9; f16+int8 185, 200, 200, 200, 200): printed, not
//    asserted.
TEST_CASE("stories260K: greedy tokens with int8 and fp8 K/V against the f32 cache") {
  if (!test::have_stories()) return;
  const llama::Checkpoint ckpt = llama::load_llama2c(test::kStoriesDir / "stories260K.bin");
  const llama::Tokenizer tok = llama::Tokenizer::load(test::kStoriesDir / "tok512.bin", 512);
  const llama::Model model = llama::Model::from_checkpoint(ckpt);
  ThreadPool pool(2);
  llama::Engine engine(model, &pool);
  constexpr std::size_t kSteps = 200;
  const llama::GenerateLimits limits{.max_new = kSteps};  // no stop: 200 tokens each
  const std::vector<std::string> prompts = {
      "", "Once upon a time, there was a little dog", "Tom and Mia went to the park",
      "The sun was hot and the bird", "Lily had a big red ball. She"};
  auto params_for = [&](const llama::KvFormat& format, std::size_t tokens) {
    llama::CacheParams params{.format = format};
    params.max_seq_len = tokens;
    return params;
  };
  // The demo's format switch (with_kv_format) over StaticCache alone: with_cache would compile
  // each lambda for every policy too.
  auto generate = [&](const llama::KvFormat& format, const std::vector<token_id>& prompt) {
    return llama::with_kv_format(format, [&](auto t) {
      TokenTrackedCache tracked(
          llama::make_cache<llama::CacheKind::static_cache, typename decltype(t)::type>(
              model, params_for(format, prompt.size() + kSteps)));
      llama::Sampler greedy;
      return llama::generate(engine, tracked, 0, prompt, limits, greedy).tokens;
    });
  };
  auto forced = [&](const llama::KvFormat& format, const std::vector<token_id>& prompt,
                    const std::vector<token_id>& run) {
    return llama::with_kv_format(format, [&](auto t) {
      auto cache = llama::make_cache<llama::CacheKind::static_cache, typename decltype(t)::type>(
          model, params_for(format, prompt.size() + kSteps + 1));
      std::size_t agree = 0;
      std::span<const float> logits = engine.forward(cache, 0, prompt);
      for (std::size_t i = 0; i < run.size(); ++i) {
        agree += llama::Sampler::argmax(logits) == run[i] ? 1 : 0;
        logits = engine.forward(cache, 0, std::span(&run[i], 1));
      }
      return agree;
    });
  };
  const llama::KvFormat formats[] = {DType::f32,  DType::f16,
                                     DType::bf16, DType::i8,
                                     DType::e4m3, llama::KvFormat(DType::f16, DType::i8)};
  constexpr std::size_t kFormats = std::size(formats);
  std::size_t agree[kFormats] = {};
  for (const std::string& text : prompts) {
    const std::vector<token_id> prompt = tok.encode(text, true, false);
    const auto f32 = generate(DType::f32, prompt);
    REQUIRE(f32.size() == kSteps);
    std::printf("prompt \"%s\":", text.c_str());
    for (std::size_t f = 0; f < kFormats; ++f) {
      const std::size_t forced_agree = forced(formats[f], prompt, f32);
      agree[f] += forced_agree;
      std::printf(" %s %zu/%zu (free run: first divergence %zu);", formats[f].name().c_str(),
                  forced_agree, kSteps, first_divergence(generate(formats[f], prompt), f32));
    }
    std::printf("\n");
  }
  const std::size_t all = prompts.size() * kSteps;
  INFO("teacher-forced top-1 agreement of " << all << " steps: f16 " << agree[1] << ", bf16 "
                                            << agree[2] << ", int8 " << agree[3] << ", fp8 "
                                            << agree[4] << ", f16+int8 " << agree[5]);
  REQUIRE(agree[0] == all);           // the f32 cache fed its own tokens: the same run
  CHECK(agree[3] >= all * 95 / 100);  // int8 (measured 97.9%)
  CHECK(agree[4] >= all * 90 / 100);  // fp8 (measured 95.6%)
  CHECK(agree[5] >= all * 95 / 100);  // f16 keys, int8 values (measured 99.9%)
}

TEST_CASE("with_cache builds the K/V format asked for, in its memory") {
  llama::ModelConfig config;
  config.dim = 64;
  config.hidden_dim = 128;
  config.num_layers = 2;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.vocab_size = 32;
  config.seq_len = 64;
  const llama::Model model = llama::Model::synthetic(config, 1);
  std::size_t f32_bytes = 0;
  for (const llama::KvFormat& format : llama::kKvFormats) {
    llama::CacheParams params{.format = format};
    params.max_seq_len = 64;
    const auto [shape, bytes] = llama::with_cache(
        llama::CacheKind::static_cache, model, params,
        [](auto& cache) { return std::pair(cache.shape(), cache.memory_bytes()); });
    REQUIRE(llama::KvFormat(shape.dtype, shape.value_dtype) == format);
    REQUIRE(llama::parse_kv_format(format.name()) == format);
    REQUIRE(bytes == kv_cache_bytes({2, 2, 16, format.k, format.v}, 64));
    if (format == DType::f32) f32_bytes = bytes;
    INFO(format.name() << ": " << bytes << " bytes");
    REQUIRE(bytes <= f32_bytes);
  }
  REQUIRE(llama::parse_kv_format("f16+int8") == llama::KvFormat(DType::f16, DType::i8));
  REQUIRE_THROWS_AS(llama::parse_kv_format("int4"), llama::usage_error);
}
