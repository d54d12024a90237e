// SPDX-License-Identifier: Apache-2.0
// Snapshots: save then load reproduces every policy bit for bit (positions, sliding-window ring,
// sinks and evicted gap, token ids), selected sequences land where asked, the file follows the
// documented layout, and every mismatch with the destination is refused with nothing changed.
#include "kvcache/io/snapshot.hpp"

#include <fstream>
#include <functional>
#include <tuple>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/snapshot_edit.hpp"
#include "support/snapshot_helpers.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::append_random;
using kvcache::test::require_same_contents;
using kvcache::test::require_throws;
using kvcache::test::TempDir;

namespace {

const ModelId kModel = ModelId::from_u64(0x5eed5eed12345678ull);

/// Saves `a` to a file, loads it into `b` with each load method, checks equality, then checks
/// that both caches evolve identically under the same appends.
template <class Cache>
void check_file_round_trip(const Cache& a, const std::function<Cache()>& make, std::mt19937_64& rng,
                           std::size_t max_chunk) {
  TempDir dir("snapshot-rt");
  const auto path = dir / "cache.kvs";
  save_snapshot(path, a, kModel);
  for (LoadMethod method : {LoadMethod::mmap, LoadMethod::read, LoadMethod::automatic}) {
    Cache b = make();
    const SnapshotInfo info = load_snapshot(path, b, kModel, {.method = method});
    INFO("method " << static_cast<int>(method));
    require_same_contents(a, b);
    REQUIRE(info.sequences.size() == a.max_batch());
    REQUIRE(info.file_bytes == std::filesystem::file_size(path));
    Cache a2 = make();  // a copy of `a` to evolve: restored from the same bytes
    load_snapshot(path, a2, kModel);
    for (std::size_t s = 0; s < a.max_batch(); ++s) {
      auto rng_b = rng;
      append_random(a2, rng, s, max_chunk, max_chunk);
      append_random(b, rng_b, s, max_chunk, max_chunk);
    }
    require_same_contents(a2, b);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("a static cache survives save and load bit for bit", "", float, half, bfloat16,
                   qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("snapshot-static");
  auto make = [] {
    return StaticCache<TestType>(
        {.num_layers = 3, .num_kv_heads = 2, .head_dim = 16, .max_batch = 3, .max_seq_len = 200});
  };
  StaticCache<TestType> a = make();
  append_random(a, rng, 0, 150, 33);
  append_random(a, rng, 2, 7, 3);  // sequence 1 stays empty
  check_file_round_trip<StaticCache<TestType>>(a, make, rng, 8);
}

TEMPLATE_TEST_CASE("a dynamic cache survives save and load bit for bit", "", float, half, bfloat16,
                   qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("snapshot-dynamic");
  auto make = [] {
    return DynamicCache<TestType>(
        {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .chunk_len = 16});
  };
  DynamicCache<TestType> a = make();
  append_random(a, rng, 0, 100, 20);
  append_random(a, rng, 1, 16, 16);
  check_file_round_trip<DynamicCache<TestType>>(a, make, rng, 5);
  // a different chunk_len is only a layout: the contents load all the same
  DynamicCache<TestType> c(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .chunk_len = 7});
  load_snapshot_bytes(snapshot_to_bytes(a, kModel), c, kModel);
  require_same_contents(a, c);
}

TEMPLATE_TEST_CASE("a sliding window survives save and load: absolute positions, sinks, gap", "",
                   float, half, qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("snapshot-sliding");
  auto make = [] {
    return SlidingWindowCache<TestType>({.num_layers = 2,
                                         .num_kv_heads = 2,
                                         .head_dim = 8,
                                         .max_batch = 3,
                                         .window = 32,
                                         .num_sink_tokens = 4,
                                         .max_append_len = 8});
  };
  SlidingWindowCache<TestType> a = make();
  append_random(a, rng, 0, 10000, 8);  // thousands of wrap-arounds
  append_random(a, rng, 1, 3, 2);      // still inside the sinks
  a.crop(0, 9998);                     // a rolled-back ring
  check_file_round_trip<SlidingWindowCache<TestType>>(a, make, rng, 8);

  const auto bytes = snapshot_to_bytes(a, kModel, std::vector<std::size_t>{0});
  const auto view = a.view(1, 0);
  REQUIRE(view.length() == 9998);
  REQUIRE(view.sink_end() == 4);
  // only sinks + ring are stored: ~ (4 + 39) positions x 2 layers, not 10000
  REQUIRE(bytes.size() < 2 * 2 * 2 * 8 * sizeof(TestType) * 50 + 2048);
  SlidingWindowCache<TestType> b = make();
  load_snapshot_bytes(bytes, b, kModel);
  const auto got = b.view(1, 0);
  REQUIRE(got.length() == 9998);
  REQUIRE(got.sink_end() == 4);
  REQUIRE(got.recent_begin() == view.recent_begin());
  REQUIRE(kvcache::test::check_view_invariants(got) == kvcache::test::check_view_invariants(view));
  // attention of the next token over the loaded window equals it over the original
  const auto q = kvcache::test::normal_floats(rng, 4 * 8);
  std::vector<float> out_a(q.size()), out_b(q.size());
  const AttentionOptions opts{.window = 32, .num_sink_tokens = 4};
  attend({q, 1, 4, 8}, view, {out_a, 1, 4, 8}, opts);
  attend({q, 1, 4, 8}, got, {out_b, 1, 4, 8}, opts);
  REQUIRE(out_a == out_b);
}

TEST_CASE("a sliding window loads into one with a larger max_append_len, not a smaller one") {
  auto rng = kvcache::test::make_rng("snapshot-sliding-ring");
  auto make = [](std::size_t max_append) {
    return SlidingWindowCache<float>({.num_layers = 1,
                                      .num_kv_heads = 1,
                                      .head_dim = 4,
                                      .window = 8,
                                      .num_sink_tokens = 2,
                                      .max_append_len = max_append});
  };
  SlidingWindowCache<float> a = make(4);
  append_random(a, rng, 0, 100, 4);
  const auto bytes = snapshot_to_bytes(a, kModel);
  SlidingWindowCache<float> wide = make(16);
  load_snapshot_bytes(bytes, wide, kModel);
  REQUIRE(kvcache::test::cache_contents(wide) == kvcache::test::cache_contents(a));
  SlidingWindowCache<float> narrow = make(1);  // ring_len 8 < the 11 ring positions held
  const auto before = kvcache::test::cache_contents(narrow);
  require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(bytes, narrow, kModel); },
                                          "ring positions", "destination's ring_len 8");
  REQUIRE(kvcache::test::cache_contents(narrow) == before);
}

TEST_CASE("a TokenTrackedCache snapshot carries its token ids") {
  auto rng = kvcache::test::make_rng("snapshot-tracked");
  auto make = [] {
    return TokenTrackedCache<StaticCache<half>>(StaticCache<half>(
        {.num_layers = 2, .num_kv_heads = 1, .head_dim = 8, .max_batch = 2, .max_seq_len = 64}));
  };
  auto a = make();
  std::vector<token_id> prompt(40);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<token_id>(1000 + 3 * i);
  append_random(a, rng, 1, prompt.size(), 16);
  a.commit(1, prompt);
  TempDir dir("snapshot-tracked");
  save_snapshot(dir / "p.kvs", a, kModel);

  auto b = make();
  const SnapshotInfo info = load_snapshot(dir / "p.kvs", b, kModel);
  REQUIRE(info.has_token_ids);
  REQUIRE(info.sequences[1].token_ids == prompt);
  require_same_contents(a.cache(), b.cache());
  REQUIRE(std::vector<token_id>(b.tokens(1).begin(), b.tokens(1).end()) == prompt);
  // the next request with the same system prompt reuses all of it but the last token
  auto next = prompt;
  next.push_back(77);
  REQUIRE(b.reuse_prefix(1, next) == prompt.size());

  // into a plain cache the ids are reported, not needed
  StaticCache<half> plain(
      {.num_layers = 2, .num_kv_heads = 1, .head_dim = 8, .max_batch = 2, .max_seq_len = 64});
  REQUIRE(load_snapshot(dir / "p.kvs", plain, kModel).sequences[1].token_ids == prompt);
  // a snapshot without ids cannot fill a tracked cache
  save_snapshot(dir / "plain.kvs", plain, kModel);
  auto c = make();
  require_throws<snapshot_mismatch_error>([&] { load_snapshot(dir / "plain.kvs", c, kModel); },
                                          "no token ids");
  REQUIRE(c.seq_length(1) == 0);
}

TEST_CASE("selected sequences are saved and loaded where asked; others stay untouched") {
  auto rng = kvcache::test::make_rng("snapshot-select");
  const StaticCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 2, .head_dim = 4, .max_batch = 4, .max_seq_len = 32};
  StaticCache<float> a(cfg), b(cfg);
  for (std::size_t s = 0; s < 4; ++s) append_random(a, rng, s, 5 + 3 * s, 4);
  for (std::size_t s = 0; s < 4; ++s) append_random(b, rng, s, 2 + s, 4);
  const auto b_before = kvcache::test::pack_all(b);
  const std::vector<std::size_t> saved{2, 0}, dest{1, 3};
  const auto bytes = snapshot_to_bytes(a, kModel, saved);
  const SnapshotInfo info = load_snapshot_bytes(bytes, b, kModel, {.dest_seqs = dest});
  REQUIRE(info.sequences.size() == 2);
  REQUIRE(info.sequences[0].seq == 2);
  REQUIRE(info.sequences[0].length == 11);
  for (std::size_t l = 0; l < 2; ++l) {
    const auto got1 = kvcache::test::pack_layer(b, l, 1),
               want1 = kvcache::test::pack_layer(a, l, 2);
    const auto got3 = kvcache::test::pack_layer(b, l, 3),
               want3 = kvcache::test::pack_layer(a, l, 0);
    REQUIRE((got1.length == want1.length && got1.k == want1.k && got1.v == want1.v));
    REQUIRE((got3.length == want3.length && got3.k == want3.k && got3.v == want3.v));
    for (std::size_t s : {0, 2}) {  // untouched
      const auto& old = b_before[l * 4 + s];
      const auto now = kvcache::test::pack_layer(b, l, s);
      REQUIRE((now.length == old.length && now.k == old.k && now.v == old.v));
    }
  }
  // default placement: the saved indices
  StaticCache<float> c(cfg);
  load_snapshot_bytes(bytes, c, kModel);
  REQUIRE(c.seq_length(2) == 11);
  REQUIRE(c.seq_length(0) == 5);
  REQUIRE(c.seq_length(1) == 0);

  const auto before = kvcache::test::cache_contents(b);
  require_throws<shape_error>(
      [&] { load_snapshot_bytes(bytes, b, kModel, {.dest_seqs = std::vector<std::size_t>{1}}); },
      "1 dest_seqs for 2 saved sequences");
  require_throws<batch_error>(
      [&] {
        load_snapshot_bytes(bytes, b, kModel, {.dest_seqs = std::vector<std::size_t>{1, 4}});
      },
      "sequence 4", "max_batch 4");
  require_throws<shape_error>(
      [&] {
        load_snapshot_bytes(bytes, b, kModel, {.dest_seqs = std::vector<std::size_t>{3, 3}});
      },
      "sequence 3 twice");
  REQUIRE(kvcache::test::cache_contents(b) == before);
  require_throws<batch_error>(
      [&] {
        (void)snapshot_to_bytes(a, kModel, std::vector<std::size_t>{0, 9});
      },
      "sequence 9");
  require_throws<shape_error>(
      [&] {
        (void)snapshot_to_bytes(a, kModel, std::vector<std::size_t>{1, 1});
      },
      "sequence 1 listed twice");
}

TEST_CASE("the file follows the documented layout, decoded by hand") {
  StaticCache<half> c(
      {.num_layers = 1, .num_kv_heads = 2, .head_dim = 3, .max_batch = 1, .max_seq_len = 8});
  // token t, head h, dim d: K = t + 10h + 0.25d, V = -K
  std::vector<float> k(2 * 2 * 3), v(k.size());
  for (std::size_t t = 0; t < 2; ++t) {
    for (std::size_t h = 0; h < 2; ++h) {
      for (std::size_t d = 0; d < 3; ++d) {
        k[(t * 2 + h) * 3 + d] = static_cast<float>(t) + 10.0f * h + 0.25f * d;
        v[(t * 2 + h) * 3 + d] = -k[(t * 2 + h) * 3 + d];
      }
    }
  }
  c.append(0, 0, TokenBlock<const float>{k, 2, 2, 3}, TokenBlock<const float>{v, 2, 2, 3});
  const auto bytes = snapshot_to_bytes(c, ModelId("tiny"));
  const std::span<const std::byte> f(bytes);
  using kvcache::test::get32;
  using kvcache::test::get64;
  REQUIRE(std::memcmp(f.data(), "\x89KVC\r\n\x1a\n", 8) == 0);
  REQUIRE(get32(f, 8) == 1);
  REQUIRE(get32(f, 12) == 0x0A0B0C0Du);
  REQUIRE(get32(f, 20) == 3);  // META, SEQUENCE, one LAYER_KV
  REQUIRE(get64(f, 24) == bytes.size());
  REQUIRE(get32(f, 60) == crc32c(f.first(60)));
  std::vector<std::uint64_t> offsets;
  for (std::size_t i = 0; i < 3; ++i) {
    const std::size_t e = 64 + 32 * i;
    REQUIRE(get32(f, e) == i + 1);  // kinds 1, 2, 3
    offsets.push_back(get64(f, e + 8));
    REQUIRE(offsets.back() % 64 == 0);
    REQUIRE(get32(f, e + 24) == crc32c(f.subspan(offsets.back(), get64(f, e + 16))));
  }
  const std::size_t m = offsets[0];
  REQUIRE(get32(f, m) == 1);      // StaticCache
  REQUIRE(get32(f, m + 4) == 1);  // f16
  REQUIRE(get64(f, m + 8) == 1);
  REQUIRE(get64(f, m + 16) == 2);
  REQUIRE(get64(f, m + 24) == 3);
  REQUIRE(get64(f, m + 40) == 8);  // max_seq_len
  REQUIRE(get32(f, m + 92) == 4);
  REQUIRE(std::memcmp(f.data() + m + 96, "tiny", 4) == 0);
  REQUIRE(get64(f, m + 160) == 1);
  const std::size_t s = offsets[1];
  REQUIRE(get64(f, s) == 0);       // sequence 0
  REQUIRE(get64(f, s + 16) == 2);  // layer 0 length
  const std::size_t kv = offsets[2];
  REQUIRE(get64(f, kv + 16) == 2);       // held
  for (std::size_t h = 0; h < 2; ++h) {  // K [head][pos][dim], then V
    for (std::size_t t = 0; t < 2; ++t) {
      for (std::size_t d = 0; d < 3; ++d) {
        const std::size_t i = (h * 2 + t) * 3 + d;
        std::uint16_t kb, vb;
        std::memcpy(&kb, f.data() + kv + 64 + 2 * i, 2);
        std::memcpy(&vb, f.data() + kv + 64 + 2 * (12 + i), 2);
        const float want = static_cast<float>(t) + 10.0f * h + 0.25f * d;
        REQUIRE(half::to_float(kb) == want);
        REQUIRE(half::to_float(vb) == -want);
      }
    }
  }
}

TEST_CASE("an unknown optional section is skipped; an unknown required one is refused") {
  auto rng = kvcache::test::make_rng("snapshot-sections");
  const StaticCacheConfig cfg{
      .num_layers = 2, .num_kv_heads = 1, .head_dim = 4, .max_batch = 1, .max_seq_len = 16};
  StaticCache<float> a(cfg);
  append_random(a, rng, 0, 9, 4);
  auto sections = kvcache::test::split_sections(snapshot_to_bytes(a, kModel));
  const kvcache::test::RawSection extra{9, snapshot_format::kFlagOptional,
                                        std::vector<std::byte>(100, std::byte{7})};
  for (std::size_t at : {1, 3, 4}) {  // after META, between layers, at the end
    auto with = sections;
    with.insert(with.begin() + static_cast<std::ptrdiff_t>(at), extra);
    StaticCache<float> b(cfg);
    load_snapshot_bytes(kvcache::test::encode_sections(with), b, kModel);
    require_same_contents(a, b);
    with[at].flags = 0;
    StaticCache<float> c(cfg);
    require_throws<snapshot_format_error>(
        [&] { load_snapshot_bytes(kvcache::test::encode_sections(with), c, kModel); }, "kind 9");
    REQUIRE(c.seq_length(0) == 0);
  }
}

TEST_CASE("a snapshot for another model, policy or shape is refused, nothing changed") {
  auto rng = kvcache::test::make_rng("snapshot-mismatch");
  StaticCache<half> a(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .max_seq_len = 32});
  append_random(a, rng, 0, 20, 8);
  append_random(a, rng, 1, 30, 8);
  const auto bytes = snapshot_to_bytes(a, kModel);

  auto check = [&](auto& dest, const ModelId& id, auto... pieces) {
    append_random(dest, rng, 0, 3, 3);
    const auto before = kvcache::test::cache_contents(dest);
    const std::string what = require_throws<snapshot_mismatch_error>(
        [&] { load_snapshot_bytes(bytes, dest, id); }, pieces...);
    REQUIRE(kvcache::test::cache_contents(dest) == before);
    return what;
  };
  StaticCache<half> same(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .max_seq_len = 32});
  check(same, ModelId::from_u64(1), "model id", "differs", "file offset 416");
  StaticCache<bfloat16> bf(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .max_seq_len = 32});
  check(bf, kModel, "dtype f16 differs from the destination's bf16");
  StaticCache<half> layers(
      {.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .max_seq_len = 32});
  check(layers, kModel, "num_layers 2 differs from the destination's 3");
  StaticCache<half> heads(
      {.num_layers = 2, .num_kv_heads = 1, .head_dim = 8, .max_batch = 2, .max_seq_len = 32});
  check(heads, kModel, "num_kv_heads 2 differs from the destination's 1");
  StaticCache<half> dim(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .max_batch = 2, .max_seq_len = 32});
  check(dim, kModel, "head_dim 8 differs from the destination's 16");
  StaticCache<half> batch(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 1, .max_seq_len = 32});
  check(batch, kModel, "sequence 1 does not exist in the destination", "max_batch 1");
  StaticCache<half> short_cache(
      {.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2, .max_seq_len = 25});
  check(short_cache, kModel, "sequence 1 layer 0 holds 30 positions",
        "destination's max_seq_len 25");
  DynamicCache<half> dyn({.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .max_batch = 2});
  check(dyn, kModel, "saved by a StaticCache, the destination is a DynamicCache");

  SlidingWindowCache<half> w({.num_layers = 2,
                              .num_kv_heads = 2,
                              .head_dim = 8,
                              .max_batch = 2,
                              .window = 16,
                              .num_sink_tokens = 1});
  append_random(w, rng, 0, 40, 1);
  const auto wbytes = snapshot_to_bytes(w, kModel);
  for (const auto& [window, sinks, piece] :
       {std::tuple{std::size_t{8}, std::size_t{1}, "window 16 differs"},
        std::tuple{std::size_t{16}, std::size_t{2}, "num_sink_tokens 1 differs"}}) {
    SlidingWindowCache<half> other({.num_layers = 2,
                                    .num_kv_heads = 2,
                                    .head_dim = 8,
                                    .max_batch = 2,
                                    .window = window,
                                    .num_sink_tokens = sinks});
    const auto before = kvcache::test::cache_contents(other);
    require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(wbytes, other, kModel); },
                                            piece);
    REQUIRE(kvcache::test::cache_contents(other) == before);
  }
}

TEST_CASE("file errors: missing file, missing directory, misaligned memory") {
  auto rng = kvcache::test::make_rng("snapshot-files");
  TempDir dir("snapshot-files");
  StaticCache<float> a(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .max_batch = 1, .max_seq_len = 8});
  append_random(a, rng, 0, 5, 5);
  require_throws<io_error>([&] { load_snapshot(dir / "missing.kvs", a, kModel); }, "missing.kvs");
  require_throws<io_error>([&] { save_snapshot(dir / "no" / "such.kvs", a, kModel); },
                           "no/such.kvs");
  REQUIRE(!std::filesystem::exists(dir / "no"));
  REQUIRE_THROWS_AS(load_snapshot(dir.path(), a, kModel), format_error);  // a directory
  // a snapshot at an odd address in memory (inside a larger buffer) loads the same
  const auto bytes = snapshot_to_bytes(a, kModel);
  std::vector<std::byte> shifted(bytes.size() + 1);
  std::copy(bytes.begin(), bytes.end(), shifted.begin() + 1);
  StaticCache<float> b(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .max_batch = 1, .max_seq_len = 8});
  load_snapshot_bytes(std::span<const std::byte>(shifted).subspan(1), b, kModel);
  require_same_contents(a, b);
  // read_snapshot_info validates and describes without a destination
  save_snapshot(dir / "a.kvs", a, kModel);
  const SnapshotInfo info = read_snapshot_info(dir / "a.kvs");
  REQUIRE(info.policy == SnapshotPolicy::static_cache);
  REQUIRE(info.shape == a.shape());
  REQUIRE(info.params.max_seq_len == 8);
  REQUIRE(info.model_id == kModel);
  REQUIRE(info.sequences.size() == 1);
  REQUIRE(info.sequences[0].length == 5);
}
