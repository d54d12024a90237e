// SPDX-License-Identifier: Apache-2.0
// PrefixIndex: a block is found only under its own parent and its own ids; a hasher that collides
// everything changes the cost, never the answers; a node moved to another block keeps its
// children (checked against a map keyed by whole prefixes).
#include "kvcache/prefix/prefix_index.hpp"

#include <iterator>
#include <map>
#include <vector>

#include "support/catch.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

struct CollidingHasher {
  std::uint64_t operator()(std::uint64_t, std::span<const token_id>) const noexcept { return 7; }
};

template <class Hasher>
void exact_answers() {
  PrefixIndex<Hasher> index(8, 2);
  const std::vector<token_id> a{1, 2}, b{3, 4}, c{1, 2};
  REQUIRE(index.find(kNoBlock, a) == kNoBlock);
  index.insert(5, kNoBlock, a);  // [1 2]
  index.insert(6, 5, b);         // [1 2][3 4]
  index.insert(2, 6, c);         // [1 2][3 4][1 2]: same ids as block 5, other parent
  REQUIRE(index.size() == 3);
  REQUIRE(index.find(kNoBlock, a) == 5);
  REQUIRE(index.find(5, b) == 6);
  REQUIRE(index.find(6, c) == 2);
  REQUIRE(index.find(kNoBlock, b) == kNoBlock);  // right ids, wrong parent
  REQUIRE(index.find(5, a) == kNoBlock);
  REQUIRE(index.num_children(5) == 1);
  REQUIRE(index.parent(2) == 6);

  const std::vector<token_id> prompt{1, 2, 3, 4, 1, 2, 9};
  std::vector<block_id> out(8, kNoBlock);
  REQUIRE(index.match(prompt, out) == 3);
  REQUIRE(out[0] == 5);
  REQUIRE(out[1] == 6);
  REQUIRE(out[2] == 2);
  REQUIRE(index.matched_blocks(prompt) == 3);
  REQUIRE(index.match(prompt, std::span<block_id>(out).first(1)) == 1);  // out bounds the walk
  const std::vector<token_id> diverges{1, 2, 3, 5, 1, 2};
  REQUIRE(index.matched_blocks(diverges) == 1);
  const std::vector<token_id> short_prompt{1};
  REQUIRE(index.matched_blocks(short_prompt) == 0);  // no full block

  // a node is named by its content, the block is only where it lives: moving the inner node
  // [1 2][3 4] from block 6 to block 7 keeps its child, and block 6 is free for other content
  const std::uint64_t key = index.key(6);
  index.relocate(6, 7);
  REQUIRE_FALSE(index.contains(6));
  REQUIRE(index.key(7) == key);
  REQUIRE(index.find(5, b) == 7);
  REQUIRE(index.parent(2) == 7);
  REQUIRE(index.num_children(7) == 1);
  REQUIRE(index.num_children(6) == 0);
  REQUIRE(index.match(prompt, out) == 3);
  REQUIRE(out[1] == 7);
  index.insert(6, kNoBlock, b);  // [3 4] at the start: other content in the old block
  REQUIRE(index.find(7, c) == 2);
  REQUIRE(index.find(6, c) == kNoBlock);
  REQUIRE(index.matched_blocks(prompt) == 3);
  index.erase(6);
  index.relocate(7, 6);  // and back
  REQUIRE(index.find(5, b) == 6);
  REQUIRE(index.parent(2) == 6);

  index.erase(2);
  REQUIRE_FALSE(index.contains(2));
  REQUIRE(index.num_children(6) == 0);
  REQUIRE(index.matched_blocks(prompt) == 2);
  index.erase(6);
  index.erase(5);
  REQUIRE(index.size() == 0);
  REQUIRE(index.matched_blocks(prompt) == 0);
}

}  // namespace

TEST_CASE("PrefixIndex finds a block only under its parent and its own ids") {
  exact_answers<DefaultBlockHasher>();
}

TEST_CASE("PrefixIndex answers exactly even when every hash collides") {
  exact_answers<CollidingHasher>();
}

TEST_CASE("DefaultBlockHasher separates ids, order and parents") {
  const DefaultBlockHasher h;
  const std::vector<token_id> a{1, 2, 3}, b{1, 2, 4}, c{2, 1, 3};
  REQUIRE(h(kRootBlockHash, a) == h(kRootBlockHash, a));
  REQUIRE(h(kRootBlockHash, a) != h(kRootBlockHash, b));
  REQUIRE(h(kRootBlockHash, a) != h(kRootBlockHash, c));
  REQUIRE(h(kRootBlockHash, a) != h(h(kRootBlockHash, a), a));
}

TEMPLATE_TEST_CASE("PrefixIndex agrees with a map of whole prefixes over random operations", "",
                   DefaultBlockHasher, CollidingHasher) {
  auto rng = kvcache::test::make_rng("index-random");
  constexpr std::size_t kBlocks = 48, kBs = 2;
  PrefixIndex<TestType> index(kBlocks, kBs);
  // model: whole prefix (ids of the block and everything before) -> block
  std::map<std::vector<token_id>, block_id> model;
  std::map<block_id, std::vector<token_id>> prefix_of;
  std::vector<block_id> free;
  for (std::size_t b = 0; b < kBlocks; ++b) free.push_back(static_cast<block_id>(b));
  const auto random_ids = [&](std::size_t n) {
    std::vector<token_id> ids(n);
    for (auto& t : ids) t = static_cast<token_id>(kvcache::test::uniform(rng, 1, 3));
    return ids;
  };
  for (int step = 0; step < 5000; ++step) {
    const auto ids = random_ids(kBs * kvcache::test::uniform(rng, 1, 5));
    // the model's answer: leading full blocks whose whole prefix is indexed
    std::size_t expect = 0;
    while (
        (expect + 1) * kBs <= ids.size() &&
        model.count({ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>((expect + 1) * kBs)}))
      ++expect;
    std::vector<block_id> out(8);
    const std::size_t got = index.match(ids, out);
    REQUIRE(got == expect);
    for (std::size_t i = 0; i < got; ++i) {
      REQUIRE(prefix_of[out[i]] ==
              std::vector<token_id>(ids.begin(),
                                    ids.begin() + static_cast<std::ptrdiff_t>((i + 1) * kBs)));
    }
    const std::size_t op = kvcache::test::uniform(rng, 0, 5);
    if (op == 0 && !free.empty() && !prefix_of.empty()) {
      // move a random node to a free block: same content, children kept
      auto it = prefix_of.begin();
      std::advance(
          it, static_cast<std::ptrdiff_t>(kvcache::test::uniform(rng, 0, prefix_of.size() - 1)));
      const block_id from = it->first;
      const std::size_t pick = kvcache::test::uniform(rng, 0, free.size() - 1);
      const block_id to = free[pick];
      const std::size_t children = index.num_children(from);
      const std::uint64_t key = index.key(from);
      index.relocate(from, to);
      REQUIRE(index.num_children(to) == children);
      REQUIRE(index.key(to) == key);
      free[pick] = from;
      std::vector<token_id> prefix = std::move(it->second);
      prefix_of.erase(it);
      model[prefix] = to;
      prefix_of[to] = std::move(prefix);
    } else if (op >= 2 && !free.empty() && got * kBs < ids.size()) {
      // index the next block after the matched part
      const block_id b = free.back();
      free.pop_back();
      const block_id parent = got == 0 ? kNoBlock : out[got - 1];
      const std::vector<token_id> prefix(
          ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>((got + 1) * kBs));
      index.insert(b, parent, std::span<const token_id>(prefix).last(kBs));
      model[prefix] = b;
      prefix_of[b] = prefix;
    } else if (!prefix_of.empty()) {
      // erase a random leaf
      std::vector<block_id> leaves;
      for (const auto& [b, p] : prefix_of) {
        if (index.num_children(b) == 0) leaves.push_back(b);
      }
      REQUIRE_FALSE(leaves.empty());
      const block_id b = leaves[kvcache::test::uniform(rng, 0, leaves.size() - 1)];
      index.erase(b);
      model.erase(prefix_of[b]);
      prefix_of.erase(b);
      free.push_back(b);
    }
    REQUIRE(index.size() == model.size());
  }
}

namespace {

template <class Hasher>
void keyed_answers() {
  PrefixIndex<Hasher> index(8, 2);
  const std::vector<token_id> a{1, 2}, b{3, 4};
  constexpr std::uint64_t kSalt = 0xfeed;
  index.insert(1, kNoBlock, a);         // [1 2] under no key
  index.insert(4, kNoBlock, a, kSalt);  // [1 2] under kSalt: the same ids, another node
  index.insert(5, 4, b, kSalt);         // [1 2][3 4] under kSalt
  REQUIRE(index.find(kNoBlock, a) == 1);
  REQUIRE(index.find(kNoBlock, a, kSalt) == 4);
  REQUIRE(index.find(kNoBlock, a, kSalt + 1) == kNoBlock);
  REQUIRE(index.find(4, b, kSalt) == 5);
  REQUIRE(index.find(4, b) == kNoBlock);  // the right parent, the wrong key
  REQUIRE(index.extra_key(5) == kSalt);
  REQUIRE(index.extra_key(1) == 0);
  const std::vector<token_id> prompt{1, 2, 3, 4};
  REQUIRE(index.matched_blocks(prompt) == 1);
  REQUIRE(index.matched_blocks(prompt, kSalt) == 2);
  REQUIRE(index.matched_blocks(prompt, 1) == 0);
  std::vector<block_id> out(2, kNoBlock);
  REQUIRE(index.match(prompt, out, kSalt) == 2);
  REQUIRE(out == std::vector<block_id>{4, 5});
  index.erase(5);
  index.erase(4);
  REQUIRE(index.matched_blocks(prompt, kSalt) == 0);
  REQUIRE(index.matched_blocks(prompt) == 1);
}

}  // namespace

TEST_CASE("PrefixIndex finds a block only under the extra key it was indexed with") {
  REQUIRE(root_block_hash(0) == kRootBlockHash);
  REQUIRE(root_block_hash(1) != root_block_hash(2));
  keyed_answers<DefaultBlockHasher>();
  keyed_answers<CollidingHasher>();  // every hash equal: the key comparison alone decides
}
