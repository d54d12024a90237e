// SPDX-License-Identifier: Apache-2.0
// PrefixIndex: finds the cached blocks that hold a prompt's prefix. A trie over full blocks of
// content whose child links are a hash table keyed by (parent node, the block's token ids, extra
// key); a node's block is only where it lives. Every hit is confirmed by comparing the parent, key
// and ids, so a hash collision can never share K/V.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// Hashes one block: the parent's hash (kRootBlockHash for a first block) and the block's ids.
/// Any function will do for correctness (hits are confirmed); a good one keeps lookups O(1).
template <class H>
concept BlockHasher = requires(const H& h, std::uint64_t parent_hash, std::span<const token_id> t) {
  { h(parent_hash, t) }
  noexcept->std::same_as<std::uint64_t>;
};

/// The parent hash a first block is hashed with (under extra key 0).
inline constexpr std::uint64_t kRootBlockHash = 0x6a09e667f3bcc908ull;

/// The parent hash a first block is hashed with under `extra_key` (a cache salt, an adapter id):
/// kRootBlockHash for 0, a mix of both otherwise, so that the chains of different keys part at
/// the first block.
[[nodiscard]] constexpr std::uint64_t root_block_hash(std::uint64_t extra_key) noexcept {
  if (extra_key == 0) return kRootBlockHash;
  std::uint64_t h = kRootBlockHash ^ (extra_key * 0x9e3779b97f4a7c15ull);
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;  // splitmix64 finaliser
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

/// The default BlockHasher: multiply-xorshift over pairs of ids, seeded by the parent's hash, so
/// equal blocks under different prefixes land in different buckets. O(block_size).
struct DefaultBlockHasher {
  [[nodiscard]] std::uint64_t operator()(std::uint64_t parent_hash,
                                         std::span<const token_id> ids) const noexcept {
    constexpr std::uint64_t kMul = 0x9e3779b97f4a7c15ull;
    std::uint64_t h = parent_hash ^ (ids.size() * kMul);
    std::size_t i = 0;
    for (; i + 2 <= ids.size(); i += 2) {
      const std::uint64_t word = static_cast<std::uint32_t>(ids[i]) |
                                 (std::uint64_t{static_cast<std::uint32_t>(ids[i + 1])} << 32);
      h = (h ^ word) * kMul;
      h ^= h >> 29;
    }
    if (i < ids.size()) h = ((h ^ static_cast<std::uint32_t>(ids[i])) * kMul) ^ (h >> 29);
    // splitmix64 finaliser
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    return h ^ (h >> 31);
  }
};
static_assert(BlockHasher<DefaultBlockHasher>);

/// The prefix index of a pool of num_blocks blocks of block_size tokens.
///
/// Structure: a trie whose nodes are full blocks *of content*. A node is keyed by its parent node
/// (the node of the previous block_size tokens; none for a first block), its own block_size token
/// ids and an *extra key* (a caller's cache salt or adapter id, 0 for none, the same along a
/// chain), so a node stands for its whole prefix under that key, exactly: the chains of two extra
/// keys never share a node. Its content key (key()) is the chained hash Hasher(parent's key, ids)
/// seeded by root_block_hash(extra key), as vLLM's block hash. A lookup accepts an entry only when
/// the hash, the parent node, the extra key and every token id match, so collisions cost time,
/// never correctness (a hasher that maps everything to one value still gives exact answers, in
/// O(entries) per lookup).
///
/// Names and locations: a node is not its physical block. The block is the node's current
/// location (the block_id every member takes and returns), and children hold their parent's
/// node, not its block, so relocate() moves a node to another block in O(1) without touching its
/// children, and a block id freed by erase() or relocate() can hold other content at once.
///
/// The table is intrusive (bucket heads plus one next link per node, all allocated by the
/// constructor, at most num_blocks nodes): insert, erase and relocate never allocate. Not
/// thread-safe (the owning cache locks).
template <BlockHasher Hasher = DefaultBlockHasher>
class PrefixIndex {
 public:
  /// @throws shape_error for a zero num_blocks or block_size; std::bad_alloc.
  PrefixIndex(std::size_t num_blocks, std::size_t block_size, Hasher hasher = {})
      : block_size_(block_size), hasher_(std::move(hasher)) {
    detail::require_nonzero(num_blocks, "PrefixIndex", "num_blocks");
    detail::require_nonzero(block_size, "PrefixIndex", "block_size");
    hash_.assign(num_blocks, 0);
    parent_.assign(num_blocks, kNoNode);
    bucket_next_.assign(num_blocks, kNoNode);
    children_.assign(num_blocks, 0);
    extra_.assign(num_blocks, 0);
    location_.assign(num_blocks, kNoBlock);
    node_of_.assign(num_blocks, kNoNode);
    tokens_.assign(detail::checked_mul(num_blocks, block_size, "PrefixIndex"), 0);
    buckets_.assign(std::bit_ceil(num_blocks), kNoNode);
    free_nodes_.resize(num_blocks);
    for (std::size_t i = 0; i < num_blocks; ++i) {
      free_nodes_[i] = static_cast<node_id>(num_blocks - 1 - i);  // node 0 is taken first
    }
  }

  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  /// Blocks indexed.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The hasher the index keys its blocks with.
  [[nodiscard]] const Hasher& hasher() const noexcept { return hasher_; }
  [[nodiscard]] bool contains(block_id b) const noexcept { return node_of_[b] != kNoNode; }
  /// Where the parent node of the node at b lives (kNoBlock for a first block). @pre contains(b).
  [[nodiscard]] block_id parent(block_id b) const noexcept {
    const node_id p = parent_[node_of_[b]];
    return p == kNoNode ? kNoBlock : location_[p];
  }
  /// Indexed nodes whose parent is the node at b (0 if b holds none).
  [[nodiscard]] std::size_t num_children(block_id b) const noexcept {
    return contains(b) ? children_[node_of_[b]] : 0;
  }
  /// The extra key the node at b was indexed under. @pre contains(b).
  [[nodiscard]] std::uint64_t extra_key(block_id b) const noexcept { return extra_[node_of_[b]]; }
  /// The content key of the node at b: the chained hash of its whole prefix's ids under its extra
  /// key (what names it wherever it lives). @pre contains(b).
  [[nodiscard]] std::uint64_t key(block_id b) const noexcept { return hash_[node_of_[b]]; }
  /// The ids the node at b was indexed with. @pre contains(b).
  [[nodiscard]] std::span<const token_id> tokens(block_id b) const noexcept {
    return node_tokens(node_of_[b]);
  }

  /// The block holding the indexed node of `ids` right after the node at `parent` (kNoBlock: at
  /// the start) under `extra_key`, or kNoBlock.
  /// @pre ids.size() == block_size(); parent == kNoBlock or contains(parent).
  /// O(block_size) plus O(block_size) per colliding entry.
  [[nodiscard]] block_id find(block_id parent, std::span<const token_id> ids,
                              std::uint64_t extra_key = 0) const noexcept {
    const node_id n = find_node(parent == kNoBlock ? kNoNode : node_of_[parent], ids, extra_key);
    return n == kNoNode ? kNoBlock : location_[n];
  }

  /// Walks `ids` block by block from the start, under `extra_key`, and writes the blocks of the
  /// matching nodes to out[0..m). Stops at the first miss, at the last full block of ids, or when
  /// out is full. @return m, the number of leading full blocks of ids that are indexed.
  /// O(m * block_size).
  [[nodiscard]] std::size_t match(std::span<const token_id> ids, std::span<block_id> out,
                                  std::uint64_t extra_key = 0) const noexcept {
    return walk(ids, out.size(), extra_key,
                [&](std::size_t i, node_id n) { out[i] = location_[n]; });
  }

  /// match() without the block ids: how many leading full blocks of ids are indexed.
  [[nodiscard]] std::size_t matched_blocks(std::span<const token_id> ids,
                                           std::uint64_t extra_key = 0) const noexcept {
    return walk(ids, ids.size(), extra_key, [](std::size_t, node_id) {});
  }

  /// Indexes a new node holding `ids` after the node at `parent` under `extra_key`, located at
  /// block b.
  /// @pre !contains(b); find(parent, ids, extra_key) == kNoBlock; parent == kNoBlock or
  ///      (contains(parent) and extra_key(parent) == extra_key).
  void insert(block_id b, block_id parent, std::span<const token_id> ids,
              std::uint64_t extra_key = 0) noexcept {
    const node_id p = parent == kNoBlock ? kNoNode : node_of_[parent];
    const node_id n = free_nodes_.back();
    free_nodes_.pop_back();
    const std::uint64_t h = hash_of(p, ids, extra_key);
    hash_[n] = h;
    parent_[n] = p;
    extra_[n] = extra_key;
    std::copy(ids.begin(), ids.end(),
              tokens_.begin() + static_cast<std::ptrdiff_t>(n * block_size_));
    node_id& head = buckets_[h & (buckets_.size() - 1)];
    bucket_next_[n] = head;
    head = n;
    if (p != kNoNode) ++children_[p];
    location_[n] = b;
    node_of_[b] = n;
    ++size_;
  }

  /// Removes the node at block b. @pre contains(b) and num_children(b) == 0 (a leaf: a child
  /// would be left under a parent no lookup can reach). O(entries in its bucket).
  void erase(block_id b) noexcept {
    const node_id n = node_of_[b];
    node_id* link = &buckets_[hash_[n] & (buckets_.size() - 1)];
    while (*link != n) link = &bucket_next_[*link];
    *link = bucket_next_[n];
    bucket_next_[n] = kNoNode;
    if (parent_[n] != kNoNode) --children_[parent_[n]];
    parent_[n] = kNoNode;
    extra_[n] = 0;
    location_[n] = kNoBlock;
    node_of_[b] = kNoNode;
    free_nodes_.push_back(n);  // within the capacity reserved at construction
    --size_;
  }

  /// Moves the node at block `from` to block `to` (its K/V moved there): lookups that found it at
  /// `from` find it at `to`, its children stay its children, and `from` holds nothing.
  /// @pre contains(from), !contains(to). O(1).
  void relocate(block_id from, block_id to) noexcept {
    const node_id n = node_of_[from];
    node_of_[from] = kNoNode;
    node_of_[to] = n;
    location_[n] = to;
  }

 private:
  using node_id = std::uint32_t;
  static constexpr node_id kNoNode = std::numeric_limits<node_id>::max();

  [[nodiscard]] std::span<const token_id> node_tokens(node_id n) const noexcept {
    return {tokens_.data() + std::size_t{n} * block_size_, block_size_};
  }

  [[nodiscard]] std::uint64_t hash_of(node_id parent, std::span<const token_id> ids,
                                      std::uint64_t extra_key) const noexcept {
    return hasher_(parent == kNoNode ? root_block_hash(extra_key) : hash_[parent], ids);
  }

  [[nodiscard]] node_id find_node(node_id parent, std::span<const token_id> ids,
                                  std::uint64_t extra_key) const noexcept {
    const std::uint64_t h = hash_of(parent, ids, extra_key);
    for (node_id n = buckets_[h & (buckets_.size() - 1)]; n != kNoNode; n = bucket_next_[n]) {
      const std::span<const token_id> held = node_tokens(n);
      if (hash_[n] == h && parent_[n] == parent && extra_[n] == extra_key &&
          std::equal(held.begin(), held.end(), ids.begin(), ids.end())) {
        return n;
      }
    }
    return kNoNode;
  }

  template <class F>
  std::size_t walk(std::span<const token_id> ids, std::size_t max_blocks, std::uint64_t extra_key,
                   F&& visit) const noexcept {
    node_id parent = kNoNode;
    std::size_t m = 0;
    for (; m < max_blocks && (m + 1) * block_size_ <= ids.size(); ++m) {
      const node_id n = find_node(parent, ids.subspan(m * block_size_, block_size_), extra_key);
      if (n == kNoNode) break;
      visit(m, n);
      parent = n;
    }
    return m;
  }

  std::size_t block_size_;
  Hasher hasher_;
  // per node
  std::vector<std::uint64_t> hash_;  // content key
  std::vector<node_id> parent_;
  std::vector<node_id> bucket_next_;
  std::vector<std::uint32_t> children_;
  std::vector<std::uint64_t> extra_;
  std::vector<block_id> location_;  // kNoBlock when free
  std::vector<token_id> tokens_;    // [node][block_size]
  // per block
  std::vector<node_id> node_of_;     // kNoNode when the block holds no node
  std::vector<node_id> buckets_;     // bit_ceil(num_blocks) chain heads
  std::vector<node_id> free_nodes_;  // a stack; capacity num_blocks
  std::size_t size_ = 0;
};

}  // namespace kvcache
