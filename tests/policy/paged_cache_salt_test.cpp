// SPDX-License-Identifier: Apache-2.0
// Cache salts (PagedCache::admit's extra key): prompts share blocks under the same key and never
// under different keys (both sides tested: a "never shares" test alone would also pass with
// prefix caching off), and the key stays with its sequence through fork, reorder, crop, context
// shift and snapshots, whose EXTRA_KEY section a reader checks.
#include <cstdint>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/io/snapshot_format.hpp"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/snapshot_edit.hpp"

using namespace kvcache;
using kvcache::test::iota_ids;
using kvcache::test::SyntheticModel;

namespace {

constexpr std::size_t kBlock = 4;
const SyntheticModel kSynth{2, 1, 8};
const ModelId kModel = ModelId::from_u64(0x5a17ull);
constexpr std::uint64_t kTenantA = 0x1111, kTenantB = 0x2222;

PagedCache<float> make_cache() {
  return PagedCache<float>({.num_layers = 2,
                            .num_kv_heads = 1,
                            .head_dim = 8,
                            .num_blocks = 64,
                            .block_size = kBlock,
                            .max_batch = 4,
                            .max_seq_len = 64});
}

// Admits `ids` to `seq` under `key` and prefills what is not cached; returns the cached count.
std::size_t serve(PagedCache<float>& cache, std::size_t seq, const std::vector<token_id>& ids,
                  std::uint64_t key) {
  const std::size_t cached = cache.admit(seq, ids, key);
  kSynth.prefill(cache, seq, ids, cached, ids.size() - cached);
  return cached;
}

std::size_t sections_of_kind(std::span<const std::byte> file, snapshot_format::SectionKind kind) {
  std::size_t n = 0;
  for (const auto& s : kvcache::test::split_sections(file)) {
    n += s.kind == static_cast<std::uint32_t>(kind);
  }
  return n;
}

}  // namespace

TEST_CASE("prompts share blocks under the same extra key and never under different ones") {
  auto cache = make_cache();
  const auto prompt = iota_ids(17, 100);  // four full blocks and one more token
  REQUIRE(serve(cache, 0, prompt, kTenantA) == 0);
  REQUIRE(cache.extra_key(0) == kTenantA);

  // the same key shares, while the first request runs and after it ends
  REQUIRE(serve(cache, 1, prompt, kTenantA) == 16);
  REQUIRE(std::ranges::equal(cache.block_table(1).first(4), cache.block_table(0).first(4)));
  cache.release(1);
  // another key, and no key, share nothing and see nothing
  REQUIRE(cache.match_prefix(prompt, kTenantB) == 0);
  REQUIRE(cache.match_prefix(prompt) == 0);
  REQUIRE(cache.match_prefix(prompt, kTenantA) == 16);
  REQUIRE(serve(cache, 1, prompt, kTenantB) == 0);
  REQUIRE(serve(cache, 2, prompt, 0) == 0);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(cache.block_table(1)[i] != cache.block_table(0)[i]);
    CHECK(cache.block_table(2)[i] != cache.block_table(0)[i]);
    CHECK(cache.block_table(2)[i] != cache.block_table(1)[i]);
  }
  // each key's copy is indexed under its own key: all three stay cached after release
  for (std::size_t s = 0; s < 3; ++s) cache.release(s);
  CHECK(cache.extra_key(0) == 0);  // release forgets the key
  CHECK(cache.stats().blocks_cached == 3 * 4);
  CHECK(cache.match_prefix(prompt, kTenantA) == 16);
  CHECK(cache.match_prefix(prompt, kTenantB) == 16);
  CHECK(cache.match_prefix(prompt) == 16);
  REQUIRE(cache.check_consistency() == "");
}

TEST_CASE("the extra key stays with its sequence through fork, reorder, crop and context shift") {
  auto cache = make_cache();
  const auto prompt = iota_ids(10, 7);
  (void)serve(cache, 0, prompt, kTenantA);
  cache.fork(0, 1);
  CHECK(cache.extra_key(1) == kTenantA);
  const std::vector<std::size_t> dst{2}, src{0};
  cache.reorder(dst, src);
  CHECK(cache.extra_key(2) == kTenantA);
  cache.crop(1, 3);
  CHECK(cache.extra_key(1) == kTenantA);
  // the fork's blocks completed later are indexed under the key too
  const auto longer = kvcache::test::concat(prompt, iota_ids(6, 50));
  cache.add_tokens(1, std::span(longer).subspan(3));
  kSynth.prefill(cache, 1, longer, 3, longer.size() - 3);
  for (std::size_t s = 0; s < 3; ++s) cache.release(s);
  CHECK(cache.match_prefix(longer, kTenantA) == 16);
  CHECK(cache.match_prefix(longer) == 0);

  // context shift re-restores the sequence: it keeps its key
  (void)serve(cache, 0, longer, kTenantB);
  const Rope rope(RopeConfig{}, 8);
  context_shift(cache, 0, 4, 4, rope);
  CHECK(cache.extra_key(0) == kTenantB);
  REQUIRE(cache.check_consistency() == "");
}

TEST_CASE("snapshots keep the extra key; its EXTRA_KEY section is written only when needed") {
  auto cache = make_cache();
  const auto prompt = iota_ids(13, 300);
  (void)serve(cache, 0, prompt, kTenantA);
  (void)serve(cache, 1, prompt, kTenantB);
  (void)serve(cache, 2, prompt, 0);
  const auto bytes = snapshot_to_bytes(cache, kModel);
  CHECK(sections_of_kind(bytes, snapshot_format::SectionKind::extra_key) == 2);

  auto loaded = make_cache();
  (void)load_snapshot_bytes(bytes, loaded, kModel);
  CHECK(loaded.extra_key(0) == kTenantA);
  CHECK(loaded.extra_key(1) == kTenantB);
  CHECK(loaded.extra_key(2) == 0);
  // the three restored sequences hold the same ids under three keys: nothing shared
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(loaded.block_table(0)[i] != loaded.block_table(1)[i]);
    CHECK(loaded.block_table(1)[i] != loaded.block_table(2)[i]);
  }
  for (std::size_t s = 0; s < 3; ++s) loaded.release(s);
  CHECK(loaded.match_prefix(prompt, kTenantA) == 12);
  CHECK(loaded.match_prefix(prompt, kTenantB) == 12);
  CHECK(loaded.match_prefix(prompt, 0x3333) == 0);
  REQUIRE(loaded.check_consistency() == "");

  // two restored sequences under one key share their blocks again
  auto same = make_cache();
  (void)serve(same, 0, prompt, kTenantA);
  same.fork(0, 1);
  auto again = make_cache();
  (void)load_snapshot_bytes(snapshot_to_bytes(same, kModel), again, kModel);
  CHECK(std::ranges::equal(again.block_table(0).first(3), again.block_table(1).first(3)));

  // no keys: no section
  auto plain = make_cache();
  (void)serve(plain, 0, prompt, 0);
  CHECK(sections_of_kind(snapshot_to_bytes(plain, kModel),
                         snapshot_format::SectionKind::extra_key) == 0);
}

TEST_CASE("a reader refuses an EXTRA_KEY section that is malformed or out of place") {
  auto cache = make_cache();
  (void)serve(cache, 0, iota_ids(9, 1), kTenantA);
  const auto bytes = snapshot_to_bytes(cache, kModel, std::vector<std::size_t>{0});
  const auto kind = static_cast<std::uint32_t>(snapshot_format::SectionKind::extra_key);
  auto edit = [&](auto&& change) {
    auto sections = kvcache::test::split_sections(bytes);
    for (auto& s : sections) {
      if (s.kind == kind) change(s);
    }
    auto file = kvcache::test::encode_sections(sections);
    auto target = make_cache();
    return load_snapshot_bytes(file, target, kModel);
  };
  CHECK_THROWS_AS(edit([](auto& s) { kvcache::test::set64(s.payload, 0, 0); }),
                  snapshot_format_error);
  CHECK_THROWS_AS(edit([](auto& s) { s.payload.resize(16); }), snapshot_format_error);
  // a reader that does not know the kind refuses the file: required, so never skipped
  CHECK_THROWS_AS(edit([](auto& s) { s.kind = 99; }), snapshot_format_error);
  // unchanged, it loads
  CHECK_NOTHROW(edit([](auto&) {}));
}
