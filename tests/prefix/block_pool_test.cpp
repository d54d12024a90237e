// SPDX-License-Identifier: Apache-2.0
// BlockPool: reference counts move blocks between free, used and cached exactly as documented;
// the counts always add up; bad sizes are rejected.
#include "kvcache/prefix/block_pool.hpp"

#include <set>

#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

using namespace kvcache;

TEST_CASE("BlockPool: allocate, share, release to free or to cached, evict") {
  BlockPool pool(4);
  REQUIRE(pool.num_free() == 4);
  REQUIRE(pool.num_used() == 0);
  const block_id a = pool.allocate(), b = pool.allocate();
  REQUIRE(a == 0);  // fresh pools hand out blocks in order
  REQUIRE(b == 1);
  REQUIRE(pool.ref_count(a) == 1);
  pool.acquire(a);
  REQUIRE(pool.ref_count(a) == 2);
  REQUIRE(pool.num_used() == 2);
  pool.release(a);
  REQUIRE(pool.ref_count(a) == 1);
  REQUIRE(pool.num_used() == 2);

  // an unindexed block goes back to the free list, the next allocation reuses it first
  pool.release(b);
  REQUIRE(pool.num_free() == 3);
  REQUIRE(pool.allocate() == b);

  // an indexed block becomes cached, not free, and can be taken back without allocating
  pool.mark_indexed(a);
  pool.release(a);
  REQUIRE(pool.cached(a));
  REQUIRE(pool.num_cached() == 1);
  REQUIRE(pool.num_free() == 2);
  pool.acquire(a);
  REQUIRE_FALSE(pool.cached(a));
  REQUIRE(pool.ref_count(a) == 1);
  REQUIRE(pool.indexed(a));
  pool.release(a);
  pool.evict(a);
  REQUIRE_FALSE(pool.indexed(a));
  REQUIRE(pool.num_cached() == 0);
  REQUIRE(pool.num_free() == 3);
  REQUIRE(pool.num_used() == 1);
}

TEST_CASE("BlockPool counts add up over random operations") {
  auto rng = kvcache::test::make_rng("pool-random");
  constexpr std::size_t kBlocks = 16;
  BlockPool pool(kBlocks);
  std::vector<std::uint32_t> refs(kBlocks, 0);
  std::vector<bool> indexed(kBlocks, false);
  for (int step = 0; step < 20000; ++step) {
    const auto b = static_cast<block_id>(kvcache::test::uniform(rng, 0, kBlocks - 1));
    switch (kvcache::test::uniform(rng, 0, 3)) {
      case 0:
        if (pool.num_free() != 0) {
          const block_id got = pool.allocate();
          REQUIRE(refs[got] == 0);
          REQUIRE_FALSE(indexed[got]);
          refs[got] = 1;
        }
        break;
      case 1:
        if (refs[b] > 0 || pool.cached(b)) {
          pool.acquire(b);
          ++refs[b];
        }
        break;
      case 2:
        if (refs[b] > 0) {
          pool.release(b);
          --refs[b];
        }
        break;
      default:
        if (refs[b] > 0 && !indexed[b]) {
          pool.mark_indexed(b);
          indexed[b] = true;
        } else if (pool.cached(b)) {
          pool.evict(b);
          indexed[b] = false;
        }
    }
    std::size_t used = 0, cached = 0;
    for (std::size_t i = 0; i < kBlocks; ++i) {
      const auto id = static_cast<block_id>(i);
      REQUIRE(pool.ref_count(id) == refs[i]);
      REQUIRE(pool.cached(id) == (refs[i] == 0 && indexed[i]));
      used += refs[i] > 0;
      cached += pool.cached(id);
    }
    REQUIRE(pool.num_used() == used);
    REQUIRE(pool.num_cached() == cached);
    REQUIRE(pool.num_free() == kBlocks - used - cached);
    const std::set<block_id> free(pool.free_list().begin(), pool.free_list().end());
    REQUIRE(free.size() == pool.num_free());
  }
}

TEST_CASE("BlockPool rejects 0 blocks and more than block ids can name") {
  kvcache::test::require_throws<shape_error>([] { BlockPool pool(0); }, "num_blocks 0");
  // checked before anything is allocated
  kvcache::test::require_throws<shape_error>([] { BlockPool pool(std::size_t{kNoBlock}); },
                                             "num_blocks 4294967295");
}
