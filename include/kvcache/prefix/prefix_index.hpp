// SPDX-License-Identifier: Apache-2.0
// PrefixIndex: finds the cached blocks that hold a prompt's prefix. A trie over full blocks whose
// child links are a hash table keyed by (parent block, the block's token ids); every hit is
// confirmed by comparing the parent and the ids, so a hash collision can never share K/V.
#pragma once

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
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
/// Structure: a trie whose nodes are full blocks. A node is keyed by its parent node (the block
/// holding the previous block_size tokens; kNoBlock for the first block), its own block_size
/// token ids and an *extra key* (a caller's cache salt or adapter id, 0 for none, the same along
/// a chain), so a node stands for its whole prefix under that key, exactly: the chains of two
/// extra keys never share a node. Child links are found through a chained hash table: hash =
/// Hasher(parent's hash, ids), a chained hash over the prefix as in vLLM, seeded by
/// root_block_hash(extra key). A lookup accepts an entry only when the hash, the parent id, the
/// extra key and every token id match, so collisions cost time, never correctness (a hasher that
/// maps everything to one value still gives exact answers, in O(entries) per lookup).
///
/// The table is intrusive (bucket heads plus one next link per block, all allocated by the
/// constructor): insert and erase never allocate. Not thread-safe (the owning cache locks).
template <BlockHasher Hasher = DefaultBlockHasher>
class PrefixIndex {
 public:
  /// @throws shape_error for a zero num_blocks or block_size; std::bad_alloc.
  PrefixIndex(std::size_t num_blocks, std::size_t block_size, Hasher hasher = {})
      : block_size_(block_size), hasher_(std::move(hasher)) {
    detail::require_nonzero(num_blocks, "PrefixIndex", "num_blocks");
    detail::require_nonzero(block_size, "PrefixIndex", "block_size");
    hash_.assign(num_blocks, 0);
    parent_.assign(num_blocks, kNoBlock);
    bucket_next_.assign(num_blocks, kNoBlock);
    children_.assign(num_blocks, 0);
    member_.assign(num_blocks, 0);
    extra_.assign(num_blocks, 0);
    tokens_.assign(detail::checked_mul(num_blocks, block_size, "PrefixIndex"), 0);
    buckets_.assign(std::bit_ceil(num_blocks), kNoBlock);
  }

  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  /// Blocks indexed.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The hasher the index keys its blocks with.
  [[nodiscard]] const Hasher& hasher() const noexcept { return hasher_; }
  [[nodiscard]] bool contains(block_id b) const noexcept { return member_[b] != 0; }
  /// @pre contains(b).
  [[nodiscard]] block_id parent(block_id b) const noexcept { return parent_[b]; }
  /// Indexed blocks whose parent is b.
  [[nodiscard]] std::size_t num_children(block_id b) const noexcept { return children_[b]; }
  /// The extra key block b was indexed under. @pre contains(b).
  [[nodiscard]] std::uint64_t extra_key(block_id b) const noexcept { return extra_[b]; }
  /// The ids block b was indexed with. @pre contains(b).
  [[nodiscard]] std::span<const token_id> tokens(block_id b) const noexcept {
    return {tokens_.data() + std::size_t{b} * block_size_, block_size_};
  }

  /// The indexed block holding `ids` right after `parent` (kNoBlock: at the start) under
  /// `extra_key`, or kNoBlock.
  /// @pre ids.size() == block_size(); parent == kNoBlock or contains(parent).
  /// O(block_size) plus O(block_size) per colliding entry.
  [[nodiscard]] block_id find(block_id parent, std::span<const token_id> ids,
                              std::uint64_t extra_key = 0) const noexcept {
    const std::uint64_t h = hash_of(parent, ids, extra_key);
    for (block_id b = buckets_[h & (buckets_.size() - 1)]; b != kNoBlock; b = bucket_next_[b]) {
      if (hash_[b] == h && parent_[b] == parent && extra_[b] == extra_key &&
          std::ranges::equal(tokens(b), ids)) {
        return b;
      }
    }
    return kNoBlock;
  }

  /// Walks `ids` block by block from the start, under `extra_key`, and writes the matching
  /// blocks to out[0..m). Stops at the first miss, at the last full block of ids, or when out is
  /// full. @return m, the number of leading full blocks of ids that are indexed.
  /// O(m * block_size).
  [[nodiscard]] std::size_t match(std::span<const token_id> ids, std::span<block_id> out,
                                  std::uint64_t extra_key = 0) const noexcept {
    return walk(ids, out.size(), extra_key, [&](std::size_t i, block_id b) { out[i] = b; });
  }

  /// match() without the block ids: how many leading full blocks of ids are indexed.
  [[nodiscard]] std::size_t matched_blocks(std::span<const token_id> ids,
                                           std::uint64_t extra_key = 0) const noexcept {
    return walk(ids, ids.size(), extra_key, [](std::size_t, block_id) {});
  }

  /// Indexes block b as holding `ids` after `parent` under `extra_key`.
  /// @pre !contains(b); find(parent, ids, extra_key) == kNoBlock; parent == kNoBlock or
  ///      (contains(parent) and extra_key(parent) == extra_key).
  void insert(block_id b, block_id parent, std::span<const token_id> ids,
              std::uint64_t extra_key = 0) noexcept {
    const std::uint64_t h = hash_of(parent, ids, extra_key);
    hash_[b] = h;
    parent_[b] = parent;
    extra_[b] = extra_key;
    std::ranges::copy(ids, tokens_.begin() + static_cast<std::ptrdiff_t>(b * block_size_));
    block_id& head = buckets_[h & (buckets_.size() - 1)];
    bucket_next_[b] = head;
    head = b;
    if (parent != kNoBlock) ++children_[parent];
    member_[b] = 1;
    ++size_;
  }

  /// Removes block b. @pre contains(b) and num_children(b) == 0 (a leaf: erasing an inner node
  /// would leave children keyed by a block id that may be reused for other content).
  /// O(entries in b's bucket).
  void erase(block_id b) noexcept {
    block_id* link = &buckets_[hash_[b] & (buckets_.size() - 1)];
    while (*link != b) link = &bucket_next_[*link];
    *link = bucket_next_[b];
    bucket_next_[b] = kNoBlock;
    if (parent_[b] != kNoBlock) --children_[parent_[b]];
    parent_[b] = kNoBlock;
    extra_[b] = 0;
    member_[b] = 0;
    --size_;
  }

 private:
  [[nodiscard]] std::uint64_t hash_of(block_id parent, std::span<const token_id> ids,
                                      std::uint64_t extra_key) const noexcept {
    return hasher_(parent == kNoBlock ? root_block_hash(extra_key) : hash_[parent], ids);
  }

  template <class F>
  std::size_t walk(std::span<const token_id> ids, std::size_t max_blocks, std::uint64_t extra_key,
                   F&& visit) const noexcept {
    block_id parent = kNoBlock;
    std::size_t m = 0;
    for (; m < max_blocks && (m + 1) * block_size_ <= ids.size(); ++m) {
      const block_id b = find(parent, ids.subspan(m * block_size_, block_size_), extra_key);
      if (b == kNoBlock) break;
      visit(m, b);
      parent = b;
    }
    return m;
  }

  std::size_t block_size_;
  Hasher hasher_;
  std::vector<std::uint64_t> hash_;
  std::vector<block_id> parent_;
  std::vector<block_id> bucket_next_;
  std::vector<std::uint32_t> children_;
  std::vector<std::uint8_t> member_;
  std::vector<std::uint64_t> extra_;
  std::vector<token_id> tokens_;   // [block][block_size]
  std::vector<block_id> buckets_;  // bit_ceil(num_blocks) chain heads
  std::size_t size_ = 0;
};

}  // namespace kvcache
