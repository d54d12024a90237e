// SPDX-License-Identifier: Apache-2.0
// BlockManager: the bookkeeping of a paged KV cache — block tables, token ids, lengths, reference
// counts, copy-on-write, fork and reorder, prefix caching, eviction — with no element type and no
// bytes. It tells the storage which blocks to copy and where rows go; PagedCache (host memory)
// and the device cache apply that to their own arrays.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/mutex.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/manager/sequence_table.hpp"
#include "kvcache/manager/shared_blocks.hpp"
#include "kvcache/prefix/prefix_index.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// Construction parameters of a BlockManager (PagedCacheConfig less the K/V shape).
struct BlockManagerConfig {
  std::size_t num_layers = 0;
  /// Blocks in the pool (>= 1, < 2^32 - 1); a block holds block_size tokens of every layer.
  std::size_t num_blocks = 0;
  /// Tokens per block (>= 1): the unit of allocation, sharing and prefix matching.
  std::size_t block_size = 16;
  /// Sequence slots 0 .. max_batch - 1.
  std::size_t max_batch = 1;
  /// Largest length of one sequence (< 2^31, the layout descriptor's limit); 0 means
  /// min(num_blocks * block_size, 2^31 - 1).
  std::size_t max_seq_len = 0;
  bool enable_prefix_caching = true;
  bool evict_when_full = false;
};

/// One sequence's part of a batched append (BlockManager::begin_append): n tokens, with their
/// ids (n of them) or without (nullptr).
struct AppendRequest {
  std::size_t seq = 0;
  std::size_t n = 0;
  const token_id* ids = nullptr;
};

/// One layer's positions to be restored into a sequence (BlockManager::begin_restore).
struct RestoreExtent {
  std::size_t layer = 0;
  std::size_t seq = 0;
  std::size_t length = 0;
};

template <BlockHasher Hasher>
class BlockManager;

/// What BlockManager::begin_restore() decided for each sequence it names; opaque but for
/// fresh_blocks(). The storage copies the restored rows into the fresh blocks (block_table(seq)
/// entries in fresh_blocks(seq)), then calls end_restore(), which sets the other entries to
/// blocks that already hold those rows.
class RestorePlan {
 public:
  /// A range of table entries [begin, end).
  struct Range {
    std::size_t begin = 0, end = 0;
  };

  /// The table entries of `seq` the storage fills: every entry of a named sequence except the
  /// shared ones, as two ranges; both empty for a sequence the restore does not name.
  /// @pre seq < max_batch.
  [[nodiscard]] std::array<Range, 2> fresh_blocks(std::size_t seq) const noexcept {
    return {Range{head_end[seq], own_end[seq]}, Range{tail_end[seq], blocks[seq]}};
  }

 private:
  template <BlockHasher>
  friend class BlockManager;

  std::vector<bool> named;
  // Per sequence: blocks; of the leading ones, those shareable with an index hit (at[q] is where
  // its matches start in first_holder), shared with the index (num_shared), and the entry ranges
  // described in begin_restore().
  std::vector<std::size_t> blocks, at, num_shared, head_end, own_end, tail_end, committable;
  std::vector<std::size_t> first_holder;  // [at[q] + i]: the sequence whose fresh block q shares
};

/// The block bookkeeping of a paged cache.
///
/// Sequences and blocks. A sequence's block table lists the blocks holding its positions, block
/// i holding [i * block_size, (i + 1) * block_size) of every layer. Layers fill independently
/// (append is per layer); the table covers the longest layer. A block has a reference count (the
/// table entries naming it). A sequence writes only into blocks it alone holds and that are not
/// indexed; appending into any other block (shared after fork() or admit(), or indexed) first
/// copies it (copy-on-write), so the other holders see no change.
///
/// Token ids and commitment. A sequence also has token ids: admit() registers the whole prompt,
/// add_tokens() further ones (each sampled token), and an append with ids registers the ids of
/// the K/V it appends. The rule that keeps ids and K/V from disagreeing: **a token's id is
/// registered before (or with) its K/V**. A sequence with at least one id is *tracked*: in every
/// layer its K/V never runs past its ids (layer_length(l, seq) <= tokens(seq).size()), and the
/// first call that would break this throws position_error and changes nothing:
///  - an append of positions past the registered ids;
///  - add_tokens() or an append with ids on an *untracked* sequence (no ids) that already holds
///    K/V in some layer: nothing ties that K/V to ids any more (crop it to 0 or release it);
///  - an append with ids that differ from the ones registered at the same positions (the K/V
///    of another token than the one the sequence holds there);
///  - a restore of a sequence given ids and K/V longer than them.
/// A sequence that never registers ids (plain CacheConcept use) takes K/V freely and is never
/// indexed. Block i is *committed* once it is full in every layer and the ids of all its
/// positions are registered: its K/V is then final. Committed blocks are indexed (in order: block
/// i after block i - 1) at the end of the append or add_tokens() that completes them; if an
/// equal block (same prefix, same ids) is already indexed, the sequence switches to that one and
/// frees its own copy. Only a block the sequence holds alone is inserted; one still shared with a
/// fork (forked before it was committed) waits until the others have copied or released it. The
/// caller's contract, which no count can check: the id registered for position p is the token
/// whose K/V is appended at p (an append with ids checks it in every layer after the first).
///
/// Where indexed blocks sit: a sequence holds indexed blocks only as a leading run of its table,
/// each under its predecessor, with its own ids at every position its K/V covers there, and
/// every layer holding all positions before the run's last block (only that one may be filled in
/// part, as after admit() of a wholly cached prompt). A write into an indexed block therefore
/// only ever copies the last one, never a parent whose child the sequence keeps.
///
/// Moved K/V. A context shift drops tokens after a sequence's first n_keep and moves the later
/// ones back: their K/V (and that of every token appended after them) was computed with the
/// dropped tokens in context, so it is not what a prompt of the sequence's new ids would
/// compute. The sequence keeps its ids (it goes on from where it was), but only its first
/// exact_prefix(seq) = n_keep positions are *exact*: no block past them is shared through the
/// index or indexed, so no other prompt ever sees moved K/V, and a moved sequence never switches
/// to an indexed block of the same ids. crop() to at most exact_prefix() makes the sequence
/// exact again; release() forgets it; fork() and reorder() pass it on; snapshots keep it.
///
/// Prefix index (see PrefixIndex): a trie of committed blocks' content keyed by (parent node, ids,
/// extra key), through a chained hash, every hit confirmed by comparing ids and key; a node's
/// physical block is only where it lives (PrefixIndex::relocate moves it, children kept).
/// admit() walks it and shares the longest match. When the last holder of an indexed block lets go
/// it stays indexed as *cached* (evictable); eviction takes the least recently released cached
/// block, a block's cached children before it (SharedBlocks); check_consistency() verifies the
/// order.
///
/// Cache salt. admit() takes an *extra key* (0 by default) that the sequence's blocks are
/// matched and indexed under: a sequence shares blocks only with prompts admitted under the same
/// key. Use it to keep tenants apart (a per-user or per-tenant salt: vLLM's cache_salt) and to
/// keep apart K/V that equal ids do not make equal (a LoRA adapter's id, a different model
/// revision's). Why tenants need it: a prefix hit is visible to the requester as a shorter time
/// to first token, so without salts one user can probe whether another recently sent a given
/// prompt, block by block. Requests under one salt share freely; under different salts they
/// never share, at the cost of computing the same prefix once per salt. The key stays with the
/// sequence through crop, fork, reorder, context shift and snapshots; release() forgets it. A
/// sequence started without admit() has key 0. A string salt can be hashed to a key (any good
/// 64-bit hash; two salts with one key share).
///
/// Pool exhaustion: an operation that needs more blocks than are free throws
/// pool_exhausted_error (a capacity_error naming blocks needed, free and evictable) and changes
/// nothing, unless config.evict_when_full lets it evict cached blocks first; when too few of them
/// can be evicted, it throws the same error (evictable: how many could) and evicts none.
///
/// Thread safety. Operations on *different* sequences may run concurrently from any threads:
/// admit, begin/end_append, add_tokens, crop, release, fork(src, dst) (which reads src and
/// writes dst; several forks may read one src at once) and the per-sequence queries
/// (layer_length, seq_length, tokens, block_table, exact_prefix). match_prefix, evict_cached,
/// stats, ref_count and the const shape queries are safe at any time. Operations on the *same*
/// sequence must not overlap unless all of them are reads. reorder() counts as an operation on
/// every sequence it names, and so does a restore (on every sequence its extents or ids name);
/// check_consistency() needs no concurrent mutation. One mutex guards the shared block metadata
/// (SharedBlocks); it is held for O(blocks touched), never while the storage copies or writes
/// rows, and a sequence's storage writes go only to blocks it holds alone.
///
/// Allocation: the constructor allocates everything; afterwards only reorder(), the restore
/// (scratch for its plan) and error messages allocate. Compiled once per hasher, whatever the
/// storage's element type.
template <BlockHasher Hasher = DefaultBlockHasher>
class BlockManager {
 public:
  using hasher_type = Hasher;

  /// Where an append writes: positions [position, position + n) of `layer` of `seq`, into the
  /// blocks of `table`, after copying `copies` (each: the rows block_rows(seq, l, c.index) of
  /// every layer l, from c.from into c.to). Valid until end_append().
  struct AppendPlan {
    std::size_t layer = 0;
    std::size_t seq = 0;
    std::size_t position = 0;
    std::size_t n = 0;
    const block_id* table = nullptr;
    std::span<const BlockCopy> copies;
    const token_id* ids = nullptr;  // the appended tokens' ids, or nullptr
  };

  /// @param name how errors name the owner ("PagedCache: append of ...").
  /// @throws shape_error for a zero num_layers, num_blocks, block_size or max_batch, or
  ///         num_blocks >= 2^32 - 1; capacity_error if a size overflows; std::bad_alloc.
  explicit BlockManager(const BlockManagerConfig& config, Hasher hasher = {},
                        const char* name = "BlockManager")
      : name_(name),
        num_blocks_(config.num_blocks),
        block_size_(config.block_size),
        prefix_caching_(config.enable_prefix_caching) {
    detail::require_nonzero(config.num_layers, name, "num_layers");
    detail::require_nonzero(config.num_blocks, name, "num_blocks");
    detail::require_nonzero(config.block_size, name, "block_size");
    detail::require_nonzero(config.max_batch, name, "max_batch");
    const std::size_t pool_tokens = detail::checked_mul(num_blocks_, block_size_, name);
    constexpr auto kMaxLen = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
    const std::size_t max_seq_len =
        config.max_seq_len == 0 ? std::min(pool_tokens, kMaxLen) : config.max_seq_len;
    detail::require_int(max_seq_len, name, "max_seq_len");
    detail::require_int(config.block_size, name, "block_size");
    detail::require_int(config.max_batch, name, "max_batch");
    shared_ = std::make_unique<SharedBlocks<Hasher>>(num_blocks_, block_size_,
                                                     config.evict_when_full, std::move(hasher));
    seqs_ = SequenceTable(config.max_batch, config.num_layers,
                          (max_seq_len + block_size_ - 1) / block_size_, max_seq_len, name);
  }

  BlockManager(BlockManager&&) noexcept = default;  ///< a moved-from manager may only be destroyed
  BlockManager& operator=(BlockManager&&) noexcept = default;

  // ---- Shape ------------------------------------------------------------------------------

  [[nodiscard]] std::size_t num_layers() const noexcept { return seqs_.num_layers(); }
  [[nodiscard]] std::size_t num_blocks() const noexcept { return num_blocks_; }
  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] std::size_t max_batch() const noexcept { return seqs_.max_batch(); }
  [[nodiscard]] std::size_t max_seq_len() const noexcept { return seqs_.max_seq_len(); }
  [[nodiscard]] bool prefix_caching() const noexcept { return prefix_caching_; }
  [[nodiscard]] bool evict_when_full() const noexcept { return shared_->evict_when_full(); }
  [[nodiscard]] const char* name() const noexcept { return name_; }

  // ---- Per-sequence queries ---------------------------------------------------------------

  /// Positions `layer` of `seq` holds. @throws layer_error, batch_error.
  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    detail::check_layer(name_, layer, num_layers());
    detail::check_seq(name_, seq, max_batch());
    return seqs_.length(seq, layer);
  }
  /// Layer 0's length. @throws batch_error.
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  /// The token ids registered for `seq`. @throws batch_error.
  [[nodiscard]] std::span<const token_id> tokens(std::size_t seq) const {
    detail::check_seq(name_, seq, max_batch());
    return {seqs_.ids(seq), seqs_.record(seq).num_tokens};
  }
  /// How many leading positions of `seq` hold K/V that follows from their ids alone: SIZE_MAX
  /// unless a context shift moved its later tokens (see "Moved K/V"). @throws batch_error.
  [[nodiscard]] std::size_t exact_prefix(std::size_t seq) const {
    detail::check_seq(name_, seq, max_batch());
    return seqs_.record(seq).exact;
  }
  /// The extra key `seq` was admitted under (see "Cache salt"); 0 for none. @throws batch_error.
  [[nodiscard]] std::uint64_t extra_key(std::size_t seq) const {
    detail::check_seq(name_, seq, max_batch());
    return seqs_.record(seq).extra_key;
  }
  /// The blocks `seq` holds, in position order. Valid until its next mutating call.
  /// @throws batch_error.
  [[nodiscard]] std::span<const block_id> block_table(std::size_t seq) const {
    detail::check_seq(name_, seq, max_batch());
    return {seqs_.table(seq), seqs_.record(seq).num_blocks};
  }
  /// How many leading table entries of `seq` are committed (indexed under its prefix): an
  /// append changes no entry before them. @throws batch_error.
  [[nodiscard]] std::size_t committed_blocks(std::size_t seq) const {
    detail::check_seq(name_, seq, max_batch());
    return seqs_.record(seq).committed;
  }
  /// Rows `layer` of `seq` holds in its table entry `index` (0 .. block_size). @pre in range.
  [[nodiscard]] std::size_t block_rows(std::size_t seq, std::size_t layer,
                                       std::size_t index) const noexcept {
    const std::size_t len = seqs_.length(seq, layer), begin = index * block_size_;
    return len <= begin ? 0 : std::min(block_size_, len - begin);
  }

  /// How many block-table entries name block b. @throws shape_error unless b < num_blocks.
  [[nodiscard]] std::size_t ref_count(block_id b) const {
    if (b >= num_blocks_) {
      throw shape_error(detail::message(name_, ": block ", static_cast<std::size_t>(b),
                                        " out of range (num_blocks ", num_blocks_, ")"));
    }
    const detail::MutexLock lock(shared_->mutex);
    return shared_->pool.ref_count(b);
  }

  /// Pool occupancy and prefix-cache counters, read together under the lock. O(1).
  [[nodiscard]] PrefixCacheStats stats() const {
    const detail::MutexLock lock(shared_->mutex);
    const SharedBlocks<Hasher>& sh = *shared_;
    return {.block_size = block_size_,
            .blocks_total = num_blocks_,
            .blocks_used = sh.pool.num_used(),
            .blocks_cached = sh.pool.num_cached(),
            .blocks_free = sh.pool.num_free(),
            .prompts = sh.prompts,
            .prompt_tokens = sh.prompt_tokens,
            .reused_tokens = sh.reused_tokens,
            .evictions = sh.evictions,
            .cow_copies = sh.cow_copies};
  }

  // ---- Appends ----------------------------------------------------------------------------

  /// First half of an append (manager/append.hpp): checks, takes blocks; says what to copy.
  [[nodiscard]] AppendPlan begin_append(std::size_t layer, std::size_t seq, std::size_t n,
                                        const token_id* ids);
  /// The same for a batch of sequences, all or nothing (manager/append.hpp).
  void begin_append(std::size_t layer, std::span<const AppendRequest> requests,
                    std::span<AppendPlan> plans);
  /// Second half, once the storage has copied and written (manager/append.hpp). Never throws.
  void end_append(std::span<const AppendPlan> plans) noexcept;
  void end_append(const AppendPlan& plan) noexcept { end_append(std::span(&plan, 1)); }

  // ---- Sequences --------------------------------------------------------------------------

  /// Rolls every layer of `seq` back to at most n tokens and its ids to at most n (dropping ids
  /// registered ahead of their K/V), releasing the blocks no layer needs any more.
  /// O(num_layers + released blocks). Never allocates.
  /// @throws batch_error, position_error (n > seq_length); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) {
    detail::check_crop_length(name_, seq, n, seq_length(seq));
    SequenceTable::Record& s = seqs_.record(seq);
    std::size_t longest = 0;
    for (std::size_t len : seqs_.lengths(seq)) longest = std::max(longest, std::min(len, n));
    const std::size_t keep = (longest + block_size_ - 1) / block_size_;
    if (keep < s.num_blocks) {
      const detail::MutexLock lock(shared_->mutex);
      release_blocks(seq, keep);
    }
    for (std::size_t& len : seqs_.lengths(seq)) len = std::min(len, n);
    s.num_blocks = std::min(s.num_blocks, keep);
    s.num_tokens = std::min(s.num_tokens, n);
    s.committed = std::min(s.committed, n / block_size_);
    if (n <= s.exact) s.exact = SequenceTable::kAllExact;  // what is left, and follows, is exact
  }

  /// Forgets `seq`: length 0 in every layer, no ids; its blocks lose a holder, and those no
  /// sequence holds become cached (indexed ones) or free. Never allocates.
  /// O(blocks + num_layers). @throws batch_error.
  void release(std::size_t seq) {
    detail::check_seq(name_, seq, max_batch());
    {
      const detail::MutexLock lock(shared_->mutex);
      release_blocks(seq, 0);
    }
    seqs_.clear(seq);
  }

  /// Starts the empty sequence `seq` with `prompt`: registers its ids and shares the blocks of
  /// the longest prefix cached under `extra_key` (see "Cache salt"), which the sequence keeps.
  /// Returns m, the number of leading prompt tokens every layer now holds: a multiple of
  /// block_size, except that m < prompt.size() always (when the whole prompt is cached, its last
  /// token is left to run, for its logits). Never allocates. O(prompt.size() + num_layers) (with
  /// the default hasher).
  /// @throws batch_error; position_error when seq is not empty; capacity_error when the prompt
  ///         exceeds max_seq_len. Unchanged on throw.
  [[nodiscard]] std::size_t admit(std::size_t seq, std::span<const token_id> prompt,
                                  std::uint64_t extra_key = 0) {
    detail::check_seq(name_, seq, max_batch());
    require_empty("admit to", seq);
    if (prompt.size() > max_seq_len()) {
      throw capacity_error(detail::message(name_, ": admit of a ", prompt.size(),
                                           "-token prompt to sequence ", seq,
                                           " exceeds max_seq_len ", max_seq_len()));
    }
    SequenceTable::Record& s = seqs_.record(seq);
    block_id* table = seqs_.table(seq);
    std::size_t cached = 0;
    {
      const detail::MutexLock lock(shared_->mutex);
      if (prefix_caching_) {
        const std::size_t m = shared_->index.match(
            prompt, std::span<block_id>(table, seqs_.max_blocks_per_seq()), extra_key);
        cached = std::min(m * block_size_, prompt.empty() ? 0 : prompt.size() - 1);
        s.num_blocks = (cached + block_size_ - 1) / block_size_;
        for (std::size_t i = 0; i < s.num_blocks; ++i) shared_->pool.acquire(table[i]);
      }
      ++shared_->prompts;
      shared_->prompt_tokens += prompt.size();
      shared_->reused_tokens += cached;
    }
    std::copy(prompt.begin(), prompt.end(), seqs_.ids(seq));
    s.num_tokens = prompt.size();
    s.committed = cached / block_size_;
    s.exact = SequenceTable::kAllExact;
    s.extra_key = extra_key;
    const std::span<std::size_t> lengths = seqs_.lengths(seq);
    std::fill(lengths.begin(), lengths.end(), cached);
    return cached;
  }

  /// How many leading tokens of `ids` are cached right now under `extra_key`: a multiple of
  /// block_size. Changes nothing (statistics included). O(ids.size()) with the default hasher.
  [[nodiscard]] std::size_t match_prefix(std::span<const token_id> ids,
                                         std::uint64_t extra_key = 0) const {
    if (!prefix_caching_) return 0;
    const detail::MutexLock lock(shared_->mutex);
    return shared_->index.matched_blocks(ids, extra_key) * block_size_;
  }

  /// Registers the ids of the tokens at positions tokens(seq).size() .. + ids.size() - 1, ahead
  /// of their K/V, then indexes the blocks this completes. Never allocates. O(ids.size()).
  /// @throws batch_error; capacity_error past max_seq_len; position_error when seq has no ids
  ///         but holds K/V (appended without ids, so not theirs to claim). Unchanged on throw.
  void add_tokens(std::size_t seq, std::span<const token_id> ids) {
    detail::check_seq(name_, seq, max_batch());
    SequenceTable::Record& s = seqs_.record(seq);
    if (ids.size() > max_seq_len() - s.num_tokens) {
      throw capacity_error(detail::message(name_, ": add_tokens of ", ids.size(),
                                           " ids to sequence ", seq, " exceeds max_seq_len ",
                                           max_seq_len(), " (holds ", s.num_tokens, " ids)"));
    }
    if (ids.empty()) return;
    require_trackable("add_tokens to", seq);
    std::copy(ids.begin(), ids.end(), seqs_.ids(seq) + s.num_tokens);
    s.num_tokens += ids.size();
    commit(seq);
  }

  /// dst becomes a copy of src sharing its blocks (manager/fork.hpp).
  void fork(std::size_t src, std::size_t dst);
  /// Beam reordering: dst[i] becomes what src[i] was, all at once (manager/fork.hpp).
  void reorder(std::span<const std::size_t> dst, std::span<const std::size_t> src);

  /// Evicts up to max_blocks cached blocks, least recently released first (a block's cached
  /// children before it); returns how many. Never allocates. O(evicted).
  std::size_t evict_cached(std::size_t max_blocks) {
    const detail::MutexLock lock(shared_->mutex);
    return shared_->evict(max_blocks);
  }

  // ---- Restore (manager/restore.hpp) -------------------------------------------------------

  /// First half of a snapshot restore; see manager/restore.hpp.
  [[nodiscard]] RestorePlan begin_restore(std::span<const RestoreExtent> extents,
                                          std::span<const SequenceTokens> tokens);
  /// Second half, once the storage has filled the plan's fresh blocks. Never throws.
  void end_restore(const RestorePlan& plan) noexcept;

  /// Checks every invariant (manager/consistency.hpp); "" or the first violation. For tests.
  [[nodiscard]] std::string check_consistency() const;

 private:
  void check_append(std::size_t layer, std::size_t seq, std::size_t n, const token_id* ids) const;

  // Throws when `op` would register ids in a sequence that has none but holds K/V: nothing ties
  // that K/V to ids any more. (A tracked sequence's K/V never runs past its ids.)
  void require_trackable(const char* op, std::size_t seq) const {
    if (seqs_.record(seq).num_tokens != 0) return;
    const std::size_t held = seqs_.extent(seq).longest;
    if (held == 0) return;
    throw position_error(detail::message(
        name_, ": ", op, " sequence ", seq, ", which holds the K/V of ", held,
        " positions appended without token ids: a token's id must be registered before or with "
        "its K/V (crop the sequence to 0 or release it first)"));
  }

  void require_empty(const char* op, std::size_t seq) const {
    const SequenceTable::Record& s = seqs_.record(seq);
    const std::size_t len = seqs_.length(seq, 0);
    if (s.num_blocks != 0 || s.num_tokens != 0 || len != 0) {
      throw position_error(detail::message(name_, ": ", op, " sequence ", seq, ", which holds ",
                                           len, " tokens and ", s.num_tokens,
                                           " ids; release it first"));
    }
  }

  // A sequence may write into a block only when it alone holds it and no index refers to it.
  [[nodiscard]] static bool writable(const BlockPool& pool, block_id b) noexcept {
    return pool.ref_count(b) == 1 && !pool.indexed(b);
  }

  // Drops seq's hold on table entries [keep, num_blocks), last first (children before
  // parents). Needs the lock.
  void release_blocks(std::size_t seq, std::size_t keep) noexcept {
    const block_id* table = seqs_.table(seq);
    for (std::size_t i = seqs_.record(seq).num_blocks; i-- > keep;) {
      shared_->pool.release(table[i]);
    }
  }

  // Indexes the blocks of seq that are now committed (full in every layer, ids registered),
  // switching to an already indexed equal block where there is one. Only a block this sequence
  // holds alone is inserted: the other holders of a shared block (forks) may have switched the
  // block before it to an equal indexed one, so indexing it under this sequence's predecessor
  // could leave a holder of a child without its parent. A shared block with no equal indexed
  // block stops the walk; a later call retries (once the others have copied or released it).
  void commit(std::size_t seq) noexcept {
    if (!prefix_caching_) return;
    SequenceTable::Record& s = seqs_.record(seq);
    const std::size_t full =
        std::min({s.num_tokens, seqs_.extent(seq).shortest, s.exact}) / block_size_;
    if (full <= s.committed) return;
    block_id* table = seqs_.table(seq);
    const token_id* ids = seqs_.ids(seq);
    const detail::MutexLock lock(shared_->mutex);
    BlockPool& pool = shared_->pool;
    PrefixIndex<Hasher>& index = shared_->index;
    std::size_t i = s.committed;
    for (; i < full; ++i) {
      const block_id b = table[i];
      if (index.contains(b)) continue;  // shared through admit/fork: indexed under this prefix
      const block_id parent = i == 0 ? kNoBlock : table[i - 1];
      const std::span<const token_id> block_ids(ids + i * block_size_, block_size_);
      const block_id existing = index.find(parent, block_ids, s.extra_key);
      if (existing != kNoBlock) {
        pool.acquire(existing);
        pool.release(b);
        table[i] = existing;
      } else if (pool.ref_count(b) == 1) {
        index.insert(b, parent, block_ids, s.extra_key);
        pool.mark_indexed(b);
      } else {
        break;
      }
    }
    s.committed = i;
  }

  const char* name_;
  std::size_t num_blocks_;
  std::size_t block_size_;
  bool prefix_caching_;
  std::unique_ptr<SharedBlocks<Hasher>> shared_;  // one pointer: the manager stays movable
  SequenceTable seqs_;
};

}  // namespace kvcache

// The member functions defined in files of their own (manager/block_manager_impl.hpp lists
// them): included here, or, in a program built with KVCACHE_EXTERN_KERNELS, compiled once for
// the default hasher in its KVCACHE_INSTANTIATE_KERNELS file (core/compiled_once.hpp).
#if KVCACHE_DETAIL_DEFINES_BODIES
#include "kvcache/manager/block_manager_impl.hpp"  // IWYU pragma: export
#else
namespace kvcache {
extern template class BlockManager<DefaultBlockHasher>;
}  // namespace kvcache
#endif
