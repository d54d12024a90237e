// SPDX-License-Identifier: Apache-2.0
// BlockManager on its own, with a storage of labels instead of K/V: thousands of random admits,
// appends, add_tokens, forks, reorders, crops, releases, evictions and restores, each applied to
// the storage exactly as the manager's commands say (copy these blocks, write these rows, fill
// these restored blocks). After every operation each sequence must read, through its block
// table, the label of (layer, position, id) at every position it holds: a copy missed, a write
// into a block someone else holds or a restored block left unfilled shows up as a wrong label.
// A refused operation must change nothing.
#include "kvcache/manager/block_manager.hpp"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

struct Params {
  std::size_t layers, block_size, num_blocks, max_batch, max_seq_len;
  bool caching, evict;
};

// What the K/V of token `id` at position `pos` of layer `layer` would be.
std::int64_t label(std::size_t layer, std::size_t pos, token_id id) {
  return (static_cast<std::int64_t>(layer) * 100003 + static_cast<std::int64_t>(pos)) * 65536 + id;
}

// [layer][block][slot] labels: the storage the manager's commands are applied to.
class LabelStorage {
 public:
  LabelStorage(const Params& p) : p_(p), cells_(p.layers * p.num_blocks * p.block_size, -1) {}

  std::int64_t& at(std::size_t layer, block_id b, std::size_t slot) {
    return cells_[(layer * p_.num_blocks + b) * p_.block_size + slot];
  }

  // Appends ids[i] to seqs[i] of `layer` for every i, as one batch.
  void append(BlockManager<>& m, std::size_t layer, const std::vector<std::size_t>& seqs,
              const std::vector<std::vector<token_id>>& ids) {
    std::vector<AppendRequest> requests;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      requests.push_back({seqs[i], ids[i].size(), ids[i].data()});
    }
    std::vector<BlockManager<>::AppendPlan> plans(seqs.size());
    m.begin_append(layer, requests, plans);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      for (const BlockCopy& c : plans[i].copies) {
        for (std::size_t l = 0; l < p_.layers; ++l) {
          for (std::size_t r = 0; r < m.block_rows(seqs[i], l, c.index); ++r) {
            at(l, c.to, r) = at(l, c.from, r);
          }
        }
      }
    }
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      for (std::size_t t = 0; t < ids[i].size(); ++t) {
        const std::size_t pos = plans[i].position + t;
        at(layer, plans[i].table[pos / p_.block_size], pos % p_.block_size) =
            label(layer, pos, ids[i][t]);
      }
    }
    m.end_append(plans);
  }

  // Restores into `dst` what `src` holds (its lengths and ids), as a snapshot load would.
  void restore_copy(BlockManager<>& m, std::size_t src, std::size_t dst) {
    std::vector<RestoreExtent> extents;
    for (std::size_t l = 0; l < p_.layers; ++l) {
      extents.push_back({l, dst, m.layer_length(l, src)});
    }
    const std::vector<token_id> ids(m.tokens(src).begin(), m.tokens(src).end());
    const SequenceTokens t{.seq = dst, .ids = ids, .exact_prefix = m.exact_prefix(src)};
    const RestorePlan plan = m.begin_restore(extents, std::span(&t, 1));
    const auto table = m.block_table(dst);
    for (const RestorePlan::Range r : plan.fresh_blocks(dst)) {
      for (std::size_t i = r.begin; i < r.end; ++i) {
        for (std::size_t l = 0; l < p_.layers; ++l) {
          for (std::size_t s = 0; s < p_.block_size; ++s) {
            const std::size_t pos = i * p_.block_size + s;
            if (pos < extents[l].length) at(l, table[i], s) = label(l, pos, ids[pos]);
          }
        }
      }
    }
    m.end_restore(plan);
  }

  // "" or the first position some sequence reads a wrong label at.
  std::string check(const BlockManager<>& m) {
    for (std::size_t q = 0; q < p_.max_batch; ++q) {
      const auto table = m.block_table(q);
      const auto ids = m.tokens(q);
      for (std::size_t l = 0; l < p_.layers; ++l) {
        for (std::size_t pos = 0; pos < m.layer_length(l, q); ++pos) {
          const std::int64_t got = at(l, table[pos / p_.block_size], pos % p_.block_size);
          if (got != label(l, pos, ids[pos])) {
            return "sequence " + std::to_string(q) + " layer " + std::to_string(l) + " position " +
                   std::to_string(pos) + " reads a wrong label";
          }
        }
      }
    }
    return {};
  }

 private:
  Params p_;
  std::vector<std::int64_t> cells_;
};

// Everything a refused operation must leave as it was.
struct State {
  std::vector<std::vector<block_id>> tables;
  std::vector<std::vector<token_id>> ids;
  std::vector<std::vector<std::size_t>> lengths;
  PrefixCacheStats stats;
  bool operator==(const State&) const = default;
};

State state_of(const BlockManager<>& m) {
  State s;
  for (std::size_t q = 0; q < m.max_batch(); ++q) {
    s.tables.emplace_back(m.block_table(q).begin(), m.block_table(q).end());
    s.ids.emplace_back(m.tokens(q).begin(), m.tokens(q).end());
    s.lengths.emplace_back();
    for (std::size_t l = 0; l < m.num_layers(); ++l)
      s.lengths.back().push_back(m.layer_length(l, q));
  }
  s.stats = m.stats();
  return s;
}

void run(const Params& p, std::mt19937_64& rng, int steps) {
  BlockManager<> m({.num_layers = p.layers,
                    .num_blocks = p.num_blocks,
                    .block_size = p.block_size,
                    .max_batch = p.max_batch,
                    .max_seq_len = p.max_seq_len,
                    .enable_prefix_caching = p.caching,
                    .evict_when_full = p.evict},
                   {}, "BlockManager test");
  LabelStorage storage(p);
  const auto pick = [&](std::size_t n) {
    return static_cast<std::size_t>(std::uniform_int_distribution<std::size_t>(0, n - 1)(rng));
  };
  // Few distinct ids, so that prompts share prefixes.
  const auto some_ids = [&](std::size_t n) {
    std::vector<token_id> ids(n);
    for (auto& t : ids) t = static_cast<token_id>(pick(3));
    return ids;
  };
  std::size_t refused = 0;
  for (int step = 0; step < steps; ++step) {
    const std::size_t seq = pick(p.max_batch), other = pick(p.max_batch);
    const State before = state_of(m);
    try {
      switch (pick(9)) {
        case 0:  // admit
          if (m.tokens(seq).empty() && m.seq_length(seq) == 0) {
            (void)m.admit(seq, some_ids(1 + pick(3 * p.block_size)));
          }
          break;
        case 1:
        case 2: {  // append with ids: registered ones where the layer is behind, then new ones;
                   // to one sequence, or to a batch of them at once
          const std::size_t layer = pick(p.layers);
          std::vector<std::size_t> seqs;
          std::vector<std::vector<token_id>> ids;
          for (std::size_t q = 0; q < p.max_batch; ++q) {
            if (q != seq && (pick(2) == 0 || seqs.size() == 3)) continue;
            const std::size_t len = m.layer_length(layer, q);
            const auto held = m.tokens(q);
            if (held.empty() && m.seq_length(q) != 0) continue;
            ids.push_back(some_ids(1 + pick(p.block_size + 2)));
            for (std::size_t i = 0; i < ids.back().size() && len + i < held.size(); ++i) {
              ids.back()[i] = held[len + i];
            }
            seqs.push_back(q);
          }
          if (!seqs.empty()) storage.append(m, layer, seqs, ids);
          break;
        }
        case 3:
          if (!m.tokens(seq).empty() || m.seq_length(seq) == 0) m.add_tokens(seq, some_ids(1));
          break;
        case 4:
          if (seq != other) {
            m.release(other);
            m.fork(seq, other);
          }
          break;
        case 5: {
          std::vector<std::size_t> dst{seq, other}, src{other, seq};
          if (seq == other) {
            dst.pop_back();
            src.pop_back();
          }
          m.reorder(dst, src);
          break;
        }
        case 6:
          m.crop(seq, pick(m.seq_length(seq) + 1));
          break;
        case 7:
          if (pick(4) == 0) {
            m.release(seq);
          } else {
            (void)m.evict_cached(pick(3));
          }
          break;
        case 8:
          if (seq != other && !m.tokens(seq).empty()) storage.restore_copy(m, seq, other);
          break;
      }
    } catch (const pool_exhausted_error& e) {
      ++refused;
      INFO(e.what());
      REQUIRE(state_of(m) == before);
    } catch (const capacity_error& e) {  // past max_seq_len
      ++refused;
      INFO(e.what());
      REQUIRE(state_of(m) == before);
    }
    INFO("step " << step);
    REQUIRE(m.check_consistency() == "");
    REQUIRE(storage.check(m) == "");
  }
  for (std::size_t q = 0; q < p.max_batch; ++q) m.release(q);
  REQUIRE(m.check_consistency() == "");
  REQUIRE(m.stats().blocks_used == 0);
  INFO("refused " << refused << " of " << steps);
  CHECK(refused < static_cast<std::size_t>(steps));
}

}  // namespace

TEST_CASE("BlockManager's commands keep every sequence's rows, whatever the operations") {
  auto rng = kvcache::test::make_rng("block_manager_commands");
  const Params configs[] = {
      {2, 4, 24, 4, 40, true, true},   {3, 3, 12, 3, 30, true, false},
      {2, 4, 24, 4, 40, false, false}, {1, 1, 16, 3, 12, true, true},
      {2, 8, 64, 6, 96, true, true},
  };
  for (const Params& p : configs) {
    INFO("layers " << p.layers << " block_size " << p.block_size << " blocks " << p.num_blocks
                   << " caching " << p.caching << " evict " << p.evict);
    for (int seed = 0; seed < 4; ++seed) run(p, rng, 1500);
  }
}

TEST_CASE("BlockManager names its owner in errors and refuses bad input unchanged") {
  BlockManager<> m(
      {.num_layers = 2, .num_blocks = 2, .block_size = 2, .max_batch = 2, .max_seq_len = 8}, {},
      "DeviceCache");
  const std::vector<token_id> ids{1, 2, 3, 4, 5};
  CHECK_THROWS_AS((void)m.begin_append(2, 0, 1, ids.data()), layer_error);
  CHECK_THROWS_AS((void)m.begin_append(0, 2, 1, ids.data()), batch_error);
  try {
    (void)m.begin_append(0, 0, 5, ids.data());
    FAIL("five tokens fit two blocks of two");
  } catch (const pool_exhausted_error& e) {
    CHECK(std::string(e.what()).starts_with("DeviceCache: append of 5 tokens"));
    CHECK(e.needed() == 3);
    CHECK(e.free() == 2);
  }
  CHECK(m.stats().blocks_free == 2);
  CHECK(m.seq_length(0) == 0);
  CHECK(m.tokens(0).empty());
  // a batch fails whole: each request alone fits, both together do not
  const AppendRequest both[] = {{0, 3, ids.data()}, {1, 3, ids.data()}};
  BlockManager<>::AppendPlan plans[2];
  try {
    m.begin_append(0, both, plans);
    FAIL("two sequences of two blocks each fit a pool of two");
  } catch (const pool_exhausted_error& e) {
    CHECK(std::string(e.what()).starts_with("DeviceCache: append of 6 tokens to 2 sequences"));
  }
  const AppendRequest twice[] = {{1, 1, ids.data()}, {1, 1, ids.data()}};
  CHECK_THROWS_AS(m.begin_append(0, twice, plans), shape_error);
  CHECK(m.stats().blocks_free == 2);
  CHECK(m.seq_length(1) == 0);
  CHECK(m.check_consistency() == "");
}
