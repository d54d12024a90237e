// SPDX-License-Identifier: Apache-2.0
// LruList: the least recently pushed block comes out first; erase from anywhere keeps the order.
// Checked against std::list over thousands of random operations.
#include "kvcache/prefix/eviction.hpp"

#include <algorithm>
#include <list>

#include "support/catch.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

std::list<block_id> contents(const LruList& lru) {
  std::list<block_id> out;
  for (block_id b = lru.front(); b != kNoBlock; b = lru.next(b)) out.push_back(b);
  return out;
}

}  // namespace

TEST_CASE("LruList keeps least-recently-pushed order through pushes and erases") {
  LruList lru(4);
  REQUIRE(lru.empty());
  REQUIRE(lru.front() == kNoBlock);
  lru.push_back(2);
  lru.push_back(0);
  lru.push_back(3);
  REQUIRE(contents(lru) == std::list<block_id>{2, 0, 3});
  lru.erase(0);  // middle
  REQUIRE(contents(lru) == std::list<block_id>{2, 3});
  lru.erase(2);  // front
  REQUIRE(lru.front() == 3);
  lru.push_back(2);
  lru.erase(2);  // back
  REQUIRE(contents(lru) == std::list<block_id>{3});
  REQUIRE(lru.contains(3));
  REQUIRE_FALSE(lru.contains(2));
  lru.erase(3);
  REQUIRE(lru.empty());
  REQUIRE(lru.front() == kNoBlock);
}

TEST_CASE("LruList agrees with std::list over random operations") {
  auto rng = kvcache::test::make_rng("lru-random");
  constexpr std::size_t kBlocks = 37;
  LruList lru(kBlocks);
  std::list<block_id> model;
  for (int step = 0; step < 20000; ++step) {
    const auto b = static_cast<block_id>(kvcache::test::uniform(rng, 0, kBlocks - 1));
    const bool listed = std::find(model.begin(), model.end(), b) != model.end();
    REQUIRE(lru.contains(b) == listed);
    if (listed) {
      lru.erase(b);
      model.remove(b);
    } else {
      lru.push_back(b);
      model.push_back(b);
    }
    REQUIRE(lru.size() == model.size());
    REQUIRE(lru.front() == (model.empty() ? kNoBlock : model.front()));
    if (step % 97 == 0) REQUIRE(contents(lru) == model);
  }
}
