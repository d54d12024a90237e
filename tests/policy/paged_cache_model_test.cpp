// SPDX-License-Identifier: Apache-2.0
// Model-based test of PagedCache: thousands of random admit/append (with and without ids)/
// add_tokens/fork/reorder/crop/release/match/evict operations and snapshot round trips into other
// slots, each checked against a naive model of the same semantics (blocks as records, the prefix
// index as a map from whole prefixes, LRU as time stamps): stats, lengths, ids, which sequences
// share which blocks, reference counts, prefix matches, the typed errors, every view's K/V and
// check_consistency(). Sequences whose layers hold different lengths, ids running ahead of the
// K/V and eviction pressure are all in the mix; each configuration runs several seeds. At the end
// every block is free or cached with no references.
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <map>
#include <string>

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::uniform;

namespace {

struct Params {
  std::size_t block_size, num_blocks, max_batch, max_seq_len;
  bool caching, evict;
  int steps;
  int seeds;
};

/// Why an append or add_tokens is refused before any block is touched (position_error).
enum class IdsError { none, past_ids, untracked, mismatch };

// The naive model.
class Model {
 public:
  struct Block {
    std::size_t refs = 0;
    bool indexed = false;
    std::vector<token_id> prefix;  // the whole prefix it stands for, when indexed
    long stamp = 0;                // when it last became cached
  };
  struct Seq {
    std::vector<long> table;
    std::vector<token_id> planned;  // the sequence's ids: registered ones, then those of K/V
    std::size_t num_ids = 0;        // registered
    std::vector<std::size_t> len;   // per layer
    std::size_t committed = 0;
    std::uint64_t salt = 0;  // the extra key it was admitted under
  };
  /// What an operation needing blocks would do: nothing missing, evictions, or an error.
  struct Need {
    std::size_t needed = 0, free = 0, cached = 0;
    bool fails = false;
  };

  Model(const Params& p, std::size_t layers) : p_(p), layers_(layers), seqs_(p.max_batch) {
    for (auto& s : seqs_) s.len.assign(layers, 0);
  }

  std::map<long, Block> blocks;
  std::map<std::vector<token_id>, long> index;
  std::size_t prompts = 0, prompt_tokens = 0, reused = 0, evictions = 0, cows = 0;

  [[nodiscard]] const Seq& seq(std::size_t s) const { return seqs_[s]; }
  [[nodiscard]] std::size_t used() const {
    return count([](const Block& b) { return b.refs > 0; });
  }
  [[nodiscard]] std::size_t cached() const {
    return count([](const Block& b) { return b.refs == 0; });  // unreferenced blocks are indexed
  }
  [[nodiscard]] std::size_t free() const { return p_.num_blocks - blocks.size(); }
  [[nodiscard]] bool empty(std::size_t s) const {
    return seqs_[s].table.empty() && seqs_[s].num_ids == 0 && seqs_[s].len[0] == 0;
  }

  // The index key of the first n ids under a salt: the salt as a (negative) pseudo-id, then the
  // ids, so that equal ids under two salts are two keys.
  [[nodiscard]] static std::vector<token_id> key(std::uint64_t salt, std::span<const token_id> ids,
                                                 std::size_t n) {
    std::vector<token_id> k{-1 - static_cast<token_id>(salt)};
    k.insert(k.end(), ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
    return k;
  }

  [[nodiscard]] std::size_t match(std::span<const token_id> ids, std::uint64_t salt) const {
    if (!p_.caching) return 0;
    std::size_t m = 0;
    while ((m + 1) * p_.block_size <= ids.size() &&
           index.count(key(salt, ids, (m + 1) * p_.block_size)))
      ++m;
    return m;
  }

  std::size_t admit(std::size_t s, const std::vector<token_id>& prompt, std::uint64_t salt) {
    Seq& q = seqs_[s];
    const std::size_t m = match(prompt, salt);
    const std::size_t cached_tokens =
        std::min(m * p_.block_size, prompt.empty() ? 0 : prompt.size() - 1);
    const std::size_t nb = (cached_tokens + p_.block_size - 1) / p_.block_size;
    for (std::size_t i = 0; i < nb; ++i) {
      const long b = index.at(key(salt, prompt, (i + 1) * p_.block_size));
      ++blocks.at(b).refs;
      q.table.push_back(b);
    }
    ++prompts;
    prompt_tokens += prompt.size();
    reused += cached_tokens;
    q.planned = prompt;
    q.salt = salt;
    q.num_ids = prompt.size();
    q.len.assign(layers_, cached_tokens);
    q.committed = cached_tokens / p_.block_size;
    return cached_tokens;
  }

  // Blocks an append of n tokens to layer l of s needs; evicts or reports failure.
  Need need_for_append(std::size_t s, std::size_t l, std::size_t n) const {
    const Seq& q = seqs_[s];
    const std::size_t first = q.len[l] / p_.block_size;
    const std::size_t end = (q.len[l] + n + p_.block_size - 1) / p_.block_size;
    Need need;
    for (std::size_t i = first; i < std::min(end, q.table.size()); ++i) {
      need.needed += !writable(q.table[i]);
    }
    need.needed += end > q.table.size() ? end - q.table.size() : 0;
    need.free = free();
    need.cached = cached();
    need.fails = need.needed > need.free && (!p_.evict || need.needed > need.free + need.cached);
    return need;
  }

  void append(std::size_t s, std::size_t l, std::size_t n) {
    Seq& q = seqs_[s];
    const Need need = need_for_append(s, l, n);
    for (std::size_t i = need.free; i < need.needed; ++i) evict_one();
    const std::size_t first = q.len[l] / p_.block_size;
    const std::size_t end = (q.len[l] + n + p_.block_size - 1) / p_.block_size;
    std::vector<long> old;
    for (std::size_t i = first; i < std::min(end, q.table.size()); ++i) {
      if (writable(q.table[i])) continue;
      old.push_back(q.table[i]);
      q.table[i] = fresh();
      ++cows;
    }
    while (q.table.size() < end) q.table.push_back(fresh());
    for (auto it = old.rbegin(); it != old.rend(); ++it) release(*it);
    q.len[l] += n;
    commit(s);
  }

  [[nodiscard]] std::size_t longest(std::size_t s) const {
    return *std::max_element(seqs_[s].len.begin(), seqs_[s].len.end());
  }

  /// What refuses an append of n tokens to layer l of s (with its ids, where `ids`; `wrong`:
  /// they claim another token at a registered position).
  [[nodiscard]] IdsError append_error(std::size_t s, std::size_t l, std::size_t n, bool ids,
                                      bool wrong) const {
    const Seq& q = seqs_[s];
    if (!ids)
      return q.num_ids != 0 && q.len[l] + n > q.num_ids ? IdsError::past_ids : IdsError::none;
    if (q.num_ids == 0 && longest(s) != 0) return IdsError::untracked;
    return wrong ? IdsError::mismatch : IdsError::none;
  }

  /// append() with ids registers those past the registered ones.
  void register_with_append(std::size_t s, std::size_t l, std::size_t n) {
    Seq& q = seqs_[s];
    q.num_ids = std::max(q.num_ids, q.len[l] + n);
  }

  [[nodiscard]] bool add_tokens_refused(std::size_t s) const {
    return seqs_[s].num_ids == 0 && longest(s) != 0;
  }

  void add_tokens(std::size_t s, std::size_t k) {
    seqs_[s].num_ids += k;
    commit(s);
  }

  /// What restoring `src` (a saved sequence: lengths, planned ids, num_ids) into slot d needs,
  /// as PagedCache::restore counts it for one named sequence.
  [[nodiscard]] Need need_for_restore(std::size_t d, const Seq& src) const {
    const auto [lo, hi] = std::minmax_element(src.len.begin(), src.len.end());
    const std::size_t nb = (*hi + p_.block_size - 1) / p_.block_size;
    const std::size_t shared = shared_for_restore(src, *lo, nb).size();
    std::map<long, std::size_t> held;  // d's blocks and how often d holds each
    for (long b : seqs_[d].table) ++held[b];
    std::size_t would_free = 0, would_cache = 0, pinned = 0;
    for (const auto& [b, n] : held) {
      if (blocks.at(b).refs == n) ++(blocks.at(b).indexed ? would_cache : would_free);
    }
    for (long b : shared_for_restore(src, *lo, nb)) {
      const auto it = held.find(b);
      if (blocks.at(b).refs == (it == held.end() ? 0 : it->second)) ++pinned;
    }
    Need need;
    need.needed = nb - shared;
    need.free = free() + would_free;
    need.cached = cached() + would_cache - pinned;
    need.fails = need.needed > need.free && (!p_.evict || need.needed > need.free + need.cached);
    return need;
  }

  /// Replaces slot d by the saved sequence src: shares the leading indexed blocks its ids match
  /// (every layer filling all but the last of them), fresh blocks for the rest, then commits.
  void restore(std::size_t d, const Seq& src) {
    const auto [lo, hi] = std::minmax_element(src.len.begin(), src.len.end());
    const std::size_t shortest = *lo;
    const std::size_t nb = (*hi + p_.block_size - 1) / p_.block_size;
    const std::vector<long> shared = shared_for_restore(src, shortest, nb);
    const Need need = need_for_restore(d, src);
    for (long b : shared) ++blocks.at(b).refs;
    release_table(seqs_[d], 0);
    for (std::size_t i = free(); i < need.needed; ++i) evict_one();
    Seq& q = seqs_[d];
    q = src;
    q.table = shared;
    while (q.table.size() < nb) q.table.push_back(fresh());
    const std::size_t committable =
        p_.caching ? std::min(shortest, src.num_ids) / p_.block_size : 0;
    q.committed = std::min(shared.size(), committable);
    commit(d);
  }

  void fork(std::size_t src, std::size_t dst) {
    for (long b : seqs_[src].table) ++blocks.at(b).refs;
    seqs_[dst] = seqs_[src];
  }

  void reorder(const std::vector<std::size_t>& dst, const std::vector<std::size_t>& src) {
    std::vector<Seq> snap;
    for (std::size_t s : src) snap.push_back(seqs_[s]);
    for (const Seq& q : snap) {
      for (long b : q.table) ++blocks.at(b).refs;
    }
    for (std::size_t d : dst) release_table(seqs_[d], 0);
    for (std::size_t i = 0; i < dst.size(); ++i) seqs_[dst[i]] = snap[i];
  }

  void crop(std::size_t s, std::size_t n) {
    Seq& q = seqs_[s];
    std::size_t longest = 0;
    for (auto& len : q.len) longest = std::max(longest, len = std::min(len, n));
    release_table(q, (longest + p_.block_size - 1) / p_.block_size);
    q.num_ids = std::min(q.num_ids, n);
    q.committed = std::min(q.committed, n / p_.block_size);
    q.planned.resize(std::min(q.planned.size(), n));
  }

  void release(std::size_t s) {
    release_table(seqs_[s], 0);
    seqs_[s] = Seq{};
    seqs_[s].len.assign(layers_, 0);
  }

  std::size_t evict_cached(std::size_t k) {
    std::size_t done = 0;
    for (; done < k && cached() != 0; ++done) evict_one();
    return done;
  }

  // The test's ids for positions [0, n) of s: extends the planned ids with fresh ones.
  void plan(std::size_t s, std::size_t n, std::mt19937_64& rng) {
    auto& planned = seqs_[s].planned;
    while (planned.size() < n) planned.push_back(static_cast<token_id>(uniform(rng, 1, 3)));
  }

 private:
  template <class F>
  std::size_t count(F f) const {
    return static_cast<std::size_t>(
        std::count_if(blocks.begin(), blocks.end(), [&](const auto& kv) { return f(kv.second); }));
  }
  [[nodiscard]] bool writable(long b) const {
    return blocks.at(b).refs == 1 && !blocks.at(b).indexed;
  }
  long fresh() {
    blocks[next_id_] = Block{1, false, {}, 0};
    return next_id_++;
  }
  void release(long b) {
    Block& blk = blocks.at(b);
    if (--blk.refs != 0) return;
    if (blk.indexed) {
      blk.stamp = ++clock_;
    } else {
      blocks.erase(b);
    }
  }
  void release_table(Seq& q, std::size_t keep) {
    while (q.table.size() > keep) {
      release(q.table.back());
      q.table.pop_back();
    }
  }
  // The indexed blocks a restore of src shares: its leading full blocks of ids that the index
  // holds, no more than every layer fills plus one, within its longest layer.
  [[nodiscard]] std::vector<long> shared_for_restore(const Seq& src, std::size_t shortest,
                                                     std::size_t nb) const {
    std::vector<long> out;
    if (!p_.caching) return out;
    const std::size_t shareable =
        std::min({src.num_ids / p_.block_size, nb, shortest / p_.block_size + 1});
    for (std::size_t i = 0; i < shareable; ++i) {
      const auto it = index.find(key(src.salt, src.planned, (i + 1) * p_.block_size));
      if (it == index.end()) break;
      out.push_back(it->second);
    }
    return out;
  }
  void evict_one() {
    auto victim = blocks.end();
    for (auto it = blocks.begin(); it != blocks.end(); ++it) {
      if (it->second.refs == 0 &&
          (victim == blocks.end() || it->second.stamp < victim->second.stamp))
        victim = it;
    }
    index.erase(victim->second.prefix);
    blocks.erase(victim);
    ++evictions;
  }
  void commit(std::size_t s) {
    if (!p_.caching) return;
    Seq& q = seqs_[s];
    std::size_t shortest = q.num_ids;
    for (std::size_t len : q.len) shortest = std::min(shortest, len);
    const std::size_t full = shortest / p_.block_size;
    for (std::size_t i = q.committed; i < full; ++i) {
      const long b = q.table[i];
      if (blocks.at(b).indexed) {
        q.committed = i + 1;
        continue;
      }
      std::vector<token_id> prefix = key(q.salt, q.planned, (i + 1) * p_.block_size);
      const auto it = index.find(prefix);
      if (it != index.end()) {
        ++blocks.at(it->second).refs;
        release(b);
        q.table[i] = it->second;
      } else if (blocks.at(b).refs == 1) {
        blocks.at(b).indexed = true;
        blocks.at(b).prefix = prefix;
        index[prefix] = b;
      } else {
        break;  // shared, and no equal block to switch to: not indexed (yet)
      }
      q.committed = i + 1;
    }
  }

  Params p_;
  std::size_t layers_;
  std::vector<Seq> seqs_;
  long next_id_ = 0;
  long clock_ = 0;
};

constexpr std::size_t kLayers = 2, kHeads = 1, kDim = 4;
const kvcache::test::SyntheticModel kSynth{kLayers, kHeads, kDim};
const ModelId kSnapshotModel = ModelId::from_u64(0x5eed0de1ull);

template <class Cache>
void check_sequence(const Cache& cache, const Model& model, std::size_t s) {
  using T = typename Cache::value_type;
  const auto& q = model.seq(s);
  INFO("sequence " << s);
  REQUIRE(
      std::ranges::equal(cache.tokens(s), std::span<const token_id>(q.planned).first(q.num_ids)));
  REQUIRE(cache.extra_key(s) == q.salt);
  REQUIRE(cache.block_table(s).size() == q.table.size());
  for (std::size_t l = 0; l < kLayers; ++l) {
    REQUIRE(cache.layer_length(l, s) == q.len[l]);
    // every position's K/V is the one computed for the sequence's own ids
    std::vector<float> k, v;
    std::vector<position_t> pos;
    reference::gather_view(cache.view(l, s), k, v, pos);
    const auto expect = kSynth.kv(l, q.planned, 0, q.len[l]);
    REQUIRE(k == kvcache::test::rounded<T>(expect.k));
    REQUIRE(v == kvcache::test::rounded<T>(expect.v));
  }
}

template <class Cache>
void check_all(const Cache& cache, const Model& model, std::size_t batch, bool contents) {
  const auto st = cache.stats();
  REQUIRE(st.blocks_used == model.used());
  REQUIRE(st.blocks_cached == model.cached());
  REQUIRE(st.blocks_free == model.free());
  REQUIRE(st.evictions == model.evictions);
  REQUIRE(st.cow_copies == model.cows);
  REQUIRE(st.prompts == model.prompts);
  REQUIRE(st.prompt_tokens == model.prompt_tokens);
  REQUIRE(st.reused_tokens == model.reused);
  // the same sharing: one physical block per model block, reference counts equal
  std::map<block_id, long> to_model;
  std::map<long, block_id> to_phys;
  for (std::size_t s = 0; s < batch; ++s) {
    const auto table = cache.block_table(s);
    const auto& q = model.seq(s);
    REQUIRE(table.size() == q.table.size());
    for (std::size_t i = 0; i < table.size(); ++i) {
      const auto [a, fresh_a] = to_model.emplace(table[i], q.table[i]);
      const auto [b, fresh_b] = to_phys.emplace(q.table[i], table[i]);
      REQUIRE(a->second == q.table[i]);
      REQUIRE(b->second == table[i]);
      if (fresh_a) REQUIRE(cache.ref_count(table[i]) == model.blocks.at(q.table[i]).refs);
    }
    if (contents) check_sequence(cache, model, s);
  }
  const std::string problem = cache.check_consistency();
  INFO(problem);
  REQUIRE(problem.empty());
}

// `op` throws pool_exhausted_error with the model's numbers and changes nothing.
template <class Cache, class Op>
void require_exhausted(const Cache& cache, const Model::Need& need, Op&& op) {
  const auto before = kvcache::test::paged_state(cache);
  bool thrown = false;
  try {
    op();
  } catch (const pool_exhausted_error& e) {
    thrown = true;
    REQUIRE(e.needed() == need.needed);
    REQUIRE(e.free() == need.free);
    REQUIRE(e.evictable() == need.cached);
  }
  REQUIRE(thrown);
  REQUIRE(kvcache::test::paged_state(cache) == before);
}

template <Element T>
void run_model_seed(const Params& p, const std::string& name) {
  auto rng = kvcache::test::make_rng(name);
  PagedCache<T> cache({.num_layers = kLayers,
                       .num_kv_heads = kHeads,
                       .head_dim = kDim,
                       .num_blocks = p.num_blocks,
                       .block_size = p.block_size,
                       .max_batch = p.max_batch,
                       .max_seq_len = p.max_seq_len,
                       .enable_prefix_caching = p.caching,
                       .evict_when_full = p.evict});
  Model model(p, kLayers);
  // prompts are cut from a few base texts plus random tails: long shared prefixes, coincidental
  // equal blocks, and prompts that are prefixes of each other
  std::vector<std::vector<token_id>> bases(3);
  for (auto& b : bases) {
    for (std::size_t i = 0; i < p.max_seq_len; ++i)
      b.push_back(static_cast<token_id>(uniform(rng, 1, 6)));
  }
  const auto random_prompt = [&] {
    const auto& base = bases[uniform(rng, 0, bases.size() - 1)];
    std::vector<token_id> ids(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(uniform(
                                                               rng, 0, p.max_seq_len * 3 / 4)));
    const std::size_t tail = uniform(rng, 0, 4);
    for (std::size_t i = 0; i < tail && ids.size() < p.max_seq_len; ++i)
      ids.push_back(static_cast<token_id>(uniform(rng, 1, 3)));
    return ids;
  };
  // Most prompts under no salt, some under one of two tenants' salts (a tenant may well send the
  // same prompt as the others: it must not share their blocks).
  const auto random_salt = [&]() -> std::uint64_t {
    const std::size_t r = uniform(rng, 0, 5);
    return r < 3 ? 0 : r == 3 ? 7 : 0x8000000000000001ull;
  };
  std::map<std::string, int> done;
  for (int step = 0; step < p.steps; ++step) {
    const std::size_t s = uniform(rng, 0, p.max_batch - 1);
    const auto& q = model.seq(s);
    const std::size_t op = uniform(rng, 0, 12);
    INFO("step " << step << " op " << op << " sequence " << s);
    if (op <= 1) {  // admit
      if (!model.empty(s)) continue;
      const auto prompt = random_prompt();
      const std::uint64_t salt = random_salt();
      REQUIRE(cache.match_prefix(prompt, salt) == model.match(prompt, salt) * p.block_size);
      REQUIRE(cache.admit(s, prompt, salt) == model.admit(s, prompt, salt));
      if (salt != 0) ++done["admit under a salt"];
      ++done["admit"];
    } else if (op <= 5) {  // append to one layer, or to every layer (a forward pass)
      const std::size_t n = uniform(rng, 1, p.block_size * 2 + 1);
      const bool all_layers = op <= 4;
      const bool with_ids = uniform(rng, 0, 1) == 0;  // append(layer, seq, ids, k, v)
      for (std::size_t l = 0; l < kLayers; ++l) {
        const std::size_t layer = all_layers ? l : uniform(rng, 0, kLayers - 1);
        const std::size_t len = model.seq(s).len[layer];
        if (len + n > p.max_seq_len) {
          const auto before = kvcache::test::paged_state(cache);
          const auto kv = kvcache::test::random_kv(rng, n, kHeads, kDim);
          kvcache::test::require_throws<capacity_error>(
              [&] { cache.append(layer, s, kv.k_block(0, n), kv.v_block(0, n)); },
              "exceeds max_seq_len");
          REQUIRE(kvcache::test::paged_state(cache) == before);
          ++done["append past max_seq_len"];
          break;
        }
        model.plan(s, len + n, rng);
        const auto kv = kSynth.kv(layer, model.seq(s).planned, len, n);
        std::vector<token_id> ids(
            model.seq(s).planned.begin() + static_cast<std::ptrdiff_t>(len),
            model.seq(s).planned.begin() + static_cast<std::ptrdiff_t>(len + n));
        // Now and then an id that disagrees with the one registered at its position.
        const bool wrong = with_ids && len < model.seq(s).num_ids && uniform(rng, 0, 5) == 0;
        if (wrong) ids[uniform(rng, 0, std::min(n, model.seq(s).num_ids - len) - 1)] += 10;
        const auto do_append = [&] {
          if (with_ids) {
            cache.append(layer, s, ids, kv.k_block(0, n), kv.v_block(0, n));
          } else {
            cache.append(layer, s, kv.k_block(0, n), kv.v_block(0, n));
          }
        };
        if (const IdsError refused = model.append_error(s, layer, n, with_ids, wrong);
            refused != IdsError::none) {
          const auto before = kvcache::test::paged_state(cache);
          const char* what = refused == IdsError::past_ids    ? "registered token ids"
                             : refused == IdsError::untracked ? "without token ids"
                                                              : "is registered";
          kvcache::test::require_throws<position_error>(do_append, what);
          REQUIRE(kvcache::test::paged_state(cache) == before);
          ++done[refused == IdsError::past_ids    ? "append past the ids refused"
                 : refused == IdsError::untracked ? "append with ids to untracked refused"
                                                  : "append of other ids refused"];
          break;
        }
        const auto need = model.need_for_append(s, layer, n);
        if (need.fails) {
          require_exhausted(cache, need, do_append);
          ++done["pool exhausted"];
          break;
        }
        if (need.needed > need.free) ++done["append with eviction"];
        do_append();
        if (with_ids) model.register_with_append(s, layer, n);
        model.append(s, layer, n);
        ++done[with_ids ? "append with ids" : "append"];
        if (!all_layers) break;
      }
    } else if (op == 6) {  // register ids, possibly ahead of their K/V
      const std::size_t k = uniform(rng, 1, p.block_size + 1);
      if (q.num_ids + k > p.max_seq_len) continue;
      model.plan(s, q.num_ids + k, rng);
      const auto ids = std::span<const token_id>(model.seq(s).planned).subspan(q.num_ids, k);
      if (model.add_tokens_refused(s)) {
        const auto before = kvcache::test::paged_state(cache);
        kvcache::test::require_throws<position_error>([&] { cache.add_tokens(s, ids); },
                                                      "without token ids");
        REQUIRE(kvcache::test::paged_state(cache) == before);
        ++done["add_tokens to untracked refused"];
        continue;
      }
      cache.add_tokens(s, ids);
      model.add_tokens(s, k);
      ++done["add_tokens"];
    } else if (op == 7) {  // fork
      const std::size_t dst = uniform(rng, 0, p.max_batch - 1);
      if (dst == s || !model.empty(dst)) continue;
      cache.fork(s, dst);
      model.fork(s, dst);
      ++done["fork"];
    } else if (op == 8) {  // crop
      const std::size_t n = uniform(rng, 0, q.len[0]);
      cache.crop(s, n);
      model.crop(s, n);
      ++done["crop"];
    } else if (op == 9) {  // release
      cache.release(s);
      model.release(s);
      ++done["release"];
    } else if (op == 10) {  // beam reorder over a random subset
      std::vector<std::size_t> dst, src;
      for (std::size_t d = 0; d < p.max_batch; ++d) {
        if (uniform(rng, 0, 1) == 0) continue;
        dst.push_back(d);
        src.push_back(uniform(rng, 0, p.max_batch - 1));
      }
      cache.reorder(dst, src);
      model.reorder(dst, src);
      ++done["reorder"];
    } else if (op == 12) {  // save s, load it into a slot (another, or s itself)
      const std::size_t dst = uniform(rng, 0, p.max_batch - 1);
      const std::vector<std::size_t> from{s}, to{dst};
      const auto bytes = snapshot_to_bytes(cache, kSnapshotModel, from);
      const auto saved = model.seq(s);
      const auto need = model.need_for_restore(dst, saved);
      if (need.fails) {
        require_exhausted(cache, need, [&] {
          load_snapshot_bytes(bytes, cache, kSnapshotModel, {.dest_seqs = to});
        });
        ++done["restore pool exhausted"];
      } else {
        const std::size_t evictions = model.evictions;
        load_snapshot_bytes(bytes, cache, kSnapshotModel, {.dest_seqs = to});
        model.restore(dst, saved);
        ++done[dst == s ? "restore into itself" : "restore into another slot"];
        if (model.evictions != evictions) ++done["restore with eviction"];
        const auto [lo, hi] = std::minmax_element(saved.len.begin(), saved.len.end());
        if (*lo != *hi) ++done["restore of unequal layers"];
      }
    } else {  // evict a few cached blocks, probe the index
      const std::size_t k = uniform(rng, 0, 2);
      REQUIRE(cache.evict_cached(k) == model.evict_cached(k));
      const auto probe = random_prompt();
      const std::uint64_t salt = random_salt();
      REQUIRE(cache.match_prefix(probe, salt) == model.match(probe, salt) * p.block_size);
      ++done["evict"];
    }
    check_all(cache, model, p.max_batch, false);
    check_sequence(cache, model, s);
    if (step % 64 == 0) check_all(cache, model, p.max_batch, true);
  }
  check_all(cache, model, p.max_batch, true);
  for (const auto& [what, n] : done) std::cerr << "  " << name << ": " << what << " x" << n << "\n";
  // the operations that the checks above are about did happen
  REQUIRE(done["admit"] > 0);
  REQUIRE(done["admit under a salt"] > 0);
  REQUIRE(done["fork"] > 0);
  REQUIRE(done["reorder"] > 0);
  REQUIRE(done["append with ids"] > 0);
  REQUIRE(done["append past the ids refused"] > 0);
  REQUIRE(done["restore into another slot"] > 0);
  REQUIRE(done["restore of unequal layers"] > 0);
  if (p.evict) REQUIRE(done["append with eviction"] > 0);
  if (!p.evict) REQUIRE(done["pool exhausted"] > 0);
  if (p.caching) REQUIRE(model.reused > 0);

  // after everything is released, every block is free or cached, and unreferenced
  for (std::size_t s = 0; s < p.max_batch; ++s) {
    cache.release(s);
    model.release(s);
  }
  check_all(cache, model, p.max_batch, true);
  const auto st = cache.stats();
  REQUIRE(st.blocks_used == 0);
  REQUIRE(st.blocks_free + st.blocks_cached == p.num_blocks);
  for (std::size_t b = 0; b < p.num_blocks; ++b) {
    REQUIRE(cache.ref_count(static_cast<block_id>(b)) == 0);
  }
  REQUIRE(cache.evict_cached(p.num_blocks) == st.blocks_cached);
  REQUIRE(cache.stats().blocks_free == p.num_blocks);
}

// p.seeds runs, each from its own seed (derived from the run's base seed and the name).
template <Element T>
void run_model_test(const Params& p, const char* name) {
  for (int i = 0; i < p.seeds; ++i) {
    // appended in place: GCC 12 at -O1 reports `std::string(name) + "#"` as out of bounds
    // (a false -Warray-bounds in the inlined move of the temporary)
    std::string seed_name(name);
    seed_name.append("#").append(std::to_string(i));
    run_model_seed<T>(p, seed_name);
  }
}

}  // namespace

TEST_CASE("PagedCache agrees with a naive model over thousands of random operations") {
  SECTION("blocks of 4, eviction on") {
    run_model_test<float>({4, 24, 5, 40, true, true, 6000, 8}, "model-bs4-evict");
  }
  SECTION("blocks of 3, eviction off: pool exhaustion errors") {
    run_model_test<half>({3, 20, 5, 36, true, false, 6000, 6}, "model-bs3-noevict");
  }
  SECTION("blocks of 1, tight pool") {
    run_model_test<bfloat16>({1, 40, 4, 30, true, true, 4000, 6}, "model-bs1");
  }
  SECTION("prefix caching off") {
    run_model_test<float>({4, 14, 5, 40, false, false, 3000, 4}, "model-nocache");
  }
}
