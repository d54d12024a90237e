// SPDX-License-Identifier: Apache-2.0
// PagedCache snapshots: save then load reproduces every sequence (K/V, lengths, token ids) in a
// pool of any block size; the loaded full blocks serve prefix-cache hits once released (a prompt
// prefilled by one process, reused by another); a pool too small is refused with nothing changed;
// paged and unpaged snapshots never mix; the format's policy-4 rules are enforced.
#include <algorithm>
#include <numeric>
#include <utility>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/snapshot_edit.hpp"
#include "support/snapshot_helpers.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::concat;
using kvcache::test::iota_ids;
using kvcache::test::paged_state;
using kvcache::test::require_same_contents;
using kvcache::test::require_throws;
using kvcache::test::SyntheticModel;
using kvcache::test::table_of;
using kvcache::test::TempDir;

static_assert(SnapshotCache<PagedCache<float>>);
static_assert(SnapshotCache<PagedCache<half>>);
static_assert(SnapshotCache<PagedCache<bfloat16>>);
// A PagedCache tracks its ids itself: wrapped in a TokenTrackedCache it is not snapshotted.
static_assert(!SnapshotCache<TokenTrackedCache<PagedCache<float>>>);

namespace {

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 8;
const SyntheticModel kSynth{kLayers, kHeads, kDim};
const ModelId kModel = ModelId::from_u64(0x9a6ed5eedull);

template <KVElement T = float>
PagedCache<T> make_paged(std::size_t num_blocks, std::size_t block_size, std::size_t max_batch,
                         bool evict = false, std::size_t max_seq_len = 0) {
  return PagedCache<T>({.num_layers = kLayers,
                        .num_kv_heads = kHeads,
                        .head_dim = kDim,
                        .num_blocks = num_blocks,
                        .block_size = block_size,
                        .max_batch = max_batch,
                        .max_seq_len = max_seq_len,
                        .evict_when_full = evict});
}

template <class Cache>
std::vector<token_id> ids_of(const Cache& cache, std::size_t seq) {
  const auto ids = cache.tokens(seq);
  return {ids.begin(), ids.end()};
}

// Contents, ids and a clean consistency check: what a load must reproduce.
template <class A, class B>
void require_same_sequences(const A& a, const B& b) {
  require_same_contents(a, b);
  for (std::size_t s = 0; s < a.max_batch(); ++s) {
    INFO("sequence " << s);
    REQUIRE(ids_of(b, s) == ids_of(a, s));
  }
  REQUIRE(b.check_consistency() == "");
}

// Attention of the last 3 positions of every (layer, sequence) of b: equal to the reference over
// a's view (within fp32-accumulation tolerance), and bit for bit to kvcache::attend over a's view
// when `exact` (same block size: the same segments).
template <class A, class B>
void require_same_attention(const A& a, const B& b, std::mt19937_64& rng, bool exact) {
  for (std::size_t s = 0; s < a.max_batch(); ++s) {
    for (std::size_t l = 0; l < kLayers; ++l) {
      const auto va = a.view(l, s), vb = b.view(l, s);
      if (vb.length() == 0) continue;
      const std::size_t nq = std::min<std::size_t>(3, static_cast<std::size_t>(vb.length()));
      const std::size_t q_heads = 2 * kHeads;
      const auto q = kvcache::test::normal_floats(rng, nq * q_heads * kDim);
      std::vector<float> want(q.size()), got(q.size()), same(q.size());
      reference::attend({q, nq, q_heads, kDim}, va, {want, nq, q_heads, kDim});
      attend({q, nq, q_heads, kDim}, vb, {got, nq, q_heads, kDim});
      INFO("sequence " << s << " layer " << l << " length " << vb.length());
      kvcache::test::require_close(got, want, kvcache::test::Tolerance{2e-5, 2e-5});
      if (exact) {
        attend({q, nq, q_heads, kDim}, va, {same, nq, q_heads, kDim});
        REQUIRE(got == same);
      }
    }
  }
}

// The first n positions of a packed [heads][held][dim] array.
template <class T>
std::vector<T> first_positions(const std::vector<T>& packed, std::size_t held, std::size_t n) {
  std::vector<T> out;
  for (std::size_t h = 0; h < kHeads; ++h) {
    const auto from = packed.begin() + static_cast<std::ptrdiff_t>(h * held * kDim);
    out.insert(out.end(), from, from + static_cast<std::ptrdiff_t>(n * kDim));
  }
  return out;
}

// Process 1 of the system-prompt flow: prefills `system` into sequence 0 and returns the snapshot.
template <KVElement T>
std::vector<std::byte> system_prompt_snapshot(const std::vector<token_id>& system,
                                              std::size_t block_size) {
  auto p = make_paged<T>(64, block_size, 1);
  kSynth.run_prompt(p, 0, system, 7);
  return snapshot_to_bytes(p, kModel);
}

}  // namespace

TEMPLATE_TEST_CASE("a paged cache survives save and load: K/V, lengths, token ids, attention", "",
                   float, half, qint8, fp8_e4m3) {
  auto rng = kvcache::test::make_rng("snapshot-paged-round-trip");
  auto make = [] { return make_paged<TestType>(40, 4, 4); };
  auto a = make();
  const auto system = kvcache::test::prompt_with_prefix(rng, {}, 18);
  const auto ids0 = concat(system, iota_ids(5, 1000));
  auto ids1 = concat(system, iota_ids(7, 2000));
  const auto ids2 = iota_ids(13, 3000);
  REQUIRE(kSynth.run_prompt(a, 0, ids0) == 0);
  REQUIRE(kSynth.run_prompt(a, 1, ids1) == 16);  // shares sequence 0's first 4 blocks
  kSynth.decode(a, 1, ids1, 2100);
  kSynth.decode(a, 1, ids1, 2101);
  REQUIRE(a.admit(2, ids2) == 0);  // ids ahead of the K/V: only 6 of 13 positions prefilled
  kSynth.prefill(a, 2, ids2, 0, 6, 4);
  const auto ids3 = iota_ids(5, 5000);  // layers filled unevenly: 5 positions, then 2
  REQUIRE(a.admit(3, ids3) == 0);
  for (std::size_t l = 0; l < kLayers; ++l) {
    const std::size_t n = l == 0 ? 5 : 2;
    const auto kv = kSynth.kv(l, ids3, 0, n);
    a.append(l, 3, kv.k_block(0, n), kv.v_block(0, n));
  }
  REQUIRE(a.check_consistency() == "");
  const PrefixCacheStats sa = a.stats();
  REQUIRE(sa.blocks_used == 6 + 3 + 2 + 2);

  TempDir dir("snapshot-paged");
  save_snapshot(dir / "paged.kvs", a, kModel);
  for (LoadMethod method : {LoadMethod::mmap, LoadMethod::read, LoadMethod::automatic}) {
    INFO("method " << static_cast<int>(method));
    auto b = make();
    const SnapshotInfo info = load_snapshot(dir / "paged.kvs", b, kModel, {.method = method});
    REQUIRE(info.policy == SnapshotPolicy::paged_cache);
    REQUIRE(info.has_token_ids);
    REQUIRE(info.params.block_len == 4);
    REQUIRE(info.sequences.size() == 4);
    REQUIRE(info.sequences[2].token_ids == ids2);
    REQUIRE(info.sequences[2].length == 6);
    require_same_sequences(a, b);
    REQUIRE(b.seq_length(2) == 6);
    REQUIRE(b.tokens(2).size() == 13);
    REQUIRE(b.layer_length(0, 3) == 5);
    REQUIRE(b.layer_length(1, 3) == 2);
    // the sharing through the prefix index is rebuilt: sequence 1's first 4 blocks are 0's
    const PrefixCacheStats sb = b.stats();
    REQUIRE(sb.blocks_used == sa.blocks_used);
    REQUIRE(sb.blocks_cached == 0);
    REQUIRE(sb.blocks_free == 40 - sa.blocks_used);
    REQUIRE(sb.prompts == 0);  // a load is not a prompt
    const auto t0 = table_of(b, 0), t1 = table_of(b, 1);
    REQUIRE(std::equal(t0.begin(), t0.begin() + 4, t1.begin()));
    REQUIRE(t0[4] != t1[4]);
    for (std::size_t s : {0, 1}) {
      kSynth.require_attention_matches(b, s, s == 0 ? ids0 : ids1, rng);
    }
    require_same_attention(a, b, rng, true);

    // both evolve identically: decoding, finishing the prefill of sequence 2, copy-on-write
    auto a2 = make();
    load_snapshot(dir / "paged.kvs", a2, kModel);
    auto ids1a = ids1, ids1b = ids1;
    kSynth.decode(a2, 1, ids1a, 2102);
    kSynth.decode(b, 1, ids1b, 2102);
    kSynth.prefill(a2, 2, ids2, 6, 7, 3);
    kSynth.prefill(b, 2, ids2, 6, 7, 3);
    for (auto* c : {&a2, &b}) {
      c->release(3);
      c->fork(0, 3);
    }
    auto ids3a = ids0, ids3b = ids0;
    kSynth.decode(a2, 3, ids3a, 4000);  // into the shared partial block: copy-on-write
    kSynth.decode(b, 3, ids3b, 4000);
    require_same_sequences(a2, b);
    REQUIRE(b.stats().blocks_used == a2.stats().blocks_used);
    kSynth.require_attention_matches(b, 2, ids2, rng);
  }
}

TEMPLATE_TEST_CASE(
    "a released loaded sequence serves prefix-cache hits: admit reuses its blocks and "
    "reads the saved K/V",
    "", float, half) {
  auto rng = kvcache::test::make_rng("snapshot-paged-hit");
  const auto system = kvcache::test::prompt_with_prefix(rng, {}, 22);
  const auto bytes = system_prompt_snapshot<TestType>(system, 4);
  auto source = make_paged<TestType>(64, 4, 1);  // the same K/V, to compare with
  kSynth.run_prompt(source, 0, system, 7);

  auto q = make_paged<TestType>(16, 4, 2);  // "another process"
  load_snapshot_bytes(bytes, q, kModel);
  REQUIRE(ids_of(q, 0) == system);
  const auto loaded = table_of(q, 0);
  REQUIRE(loaded.size() == 6);
  q.release(0);
  PrefixCacheStats st = q.stats();
  REQUIRE(st.blocks_cached == 5);  // the 5 full blocks stay indexed; the partial 6th is freed
  REQUIRE(st.blocks_used == 0);
  REQUIRE(st.blocks_free == 11);
  REQUIRE(q.check_consistency() == "");

  const auto prompt = concat(system, iota_ids(9, 500));
  REQUIRE(q.match_prefix(prompt) == 20);
  REQUIRE(q.match_prefix(std::vector<token_id>(system.begin(), system.begin() + 11)) == 8);
  REQUIRE(q.admit(1, prompt) == 20);
  st = q.stats();
  REQUIRE(st.prompts == 1);
  REQUIRE(st.reused_tokens == 20);
  REQUIRE(st.blocks_used == 5);
  const auto hit = table_of(q, 1);
  REQUIRE(std::equal(hit.begin(), hit.end(), loaded.begin()));
  for (std::size_t l = 0; l < kLayers; ++l) {  // the K/V read through the hit are the saved ones
    const auto got = kvcache::test::pack_layer(q, l, 1);
    const auto want = kvcache::test::pack_layer(source, l, 0);
    REQUIRE(got.length == 20);
    REQUIRE(got.k == first_positions(want.k, system.size(), 20));
    REQUIRE(got.v == first_positions(want.v, system.size(), 20));
  }
  kSynth.prefill(q, 1, prompt, 20, prompt.size() - 20, 4);
  kSynth.require_attention_matches(q, 1, prompt, rng);
  REQUIRE(q.check_consistency() == "");
  // the whole system prompt as a prompt: its last token is left to run
  q.release(1);
  REQUIRE(q.admit(0, system) == 20);
  REQUIRE(q.admit(1, std::vector<token_id>(system.begin(), system.begin() + 20)) == 19);
}

TEST_CASE("a paged snapshot loads into a pool of another block size") {
  auto rng = kvcache::test::make_rng("snapshot-paged-block-size");
  const auto system = kvcache::test::prompt_with_prefix(rng, {}, 22);
  auto source = make_paged<float>(64, 4, 2);
  kSynth.run_prompt(source, 0, system, 7);
  auto other = concat(std::vector<token_id>(system.begin(), system.begin() + 13), iota_ids(6, 70));
  kSynth.run_prompt(source, 1, other, 3);
  const auto bytes = snapshot_to_bytes(source, kModel);
  for (std::size_t bs : {1, 3, 5, 16, 32}) {
    INFO("destination block_size " << bs);
    auto dest = make_paged<float>(64, bs, 2);
    load_snapshot_bytes(bytes, dest, kModel);
    require_same_sequences(source, dest);
    require_same_attention(source, dest, rng, false);
    kSynth.require_attention_matches(dest, 0, system, rng);
    kSynth.require_attention_matches(dest, 1, other, rng);
    dest.release(0);
    dest.release(1);
    const auto prompt = concat(system, iota_ids(4, 900));
    const std::size_t want = system.size() / bs * bs;
    REQUIRE(dest.match_prefix(prompt) == want);
    REQUIRE(dest.admit(0, prompt) == want);
    kSynth.prefill(dest, 0, prompt, want, prompt.size() - want, 5);
    kSynth.require_attention_matches(dest, 0, prompt, rng);
    REQUIRE(dest.check_consistency() == "");
  }
  // and back: a block size of 3 saved, loaded into 4
  auto three = make_paged<float>(64, 3, 2);
  load_snapshot_bytes(bytes, three, kModel);
  auto four = make_paged<float>(64, 4, 2);
  load_snapshot_bytes(snapshot_to_bytes(three, kModel), four, kModel);
  require_same_sequences(source, four);
}

TEST_CASE("a destination pool too small is refused with pool_exhausted_error, nothing changed") {
  auto rng = kvcache::test::make_rng("snapshot-paged-pool");
  auto source = make_paged<float>(64, 4, 2);
  kSynth.run_prompt(source, 0, iota_ids(22, 100));  // 6 blocks
  kSynth.run_prompt(source, 1, iota_ids(9, 200));   // 3 blocks
  const auto bytes = snapshot_to_bytes(source, kModel);

  // 10 blocks: 2 held by sequence 2, 2 cached (a released prompt), 6 free; the load needs 9
  auto setup = [&](bool evict, std::size_t blocks) {
    auto dest = make_paged<float>(blocks, 4, 3, evict);
    kSynth.run_prompt(dest, 0, iota_ids(8, 300));
    dest.release(0);
    kSynth.run_prompt(dest, 2, iota_ids(7, 400));
    return dest;
  };
  for (bool evict : {false, true}) {
    INFO("evict_when_full " << evict);
    auto dest = setup(evict, 10);
    const auto before = paged_state(dest);
    REQUIRE(before.stats.blocks_free == 6);
    REQUIRE(before.stats.blocks_cached == 2);
    bool thrown = false;
    try {
      load_snapshot_bytes(bytes, dest, kModel);
    } catch (const pool_exhausted_error& e) {
      thrown = true;
      INFO(e.what());
      REQUIRE(e.needed() == 9);
      REQUIRE(e.free() == 6);
      REQUIRE(e.evictable() == 2);
      const std::string what = e.what();
      REQUIRE(what.find("restore of 2 sequences needs 9 blocks but the pool of 10 has 6 free and "
                        "2 evictable") != std::string::npos);
    }
    REQUIRE(thrown);
    REQUIRE(paged_state(dest) == before);
    REQUIRE(dest.check_consistency() == "");
    REQUIRE(dest.seq_length(2) == 7);
    REQUIRE(dest.seq_length(0) == 0);
  }
  {  // one block more: with eviction the 2 cached blocks make room
    auto dest = setup(true, 11);
    load_snapshot_bytes(bytes, dest, kModel);
    REQUIRE(dest.stats().evictions == 2);
    REQUIRE(dest.seq_length(2) == 7);
    REQUIRE(dest.check_consistency() == "");
    for (std::size_t s : {0, 1}) {
      REQUIRE(ids_of(dest, s) == ids_of(source, s));
      for (std::size_t l = 0; l < kLayers; ++l) {
        REQUIRE(kvcache::test::view_contents(dest.view(l, s)) ==
                kvcache::test::view_contents(source.view(l, s)));
      }
    }
    auto no_evict = setup(false, 11);
    const auto before = paged_state(no_evict);
    require_throws<pool_exhausted_error>([&] { load_snapshot_bytes(bytes, no_evict, kModel); },
                                         "needs 9 blocks", "7 free and 2 evictable",
                                         "eviction is off");
    REQUIRE(paged_state(no_evict) == before);
  }
  {  // the blocks the replaced sequences hold alone count, exactly: a full pool reloads
    auto dest = make_paged<float>(9, 4, 2);
    kvcache::test::append_random(dest, rng, 0, 16, 5);  // no ids: 4 blocks, not indexed
    kvcache::test::append_random(dest, rng, 1, 19, 5);  // 5 blocks
    REQUIRE(dest.stats().blocks_free == 0);
    load_snapshot_bytes(bytes, dest, kModel);
    require_same_sequences(source, dest);
    REQUIRE(dest.stats().blocks_used == 9);
  }
  {  // ... but not a block another sequence still holds (a fork)
    auto dest = make_paged<float>(5, 4, 2);
    kvcache::test::append_random(dest, rng, 0, 16, 5);
    dest.fork(0, 1);  // 4 blocks held twice, 1 free
    auto small = make_paged<float>(8, 4, 2);
    kSynth.run_prompt(small, 0, iota_ids(8, 10));
    kSynth.run_prompt(small, 1, iota_ids(8, 20));
    const auto one = snapshot_to_bytes(small, kModel, std::vector<std::size_t>{0});
    const auto before = paged_state(dest);
    require_throws<pool_exhausted_error>(
        [&] { load_snapshot_bytes(one, dest, kModel); },
        "restore of 1 sequences needs 2 blocks but the pool of 5 has 1 free and 0 evictable, "
        "counting the 0 blocks only the replaced sequences hold");
    REQUIRE(paged_state(dest) == before);
    // replacing both holders frees the 4 shared blocks: 2 x 2 blocks fit
    load_snapshot_bytes(snapshot_to_bytes(small, kModel), dest, kModel);
    require_same_sequences(small, dest);
    REQUIRE(dest.stats().blocks_free == 1);
  }
  {  // sequences holding the same content: their 7 full blocks are shared, not copied, and
     // their 2 partial blocks freed make room for the 2 new ones; no eviction needed
    for (bool evict : {false, true}) {
      auto dest = make_paged<float>(9, 4, 2, evict);
      load_snapshot_bytes(bytes, dest, kModel);
      const auto before = paged_state(dest);
      load_snapshot_bytes(bytes, dest, kModel);
      require_same_sequences(source, dest);
      const auto after = paged_state(dest);
      REQUIRE(std::equal(before.tables[0].begin(), before.tables[0].begin() + 5,
                         after.tables[0].begin()));
      REQUIRE(std::equal(before.tables[1].begin(), before.tables[1].begin() + 2,
                         after.tables[1].begin()));
      REQUIRE(after.stats.blocks_used == 9);
      REQUIRE(after.stats.evictions == 0);
    }
  }
}

TEST_CASE(
    "sequences that shared a prefix share it again after a load, in a pool of the same size") {
  auto rng = kvcache::test::make_rng("snapshot-paged-batch");
  const auto system = kvcache::test::prompt_with_prefix(rng, {}, 18);  // 4 full blocks + 2
  auto source = make_paged<float>(20, 4, 4);
  // sequence 0 runs the system prompt; 1..3 start with it and go on (1 and 2 sharing 3 more
  // blocks), each sharing the 4 full blocks through admit()
  kSynth.run_prompt(source, 0, system, 5);
  const auto long_prefix = concat(system, iota_ids(10, 300));
  kSynth.run_prompt(source, 1, concat(long_prefix, iota_ids(3, 40)), 5);
  kSynth.run_prompt(source, 2, concat(long_prefix, iota_ids(5, 50)), 5);
  kSynth.run_prompt(source, 3, concat(system, iota_ids(7, 60)), 5);
  const PrefixCacheStats used = source.stats();
  REQUIRE(used.blocks_used < 20);
  REQUIRE(source.check_consistency() == "");
  const auto bytes = snapshot_to_bytes(source, kModel);
  for (bool evict : {false, true}) {
    INFO("evict_when_full " << evict);
    auto dest = make_paged<float>(used.blocks_used, 4, 4, evict);  // exactly as many blocks
    load_snapshot_bytes(bytes, dest, kModel);
    require_same_sequences(source, dest);
    REQUIRE(dest.stats().blocks_used == used.blocks_used);
    REQUIRE(dest.stats().blocks_free == 0);
    const auto t0 = table_of(dest, 0), t1 = table_of(dest, 1);
    for (std::size_t s = 1; s < 4; ++s) {  // the system prompt's blocks, once
      const auto ts = table_of(dest, s);
      REQUIRE(std::equal(t0.begin(), t0.begin() + 4, ts.begin()));
    }
    const auto t2 = table_of(dest, 2);
    REQUIRE(std::equal(t1.begin(), t1.begin() + 7, t2.begin()));
    for (std::size_t s = 0; s < 4; ++s) {
      kSynth.require_attention_matches(dest, s, ids_of(source, s), rng);
    }
  }
}

TEST_CASE("random batches with shared prefixes reload into a pool of the same size") {
  auto rng = kvcache::test::make_rng("snapshot-paged-batch-random");
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t bs = kvcache::test::uniform(rng, 1, 5);
    const std::size_t seqs = kvcache::test::uniform(rng, 2, 6);
    // prompts branching off a few stems at random points; some with ids ahead of their K/V
    std::vector<std::vector<token_id>> stems;
    for (int i = 0; i < 3; ++i) stems.push_back(kvcache::test::prompt_with_prefix(rng, {}, 30));
    auto source = make_paged<float>(200, bs, seqs, false, 64);
    for (std::size_t s = 0; s < seqs; ++s) {
      const auto& stem = stems[kvcache::test::uniform(rng, 0, 2)];
      const auto prompt =
          kvcache::test::prompt_with_prefix(rng, stem, kvcache::test::uniform(rng, 1, 40), 3);
      const std::size_t cached = source.admit(s, prompt);
      const std::size_t rest = prompt.size() - cached;
      const std::size_t run =
          kvcache::test::uniform(rng, 0, 3) == 0 ? kvcache::test::uniform(rng, 0, rest) : rest;
      kSynth.prefill(source, s, prompt, cached, run, 4);
    }
    if (kvcache::test::uniform(rng, 0, 1) == 0) source.release(0);  // some blocks cached
    REQUIRE(source.check_consistency() == "");
    const std::size_t used = source.stats().blocks_used;
    const auto bytes = snapshot_to_bytes(source, kModel);
    INFO("trial " << trial << " block_size " << bs << " sequences " << seqs << " used " << used);
    auto dest = make_paged<float>(std::max<std::size_t>(used, 1), bs, seqs, false, 64);
    load_snapshot_bytes(bytes, dest, kModel);
    require_same_sequences(source, dest);  // it fit: no more blocks than the source used
    for (std::size_t s = 0; s < seqs; ++s) {
      const auto ids = ids_of(source, s);
      if (dest.seq_length(s) != 0) {
        kSynth.require_attention_matches(
            dest, s, std::span<const token_id>(ids).first(dest.seq_length(s)), rng);
      }
    }
    // loaded again over itself: the indexed blocks stay, the rest fit in what they free
    load_snapshot_bytes(bytes, dest, kModel);
    require_same_sequences(source, dest);
  }
}

TEST_CASE("restoring a prefix the pool caches shares its blocks: only the rest needs room") {
  auto rng = kvcache::test::make_rng("snapshot-paged-shared");
  const auto system = kvcache::test::prompt_with_prefix(rng, {}, 22);  // 5 full blocks + 2
  const auto bytes = system_prompt_snapshot<float>(system, 4);
  auto source = make_paged<float>(64, 4, 1);
  kSynth.run_prompt(source, 0, system, 7);
  const auto other = iota_ids(4, 900);
  // 8 blocks: the system prompt's 5 full blocks cached (loaded, released), then one block of
  // another prompt cached after them (the most recently released), 2 held by sequence 1
  auto setup = [&](bool evict) {
    auto dest = make_paged<float>(8, 4, 2, evict);
    load_snapshot_bytes(bytes, dest, kModel);
    const auto loaded = table_of(dest, 0);
    dest.release(0);
    kSynth.run_prompt(dest, 1, other);
    dest.release(1);
    kvcache::test::append_random(dest, rng, 1, 8, 3);
    const PrefixCacheStats st = dest.stats();
    REQUIRE(st.blocks_free == 0);
    REQUIRE(st.blocks_cached == 6);
    return std::pair{std::move(dest), loaded};
  };
  {  // the load needs 1 block (the partial one): the only evictable block is the other prompt's,
     // although the system prompt's were released first
    auto [dest, loaded] = setup(true);
    load_snapshot_bytes(bytes, dest, kModel);
    const PrefixCacheStats st = dest.stats();
    REQUIRE(st.evictions == 1);
    REQUIRE(st.blocks_cached == 0);
    REQUIRE(st.blocks_used == 8);
    const auto table = table_of(dest, 0);
    REQUIRE(std::equal(loaded.begin(), loaded.begin() + 5, table.begin()));
    REQUIRE(dest.match_prefix(other) == 0);
    REQUIRE(ids_of(dest, 0) == system);
    for (std::size_t l = 0; l < kLayers; ++l) {
      REQUIRE(kvcache::test::view_contents(dest.view(l, 0)) ==
              kvcache::test::view_contents(source.view(l, 0)));
    }
    kSynth.require_attention_matches(dest, 0, system, rng);
    REQUIRE(dest.check_consistency() == "");
    // and released again, the prefix is cached once: an admit shares it
    dest.release(0);
    REQUIRE(dest.stats().blocks_cached == 5);
    REQUIRE(dest.admit(0, concat(system, iota_ids(3, 50))) == 20);
    REQUIRE(dest.check_consistency() == "");
  }
  {  // without eviction the one block is not there: refused, the shared blocks counted, nothing
     // changed (the system prompt's blocks still cached, none held)
    auto [dest, loaded] = setup(false);
    const auto before = paged_state(dest);
    require_throws<pool_exhausted_error>(
        [&, &d = dest] { load_snapshot_bytes(bytes, d, kModel); },
        "restore of 1 sequences needs 1 blocks but the pool of 8 has 0 free and 1 evictable",
        "sharing 5 already cached", "eviction is off");
    REQUIRE(paged_state(dest) == before);
    REQUIRE(dest.check_consistency() == "");
    REQUIRE(dest.match_prefix(system) == 20);
  }
}

TEST_CASE("PagedCache::restore validates everything before it changes anything") {
  auto c = make_paged<float>(8, 4, 3, false, 12);
  kSynth.run_prompt(c, 0, iota_ids(9, 1));
  kSynth.run_prompt(c, 1, iota_ids(6, 50));
  c.release(1);
  const auto before = paged_state(c);
  std::vector<float> k(12 * kHeads * kDim, 0.5f), v(k.size(), -0.5f);
  const std::vector<token_id> ids = iota_ids(10, 7);
  auto entry = [&](std::size_t layer, std::size_t seq, position_t length) {
    const std::size_t n = static_cast<std::size_t>(length) * kHeads * kDim;
    return LayerRestore<float>{layer,
                               seq,
                               length,
                               0,
                               0,
                               std::span<const float>(k).first(n),
                               std::span<const float>(v).first(n)};
  };
  auto check = [&]<class E>(std::vector<LayerRestore<float>> entries,
                            std::vector<SequenceTokens> tokens, auto... pieces) {
    require_throws<E>([&] { c.restore(entries, tokens); }, pieces...);
    REQUIRE(paged_state(c) == before);
    REQUIRE(c.check_consistency() == "");
  };
  auto sinks = entry(0, 2, 4);
  sinks.sink_end = 1;
  sinks.recent_begin = 1;
  check.operator()<position_error>({entry(1, 2, 4), sinks}, {},
                                   "restore entry 1 drops positions [1, 1)",
                                   "holds every position");
  std::vector<float> big(13 * kHeads * kDim);
  check.operator()<capacity_error>({LayerRestore<float>{0, 2, 13, 0, 0, big, big}}, {},
                                   "sequence 2 layer 0 holds 13 tokens", "max_seq_len 12");
  check.operator()<shape_error>({entry(0, 2, 4), entry(0, 2, 3)}, {}, "both name layer 0");
  check.operator()<layer_error>({entry(2, 2, 4)}, {}, "layer 2");
  check.operator()<batch_error>({entry(0, 3, 4)}, {}, "sequence 3");
  check.operator()<shape_error>({entry(0, 2, 4)}, {{2, ids}, {2, ids}}, "ids of sequence 2 twice");
  check.operator()<batch_error>({}, {{5, ids}}, "restore ids 0: sequence 5", "max_batch 3");
  const std::vector<token_id> many(13, 1);
  check.operator()<capacity_error>({}, {{2, many}}, "13 token ids into sequence 2",
                                   "max_seq_len 12");
  auto bad_kv = entry(0, 2, 4);
  bad_kv.v = bad_kv.v.first(kDim);
  check.operator()<shape_error>({bad_kv}, {}, "restore entry 0 holds 4 positions");
  check.operator()<pool_exhausted_error>(
      {entry(0, 2, 10), entry(0, 1, 10), entry(1, 0, 12)}, {},
      "restore of 3 sequences needs 9 blocks but the pool of 8 has 5 free and 3 evictable, "
      "counting the 3 blocks only the replaced sequences hold");

  // layers without an entry are left empty; ids may run ahead of the K/V; the replaced sequence's
  // blocks are released (its indexed ones stay cached)
  c.restore(std::vector{entry(1, 0, 5)}, std::vector<SequenceTokens>{{0, ids}});
  REQUIRE(c.layer_length(0, 0) == 0);
  REQUIRE(c.layer_length(1, 0) == 5);
  REQUIRE(ids_of(c, 0) == ids);
  REQUIRE(c.block_table(0).size() == 2);
  REQUIRE(c.stats().blocks_cached == 1 + 2);  // 1's released prompt + 0's 2 old full blocks
  REQUIRE(c.stats().blocks_used == 2);
  REQUIRE(c.check_consistency() == "");
  const auto packed = kvcache::test::pack_layer(c, 1, 0);
  REQUIRE(packed.k == std::vector<float>(5 * kHeads * kDim, 0.5f));
  REQUIRE(packed.v == std::vector<float>(5 * kHeads * kDim, -0.5f));
  // nothing indexed: layer 0 is empty, so no block is full in every layer
  REQUIRE(c.match_prefix(ids) == 0);
  // ids alone: an empty sequence with ids (as admit() of an uncached prompt leaves it)
  c.restore({}, std::vector<SequenceTokens>{{2, ids}});
  REQUIRE(c.seq_length(2) == 0);
  REQUIRE(ids_of(c, 2) == ids);
  REQUIRE(c.block_table(2).empty());
  REQUIRE(c.check_consistency() == "");
}

TEST_CASE("paged and unpaged snapshots never mix; every misfit is refused, nothing changed") {
  auto rng = kvcache::test::make_rng("snapshot-paged-mismatch");
  auto paged = make_paged<half>(32, 4, 2);
  kSynth.run_prompt(paged, 0, iota_ids(22, 1));
  const auto ahead = iota_ids(20, 100);
  REQUIRE(paged.admit(1, ahead) == 0);  // 20 ids, 8 positions
  kSynth.prefill(paged, 1, ahead, 0, 8);
  const auto pbytes = snapshot_to_bytes(paged, kModel);

  auto check = [&](auto& dest, const std::vector<std::byte>& bytes, auto... pieces) {
    const auto before = kvcache::test::cache_contents(dest);
    require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(bytes, dest, kModel); },
                                            pieces...);
    REQUIRE(kvcache::test::cache_contents(dest) == before);
  };
  const StaticCacheConfig static_cfg{.num_layers = kLayers,
                                     .num_kv_heads = kHeads,
                                     .head_dim = kDim,
                                     .max_batch = 2,
                                     .max_seq_len = 64};
  StaticCache<half> st(static_cfg);
  kvcache::test::append_random(st, rng, 0, 5, 5);
  check(st, pbytes, "saved by a PagedCache, the destination is a StaticCache", "file offset");
  TokenTrackedCache<StaticCache<half>> tracked{StaticCache<half>(static_cfg)};
  check(tracked, pbytes, "saved by a PagedCache, the destination is a StaticCache");
  DynamicCache<half> dyn(
      {.num_layers = kLayers, .num_kv_heads = kHeads, .head_dim = kDim, .max_batch = 2});
  check(dyn, pbytes, "saved by a PagedCache, the destination is a DynamicCache");

  // unpaged snapshots into a paged cache
  auto dest = make_paged<half>(32, 4, 2);
  kSynth.run_prompt(dest, 1, iota_ids(6, 9));
  const auto before = paged_state(dest);
  auto check_paged = [&](const std::vector<std::byte>& bytes, auto... pieces) {
    require_throws<snapshot_mismatch_error>([&] { load_snapshot_bytes(bytes, dest, kModel); },
                                            pieces...);
    REQUIRE(paged_state(dest) == before);
    REQUIRE(dest.check_consistency() == "");
  };
  check_paged(snapshot_to_bytes(st, kModel),
              "saved by a StaticCache, the destination is a PagedCache");
  tracked.reset(0);
  kvcache::test::append_random(tracked, rng, 0, 3, 3);
  tracked.commit(0, std::vector<token_id>{1, 2, 3});
  check_paged(snapshot_to_bytes(tracked, kModel),
              "saved by a StaticCache, the destination is a PagedCache");

  // paged into paged: dtype, shape, max_batch, max_seq_len (positions, and ids ahead of them)
  auto f32 = make_paged<float>(32, 4, 2);
  check(f32, pbytes, "dtype f16 differs from the destination's f32");
  PagedCache<half> heads({.num_layers = kLayers,
                          .num_kv_heads = 1,
                          .head_dim = kDim,
                          .num_blocks = 32,
                          .block_size = 4,
                          .max_batch = 2});
  check(heads, pbytes, "num_kv_heads 2 differs from the destination's 1");
  auto one = make_paged<half>(32, 4, 1);
  check(one, pbytes, "sequence 1 does not exist in the destination", "max_batch 1");
  auto short_positions = make_paged<half>(32, 4, 2, false, 21);
  check(short_positions, pbytes, "sequence 0 layer 0 holds 22 positions",
        "destination's max_seq_len 21");
  const std::vector<std::size_t> just1{1};
  const auto ahead_bytes = snapshot_to_bytes(paged, kModel, just1);
  auto short_ids = make_paged<half>(32, 4, 2, false, 19);
  check(short_ids, ahead_bytes, "sequence 1 has 20 token ids",
        "more than the destination's max_seq_len 19");
  // ... while 20 fit: the ids run ahead of the 8 positions, as saved
  auto fits = make_paged<half>(32, 4, 2, false, 20);
  load_snapshot_bytes(ahead_bytes, fits, kModel, {.dest_seqs = std::vector<std::size_t>{0}});
  REQUIRE(ids_of(fits, 0) == ahead);
  REQUIRE(fits.seq_length(0) == 8);
  REQUIRE(fits.seq_length(1) == 0);
  REQUIRE(fits.check_consistency() == "");
}

TEST_CASE("a paged snapshot follows the documented layout; policy-4 rules are enforced") {
  auto rng = kvcache::test::make_rng("snapshot-paged-layout");
  auto c = make_paged<float>(8, 4, 2, false, 12);
  kSynth.run_prompt(c, 1, iota_ids(6, 40));
  const auto good = snapshot_to_bytes(c, kModel);
  const std::span<const std::byte> f(good);
  using kvcache::test::get32;
  using kvcache::test::get64;
  const snapshot_format::Parsed parsed = snapshot_format::parse(good, "good");
  const std::size_t m = parsed.meta_offset;
  REQUIRE(get32(f, m + 0) == 4);    // policy: PagedCache
  REQUIRE(get64(f, m + 32) == 2);   // max_batch
  REQUIRE(get64(f, m + 40) == 12);  // max_seq_len: capacity()
  REQUIRE(get64(f, m + 48) == 0);
  REQUIRE(get64(f, m + 56) == 0);
  REQUIRE(get64(f, m + 64) == 0);
  REQUIRE(get64(f, m + 72) == 0);
  REQUIRE(get64(f, m + 80) == 4);  // block_len: block_size
  REQUIRE(get32(f, m + 88) == 1);  // token ids present
  REQUIRE(get64(f, m + 160) == 2);
  REQUIRE(get32(f, 20) == 1 + 2 * (1 + kLayers));  // META, then SEQUENCE + LAYER_KVs per sequence
  const auto& s1 = parsed.sequences[1];
  REQUIRE(get64(f, s1.section_offset) == 1);
  REQUIRE(get64(f, s1.section_offset + 8) == 6);
  REQUIRE(get32(f, s1.token_ids_offset) == 40);
  REQUIRE(snapshot_policy_name(SnapshotPolicy::paged_cache) == std::string("PagedCache"));
  TempDir dir("snapshot-paged-layout");
  save_snapshot(dir / "c.kvs", c, kModel);
  const SnapshotInfo info = read_snapshot_info(dir / "c.kvs");
  REQUIRE(info.policy == SnapshotPolicy::paged_cache);
  REQUIRE(info.params == SnapshotParams{.max_batch = 2, .max_seq_len = 12, .block_len = 4});
  REQUIRE(info.has_token_ids);

  // edits behind recomputed checksums: each is refused naming the field's offset
  auto edited = [&](std::size_t off, std::uint64_t value, bool wide, std::size_t err_off,
                    auto... pieces) {
    std::vector<std::byte> bad = good;
    if (wide) {
      kvcache::test::set64(bad, off, value);
    } else {
      kvcache::test::set32(bad, off, static_cast<std::uint32_t>(value));
    }
    kvcache::test::fix_checksums(bad);
    auto dest = make_paged<float>(8, 4, 2, false, 12);
    const std::string what = require_throws<snapshot_format_error>(
        [&] { load_snapshot_bytes(bad, dest, kModel); }, pieces...,
        "(file offset " + std::to_string(err_off) + ")");
    REQUIRE(dest.seq_length(1) == 0);
    return what;
  };
  edited(m + 80, 0, true, m + 80, "block_len is 0");
  edited(m + 40, 0, true, m + 40, "max_seq_len is 0");
  edited(m + 88, 0, false, m + 88, "lack bit 0 (token ids)");
  edited(m + 56, 3, true, m + 56, "window is 3 but PagedCache does not use it");
  edited(m + 0, 1, false, m + 80, "block_len is 4 but StaticCache does not use it");
  edited(m + 0, 5, false, m + 0, "unknown policy 5", "4 paged");
  const std::size_t l1 = s1.layer_state_offset(1), l0 = s1.layer_state_offset(0);
  edited(l1 + 8, 1, true, l1, "sequence 1 layer 1", "not a state of the saved PagedCache");
  edited(l0, 13, true, l0, "length 13", "not a state of the saved PagedCache");
  // a static snapshot turned into policy 4 lacks block_len; with the policy's rules it would pass
  StaticCache<float> st({.num_layers = kLayers,
                         .num_kv_heads = kHeads,
                         .head_dim = kDim,
                         .max_batch = 1,
                         .max_seq_len = 12});
  kvcache::test::append_random(st, rng, 0, 3, 3);
  std::vector<std::byte> as_paged = snapshot_to_bytes(st, kModel);
  const std::size_t sm = snapshot_format::parse(as_paged, "static").meta_offset;
  kvcache::test::set32(as_paged, sm, 4);
  kvcache::test::fix_checksums(as_paged);
  require_throws<snapshot_format_error>([&] { (void)snapshot_format::parse(as_paged, "x"); },
                                        "block_len is 0");
  kvcache::test::set64(as_paged, sm + 80, 4);
  kvcache::test::fix_checksums(as_paged);
  require_throws<snapshot_format_error>([&] { (void)snapshot_format::parse(as_paged, "x"); },
                                        "lack bit 0");

  // more ids than the saved max_seq_len (an 8-token paged cache with 8 ids, one id appended)
  auto small = make_paged<float>(2, 4, 1);
  kSynth.run_prompt(small, 0, iota_ids(8, 1));
  auto sections = kvcache::test::split_sections(snapshot_to_bytes(small, kModel));
  auto& seq = sections[1].payload;
  kvcache::test::set64(seq, 8, 9);
  seq.resize(seq.size() + 4, std::byte{0});
  const auto nine = kvcache::test::encode_sections(sections);
  require_throws<snapshot_format_error>([&] { (void)snapshot_format::parse(nine, "nine"); },
                                        "sequence 0 has 9 token ids",
                                        "more than the saved max_seq_len 8");
  // but 8 ids over 3 positions are a valid paged state (ids ahead of the K/V)
  auto three = make_paged<float>(2, 4, 1);
  REQUIRE(three.admit(0, iota_ids(8, 1)) == 0);
  kSynth.prefill(three, 0, iota_ids(8, 1), 0, 3);
  auto back = make_paged<float>(2, 4, 1);
  load_snapshot_bytes(snapshot_to_bytes(three, kModel), back, kModel);
  require_same_sequences(three, back);
}
