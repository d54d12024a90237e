// SPDX-License-Identifier: Apache-2.0
// context_shift() on every policy, model-based: random appends, crops, forks and shifts against a
// naive model that keeps each token's unrotated key. After every step each view holds exactly
// the positions the shift maps its old ones to, with keys equal (up to the roundings the moves
// made) to keys rotated at their new positions in the first place; ids follow; bad shifts throw
// typed errors naming the numbers and change nothing; attention after a shift equals attention
// recomputed from scratch over the shortened sequence.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

constexpr std::size_t kLayers = 2, kKvHeads = 2, kDim = 16, kBatch = 2, kMaxLen = 72;
constexpr std::size_t kRow = kKvHeads * kDim;

// Partial NeoX rotation with YaRN scaling: a moved key must not get the magnitude twice.
Rope test_rope() {
  return Rope({.base = 10000.0f,
               .rotary_dims = 12,
               .pairing = RopePairing::neox,
               .scaling = RopeScaling::yarn,
               .factor = 4.0f,
               .original_max_position = 32},
              kDim);
}

// One token as the naive model holds it: unrotated K and V of every layer, its id, and how
// many times a shift has moved it (each move may round its key once more).
struct Token {
  std::vector<float> k, v;  // [layer][head][dim]
  token_id id = 0;
  int moves = 0;
};

// The element type's unit roundoff, and 1e-6 for float (the rotation's own arithmetic); for the
// quantized formats the largest error of a value relative to its row's largest (int8: half a step
// of amax / 127, doubled as a rotation can raise a row's largest by sqrt 2; fp8: 2^-4 of the
// value).
template <KVElement T>
double unit() {
  if constexpr (std::same_as<T, half>) return 1.0 / 2048;
  if constexpr (std::same_as<T, bfloat16>) return 1.0 / 256;
  if constexpr (std::same_as<T, qint8>) return 1.0 / 127;
  if constexpr (std::same_as<T, fp8_e4m3>) return 1.0 / 16;
  return 1e-6;
}

template <class Cache>
struct Policy;

template <KVElement T>
struct Policy<StaticCache<T>> {
  static StaticCache<T> make() {
    return StaticCache<T>({.num_layers = kLayers,
                           .num_kv_heads = kKvHeads,
                           .head_dim = kDim,
                           .max_batch = kBatch,
                           .max_seq_len = kMaxLen});
  }
  static constexpr std::size_t kMaxAppend = 7;
};

template <KVElement T>
struct Policy<DynamicCache<T>> {
  static DynamicCache<T> make() {
    return DynamicCache<T>({.num_layers = kLayers,
                            .num_kv_heads = kKvHeads,
                            .head_dim = kDim,
                            .max_batch = kBatch,
                            .max_seq_len = kMaxLen,
                            .chunk_len = 8});
  }
  static constexpr std::size_t kMaxAppend = 7;
};

template <KVElement T>
struct Policy<SlidingWindowCache<T>> {
  static SlidingWindowCache<T> make() {
    return SlidingWindowCache<T>({.num_layers = kLayers,
                                  .num_kv_heads = kKvHeads,
                                  .head_dim = kDim,
                                  .max_batch = kBatch,
                                  .window = 12,
                                  .num_sink_tokens = 3,
                                  .max_append_len = 5});
  }
  static constexpr std::size_t kMaxAppend = 5;
};

template <KVElement T>
struct Policy<PagedCache<T>> {
  static PagedCache<T> make() {
    return PagedCache<T>({.num_layers = kLayers,
                          .num_kv_heads = kKvHeads,
                          .head_dim = kDim,
                          .num_blocks = 64,
                          .block_size = 4,
                          .max_batch = kBatch,
                          .max_seq_len = kMaxLen,
                          .evict_when_full = true});
  }
  static constexpr std::size_t kMaxAppend = 7;
};

template <class C>
struct Policy<TokenTrackedCache<C>> {
  static TokenTrackedCache<C> make() { return TokenTrackedCache<C>(Policy<C>::make()); }
  static constexpr std::size_t kMaxAppend = Policy<C>::kMaxAppend;
};

template <class Cache>
constexpr bool kHasIds = requires(const Cache& c) {
  c.tokens(std::size_t{0});
};
template <class Cache>
constexpr bool kCanFork = requires(Cache& c) {
  c.fork(std::size_t{0}, std::size_t{1});
};

template <class Cache>
class Harness {
 public:
  using T = typename Cache::value_type;

  explicit Harness(std::mt19937_64& rng) : rng_(rng), cache_(Policy<Cache>::make()) {}

  Cache& cache() { return cache_; }
  std::vector<Token>& tokens(std::size_t seq) { return model_[seq]; }

  void append(std::size_t seq, std::size_t n) {
    // A token's K/V is a function of the ids up to it, as a model's is (the contract the
    // prefix index relies on); moved tokens break it, and the caches must not share them.
    std::vector<Token> add(n);
    std::vector<token_id> ids(n);
    std::uint64_t chain = 1469598103934665603ull;
    for (const Token& t : model_[seq])
      chain = (chain ^ static_cast<std::uint64_t>(t.id)) * 1099511628211ull;
    for (std::size_t i = 0; i < n; ++i) {
      add[i].id = ids[i] = static_cast<token_id>(rng_() % 50);
      chain = (chain ^ static_cast<std::uint64_t>(ids[i])) * 1099511628211ull;
      std::mt19937_64 of_prefix(chain);
      add[i].k = kvcache::test::normal_floats(of_prefix, kLayers * kRow);
      add[i].v = kvcache::test::normal_floats(of_prefix, kLayers * kRow);
    }
    const auto first = static_cast<position_t>(model_[seq].size());
    for (std::size_t l = 0; l < kLayers; ++l) {
      std::vector<float> k(n * kRow), v(n * kRow);
      for (std::size_t i = 0; i < n; ++i) {
        std::copy_n(add[i].k.begin() + static_cast<std::ptrdiff_t>(l * kRow), kRow,
                    k.begin() + static_cast<std::ptrdiff_t>(i * kRow));
        std::copy_n(add[i].v.begin() + static_cast<std::ptrdiff_t>(l * kRow), kRow,
                    v.begin() + static_cast<std::ptrdiff_t>(i * kRow));
      }
      rope_.apply({k, n, kKvHeads, kDim}, first);
      const TokenBlock<const float> kb{k, n, kKvHeads, kDim}, vb{v, n, kKvHeads, kDim};
      if constexpr (requires { cache_.add_tokens(seq, ids); }) {
        cache_.append(l, seq, ids, kb, vb);  // PagedCache: ids with the K/V
      } else {
        cache_.append(l, seq, kb, vb);
      }
    }
    if constexpr (requires { cache_.commit(seq, ids); }) cache_.commit(seq, ids);
    model_[seq].insert(model_[seq].end(), add.begin(), add.end());
  }

  // Shifts through the cache and the model, or checks the refusal; returns whether it shifted.
  bool shift(std::size_t seq, std::size_t keep, std::size_t discard) {
    const std::size_t length = model_[seq].size();
    std::vector<std::vector<position_t>> before(kLayers);
    for (std::size_t l = 0; l < kLayers; ++l) before[l] = held(l, seq);
    const std::optional<std::string> refusal = expected_refusal(seq, keep, discard);
    INFO("shift sequence " << seq << " of length " << length << ": keep " << keep << ", discard "
                           << discard);
    if (refusal) {
      const auto contents = kvcache::test::cache_contents(cache_);
      const auto ids = all_ids();
      kvcache::test::require_throws<position_error>(
          [&] { context_shift(cache_, seq, keep, discard, rope_); }, *refusal);
      REQUIRE(kvcache::test::cache_contents(cache_) == contents);
      REQUIRE(all_ids() == ids);
      return false;
    }
    context_shift(cache_, seq, keep, discard, rope_);
    auto& m = model_[seq];
    const auto cut = m.begin() + static_cast<std::ptrdiff_t>(keep);
    m.erase(cut, cut + static_cast<std::ptrdiff_t>(discard));
    for (std::size_t i = keep; i < m.size(); ++i) ++m[i].moves;
    // every held position p < keep stays, every held p >= keep + discard becomes p - discard
    for (std::size_t l = 0; l < kLayers; ++l) {
      std::vector<position_t> want;
      for (position_t p : before[l]) {
        if (p < static_cast<position_t>(keep)) want.push_back(p);
        if (p >= static_cast<position_t>(keep + discard))
          want.push_back(p - static_cast<position_t>(discard));
      }
      REQUIRE(held(l, seq) == want);
    }
    return true;
  }

  void crop(std::size_t seq, std::size_t n) {
    if (!cache_.can_crop(seq, n)) return;
    cache_.crop(seq, n);
    model_[seq].resize(std::min(model_[seq].size(), n));
  }

  void fork(std::size_t src, std::size_t dst) {
    if constexpr (kCanFork<Cache>) {
      cache_.fork(src, dst);
      model_[dst] = model_[src];
    }
  }

  void reset(std::size_t seq) {
    cache_.reset(seq);
    model_[seq].clear();
  }

  // Every view against the model: lengths, ids, and each held K/V row.
  void check() {
    if constexpr (requires { cache_.check_consistency(); }) {
      REQUIRE(cache_.check_consistency() == "");
    }
    for (std::size_t s = 0; s < kBatch; ++s) {
      const auto& m = model_[s];
      REQUIRE(cache_.seq_length(s) == m.size());
      if constexpr (kHasIds<Cache>) {
        const auto ids = cache_.tokens(s);
        REQUIRE(ids.size() == m.size());
        for (std::size_t i = 0; i < m.size(); ++i) REQUIRE(ids[i] == m[i].id);
      }
      for (std::size_t l = 0; l < kLayers; ++l) {
        const auto view = cache_.view(l, s);
        REQUIRE(static_cast<std::size_t>(view.length()) == m.size());
        std::vector<float> k, v;
        std::vector<position_t> pos;
        reference::gather_view(view, k, v, pos);
        for (std::size_t i = 0; i < pos.size(); ++i) {
          const Token& t = m[static_cast<std::size_t>(pos[i])];
          std::vector<float> want_k(t.k.begin() + static_cast<std::ptrdiff_t>(l * kRow),
                                    t.k.begin() + static_cast<std::ptrdiff_t>((l + 1) * kRow));
          rope_.apply({want_k, 1, kKvHeads, kDim}, pos[i]);
          const std::vector<float> want_v =
              kvcache::test::rounded<T>({t.v.begin() + static_cast<std::ptrdiff_t>(l * kRow),
                                         t.v.begin() + static_cast<std::ptrdiff_t>((l + 1) * kRow)},
                                        kDim);
          const auto row = [&](const std::vector<float>& x) {  // gather_view: token-major
            return std::vector<float>(x.begin() + static_cast<std::ptrdiff_t>(i * kRow),
                                      x.begin() + static_cast<std::ptrdiff_t>((i + 1) * kRow));
          };
          const std::vector<float> got_k = row(k), got_v = row(v);
          INFO("sequence " << s << " layer " << l << " position " << pos[i] << ", moved " << t.moves
                           << " times");
          // each rounding to T (the append, then one per move) errs by a unit of the row's
          // largest element at most
          float largest = 0.0f;
          for (float x : want_k) largest = std::max(largest, std::abs(x));
          const double allowed = 2.0 * unit<T>() * (t.moves + 1) * static_cast<double>(largest);
          kvcache::test::require_close(got_k, want_k, Tolerance{allowed, 0.0});
          REQUIRE(got_v == want_v);  // values move unchanged
        }
      }
    }
  }

  [[nodiscard]] std::vector<position_t> held(std::size_t layer, std::size_t seq) const {
    const auto view = cache_.view(layer, seq);
    return kvcache::test::check_view_invariants(view);
  }

 private:
  std::vector<std::vector<token_id>> all_ids() const {
    std::vector<std::vector<token_id>> out;
    if constexpr (kHasIds<Cache>) {
      for (std::size_t s = 0; s < kBatch; ++s) {
        const auto ids = cache_.tokens(s);
        out.emplace_back(ids.begin(), ids.end());
      }
    }
    return out;
  }

  // The piece of the message a refused shift must carry, or nullopt when it must succeed.
  std::optional<std::string> expected_refusal(std::size_t seq, std::size_t keep,
                                              std::size_t discard) const {
    const std::size_t length = model_[seq].size();
    if (keep > length || discard > length - keep) {
      return "sequence " + std::to_string(seq) + ", which holds only " + std::to_string(length);
    }
    const auto view = cache_.view(0, seq);
    const auto se = static_cast<std::size_t>(view.sink_end());
    const auto rb = static_cast<std::size_t>(view.recent_begin());
    if (discard == 0 || se == rb) return std::nullopt;
    if (keep > se) return "n_keep " + std::to_string(keep) + " of sequence";
    if (keep < se && keep + discard < rb) {
      return "discard through position " + std::to_string(rb - 1);
    }
    return std::nullopt;
  }

  std::mt19937_64& rng_;
  Rope rope_ = test_rope();
  Cache cache_;
  std::vector<std::vector<Token>> model_ = std::vector<std::vector<Token>>(kBatch);
};

template <class Cache>
void run_model(const char* name, std::size_t seeds, std::size_t steps) {
  auto rng = kvcache::test::make_rng(name);
  std::size_t shifts = 0, refused = 0;
  for (std::size_t round = 0; round < seeds; ++round) {
    Harness<Cache> h(rng);
    for (std::size_t step = 0; step < steps; ++step) {
      const std::size_t seq = rng() % kBatch;
      const std::size_t length = h.tokens(seq).size();
      const std::size_t op = rng() % 10;
      if (op < 5) {
        const std::size_t n = 1 + rng() % Policy<Cache>::kMaxAppend;
        if (length + n <= kMaxLen) {
          h.append(seq, n);
        } else {
          ++(h.shift(seq, rng() % 8, length / 2) ? shifts : refused);
        }
      } else if (op < 8) {
        // keep the sinks (0 without), or a random count; discard some, sometimes past the end
        const auto sinks = static_cast<std::size_t>(h.cache().view(0, seq).sink_end());
        const std::size_t keep = op == 5 ? sinks : rng() % (length + 2);
        const std::size_t discard = rng() % (length + 2 - std::min(keep, length));
        if (h.shift(seq, keep, discard)) {
          shifts += discard > 0 ? 1 : 0;
        } else {
          ++refused;
        }
      } else if (op == 8) {
        h.crop(seq, length - std::min(length, rng() % 4));
      } else if (kCanFork<Cache> && h.tokens(1 - seq).empty()) {
        h.fork(seq, 1 - seq);
      } else {
        h.reset(seq);
      }
      h.check();
    }
  }
  INFO("shifts done: " << shifts << ", refused: " << refused);
  REQUIRE(shifts >= seeds * steps / 20);  // the operations did exercise shifts, and refusals
  REQUIRE(refused >= seeds);
}

}  // namespace

TEST_CASE("context_shift on a StaticCache matches the naive model") {
  run_model<StaticCache<float>>("context_shift static f32", 6, 120);
  run_model<StaticCache<half>>("context_shift static f16", 3, 120);
  run_model<StaticCache<qint8>>("context_shift static int8", 3, 120);
}

TEST_CASE("context_shift on a DynamicCache matches the naive model") {
  run_model<DynamicCache<bfloat16>>("context_shift dynamic bf16", 6, 120);
  run_model<DynamicCache<fp8_e4m3>>("context_shift dynamic fp8", 3, 120);
}

TEST_CASE(
    "context_shift on a SlidingWindowCache matches the naive model, and refuses shifts "
    "that would keep evicted positions") {
  run_model<SlidingWindowCache<float>>("context_shift sliding f32", 6, 150);
  run_model<SlidingWindowCache<half>>("context_shift sliding f16", 3, 150);
  run_model<SlidingWindowCache<fp8_e4m3>>("context_shift sliding fp8", 3, 150);
}

TEST_CASE("context_shift on a PagedCache matches the naive model, ids and forks included") {
  run_model<PagedCache<float>>("context_shift paged f32", 6, 120);
  run_model<PagedCache<half>>("context_shift paged f16", 3, 120);
  run_model<PagedCache<qint8>>("context_shift paged int8", 3, 120);
}

TEST_CASE("context_shift on a TokenTrackedCache shifts its committed ids") {
  run_model<TokenTrackedCache<DynamicCache<float>>>("context_shift tracked", 4, 120);
}

TEST_CASE(
    "after context_shift, attention equals attention recomputed over the shortened "
    "sequence at its new positions") {
  auto rng = kvcache::test::make_rng("context_shift attention");
  Harness<DynamicCache<float>> h(rng);
  h.append(0, 40);
  REQUIRE(h.shift(0, 4, 20));
  h.append(0, 3);  // appends continue at the new length
  const auto& m = h.tokens(0);
  REQUIRE(m.size() == 23);
  const Rope rope = test_rope();
  constexpr std::size_t kQHeads = 4, kQ = 3;
  std::vector<float> q = kvcache::test::normal_floats(rng, kQ * kQHeads * kDim);
  rope.apply({q, kQ, kQHeads, kDim}, 20);
  for (std::size_t l = 0; l < kLayers; ++l) {
    std::vector<float> k, v;
    for (std::size_t p = 0; p < m.size(); ++p) {
      std::vector<float> row(m[p].k.begin() + static_cast<std::ptrdiff_t>(l * kRow),
                             m[p].k.begin() + static_cast<std::ptrdiff_t>((l + 1) * kRow));
      rope.apply({row, 1, kKvHeads, kDim}, static_cast<position_t>(p));
      k.insert(k.end(), row.begin(), row.end());
      v.insert(v.end(), m[p].v.begin() + static_cast<std::ptrdiff_t>(l * kRow),
               m[p].v.begin() + static_cast<std::ptrdiff_t>((l + 1) * kRow));
    }
    const auto want =
        kvcache::test::scratch_attention(q, kQ, kQHeads, k, v, m.size(), kKvHeads, kDim, 20, {});
    const auto got = attend({q, kQ, kQHeads, kDim}, h.cache().view(l, 0));
    kvcache::test::require_close(got, want, Tolerance{2e-5, 2e-5});
  }
}

TEST_CASE("context_shift refuses bad arguments by name and changes nothing") {
  auto rng = kvcache::test::make_rng("context_shift errors");
  Harness<PagedCache<float>> h(rng);
  h.append(0, 10);
  auto& cache = h.cache();
  const auto before = kvcache::test::cache_contents(cache);
  const Rope rope = test_rope();
  using kvcache::test::require_throws;
  require_throws<position_error>([&] { context_shift(cache, 0, 6, 5, rope); }, "discarding 5",
                                 "n_keep 6", "holds only 10");
  require_throws<position_error>([&] { context_shift(cache, 0, 11, 0, rope); }, "n_keep 11");
  require_throws<batch_error>([&] { context_shift(cache, 2, 0, 1, rope); }, "sequence 2",
                              "max_batch 2");
  const Rope wide({}, 32);
  require_throws<shape_error>([&] { context_shift(cache, 0, 0, 1, wide); }, "head_dim 32",
                              "head_dim 16");
  // mid forward pass: layer 0 one token ahead of layer 1
  std::vector<float> k(kRow, 0.5f);
  const token_id id[] = {7};
  cache.append(0, 0, id, TokenBlock<const float>{k, 1, kKvHeads, kDim},
               TokenBlock<const float>{k, 1, kKvHeads, kDim});
  const auto mid = kvcache::test::cache_contents(cache);
  require_throws<position_error>([&] { context_shift(cache, 0, 0, 1, rope); }, "layer 1",
                                 "holds 10", "layer 0 holds 11");
  REQUIRE(kvcache::test::cache_contents(cache) == mid);
  cache.crop(0, 10);
  REQUIRE(kvcache::test::cache_contents(cache) == before);
  // Rope descriptions no kernel can apply are refused where they are made
  require_throws<shape_error>([] { (void)Rope({.rotary_dims = 7}, 16); }, "rotary_dims 7");
  require_throws<shape_error>([] { (void)Rope({.rotary_dims = 18}, 16); }, "rotary_dims 18",
                              "head_dim 16");
}

TEST_CASE(
    "a shifted PagedCache keeps its kept prefix shared and never shares or indexes moved "
    "K/V") {
  auto rng = kvcache::test::make_rng("context_shift paged prefix");
  Harness<PagedCache<float>> h(rng);
  h.append(0, 24);  // six full blocks of 4, indexed
  auto& cache = h.cache();
  std::vector<token_id> old_ids(cache.tokens(0).begin(), cache.tokens(0).end());
  const auto first_block = cache.view(0, 0).block_table()[0];
  const auto second_block = cache.view(0, 0).block_table()[1];
  REQUIRE(h.shift(0, 8, 6));  // keep two blocks, drop 6 tokens
  h.check();
  // the kept blocks are the same physical blocks (never copied)
  REQUIRE(cache.view(0, 0).block_table()[0] == first_block);
  REQUIRE(cache.view(0, 0).block_table()[1] == second_block);
  std::vector<token_id> new_ids(cache.tokens(0).begin(), cache.tokens(0).end());
  REQUIRE(new_ids.size() == 18);
  REQUIRE(cache.exact_prefix(0) == 8);
  REQUIRE(cache.check_consistency() == "");
  // more tokens after the shift carry the dropped context too: still not indexed
  h.append(0, 6);
  REQUIRE(cache.exact_prefix(0) == 8);
  std::vector<token_id> longer(cache.tokens(0).begin(), cache.tokens(0).end());
  cache.release(0);
  // the moved blocks were never indexed: only the two kept blocks serve the new ids, and the
  // blocks of the old ids stay cached for prompts that really have them
  REQUIRE(cache.match_prefix(new_ids) == 8);
  REQUIRE(cache.match_prefix(longer) == 8);
  REQUIRE(cache.match_prefix(old_ids) == 24);
  // a prompt with exactly the shifted ids computes its own K/V past n_keep
  new_ids.push_back(49);
  REQUIRE(cache.admit(1, new_ids) == 8);
  REQUIRE(cache.exact_prefix(1) == std::numeric_limits<std::size_t>::max());
  for (std::size_t l = 0; l < kLayers; ++l) {
    const auto view = cache.view(l, 1);
    REQUIRE(view.block_table()[0] == first_block);
    REQUIRE(view.length() == 8);
  }
  // crop back to the kept tokens: the sequence is exact again and indexes what it appends
  Harness<PagedCache<float>> g(rng);
  g.append(0, 20);
  REQUIRE(g.shift(0, 4, 4));
  REQUIRE(g.cache().exact_prefix(0) == 4);
  g.crop(0, 4);
  REQUIRE(g.cache().exact_prefix(0) == std::numeric_limits<std::size_t>::max());
  g.append(0, 8);
  g.check();
  std::vector<token_id> fresh(g.cache().tokens(0).begin(), g.cache().tokens(0).end());
  g.cache().release(0);
  REQUIRE(g.cache().match_prefix(fresh) == 12);
  REQUIRE(cache.check_consistency() == "");
}

TEST_CASE("a snapshot of a shifted PagedCache sequence keeps its exact prefix") {
  auto rng = kvcache::test::make_rng("context_shift snapshot");
  Harness<PagedCache<float>> h(rng);
  h.append(0, 24);
  h.append(1, 9);  // an unshifted sequence beside it
  REQUIRE(h.shift(0, 6, 5));
  h.append(0, 3);
  const ModelId model("context-shift-test");
  const auto bytes = snapshot_to_bytes(h.cache(), model);
  Harness<PagedCache<float>> g(rng);
  (void)load_snapshot_bytes(bytes, g.cache(), model);
  REQUIRE(g.cache().exact_prefix(0) == 6);
  REQUIRE(g.cache().exact_prefix(1) == std::numeric_limits<std::size_t>::max());
  REQUIRE(kvcache::test::cache_contents(g.cache()) == kvcache::test::cache_contents(h.cache()));
  REQUIRE(g.cache().check_consistency() == "");
  const std::vector<token_id> ids(g.cache().tokens(0).begin(), g.cache().tokens(0).end());
  g.cache().release(0);
  REQUIRE(g.cache().match_prefix(ids) == 4);  // the one block before n_keep, nothing moved
  // a file without a shifted sequence carries no EXACT_PREFIX section: one section fewer
  h.cache().crop(0, 6);
  REQUIRE(h.cache().exact_prefix(0) == std::numeric_limits<std::size_t>::max());
  h.append(0, 13);
  REQUIRE(snapshot_to_bytes(h.cache(), model).size() < bytes.size());
}
