// SPDX-License-Identifier: Apache-2.0
// Every single-byte corruption, every truncation and every extension of valid snapshots (each
// policy, the paged cache included) is rejected with a snapshot_format_error naming an offset
// inside the file, and the destination cache is left exactly as it was. Behind the checksums:
// every metadata field set to edge values with the checksums recomputed is refused with a typed
// error or loads a consistent cache.
#include <fstream>
#include <iostream>
#include <random>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/snapshot_edit.hpp"
#include "support/snapshot_helpers.hpp"

using namespace kvcache;
using kvcache::test::append_random;

namespace {

const ModelId kModel("corruption-test-model");

/// What "unchanged" compares: every view's contents, plus a paged cache's ids, block tables and
/// pool statistics.
template <class Cache>
auto state_of(const Cache& cache) {
  if constexpr (PrefixCacheConcept<Cache>) {
    return kvcache::test::paged_state(cache);
  } else {
    return kvcache::test::cache_contents(cache);
  }
}

/// "" for a consistent cache (a paged cache checks its invariants; the others have none hidden).
template <class Cache>
std::string consistency_of(const Cache& cache) {
  if constexpr (PrefixCacheConcept<Cache>) {
    return cache.check_consistency();
  } else {
    return {};
  }
}

/// Loads `bytes` into `dest`; requires a snapshot_format_error whose offset lies in
/// [0, max(size, original size)] and an unchanged `dest`.
template <class Cache, class State>
void require_rejected(std::span<const std::byte> bytes, Cache& dest, const State& before,
                      std::size_t original_size, const std::string& what) {
  bool rejected = false;
  std::string message;
  std::uint64_t offset = 0;
  try {
    load_snapshot_bytes(bytes, dest, kModel);
  } catch (const snapshot_format_error& e) {
    rejected = true;
    message = e.what();
    offset = e.offset();
  }
  INFO(what << ": " << (rejected ? message : std::string("loaded without an error")));
  REQUIRE(rejected);
  REQUIRE(offset <= std::max(bytes.size(), original_size));
  REQUIRE(message.find("file offset") != std::string::npos);
  REQUIRE(state_of(dest) == before);
}

template <class Cache>
void check_every_corruption(const Cache& source, Cache& dest, Cache probe, std::mt19937_64& rng) {
  const std::vector<std::byte> good = snapshot_to_bytes(source, kModel);
  append_random(dest, rng, 0, 2, 2);  // the destination holds something of its own
  const auto before = state_of(dest);
  {  // the valid file loads (sanity of the test itself)
    load_snapshot_bytes(good, probe, kModel);
    REQUIRE(kvcache::test::cache_contents(probe) == kvcache::test::cache_contents(source));
    REQUIRE(consistency_of(probe) == "");
  }
  std::vector<std::byte> bad = good;
  std::size_t cases = 0;
  for (std::size_t i = 0; i < good.size(); ++i) {
    const auto random = static_cast<std::byte>(kvcache::test::uniform(rng, 1, 255));
    for (std::byte flip : {std::byte{0x01}, std::byte{0x80}, random}) {
      bad[i] = good[i] ^ flip;
      require_rejected(
          bad, dest, before, good.size(),
          "byte " + std::to_string(i) + " ^ " + std::to_string(static_cast<unsigned>(flip)));
      ++cases;
    }
    bad[i] = good[i];
  }
  for (std::size_t n = 0; n < good.size(); ++n) {
    require_rejected(std::span<const std::byte>(good).first(n), dest, before, good.size(),
                     "truncated to " + std::to_string(n) + " bytes");
    ++cases;
  }
  for (std::size_t extra = 1; extra <= 130; ++extra) {
    std::vector<std::byte> longer = good;
    longer.resize(good.size() + extra, extra % 2 ? std::byte{0} : std::byte{0x5a});
    require_rejected(longer, dest, before, good.size(),
                     "extended by " + std::to_string(extra) + " bytes");
    ++cases;
  }
  for (int trial = 0; trial < 300; ++trial) {  // a few scattered bytes at once
    bad = good;
    const std::size_t k = kvcache::test::uniform(rng, 2, 8);
    for (std::size_t j = 0; j < k; ++j) {
      bad[kvcache::test::uniform(rng, 0, bad.size() - 1)] ^=
          static_cast<std::byte>(kvcache::test::uniform(rng, 1, 255));
    }
    if (bad == good) continue;
    require_rejected(bad, dest, before, good.size(),
                     "scattered damage, trial " + std::to_string(trial));
    ++cases;
  }
  REQUIRE(consistency_of(dest) == "");
  std::cerr << "[corruption] " << good.size() << "-byte snapshot: " << cases
            << " damaged variants, all rejected\n";
}

/// Sets every 4-byte metadata word of `source`'s snapshot (everything but the K/V elements) to
/// edge values, recomputes the checksums and loads the result into a fresh `make()` holding
/// something of its own: each must be refused with a typed error and nothing changed, or load a
/// consistent cache that saves and loads again identically.
template <class Make, class Cache>
void check_semantic_edits(const Make& make, const Cache& source, std::mt19937_64& rng) {
  using T = typename Cache::value_type;
  const std::vector<std::byte> good = snapshot_to_bytes(source, kModel);
  const std::size_t row_bytes = source.shape().token_elems() * sizeof(T);
  std::vector<bool> is_data(good.size(), false);
  for (const auto& s : snapshot_format::parse(good, "good").sequences) {
    for (std::size_t l = 0; l < s.kv_offset.size(); ++l) {
      const std::size_t n = 2 * static_cast<std::size_t>(s.layers[l].held()) * row_bytes;
      for (std::size_t i = 0; i < n; ++i) is_data[s.kv_offset[l] + i] = true;
    }
  }
  std::size_t rejected = 0, loaded = 0;
  for (std::size_t off = 0; off + 4 <= good.size(); off += 4) {
    if (is_data[off]) continue;
    const std::uint32_t v = kvcache::test::get32(good, off);
    for (std::uint32_t x : {0u, 1u, 2u, 3u, 0x7fffffffu, 0x80000000u, 0xffffffffu, v + 1, v - 1,
                            v * 2, v ^ 0x10000u}) {
      if (x == v) continue;
      std::vector<std::byte> bad = good;
      kvcache::test::set32(bad, off, x);
      kvcache::test::fix_checksums(bad);
      auto dest = make();
      append_random(dest, rng, 0, 4, 2);
      const auto before = state_of(dest);
      INFO("word at offset " << off << " set to " << x << " (was " << v << ")");
      try {
        load_snapshot_bytes(bad, dest, kModel);
      } catch (const kvcache::error&) {
        REQUIRE(state_of(dest) == before);
        REQUIRE(consistency_of(dest) == "");
        ++rejected;
        continue;
      }
      ++loaded;  // accepted: the result must be a consistent cache that round-trips
      REQUIRE(consistency_of(dest) == "");
      for (std::size_t l = 0; l < dest.shape().num_layers; ++l) {
        for (std::size_t s = 0; s < dest.max_batch(); ++s) {
          kvcache::test::check_view_invariants(dest.view(l, s));
        }
      }
      auto again = make();
      const auto bytes = snapshot_to_bytes(dest, kModel);
      load_snapshot_bytes(bytes, again, kModel);
      REQUIRE(snapshot_to_bytes(again, kModel) == bytes);
    }
  }
  std::cerr << "[semantic] " << rejected << " edited snapshots refused, " << loaded
            << " loaded consistently (e.g. other token ids)\n";
  REQUIRE(rejected > 0);
}

}  // namespace

TEST_CASE("every damaged variant of a static-cache snapshot with token ids is rejected") {
  auto rng = kvcache::test::make_rng("corrupt-static");
  auto make = [] {
    return TokenTrackedCache<StaticCache<half>>(StaticCache<half>(
        {.num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .max_batch = 2, .max_seq_len = 16}));
  };
  auto source = make(), dest = make();
  append_random(source, rng, 0, 5, 3);
  source.commit(0, std::vector<token_id>{11, 12, 13, 14, 15});
  append_random(source, rng, 1, 3, 3);
  source.commit(1, std::vector<token_id>{-1, 0, 1});
  check_every_corruption(source, dest, make(), rng);
}

TEST_CASE("every damaged variant of a sliding-window snapshot is rejected") {
  auto rng = kvcache::test::make_rng("corrupt-sliding");
  auto make = [] {
    return SlidingWindowCache<float>({.num_layers = 2,
                                      .num_kv_heads = 1,
                                      .head_dim = 4,
                                      .max_batch = 1,
                                      .window = 4,
                                      .num_sink_tokens = 2,
                                      .max_append_len = 2});
  };
  auto source = make(), dest = make();
  append_random(source, rng, 0, 30, 2);
  check_every_corruption(source, dest, make(), rng);
}

TEST_CASE("every damaged variant of a dynamic-cache snapshot is rejected") {
  auto rng = kvcache::test::make_rng("corrupt-dynamic");
  auto make = [] {
    return DynamicCache<bfloat16>(
        {.num_layers = 1, .num_kv_heads = 2, .head_dim = 4, .max_batch = 2, .chunk_len = 3});
  };
  auto source = make(), dest = make();
  append_random(source, rng, 1, 7, 3);
  check_every_corruption(source, dest, make(), rng);
}

TEST_CASE("every damaged variant of a paged snapshot is rejected") {
  auto rng = kvcache::test::make_rng("corrupt-paged");
  auto make = [] {
    return PagedCache<half>({.num_layers = 2,
                             .num_kv_heads = 1,
                             .head_dim = 4,
                             .num_blocks = 8,
                             .block_size = 2,
                             .max_batch = 2,
                             .max_seq_len = 8});
  };
  auto source = make(), dest = make();
  REQUIRE(source.admit(0, std::vector<token_id>{5, 6, 7, 8, 9}) == 0);
  append_random(source, rng, 0, 5, 3);
  REQUIRE(source.admit(1, std::vector<token_id>{5, 6, 7, 1}) == 2);  // shares a block of 0
  append_random(source, rng, 1, 1, 1);  // ids ahead of the K/V: 4 ids, 3 positions
  {  // besides a sequence of its own, the destination caches a block with the source's first ids
    REQUIRE(dest.admit(1, std::vector<token_id>{5, 6, 3}) == 0);
    append_random(dest, rng, 1, 3, 3);
    dest.release(1);
  }
  check_every_corruption(source, dest, make(), rng);
}

TEST_CASE("damaged snapshot files are rejected through both load methods") {
  auto rng = kvcache::test::make_rng("corrupt-files");
  kvcache::test::TempDir dir("corrupt-files");
  StaticCache<float> source(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 1, .max_seq_len = 64});
  append_random(source, rng, 0, 40, 16);
  const auto good = snapshot_to_bytes(source, kModel);
  StaticCache<float> dest(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 1, .max_seq_len = 64});
  const auto before = kvcache::test::cache_contents(dest);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<std::byte> bad = good;
    if (trial % 2 == 0) {
      bad[kvcache::test::uniform(rng, 0, bad.size() - 1)] ^= std::byte{0x10};
    } else {
      bad.resize(kvcache::test::uniform(rng, 0, bad.size() - 1));
    }
    const auto path = dir / "bad.kvs";
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bad.data()),
                static_cast<std::streamsize>(bad.size()));
    }
    for (LoadMethod method : {LoadMethod::mmap, LoadMethod::read}) {
      INFO("trial " << trial << " method " << static_cast<int>(method));
      REQUIRE_THROWS_AS(load_snapshot(path, dest, kModel, {.method = method}),
                        snapshot_format_error);
      REQUIRE(kvcache::test::cache_contents(dest) == before);
    }
  }
}

TEST_CASE("metadata fields set to edge values, checksums recomputed: typed error or a valid load") {
  auto rng = kvcache::test::make_rng("corrupt-semantic");
  auto make = [] {
    return TokenTrackedCache<SlidingWindowCache<half>>(
        SlidingWindowCache<half>({.num_layers = 2,
                                  .num_kv_heads = 1,
                                  .head_dim = 2,
                                  .max_batch = 2,
                                  .window = 3,
                                  .num_sink_tokens = 1,
                                  .max_append_len = 2}));
  };
  auto source = make();
  append_random(source, rng, 1, 9, 2);
  source.commit(1, std::vector<token_id>{1, 2, 3, 4, 5, 6, 7, 8, 9});
  check_semantic_edits(make, source, rng);
}

TEST_CASE("paged metadata set to edge values, checksums recomputed: typed error or a valid load") {
  auto rng = kvcache::test::make_rng("corrupt-semantic-paged");
  auto make = [] {
    return PagedCache<float>({.num_layers = 2,
                              .num_kv_heads = 1,
                              .head_dim = 2,
                              .num_blocks = 6,
                              .block_size = 2,
                              .max_batch = 2,
                              .max_seq_len = 8});
  };
  auto source = make();
  REQUIRE(source.admit(1, std::vector<token_id>{1, 2, 3, 4, 5, 6, 7}) == 0);
  append_random(source, rng, 1, 5, 2);  // 7 ids, 5 positions
  check_semantic_edits(make, source, rng);
}
