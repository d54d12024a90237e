// SPDX-License-Identifier: Apache-2.0
// The system prompt from disk: requests served from a loaded snapshot produce exactly the tokens
// of from-scratch runs of system prompt + request; a snapshot is refused (typed error, the cache
// unchanged) for another model and for another shape. (The demo runs the same through two real
// processes: see examples/CMakeLists.txt.)
#include <filesystem>
#include <fstream>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "llama/from_disk.hpp"
#include "support/catch.hpp"
#include "support/snapshot_helpers.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using llama::token_id;

namespace {

const char* const kSpec = "2L-64d-4h-2kv-96ff-97v-128ctx";

void write_file(const std::filesystem::path& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// A TokenTrackedCache<StaticCache> for `model` with `n` prompt tokens of `source` prefilled
/// and committed in sequence 0.
TokenTrackedCache<StaticCache<float>> filled_cache(llama::Engine& engine, std::size_t n,
                                                   std::uint64_t seed) {
  const auto& c = engine.model().config();
  TokenTrackedCache tracked(StaticCache<float>({.num_layers = c.num_layers,
                                                .num_kv_heads = c.num_kv_heads,
                                                .head_dim = c.head_dim(),
                                                .max_seq_len = 128}));
  llama::PromptSource source(nullptr, c.vocab_size, seed);
  const auto prompt = llama::take_system_prompt(source, n);
  engine.forward(tracked, 0, prompt);
  tracked.commit(0, prompt);
  return tracked;
}

template <class C>
void require_unchanged(const TokenTrackedCache<C>& cache, const TokenTrackedCache<C>& before) {
  test::require_same_contents(cache, before);
  const auto a = cache.tokens(0), b = before.tokens(0);
  REQUIRE(std::vector<token_id>(a.begin(), a.end()) == std::vector<token_id>(b.begin(), b.end()));
}

}  // namespace

TEST_CASE("requests served from a loaded snapshot equal from-scratch runs of the whole prompt") {
  ThreadPool pool(2);
  const llama::ModelConfig config = llama::parse_synthetic_spec(kSpec);
  test::TempDir dir("from-disk");
  for (llama::CacheKind kind :
       {llama::CacheKind::static_cache, llama::CacheKind::dynamic, llama::CacheKind::paged}) {
    INFO("cache " << llama::cache_kind_name(kind));
    const auto path = dir / (std::string(llama::cache_kind_name(kind)) + ".kvs");
    llama::DiskPromptOptions o{.system_tokens = 70,
                               .requests = 3,
                               .suffix_tokens = 9,
                               .reply_tokens = 6,
                               .cache = kind,
                               .other_model = llama::synthetic_model_id(config, 4)};
    {  // "process 1": its own model, engine and prompt stream, gone before process 2 starts
      const llama::Model model = llama::Model::synthetic(config, 3, &pool);
      llama::Engine engine(model, &pool, 16);
      llama::PromptSource source(nullptr, config.vocab_size, 7);
      const auto saved =
          llama::save_system_prompt(engine, source, o, path, llama::synthetic_model_id(config, 3));
      REQUIRE(saved.tokens == 70);
      REQUIRE(saved.file_bytes == std::filesystem::file_size(path));
    }
    // "process 2": a model built again from the same spec and seed
    const llama::Model model = llama::Model::synthetic(config, 3, &pool);
    llama::Engine engine(model, &pool, 16);
    llama::PromptSource source(nullptr, config.vocab_size, 7);
    const auto r =
        llama::serve_from_snapshot(engine, source, o, path, llama::synthetic_model_id(config, 3));
    REQUIRE(r.system_tokens == 70);
    REQUIRE(r.holds_system_prompt);
    REQUIRE(r.rows.size() == 3);
    // The system prompt was loaded, never recomputed; the paged cache shares its 4 full
    // 16-token blocks (its last 6 tokens share a block with each request's own tokens).
    REQUIRE(r.shareable_tokens == (kind == llama::CacheKind::paged ? 64 : 70));
    REQUIRE(r.reused_system_prompt());
    for (const auto& row : r.rows) REQUIRE(row.disk_computed == 79 - r.shareable_tokens);
    REQUIRE(r.other_model_refused);
    REQUIRE(r.refusal.find("model id") != std::string::npos);
    REQUIRE(r.ok(o));

    // Independently of serve_from_snapshot's own recompute: each prompt without any cache.
    llama::PromptSource again(nullptr, config.vocab_size, 7);
    const auto system = llama::take_system_prompt(again, 70);
    for (const auto& row : r.rows) {
      std::vector<token_id> prompt = system;
      const auto suffix = again.take(9);
      prompt.insert(prompt.end(), suffix.begin(), suffix.end());
      llama::Sampler greedy;
      const auto scratch = llama::generate_uncached(engine, prompt, {.max_new = 6}, greedy);
      REQUIRE(row.prompt_tokens == prompt.size());
      REQUIRE(row.reply == scratch.tokens);
    }
  }
}

TEST_CASE("model ids: a weights file's fingerprint, a synthetic model's spec and seed") {
  const llama::ModelConfig config = llama::parse_synthetic_spec(kSpec);
  REQUIRE(llama::synthetic_model_id(config, 3) == llama::synthetic_model_id(config, 3));
  REQUIRE(!(llama::synthetic_model_id(config, 3) == llama::synthetic_model_id(config, 4)));
  const llama::ModelConfig other = llama::parse_synthetic_spec("2L-64d-4h-2kv-96ff-97v-256ctx");
  REQUIRE(!(llama::synthetic_model_id(config, 3) == llama::synthetic_model_id(other, 3)));

  test::TempDir dir("model-id");
  write_file(dir / "a.bin", llama::serialize_llama2c(llama::synthetic_checkpoint(config, 1)));
  write_file(dir / "b.bin", llama::serialize_llama2c(llama::synthetic_checkpoint(config, 2)));
  write_file(dir / "a2.bin", llama::serialize_llama2c(llama::synthetic_checkpoint(config, 1)));
  REQUIRE(std::filesystem::file_size(dir / "a.bin") == std::filesystem::file_size(dir / "b.bin"));
  const ModelId a = model_id_of_file(dir / "a.bin");
  REQUIRE(a == model_id_of_file(dir / "a2.bin"));
  REQUIRE(!(a == model_id_of_file(dir / "b.bin")));
  REQUIRE(!(a == llama::synthetic_model_id(config, 1)));  // 16 bytes vs 8
}

TEST_CASE("a snapshot of another model is refused and leaves the cache unchanged") {
  ThreadPool pool(2);
  const llama::ModelConfig config = llama::parse_synthetic_spec(kSpec);
  test::TempDir dir("other-model");
  // Two checkpoints of the same shape and size, told apart by their weights' fingerprint.
  write_file(dir / "a.bin", llama::serialize_llama2c(llama::synthetic_checkpoint(config, 1)));
  write_file(dir / "b.bin", llama::serialize_llama2c(llama::synthetic_checkpoint(config, 2)));
  const llama::Model a = llama::Model::from_checkpoint(llama::load_llama2c(dir / "a.bin"), &pool);
  const llama::Model b = llama::Model::from_checkpoint(llama::load_llama2c(dir / "b.bin"), &pool);
  llama::Engine engine_a(a, &pool, 16), engine_b(b, &pool, 16);
  const ModelId id_a = model_id_of_file(dir / "a.bin"), id_b = model_id_of_file(dir / "b.bin");

  const llama::DiskPromptOptions o{.system_tokens = 40};
  llama::PromptSource source(nullptr, config.vocab_size, 5);
  (void)llama::save_system_prompt(engine_a, source, o, dir / "a.kvs", id_a);

  // Model b's server holds its own 25 tokens; a's snapshot must not replace them.
  auto cache = filled_cache(engine_b, 25, 9);
  const auto before = filled_cache(engine_b, 25, 9);
  test::require_throws<snapshot_mismatch_error>(
      [&] { (void)load_snapshot(dir / "a.kvs", cache, id_b); }, "model id '", id_a.hex(),
      "' differs from the caller's '", id_b.hex(), "'");
  require_unchanged(cache, before);
  // With its own model the same snapshot loads (the refusal above was the id, nothing else).
  auto fresh = filled_cache(engine_a, 25, 9);
  (void)load_snapshot(dir / "a.kvs", fresh, id_a);
  REQUIRE(fresh.seq_length(0) == 40);
}

TEST_CASE("a snapshot of another shape is refused and leaves the cache unchanged") {
  ThreadPool pool(2);
  const llama::ModelConfig config = llama::parse_synthetic_spec(kSpec);
  test::TempDir dir("other-shape");
  const llama::Model model = llama::Model::synthetic(config, 3, &pool);
  llama::Engine engine(model, &pool, 16);
  const ModelId id = llama::synthetic_model_id(config, 3);
  const llama::DiskPromptOptions o{.system_tokens = 40};
  llama::PromptSource source(nullptr, config.vocab_size, 5);
  (void)llama::save_system_prompt(engine, source, o, dir / "s.kvs", id);

  // Even under the same model id (a caller that mislabels its models), a cache of another
  // shape never takes the K/V: 3 layers instead of 2, or 4 KV heads instead of 2.
  for (const char* spec : {"3L-64d-4h-2kv-96ff-97v-128ctx", "2L-64d-4h-4kv-96ff-97v-128ctx"}) {
    INFO("destination " << spec);
    const llama::Model other = llama::Model::synthetic(llama::parse_synthetic_spec(spec), 3, &pool);
    llama::Engine other_engine(other, &pool, 16);
    auto cache = filled_cache(other_engine, 25, 9);
    const auto before = filled_cache(other_engine, 25, 9);
    const auto& c = other.config();
    const std::string what = c.num_layers != 2 ? "num_layers 2 differs from the destination's 3"
                                               : "num_kv_heads 2 differs from the destination's 4";
    test::require_throws<snapshot_mismatch_error>(
        [&] { (void)load_snapshot(dir / "s.kvs", cache, id); }, what);
    require_unchanged(cache, before);
  }
}
