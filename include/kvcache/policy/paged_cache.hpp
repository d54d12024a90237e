// SPDX-License-Identifier: Apache-2.0
// PagedCache: a fixed pool of KV blocks shared by many sequences through block tables, with
// automatic prefix caching (a new prompt reuses the cached blocks of its longest cached prefix),
// reference counts, LRU eviction, copy-on-write, fork and beam reordering, safe across threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"
#include "kvcache/prefix/block_pool.hpp"
#include "kvcache/prefix/prefix_index.hpp"
#include "kvcache/prefix/types.hpp"

namespace kvcache {

/// Construction parameters of a PagedCache.
struct PagedCacheConfig {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  /// Blocks in the pool (>= 1), shared by every sequence; a block holds block_size tokens of
  /// every layer. memory_bytes() == kv_cache_bytes(shape, num_blocks * block_size).
  std::size_t num_blocks = 0;
  /// Tokens per block (>= 1): the unit of allocation, sharing and prefix matching.
  std::size_t block_size = 16;
  /// Sequence slots: sequences are 0 .. max_batch - 1, each empty until used.
  std::size_t max_batch = 1;
  /// Largest length of one sequence; 0 means num_blocks * block_size. Each slot's block table
  /// and token-id buffer are allocated for it at construction: about
  /// max_batch * max_seq_len * (4 + 12 / block_size) bytes besides the pool.
  std::size_t max_seq_len = 0;
  /// Index full blocks by their token ids so that later prompts reuse them (admit()).
  bool enable_prefix_caching = true;
  /// Opt-in: when an operation needs more blocks than are free, evict cached (unreferenced)
  /// blocks, least recently released first, instead of throwing pool_exhausted_error.
  bool evict_when_full = false;
};

/// A view over one layer of one paged sequence: one segment per block, read in place from the
/// pool (no gather). Block i of the table holds positions [i * block_size, (i + 1) * block_size)
/// clipped to length; its K is [num_kv_heads][block_size][head_dim], V follows.
template <Element T>
class PagedView {
 public:
  using value_type = T;

  PagedView() = default;
  /// `layer_base`: the layer's first block; blocks are `block_elems` elements apart.
  PagedView(const T* layer_base, const block_id* table, std::size_t block_size,
            std::size_t block_elems, std::size_t num_kv_heads, std::size_t head_dim,
            position_t length) noexcept
      : layer_base_(layer_base),
        table_(table),
        block_size_(block_size),
        block_elems_(block_elems),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        length_(length) {}

  [[nodiscard]] std::size_t num_kv_heads() const noexcept { return num_kv_heads_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] position_t length() const noexcept { return length_; }
  [[nodiscard]] position_t sink_end() const noexcept { return 0; }
  [[nodiscard]] position_t recent_begin() const noexcept { return 0; }
  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] std::size_t num_segments() const noexcept {
    return (static_cast<std::size_t>(length_) + block_size_ - 1) / block_size_;
  }
  /// The block ids behind the segments.
  [[nodiscard]] std::span<const block_id> block_table() const noexcept {
    return {table_, num_segments()};
  }
  [[nodiscard]] KVSegment<T> segment(std::size_t i) const noexcept {
    const T* k = layer_base_ + std::size_t{table_[i]} * block_elems_;
    const std::size_t first = i * block_size_;
    return {k, k + num_kv_heads_ * block_size_ * head_dim_, block_size_ * head_dim_,
            static_cast<position_t>(first),
            std::min(block_size_, static_cast<std::size_t>(length_) - first)};
  }

 private:
  const T* layer_base_ = nullptr;
  const block_id* table_ = nullptr;
  std::size_t block_size_ = 1;
  std::size_t block_elems_ = 0;
  std::size_t num_kv_heads_ = 0;
  std::size_t head_dim_ = 0;
  position_t length_ = 0;
};

static_assert(KVView<PagedView<float>>);

/// Paged KV cache with automatic prefix caching.
///
/// Storage: one allocation at construction, [layer][block][K, V][kv_head][block_size][head_dim],
/// so a layer's blocks form one array (what a GPU kernel takes with a block table) and a segment's
/// heads are block_size * head_dim apart. Every slot's block table and token-id buffer are
/// allocated then too; afterwards no operation allocates except reorder(), restore() (scratch for
/// its validation) and error messages.
///
/// Sequences and blocks. A sequence's block table lists the blocks holding its positions, block
/// i holding [i * block_size, (i + 1) * block_size) of every layer. Layers fill independently
/// (append is per layer); the table covers the longest layer. A block has a reference count (the
/// table entries naming it). A sequence writes only into blocks it alone holds and that are not
/// indexed; appending into any other block (shared after fork() or admit(), or indexed) first
/// copies it (copy-on-write), so the other holders see no change.
///
/// Token ids and commitment. A sequence also has token ids: admit() registers the whole prompt,
/// add_tokens() further ones (each sampled token), and append() with ids registers the ids of
/// the K/V it appends. The rule that keeps ids and K/V from disagreeing: **a token's id is
/// registered before (or with) its K/V**. A sequence with at least one id is *tracked*: in every
/// layer its K/V never runs past its ids (layer_length(l, seq) <= tokens(seq).size()), and the
/// first call that would break this throws position_error and changes nothing:
///  - append(layer, seq, k, v) of positions past the registered ids;
///  - add_tokens() or append() with ids on an *untracked* sequence (no ids) that already holds
///    K/V in some layer: nothing ties that K/V to ids any more (crop it to 0 or release it);
///  - append(layer, seq, ids, k, v) whose ids differ from the ones registered at the same
///    positions (the K/V of another token than the one the sequence holds there);
///  - restore() of a sequence given ids and K/V longer than them.
/// A sequence that never registers ids (plain CacheConcept use) takes K/V freely and is never
/// indexed. Block i is *committed* once it is full in every layer and the ids of all its
/// positions are registered: its K/V is then final. Committed blocks are indexed (in order: block
/// i after block i - 1) at the end of the append() or add_tokens() that completes them; if an
/// equal block (same prefix, same ids) is already indexed, the sequence switches to that one and
/// frees its own copy. Only a block the sequence holds alone is inserted; one still shared with a
/// fork (forked before it was committed) waits until the others have copied or released it. The
/// caller's contract, which no count can check: the id registered for position p is the token
/// whose K/V is appended at p (append() with ids checks it in every layer after the first).
///
/// Where indexed blocks sit: a sequence holds indexed blocks only as a leading run of its table,
/// each under its predecessor, with its own ids at every position its K/V covers there, and
/// every layer holding all positions before the run's last block (only that one may be filled in
/// part, as after admit() of a wholly cached prompt). A write into an indexed block therefore
/// only ever copies the last one, never a parent whose child the sequence keeps.
///
/// Moved K/V. context_shift() drops tokens after a sequence's first n_keep and moves the later
/// ones back: their K/V (and that of every token appended after them) was computed with the
/// dropped tokens in context, so it is not what a prompt of the sequence's new ids would
/// compute. The sequence keeps its ids (it goes on from where it was), but only its first
/// exact_prefix(seq) = n_keep positions are *exact*: no block past them is shared through the
/// index or indexed, so no other prompt ever sees moved K/V, and a moved sequence never switches
/// to an indexed block of the same ids. crop() to at most exact_prefix() makes the sequence
/// exact again; release() forgets it; fork() and reorder() pass it on; snapshots keep it.
///
/// Prefix index (see PrefixIndex): a trie of committed blocks keyed by (parent block, ids),
/// through a chained hash, every hit confirmed by comparing ids. admit() walks it and shares the
/// longest match. When the last holder of an indexed block lets go it stays indexed as *cached*
/// (evictable); eviction takes the least recently released cached block. Every holder of an
/// indexed block holds its parent too (see "Where indexed blocks sit"), and releases children
/// before parents, so the LRU front is always a leaf of the trie and every cached block is
/// evictable. Eviction still only ever removes leaves, and plans before it evicts: it walks the
/// LRU list from the front (never past its end) for blocks whose children are all gone before
/// them; check_consistency() verifies the order.
///
/// Pool exhaustion: an operation that needs more blocks than are free throws
/// pool_exhausted_error (a capacity_error naming blocks needed, free and evictable) and changes
/// nothing, unless config.evict_when_full lets it evict cached blocks first; when too few of them
/// can be evicted, it throws the same error (evictable: how many could) and evicts none.
///
/// Thread safety. Operations on *different* sequences may run concurrently from any threads:
/// admit, append, add_tokens, view, crop, reset/release, fork(src, dst) (which reads src and
/// writes dst; several forks may read one src at once) and the per-sequence queries
/// (layer_length, seq_length, tokens, block_table). match_prefix, evict_cached, stats,
/// ref_count and the const shape queries are safe at any time. Operations on the *same*
/// sequence must not overlap unless all of them are reads. reorder() counts as an operation on
/// every sequence it names, and so does restore() (on every sequence its entries or ids name);
/// check_consistency() needs no concurrent mutation. One mutex guards the shared block metadata
/// (pool, index, counters); it is held for O(blocks touched), never while K/V rows are written or
/// read, and a thread writes only blocks it holds alone. A view is valid until the next mutating
/// call on its own sequence; other sequences' operations never invalidate it.
template <Element T, BlockHasher Hasher = DefaultBlockHasher>
class PagedCache {
 public:
  using value_type = T;
  using view_type = PagedView<T>;
  using hasher_type = Hasher;

  /// Allocates the pool, block tables and id buffers.
  /// @throws shape_error for a zero num_layers, num_kv_heads, head_dim, num_blocks, block_size
  ///         or max_batch, or num_blocks >= 2^32 - 1; capacity_error if a size overflows;
  ///         std::bad_alloc.
  explicit PagedCache(const PagedCacheConfig& config, Hasher hasher = {})
      : shape_{config.num_layers, config.num_kv_heads, config.head_dim, dtype_of<T>},
        num_blocks_(config.num_blocks),
        block_size_(config.block_size),
        max_batch_(config.max_batch),
        prefix_caching_(config.enable_prefix_caching),
        evict_when_full_(config.evict_when_full) {
    detail::require_nonzero(config.num_layers, kName, "num_layers");
    detail::require_nonzero(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_nonzero(config.head_dim, kName, "head_dim");
    detail::require_nonzero(config.num_blocks, kName, "num_blocks");
    detail::require_nonzero(config.block_size, kName, "block_size");
    detail::require_nonzero(config.max_batch, kName, "max_batch");
    const std::size_t pool_tokens = detail::checked_mul(num_blocks_, block_size_, kName);
    max_seq_len_ = config.max_seq_len == 0 ? pool_tokens : config.max_seq_len;
    max_blocks_per_seq_ = (max_seq_len_ + block_size_ - 1) / block_size_;
    block_elems_ = kv_cache_bytes(1, shape_.num_kv_heads, shape_.head_dim, block_size_, 1);
    layer_elems_ = detail::checked_mul(num_blocks_, block_elems_, kName);
    shared_ = std::make_unique<Shared>(num_blocks_, block_size_, std::move(hasher));
    storage_ = AlignedBuffer<T>(kv_cache_bytes(shape_, pool_tokens) / sizeof(T));
    seqs_.resize(max_batch_);
    tables_.assign(detail::checked_mul(max_batch_, max_blocks_per_seq_, kName), kNoBlock);
    cow_.resize(tables_.size());
    tokens_.assign(detail::checked_mul(max_batch_, max_seq_len_, kName), 0);
    lengths_.assign(detail::checked_mul(max_batch_, shape_.num_layers, kName), 0);
  }

  PagedCache(PagedCache&&) noexcept = default;  ///< a moved-from cache may only be destroyed
  PagedCache& operator=(PagedCache&&) noexcept = default;

  // ---- CacheConcept ----------------------------------------------------------------------

  /// Appends n = k.num_tokens tokens to `layer` of `seq` (CacheConcept requirement 2), taking
  /// new blocks from the pool and copying shared or indexed blocks it writes into. Then indexes
  /// the blocks this completes (see "Token ids and commitment"). Never allocates.
  /// O(n * num_kv_heads * head_dim), plus O(num_layers * block) per copied block.
  /// @throws layer_error, batch_error, shape_error, capacity_error (past max_seq_len),
  ///         position_error (a tracked sequence: positions past its registered ids),
  ///         pool_exhausted_error; the cache is unchanged on throw.
  template <class U>
  requires std::same_as<std::remove_const_t<U>, T> || std::same_as < std::remove_const_t<U>,
  float > void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
    using In = TokenBlock<const std::remove_const_t<U>>;
    append_rows(layer, seq, nullptr, In(k), In(v));
  }

  /// append() of the K/V of the tokens `ids` (one id per token, ids.size() == k.num_tokens) at
  /// positions p = layer_length(layer, seq) .. p + n - 1: ids at positions already registered
  /// must equal those (the K/V is then checked to be the registered tokens'), the others are
  /// registered here, so the engine's loop needs no add_tokens(). The first layer of a forward
  /// pass registers a step's ids, every later layer confirms them:
  ///   for each layer l: cache.append(l, seq, step_ids, k_l, v_l);
  /// Never allocates. O(n * num_kv_heads * head_dim), plus as append().
  /// @throws as append(); shape_error (ids.size() != n); position_error (an id differs from
  ///         the one registered at its position, naming both; or an untracked sequence holding
  ///         K/V); the cache is unchanged on throw.
  template <class U>
  requires std::same_as<std::remove_const_t<U>, T> || std::same_as < std::remove_const_t<U>,
  float > void append(std::size_t layer, std::size_t seq, std::span<const token_id> ids,
                      TokenBlock<U> k, TokenBlock<U> v) {
    using In = TokenBlock<const std::remove_const_t<U>>;
    const In kin = k;
    if (ids.size() != kin.num_tokens) {
      throw shape_error(detail::message(kName, ": append of ", ids.size(),
                                        " token ids with the K/V of ", kin.num_tokens,
                                        " tokens to sequence ", seq, " layer ", layer));
    }
    append_rows(layer, seq, ids.data(), kin, In(v));
  }

  /// View over `layer` of `seq`: one segment per block. O(1). @throws layer_error, batch_error.
  [[nodiscard]] view_type view(std::size_t layer, std::size_t seq) const {
    const std::size_t len = layer_length(layer, seq);
    return view_type(storage_.data() + layer * layer_elems_, table_of(seq), block_size_,
                     block_elems_, shape_.num_kv_heads, shape_.head_dim,
                     static_cast<position_t>(len));
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    return lengths_[seq * shape_.num_layers + layer];
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  /// The largest length of one sequence (max_seq_len).
  [[nodiscard]] std::size_t capacity() const noexcept { return max_seq_len_; }
  [[nodiscard]] std::size_t max_batch() const noexcept { return max_batch_; }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  /// Bytes of the block pool (all of it, from construction on).
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return storage_.bytes(); }

  /// True when crop(seq, n) would succeed: n <= seq_length(seq). @throws batch_error.
  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const { return n <= seq_length(seq); }

  /// Rolls every layer of `seq` back to at most n tokens and its token ids to at most n ids
  /// (dropping ids registered ahead of their K/V), releasing the blocks no layer needs any
  /// more. O(num_layers + released blocks). Never allocates.
  /// @throws batch_error, position_error (n > seq_length); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) {
    detail::check_crop_length(kName, seq, n, seq_length(seq));
    Sequence& s = seqs_[seq];
    std::size_t longest = 0;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      longest = std::max(longest, std::min(lengths_[seq * shape_.num_layers + l], n));
    }
    const std::size_t keep = (longest + block_size_ - 1) / block_size_;
    if (keep < s.num_blocks) {
      std::lock_guard lock(shared_->mutex);
      release_blocks_locked(seq, keep);
    }
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      std::size_t& len = lengths_[seq * shape_.num_layers + l];
      len = std::min(len, n);
    }
    s.num_blocks = std::min(s.num_blocks, keep);
    s.num_tokens = std::min(s.num_tokens, n);
    s.committed = std::min(s.committed, n / block_size_);
    if (n <= s.exact) s.exact = kAllExact;  // what is left, and what follows, is exact again
  }

  /// CacheConcept's name for release(). @throws batch_error.
  void reset(std::size_t seq) { release(seq); }

  // ---- Prefix caching (PrefixCacheConcept) -----------------------------------------------

  /// Starts the empty sequence `seq` with `prompt`: registers its ids and shares the blocks of
  /// the longest cached prefix. Returns m, the number of leading prompt tokens whose K/V every
  /// layer now holds: a multiple of block_size, except that m < prompt.size() always (when the
  /// whole prompt is cached, its last token is left to run, for its logits). The caller appends
  /// K/V for prompt[m..] layer by layer; those blocks are indexed as they complete. Never
  /// allocates. O(prompt.size() + num_layers) (with the default hasher).
  /// @post seq_length(seq) == m, tokens(seq) == prompt.
  /// @throws batch_error; position_error when seq is not empty; capacity_error when the prompt
  ///         exceeds max_seq_len. Unchanged on throw.
  [[nodiscard]] std::size_t admit(std::size_t seq, std::span<const token_id> prompt) {
    detail::check_seq(kName, seq, max_batch_);
    require_empty("admit to", seq);
    if (prompt.size() > max_seq_len_) {
      throw capacity_error(detail::message(kName, ": admit of a ", prompt.size(),
                                           "-token prompt to sequence ", seq,
                                           " exceeds max_seq_len ", max_seq_len_));
    }
    Sequence& s = seqs_[seq];
    block_id* table = table_of(seq);
    std::size_t cached = 0;
    {
      std::lock_guard lock(shared_->mutex);
      if (prefix_caching_) {
        const std::size_t m =
            shared_->index.match(prompt, std::span<block_id>(table, max_blocks_per_seq_));
        cached = std::min(m * block_size_, prompt.empty() ? 0 : prompt.size() - 1);
        s.num_blocks = (cached + block_size_ - 1) / block_size_;
        for (std::size_t i = 0; i < s.num_blocks; ++i) shared_->pool.acquire(table[i]);
      }
      ++shared_->prompts;
      shared_->prompt_tokens += prompt.size();
      shared_->reused_tokens += cached;
    }
    std::ranges::copy(prompt, table_tokens(seq));
    s.num_tokens = prompt.size();
    s.committed = cached / block_size_;
    s.exact = kAllExact;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      lengths_[seq * shape_.num_layers + l] = cached;
    }
    return cached;
  }

  /// How many leading tokens of `ids` are cached right now: a multiple of block_size. Changes
  /// nothing (statistics included). O(ids.size()) with the default hasher.
  [[nodiscard]] std::size_t match_prefix(std::span<const token_id> ids) const {
    if (!prefix_caching_) return 0;
    std::lock_guard lock(shared_->mutex);
    return shared_->index.matched_blocks(ids) * block_size_;
  }

  /// Registers the ids of the tokens at positions tokens(seq).size() .. + ids.size() - 1, ahead
  /// of their K/V (see "Token ids and commitment"), then indexes the blocks this completes.
  /// Never allocates. O(ids.size()).
  /// @throws batch_error; capacity_error past max_seq_len; position_error when seq has no ids
  ///         but holds K/V (appended without ids, so not theirs to claim). Unchanged on throw.
  void add_tokens(std::size_t seq, std::span<const token_id> ids) {
    detail::check_seq(kName, seq, max_batch_);
    Sequence& s = seqs_[seq];
    if (ids.size() > max_seq_len_ - s.num_tokens) {
      throw capacity_error(detail::message(kName, ": add_tokens of ", ids.size(),
                                           " ids to sequence ", seq, " exceeds max_seq_len ",
                                           max_seq_len_, " (holds ", s.num_tokens, " ids)"));
    }
    if (ids.empty()) return;
    require_trackable("add_tokens to", seq);
    std::ranges::copy(ids, table_tokens(seq) + s.num_tokens);
    s.num_tokens += ids.size();
    commit(seq);
  }

  /// The token ids registered for `seq`. @throws batch_error.
  [[nodiscard]] std::span<const token_id> tokens(std::size_t seq) const {
    detail::check_seq(kName, seq, max_batch_);
    return {tokens_.data() + seq * max_seq_len_, seqs_[seq].num_tokens};
  }

  /// How many leading positions of `seq` hold K/V that follows from their ids alone: SIZE_MAX
  /// unless a context shift moved its later tokens (see "Moved K/V"). @throws batch_error.
  [[nodiscard]] std::size_t exact_prefix(std::size_t seq) const {
    detail::check_seq(kName, seq, max_batch_);
    return seqs_[seq].exact;
  }

  /// Makes the empty sequence `dst` a copy of `src` sharing all of its blocks (parallel
  /// sampling, beam search); the first append of either into a shared block copies that block.
  /// Never allocates or needs a free block. O(blocks + tokens + num_layers).
  /// @throws batch_error (an index out of range, or src == dst); position_error when dst is not
  ///         empty. Unchanged on throw.
  void fork(std::size_t src, std::size_t dst) {
    detail::check_seq(kName, src, max_batch_);
    detail::check_seq(kName, dst, max_batch_);
    if (src == dst) {
      throw batch_error(detail::message(kName, ": fork of sequence ", src, " into itself"));
    }
    require_empty("fork into", dst);
    const Sequence& s = seqs_[src];
    {
      std::lock_guard lock(shared_->mutex);
      for (std::size_t i = 0; i < s.num_blocks; ++i) shared_->pool.acquire(table_of(src)[i]);
    }
    std::copy(table_of(src), table_of(src) + s.num_blocks, table_of(dst));
    std::copy(table_tokens(src), table_tokens(src) + s.num_tokens, table_tokens(dst));
    std::copy_n(lengths_.begin() + static_cast<std::ptrdiff_t>(src * shape_.num_layers),
                shape_.num_layers,
                lengths_.begin() + static_cast<std::ptrdiff_t>(dst * shape_.num_layers));
    seqs_[dst] = s;
  }

  /// Beam reordering on block tables: for every i at once, sequence dst[i] becomes a copy of
  /// what sequence src[i] was before the call (sharing its blocks; nothing is copied but block
  /// ids, token ids and lengths). Sequences not named in dst are unchanged. Allocates a
  /// snapshot of the sources. O(sum of their blocks + tokens).
  /// @throws shape_error (dst.size() != src.size()); batch_error (an index out of range, or an
  ///         index twice in dst); std::bad_alloc. Unchanged on throw.
  void reorder(std::span<const std::size_t> dst, std::span<const std::size_t> src) {
    if (dst.size() != src.size()) {
      throw shape_error(detail::message(kName, ": reorder of ", dst.size(), " sequences from ",
                                        src.size(), " sources"));
    }
    std::vector<bool> seen(max_batch_, false);
    for (std::size_t i = 0; i < dst.size(); ++i) {
      detail::check_seq(kName, dst[i], max_batch_);
      detail::check_seq(kName, src[i], max_batch_);
      if (seen[dst[i]]) {
        throw batch_error(
            detail::message(kName, ": reorder names sequence ", dst[i], " twice as a destination"));
      }
      seen[dst[i]] = true;
    }
    struct Snapshot {
      Sequence seq;
      std::vector<block_id> table;
      std::vector<token_id> ids;
      std::vector<std::size_t> lengths;
    };
    std::vector<Snapshot> snap;
    snap.reserve(src.size());
    for (std::size_t from : src) {
      const Sequence& s = seqs_[from];
      snap.push_back(
          {s,
           {table_of(from), table_of(from) + s.num_blocks},
           {table_tokens(from), table_tokens(from) + s.num_tokens},
           {lengths_.begin() + static_cast<std::ptrdiff_t>(from * shape_.num_layers),
            lengths_.begin() + static_cast<std::ptrdiff_t>((from + 1) * shape_.num_layers)}});
    }
    {
      std::lock_guard lock(shared_->mutex);
      for (const Snapshot& sn : snap) {
        for (block_id b : sn.table) shared_->pool.acquire(b);
      }
      for (std::size_t to : dst) release_blocks_locked(to, 0);
    }
    for (std::size_t i = 0; i < dst.size(); ++i) {
      const Snapshot& sn = snap[i];
      std::ranges::copy(sn.table, table_of(dst[i]));
      std::ranges::copy(sn.ids, table_tokens(dst[i]));
      std::ranges::copy(sn.lengths,
                        lengths_.begin() + static_cast<std::ptrdiff_t>(dst[i] * shape_.num_layers));
      seqs_[dst[i]] = sn.seq;
    }
  }

  /// Snapshot restore hook (load_snapshot() calls it): replaces every *named* sequence (one
  /// that an entry or `tokens` names) by the one described; other sequences are untouched.
  /// A named sequence's previous blocks are released (as release() would); its leading blocks
  /// whose ids it has and that equal a block already indexed (same prefix, same ids, as
  /// admit() would match) or a block full in every layer, with its ids, of another sequence
  /// named in the same call share that block, their K/V rows in the entries unread (so sequences
  /// that shared a prefix when saved share it again, in a pool of the same size). Only blocks
  /// every restored layer fills are shared, and at most one more after them (as admit() of a
  /// wholly cached prompt leaves it); blocks further on are filled fresh, so that no later write
  /// copies a shared block whose child the sequence keeps. Fresh blocks are taken from the pool
  /// for the rest of the positions of its longest restored layer and the K/V rows copied in; its
  /// ids are registered (those `tokens` gives it; none if it gives none), and a layer without an
  /// entry is left empty. Ids may run ahead of the K/V (as after admit()), never behind: a
  /// sequence given ids holds at most that many positions in every layer (see "Token ids and
  /// commitment"). Then the normal commit path runs, as after
  /// append() and add_tokens(): the fresh blocks that are full in every layer and have their ids
  /// are indexed. So after a restore and release(seq), the restored prefix stays cached and a later
  /// admit() of a prompt starting with those ids shares it: a prompt prefilled by one process
  /// serves prefix hits in another, and restoring a prefix the pool caches already costs no blocks.
  ///
  /// Blocks: the named sequences need the sum over them of ceil(longest restored layer /
  /// block_size) blocks less those shared (with the index or another named sequence). Available
  /// are the free blocks plus those the replaced sequences would free (held by no other sequence
  /// and not indexed), and with evict_when_full also the cached blocks plus the indexed ones the
  /// replaced sequences would leave cached, less those shared (counted exactly: each block's
  /// references from the named sequences against its reference count).
  ///
  /// Allocates scratch: O(num_layers * max_batch + max_seq_len / block_size), the ids of the
  /// blocks the named sequences hold, and a scratch index of the committable blocks (their ids
  /// copied). O(elements of the entries + num_layers * max_batch + H log H + I) for the H blocks
  /// the named sequences held and the I ids they are given, plus O(block_size) per block
  /// committed.
  /// @pre no other thread operates on a named sequence during the call (see Thread safety);
  ///      the entries' K/V and the ids do not alias this cache's storage.
  /// @post view(e.layer, e.seq) reports e.length and holds e.k / e.v for each entry e;
  ///       tokens(t.seq) equals t.ids for each t in `tokens`.
  /// @throws layer_error, batch_error (a layer or sequence out of range), shape_error (a (layer,
  ///         sequence) or the ids of a sequence named twice, K/V of the wrong size),
  ///         position_error (sink_end or recent_begin not 0: a PagedCache holds every position;
  ///         a layer longer than the non-empty ids given for its sequence),
  ///         capacity_error (a length or more ids than max_seq_len), pool_exhausted_error (fewer
  ///         blocks available than needed; names needed, free and evictable), std::bad_alloc;
  ///         all before anything changes.
  void restore(std::span<const LayerRestore<T>> entries, std::span<const SequenceTokens> tokens) {
    detail::check_restore_entries(kName, entries, shape_, max_batch_);
    const std::size_t num_layers = shape_.num_layers;
    std::vector<std::size_t> length(max_batch_ * num_layers, 0);  // [seq][layer], restored
    std::vector<const SequenceTokens*> ids_of(max_batch_, nullptr);
    std::vector<bool> named(max_batch_, false);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const LayerRestore<T>& e = entries[i];
      if (e.sink_end != 0 || e.recent_begin != 0) {
        throw position_error(detail::message(kName, ": restore entry ", i, " drops positions [",
                                             e.sink_end, ", ", e.recent_begin,
                                             "), but a PagedCache holds every position"));
      }
      if (static_cast<std::size_t>(e.length) > max_seq_len_) {
        throw capacity_error(detail::message(kName, ": restore entry ", i, ": sequence ", e.seq,
                                             " layer ", e.layer, " holds ", e.length,
                                             " tokens, more than max_seq_len ", max_seq_len_));
      }
      length[e.seq * num_layers + e.layer] = static_cast<std::size_t>(e.length);
      named[e.seq] = true;
    }
    for (std::size_t j = 0; j < tokens.size(); ++j) {
      const SequenceTokens& t = tokens[j];
      if (t.seq >= max_batch_) {
        throw batch_error(detail::message(kName, ": restore ids ", j, ": sequence ", t.seq,
                                          " out of range (max_batch ", max_batch_, ")"));
      }
      if (ids_of[t.seq] != nullptr) {
        throw shape_error(
            detail::message(kName, ": restore names the ids of sequence ", t.seq, " twice"));
      }
      if (t.ids.size() > max_seq_len_) {
        throw capacity_error(detail::message(kName, ": restore of ", t.ids.size(),
                                             " token ids into sequence ", t.seq,
                                             " exceeds max_seq_len ", max_seq_len_));
      }
      ids_of[t.seq] = &t;
      named[t.seq] = true;
    }
    for (std::size_t q = 0; q < max_batch_; ++q) {  // K/V never past the ids (a tracked sequence)
      if (ids_of[q] == nullptr || ids_of[q]->ids.empty()) continue;
      for (std::size_t l = 0; l < num_layers; ++l) {
        if (length[q * num_layers + l] <= ids_of[q]->ids.size()) continue;
        throw position_error(detail::message(
            kName, ": restore of sequence ", q, " gives layer ", l, " the K/V of ",
            length[q * num_layers + l], " positions but only ", ids_of[q]->ids.size(),
            " token ids: a sequence's K/V never runs past its ids"));
      }
    }
    // Per named sequence: its blocks; the leading ones its ids cover and every layer fills,
    // plus at most one more (shareable with an equal indexed block, as admit() shares them); of
    // those, the ones that commit() will index (committable: full in every layer). And the blocks
    // the named sequences hold now (sorted, so that each block's references can be counted).
    std::vector<std::size_t> blocks(max_batch_, 0), shareable(max_batch_, 0),
        committable(max_batch_, 0), at(max_batch_, 0);
    std::size_t num_named = 0, most_shared = 0, most_committed = 0;
    std::vector<block_id> held;
    for (std::size_t q = 0; q < max_batch_; ++q) {
      if (!named[q]) continue;
      const auto first = length.begin() + static_cast<std::ptrdiff_t>(q * num_layers);
      const auto last = first + static_cast<std::ptrdiff_t>(num_layers);
      const std::size_t shortest = *std::min_element(first, last);
      blocks[q] = (*std::max_element(first, last) + block_size_ - 1) / block_size_;
      if (prefix_caching_ && ids_of[q] != nullptr) {
        // As admit() leaves them: every layer fills each shared block but perhaps the last.
        // Only ids of exact K/V name blocks (see "Moved K/V").
        const std::size_t exact = std::min(ids_of[q]->ids.size(), ids_of[q]->exact_prefix);
        shareable[q] = std::min({exact / block_size_, blocks[q], shortest / block_size_ + 1});
        committable[q] = std::min(shortest, exact) / block_size_;
        at[q] = most_shared;
        most_shared += shareable[q];
        most_committed += committable[q];
      }
      ++num_named;
      held.insert(held.end(), table_of(q), table_of(q) + seqs_[q].num_blocks);
    }
    std::sort(held.begin(), held.end());
    // The blocks the named sequences will index, once each: a scratch index of their
    // committable blocks, each inserted by the first sequence (in order) that has it, whose
    // fresh block it will be. Every other sequence whose ids reach it shares that block. Along
    // one sequence's blocks the first holders never decrease, so sequence q's shareable blocks
    // run: [0, num_shared) indexed already; [num_shared, head_end) from earlier sequences;
    // [head_end, own_end) its own fresh ones (up to committable); [own_end, tail_end) from any
    // sequence (blocks its K/V fill only in part); [tail_end, blocks) fresh again.
    std::vector<std::size_t> head_end(max_batch_, 0), own_end(max_batch_, 0),
        tail_end(max_batch_, 0), first_holder(most_shared, 0);
    if (most_committed != 0) {
      PrefixIndex<Hasher> scratch(most_committed, block_size_, shared_->index.hasher());
      std::vector<std::size_t> holder;  // scratch block -> the sequence that inserted it
      holder.reserve(most_committed);
      std::vector<block_id> path(max_blocks_per_seq_);
      for (std::size_t q = 0; q < max_batch_; ++q) {
        if (committable[q] == 0) continue;
        const std::span<const token_id> ids(ids_of[q]->ids);
        const std::size_t m = scratch.match(ids.first(committable[q] * block_size_),
                                            std::span<block_id>(path).first(committable[q]));
        head_end[q] = m;
        for (std::size_t i = m; i < committable[q]; ++i) {
          path[i] = static_cast<block_id>(holder.size());
          holder.push_back(q);
          scratch.insert(path[i], i == 0 ? kNoBlock : path[i - 1],
                         ids.subspan(i * block_size_, block_size_));
        }
      }
      for (std::size_t q = 0; q < max_batch_; ++q) {
        if (shareable[q] == 0) continue;
        const std::size_t m = scratch.match(
            std::span<const token_id>(ids_of[q]->ids).first(shareable[q] * block_size_),
            std::span<block_id>(path).first(shareable[q]));
        for (std::size_t i = 0; i < m; ++i) first_holder[at[q] + i] = holder[path[i]];
        tail_end[q] = m;
      }
    }
    // Indexed blocks equal to a named sequence's leading blocks (same prefix, same ids), shared
    // rather than filled with a copy: those of q are matched[at[q] ..], num_shared[q] of them.
    std::vector<block_id> matched(most_shared), pinned;
    std::vector<std::size_t> num_shared(max_batch_, 0);
    pinned.reserve(most_shared);
    {
      std::lock_guard lock(shared_->mutex);
      BlockPool& pool = shared_->pool;
      std::size_t needed = 0, num_matched = 0, num_dup = 0;
      for (std::size_t q = 0; q < max_batch_; ++q) {
        if (!named[q]) continue;
        if (shareable[q] != 0) {
          num_shared[q] = shared_->index.match(
              std::span<const token_id>(ids_of[q]->ids).first(shareable[q] * block_size_),
              std::span<block_id>(matched).subspan(at[q], shareable[q]));
          num_matched += num_shared[q];
        }
        // A block the index has is that one for every sequence reaching it.
        head_end[q] = std::max(head_end[q], num_shared[q]);
        own_end[q] = std::max(head_end[q], committable[q]);
        tail_end[q] = std::max(tail_end[q], own_end[q]);
        num_dup += (head_end[q] - num_shared[q]) + (tail_end[q] - own_end[q]);
        needed += (own_end[q] - head_end[q]) + (blocks[q] - tail_end[q]);
      }
      std::size_t would_free = 0, would_cache = 0;  // what releasing the named sequences yields
      for (std::size_t i = 0, j = 0; i < held.size(); i = j) {
        while (j < held.size() && held[j] == held[i]) ++j;
        if (pool.ref_count(held[i]) == j - i) ++(pool.indexed(held[i]) ? would_cache : would_free);
      }
      // Shared blocks that are, or would be left, cached stay held: not evictable.
      for (std::size_t q = 0; q < max_batch_; ++q) {
        const auto from = matched.begin() + static_cast<std::ptrdiff_t>(at[q]);
        pinned.insert(pinned.end(), from, from + static_cast<std::ptrdiff_t>(num_shared[q]));
      }
      std::sort(pinned.begin(), pinned.end());
      pinned.erase(std::unique(pinned.begin(), pinned.end()), pinned.end());
      std::size_t num_pinned = 0;
      for (const block_id b : pinned) {
        const auto [lo, hi] = std::equal_range(held.begin(), held.end(), b);
        if (pool.ref_count(b) == static_cast<std::size_t>(hi - lo)) ++num_pinned;
      }
      const std::size_t free = pool.num_free() + would_free;
      const std::size_t cached = pool.num_cached() + would_cache - num_pinned;
      if (needed > free && !(evict_when_full_ && needed <= free + cached)) {
        throw_exhausted(
            detail::message(kName, ": restore of ", num_named, " sequences"), needed, free, cached,
            detail::message(", counting the ", would_free + would_cache,
                            " blocks only the replaced sequences hold, sharing ", num_matched,
                            " already cached and ", num_dup, " between the restored sequences"));
      }
      for (std::size_t q = 0; q < max_batch_; ++q) {
        for (std::size_t i = 0; i < num_shared[q]; ++i) pool.acquire(matched[at[q] + i]);
      }
      for (std::size_t q = 0; q < max_batch_; ++q) {
        if (named[q]) release_blocks_locked(q, 0);
      }
      // The pool now has exactly `free` free and `cached` cached blocks: this cannot throw.
      reserve_locked(needed, [] { return std::string(kName); });
      for (std::size_t q = 0; q < max_batch_; ++q) {
        if (!named[q]) continue;
        block_id* table = table_of(q);
        std::copy_n(matched.begin() + static_cast<std::ptrdiff_t>(at[q]), num_shared[q], table);
        std::fill(table + num_shared[q], table + head_end[q], kNoBlock);  // set below
        for (std::size_t i = head_end[q]; i < own_end[q]; ++i) table[i] = pool.allocate();
        std::fill(table + own_end[q], table + tail_end[q], kNoBlock);  // set below
        for (std::size_t i = tail_end[q]; i < blocks[q]; ++i) table[i] = pool.allocate();
        seqs_[q].num_blocks = blocks[q];
      }
    }
    // The fresh blocks are this call's alone (held once, not indexed) until commit() below.
    for (std::size_t q = 0; q < max_batch_; ++q) {
      if (!named[q]) continue;
      Sequence& s = seqs_[q];
      s.num_tokens = 0;
      s.committed = std::min(head_end[q], committable[q]);  // not a block its K/V fill in part
      s.exact = kAllExact;
      if (ids_of[q] != nullptr) {
        std::ranges::copy(ids_of[q]->ids, table_tokens(q));
        s.num_tokens = ids_of[q]->ids.size();
        if (ids_of[q]->exact_prefix < s.num_tokens) s.exact = ids_of[q]->exact_prefix;
      }
      std::copy_n(length.begin() + static_cast<std::ptrdiff_t>(q * num_layers), num_layers,
                  lengths_.begin() + static_cast<std::ptrdiff_t>(q * num_layers));
    }
    const std::size_t head_elems = block_size_ * shape_.head_dim;
    const std::size_t v_offset = shape_.num_kv_heads * head_elems;
    for (const LayerRestore<T>& e : entries) {  // into the fresh blocks only
      const std::size_t n = e.held();
      T* layer_base = storage_.data() + e.layer * layer_elems_;
      const block_id* table = table_of(e.seq);
      const auto copy_blocks = [&](std::size_t begin, std::size_t end) {
        for (std::size_t i = begin; i < end && i * block_size_ < n; ++i) {
          T* base = layer_base + std::size_t{table[i]} * block_elems_;
          const std::size_t first = i * block_size_, rows = std::min(block_size_, n - first);
          detail::copy_packed_rows(base, head_elems, 0, e.k.data(), n, first, rows, shape_);
          detail::copy_packed_rows(base + v_offset, head_elems, 0, e.v.data(), n, first, rows,
                                   shape_);
        }
      };
      copy_blocks(head_end[e.seq], own_end[e.seq]);
      copy_blocks(tail_end[e.seq], blocks[e.seq]);
    }
    // Sequences in order: the first holder of a block q shares at positions below head_end[q]
    // is an earlier one, whose commit() has indexed it; a block past own_end[q] may come from
    // any sequence, so those are set once every commit() has run.
    const auto share = [&](std::size_t q, std::size_t begin, std::size_t end) {
      if (begin == end) return;
      std::lock_guard lock(shared_->mutex);
      block_id* table = table_of(q);
      for (std::size_t i = begin; i < end; ++i) {
        const block_id b = table_of(first_holder[at[q] + i])[i];
        shared_->pool.acquire(b);
        table[i] = b;
      }
    };
    for (std::size_t q = 0; q < max_batch_; ++q) {
      if (!named[q]) continue;
      share(q, num_shared[q], head_end[q]);
      commit(q);
    }
    for (std::size_t q = 0; q < max_batch_; ++q) {
      if (named[q]) share(q, own_end[q], tail_end[q]);
    }
  }

  /// Forgets `seq`: length 0 in every layer, no ids; its blocks lose a holder, and those no
  /// sequence holds become cached (indexed ones, reusable by later prompts) or free. Never
  /// allocates. O(blocks + num_layers). @throws batch_error.
  void release(std::size_t seq) {
    detail::check_seq(kName, seq, max_batch_);
    {
      std::lock_guard lock(shared_->mutex);
      release_blocks_locked(seq, 0);
    }
    seqs_[seq] = {};
    std::fill_n(lengths_.begin() + static_cast<std::ptrdiff_t>(seq * shape_.num_layers),
                shape_.num_layers, 0);
  }

  /// Evicts up to max_blocks cached blocks, least recently released first (a block's cached
  /// children before it); returns how many. Never allocates. O(evicted).
  std::size_t evict_cached(std::size_t max_blocks) {
    std::lock_guard lock(shared_->mutex);
    const std::size_t planned =
        plan_evictions_locked(std::min(max_blocks, shared_->pool.num_cached()));
    evict_planned_locked(planned);
    return planned;
  }

  /// Pool occupancy and prefix-cache counters, read together under the lock. O(1).
  [[nodiscard]] PrefixCacheStats stats() const {
    std::lock_guard lock(shared_->mutex);
    const Shared& sh = *shared_;
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

  // ---- Inspection ------------------------------------------------------------------------

  [[nodiscard]] std::size_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] std::size_t num_blocks() const noexcept { return num_blocks_; }
  [[nodiscard]] bool prefix_caching() const noexcept { return prefix_caching_; }

  /// The blocks `seq` holds, in position order. Valid until its next mutating call.
  /// @throws batch_error.
  [[nodiscard]] std::span<const block_id> block_table(std::size_t seq) const {
    detail::check_seq(kName, seq, max_batch_);
    return {table_of(seq), seqs_[seq].num_blocks};
  }

  /// How many block-table entries name block b. @throws shape_error unless b < num_blocks.
  [[nodiscard]] std::size_t ref_count(block_id b) const {
    if (b >= num_blocks_) {
      throw shape_error(detail::message(kName, ": block ", static_cast<std::size_t>(b),
                                        " out of range (num_blocks ", num_blocks_, ")"));
    }
    std::lock_guard lock(shared_->mutex);
    return shared_->pool.ref_count(b);
  }

  /// Checks every internal invariant: each block exactly one of free, used, cached; reference
  /// counts equal to table entries; tables as long as the longest layer; no layer of a sequence
  /// with ids holding more positions than its ids; committed blocks indexed under the sequence's
  /// own prefix and ids; every indexed block a sequence holds placed as "Where indexed blocks
  /// sit" says, its ids equal to the sequence's wherever the sequence sees its K/V; index links
  /// and child counts; LRU order children-before-parents. Returns "" or a description of the first
  /// violation. For tests; needs no concurrent mutation. O(num_blocks + max_batch * (blocks +
  /// num_layers)).
  [[nodiscard]] std::string check_consistency() const {
    std::lock_guard lock(shared_->mutex);
    const BlockPool& pool = shared_->pool;
    const PrefixIndex<Hasher>& index = shared_->index;
    using detail::message;
    std::vector<std::size_t> refs(num_blocks_, 0), lru_rank(num_blocks_, 0);
    std::vector<bool> on_free(num_blocks_, false);
    for (block_id b : pool.free_list()) {
      if (on_free[b]) return message("block ", std::size_t{b}, " twice on the free list");
      on_free[b] = true;
    }
    std::size_t rank = 0;
    for (block_id b = pool.lru().front(); b != kNoBlock; b = pool.lru().next(b)) {
      lru_rank[b] = ++rank;
    }
    for (std::size_t q = 0; q < max_batch_; ++q) {
      const Sequence& s = seqs_[q];
      const auto [shortest, longest] = extent(q);
      if (s.num_blocks != (longest + block_size_ - 1) / block_size_) {
        return message("sequence ", q, " holds ", s.num_blocks, " blocks for ", longest, " tokens");
      }
      if (s.committed * block_size_ > std::min({shortest, s.num_tokens, s.exact})) {
        return message("sequence ", q, " has ", s.committed, " committed blocks but ", shortest,
                       " tokens in its shortest layer and ", s.num_tokens, " ids");
      }
      if (s.num_tokens != 0 && longest > s.num_tokens) {
        return message("sequence ", q, " holds the K/V of ", longest, " positions but only ",
                       s.num_tokens, " token ids");
      }
      for (std::size_t i = 0; i < s.num_blocks; ++i) {
        const block_id b = table_of(q)[i];
        if (b >= num_blocks_ || on_free[b] || lru_rank[b] != 0) {
          return message("sequence ", q, " block ", i, " is ", std::size_t{b},
                         ", which is free, cached or out of range");
        }
        ++refs[b];
        if (index.contains(b)) {
          if ((i + 1) * block_size_ > s.exact) {
            return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                           " past its ", s.exact, " positions of exact K/V");
          }
          if (index.parent(b) != (i == 0 ? kNoBlock : table_of(q)[i - 1])) {
            return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                           " after another block than its parent");
          }
          if (shortest < i * block_size_) {
            return message("sequence ", q, " holds indexed block ", std::size_t{b}, " at ", i,
                           " but its shortest layer holds only ", shortest, " positions");
          }
          const std::size_t end = std::min((i + 1) * block_size_, longest);
          for (std::size_t p = i * block_size_; p < end; ++p) {
            if (p >= s.num_tokens || table_tokens(q)[p] != index.tokens(b)[p - i * block_size_]) {
              return message("sequence ", q, " sees K/V of indexed block ", std::size_t{b},
                             " at position ", p, ", which its ids do not match");
            }
          }
        }
        if (i < s.committed) {
          const block_id parent = i == 0 ? kNoBlock : table_of(q)[i - 1];
          const auto ids = tokens(q).subspan(i * block_size_, block_size_);
          if (!index.contains(b) || index.find(parent, ids) != b) {
            return message("sequence ", q, " committed block ", i, " (", std::size_t{b},
                           ") is not indexed under its prefix");
          }
        }
      }
    }
    std::vector<std::size_t> children(num_blocks_, 0);
    for (std::size_t b = 0; b < num_blocks_; ++b) {
      const auto id = static_cast<block_id>(b);
      if (refs[b] != pool.ref_count(id)) {
        return message("block ", b, " has reference count ", std::size_t{pool.ref_count(id)},
                       " but ", refs[b], " table entries");
      }
      const bool used = refs[b] != 0, cached = lru_rank[b] != 0;
      if (int{used} + int{cached} + int{on_free[b]} != 1) {
        return message("block ", b, " is not exactly one of free, used, cached");
      }
      if (index.contains(id) != pool.indexed(id) || (cached && !index.contains(id)) ||
          (on_free[b] && index.contains(id))) {
        return message("block ", b, " index membership disagrees with its state");
      }
      if (!index.contains(id)) continue;
      if (index.find(index.parent(id), index.tokens(id)) != id) {
        return message("indexed block ", b, " is not found under its own key");
      }
      const block_id parent = index.parent(id);
      if (parent != kNoBlock) {
        if (!index.contains(parent)) return message("indexed block ", b, " has a lost parent");
        ++children[parent];
        if (cached && lru_rank[parent] != 0 && lru_rank[parent] < lru_rank[b]) {
          return message("cached block ", b, " would be evicted after its parent");
        }
        if (used && refs[parent] == 0) {
          return message("used block ", b, " has an unreferenced parent");
        }
      }
    }
    for (std::size_t b = 0; b < num_blocks_; ++b) {
      if (children[b] != index.num_children(static_cast<block_id>(b))) {
        return message("block ", b, " child count is wrong");
      }
    }
    return {};
  }

 private:
  static constexpr const char* kName = "PagedCache";
  static constexpr std::size_t kAllExact = std::numeric_limits<std::size_t>::max();

  struct Sequence {
    std::size_t num_blocks = 0;  // table entries in use
    std::size_t num_tokens = 0;  // ids registered
    std::size_t committed = 0;   // leading blocks that are indexed under this sequence's prefix
    // Leading positions whose K/V follows from their ids alone (see "Moved K/V"): no block past
    // it is shared through the index or indexed.
    std::size_t exact = kAllExact;
  };

  // A block-table entry being copied on write: its index and the shared block it held.
  struct CowEntry {
    std::size_t index = 0;
    block_id from = kNoBlock;
  };

  // Everything threads share, behind one mutex (and one pointer, so the cache stays movable).
  struct Shared {
    Shared(std::size_t num_blocks, std::size_t block_size, Hasher hasher)
        : pool(num_blocks),
          index(num_blocks, block_size, std::move(hasher)),
          victims(num_blocks, kNoBlock),
          planned_children(num_blocks, 0) {}
    std::mutex mutex;
    BlockPool pool;
    PrefixIndex<Hasher> index;
    std::vector<block_id> victims;              // plan_evictions_locked() scratch: its plan
    std::vector<std::size_t> planned_children;  // ... and per block, children planned (0 after)
    std::size_t prompts = 0;
    std::size_t prompt_tokens = 0;
    std::size_t reused_tokens = 0;
    std::size_t evictions = 0;
    std::size_t cow_copies = 0;
  };

  [[nodiscard]] block_id* table_of(std::size_t seq) noexcept {
    return tables_.data() + seq * max_blocks_per_seq_;
  }
  [[nodiscard]] const block_id* table_of(std::size_t seq) const noexcept {
    return tables_.data() + seq * max_blocks_per_seq_;
  }
  [[nodiscard]] token_id* table_tokens(std::size_t seq) noexcept {
    return tokens_.data() + seq * max_seq_len_;
  }
  [[nodiscard]] const token_id* table_tokens(std::size_t seq) const noexcept {
    return tokens_.data() + seq * max_seq_len_;
  }

  // The lengths of seq's shortest and longest layer.
  struct Extent {
    std::size_t shortest = 0, longest = 0;
  };
  [[nodiscard]] Extent extent(std::size_t seq) const noexcept {
    const auto first = lengths_.begin() + static_cast<std::ptrdiff_t>(seq * shape_.num_layers);
    const auto [lo, hi] =
        std::minmax_element(first, first + static_cast<std::ptrdiff_t>(shape_.num_layers));
    return {*lo, *hi};
  }

  // Throws when `op` would register ids in a sequence that has none but holds K/V: nothing ties
  // that K/V to ids any more. (A tracked sequence's K/V never runs past its ids.)
  void require_trackable(const char* op, std::size_t seq) const {
    if (seqs_[seq].num_tokens != 0) return;
    const std::size_t held = extent(seq).longest;
    if (held == 0) return;
    throw position_error(detail::message(
        kName, ": ", op, " sequence ", seq, ", which holds the K/V of ", held,
        " positions appended without token ids: a token's id must be registered before or with "
        "its K/V (crop the sequence to 0 or release it first)"));
  }

  // The checks of append() and append() with ids; nothing changes before they pass.
  template <class U>
  void check_append(std::size_t layer, std::size_t seq, const token_id* ids,
                    const TokenBlock<const U>& k, const TokenBlock<const U>& v) const {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch_);
    const std::size_t n = detail::check_kv_input(kName, shape_, k, v);
    const std::size_t len = lengths_[seq * shape_.num_layers + layer];
    if (n > max_seq_len_ - len) {
      throw capacity_error(detail::message(kName, ": append of ", n, " tokens to sequence ", seq,
                                           " layer ", layer, " exceeds max_seq_len ", max_seq_len_,
                                           " (holds ", len, ")"));
    }
    const Sequence& s = seqs_[seq];
    if (ids == nullptr) {
      if (s.num_tokens != 0 && len + n > s.num_tokens) {
        throw position_error(detail::message(
            kName, ": append of ", n, " tokens to sequence ", seq, " layer ", layer,
            " at positions ", len, "..", len + n - 1, " runs past its ", s.num_tokens,
            " registered token ids: register each token's id before its K/V (add_tokens(), or "
            "append() with the ids)"));
      }
      return;
    }
    require_trackable("append with ids to", seq);
    const token_id* held = table_tokens(seq);
    for (std::size_t i = 0; len + i < s.num_tokens && i < n; ++i) {
      if (ids[i] != held[len + i]) {
        throw position_error(detail::message(kName, ": append to sequence ", seq, " layer ", layer,
                                             " gives token id ", ids[i], " for position ", len + i,
                                             ", where id ", held[len + i], " is registered"));
      }
    }
  }

  // append() and append() with ids (ids == nullptr: none): checks, takes and copies blocks,
  // writes the rows, registers the new ids, then indexes what this completes.
  template <class U>
  void append_rows(std::size_t layer, std::size_t seq, const token_id* ids,
                   const TokenBlock<const U>& kin, const TokenBlock<const U>& vin) {
    check_append(layer, seq, ids, kin, vin);
    const std::size_t n = kin.num_tokens;
    std::size_t& len = lengths_[seq * shape_.num_layers + layer];
    Sequence& s = seqs_[seq];
    block_id* table = table_of(seq);
    CowEntry* cow = cow_.data() + seq * max_blocks_per_seq_;
    const std::size_t first = len / block_size_;
    const std::size_t end = (len + n + block_size_ - 1) / block_size_;
    std::size_t num_cow = 0;
    {
      std::lock_guard lock(shared_->mutex);
      BlockPool& pool = shared_->pool;
      for (std::size_t i = first; i < std::min(end, s.num_blocks); ++i) {
        if (!writable(pool, table[i])) ++num_cow;
      }
      const std::size_t fresh = end > s.num_blocks ? end - s.num_blocks : 0;
      reserve_locked(fresh + num_cow, [&] {
        return detail::message(kName, ": append of ", n, " tokens to sequence ", seq, " layer ",
                               layer, " (holds ", len, ")");
      });
      for (std::size_t i = first, c = 0; c < num_cow; ++i) {
        if (writable(pool, table[i])) continue;
        cow[c++] = {i, table[i]};
        table[i] = pool.allocate();
      }
      for (std::size_t i = s.num_blocks; i < end; ++i) table[i] = pool.allocate();
      s.num_blocks = std::max(s.num_blocks, end);
      shared_->cow_copies += num_cow;
    }
    if (num_cow != 0) {
      // The old blocks are still held (their counts were not dropped), so nobody can evict or
      // reuse them while they are copied; the new ones are this sequence's alone.
      for (std::size_t c = 0; c < num_cow; ++c) {
        copy_block(seq, cow[c].index, cow[c].from, table[cow[c].index]);
      }
      std::lock_guard lock(shared_->mutex);
      for (std::size_t c = num_cow; c-- > 0;) shared_->pool.release(cow[c].from);
    }
    write_rows(layer, table, len, kin, vin);
    if (ids != nullptr && len + n > s.num_tokens) {
      const std::size_t known = s.num_tokens - len;  // len <= num_tokens: the ids come first
      std::copy(ids + known, ids + n, table_tokens(seq) + s.num_tokens);
      s.num_tokens = len + n;
    }
    len += n;
    commit(seq);
  }

  // A sequence may write into a block only when it alone holds it and no index refers to it.
  [[nodiscard]] static bool writable(const BlockPool& pool, block_id b) noexcept {
    return pool.ref_count(b) == 1 && !pool.indexed(b);
  }

  void require_empty(const char* op, std::size_t seq) const {
    const Sequence& s = seqs_[seq];
    if (s.num_blocks != 0 || s.num_tokens != 0 || seq_length(seq) != 0) {
      throw position_error(detail::message(kName, ": ", op, " sequence ", seq, ", which holds ",
                                           seq_length(seq), " tokens and ", s.num_tokens,
                                           " ids; release it first"));
    }
  }

  // Makes `needed` blocks allocatable, evicting cached ones where the caller opted in.
  // @throws pool_exhausted_error (message: describe() + the numbers); nothing changed then.
  template <class Describe>
  void reserve_locked(std::size_t needed, Describe&& describe) {
    BlockPool& pool = shared_->pool;
    const std::size_t free = pool.num_free(), cached = pool.num_cached();
    if (needed <= free) return;
    if (evict_when_full_ && needed <= free + cached) {
      const std::size_t planned = plan_evictions_locked(needed - free);
      if (planned == needed - free) {
        evict_planned_locked(planned);
        return;
      }
      throw_exhausted(describe(), needed, free, plan_evictions_locked(cached));
    }
    throw_exhausted(describe(), needed, free, cached);
  }

  // Throws the pool_exhausted_error of an operation: "<what> needs ... evictable<note> (...)".
  [[noreturn]] void throw_exhausted(const std::string& what, std::size_t needed, std::size_t free,
                                    std::size_t cached, const std::string& note = {}) const {
    throw pool_exhausted_error(
        detail::message(what, " needs ", needed, " blocks but the pool of ", num_blocks_, " has ",
                        free, " free and ", cached, " evictable", note,
                        evict_when_full_ ? ""
                                         : " (eviction is off: set evict_when_full or call "
                                           "evict_cached)"),
        needed, free, cached);
  }

  // Plans the eviction of up to `count` cached blocks into shared_->victims, in an order they
  // can go in: walking the LRU list from its front (and never past its end), each block whose
  // indexed children are all planned before it. By the ordering argument in the class comment
  // that is the first `count` blocks of the list. Changes nothing the cache reports; returns how
  // many it planned. O(blocks walked).
  [[nodiscard]] std::size_t plan_evictions_locked(std::size_t count) noexcept {
    Shared& sh = *shared_;
    const LruList& lru = sh.pool.lru();
    std::size_t planned = 0;
    for (block_id b = lru.front(); b != kNoBlock && planned < count; b = lru.next(b)) {
      if (sh.planned_children[b] != sh.index.num_children(b)) continue;
      sh.victims[planned++] = b;
      if (const block_id parent = sh.index.parent(b); parent != kNoBlock) {
        ++sh.planned_children[parent];
      }
    }
    for (std::size_t i = 0; i < planned; ++i) {
      if (const block_id parent = sh.index.parent(sh.victims[i]); parent != kNoBlock) {
        sh.planned_children[parent] = 0;
      }
    }
    return planned;
  }

  // Evicts the first `planned` blocks plan_evictions_locked() chose (children before parents).
  void evict_planned_locked(std::size_t planned) noexcept {
    Shared& sh = *shared_;
    for (std::size_t i = 0; i < planned; ++i) {
      sh.index.erase(sh.victims[i]);
      sh.pool.evict(sh.victims[i]);
    }
    sh.evictions += planned;
  }

  // Drops seq's hold on table entries [keep, num_blocks), last first (children before parents).
  void release_blocks_locked(std::size_t seq, std::size_t keep) noexcept {
    const block_id* table = table_of(seq);
    for (std::size_t i = seqs_[seq].num_blocks; i-- > keep;) shared_->pool.release(table[i]);
  }

  // Copies what every layer of seq holds in its block `index` from block `from` into `to`.
  void copy_block(std::size_t seq, std::size_t index, block_id from, block_id to) noexcept {
    const std::size_t d = shape_.head_dim, head_elems = block_size_ * d;
    for (std::size_t l = 0; l < shape_.num_layers; ++l) {
      const std::size_t len = lengths_[seq * shape_.num_layers + l];
      const std::size_t begin = index * block_size_;
      const std::size_t rows = len <= begin ? 0 : std::min(block_size_, len - begin);
      if (rows == 0) continue;
      const T* src = storage_.data() + l * layer_elems_ + std::size_t{from} * block_elems_;
      T* dst = storage_.data() + l * layer_elems_ + std::size_t{to} * block_elems_;
      for (std::size_t h = 0; h < 2 * shape_.num_kv_heads; ++h) {  // K heads, then V heads
        std::copy_n(src + h * head_elems, rows * d, dst + h * head_elems);
      }
    }
  }

  // Writes tokens [len, len + n) of one layer into the (writable) blocks of `table`.
  template <class U>
  void write_rows(std::size_t layer, const block_id* table, std::size_t len,
                  const TokenBlock<const U>& k, const TokenBlock<const U>& v) noexcept {
    const std::size_t d = shape_.head_dim, head_elems = block_size_ * d;
    const std::size_t v_offset = shape_.num_kv_heads * head_elems;
    T* layer_base = storage_.data() + layer * layer_elems_;
    for (std::size_t done = 0; done < k.num_tokens;) {
      const std::size_t pos = len + done;
      const std::size_t in_block = pos % block_size_;
      const std::size_t run = std::min(k.num_tokens - done, block_size_ - in_block);
      T* base = layer_base + std::size_t{table[pos / block_size_]} * block_elems_;
      for (std::size_t h = 0; h < shape_.num_kv_heads; ++h) {
        T* kdst = base + h * head_elems + in_block * d;
        detail::store_rows(kdst, k, done, run, h);
        detail::store_rows(kdst + v_offset, v, done, run, h);
      }
      done += run;
    }
  }

  // Indexes the blocks of seq that are now committed (full in every layer, ids registered),
  // switching to an already indexed equal block where there is one. Only a block this sequence
  // holds alone is inserted: the other holders of a shared block (forks) may have switched the
  // block before it to an equal indexed one, so indexing it under this sequence's predecessor
  // could leave a holder of a child without its parent. A shared block with no equal indexed
  // block stops the walk; a later call retries (once the others have copied or released it).
  // Never throws.
  void commit(std::size_t seq) noexcept {
    if (!prefix_caching_) return;
    Sequence& s = seqs_[seq];
    const std::size_t full = std::min({s.num_tokens, extent(seq).shortest, s.exact}) / block_size_;
    if (full <= s.committed) return;
    block_id* table = table_of(seq);
    const token_id* ids = table_tokens(seq);
    std::lock_guard lock(shared_->mutex);
    BlockPool& pool = shared_->pool;
    PrefixIndex<Hasher>& index = shared_->index;
    std::size_t i = s.committed;
    for (; i < full; ++i) {
      const block_id b = table[i];
      if (index.contains(b)) continue;  // shared through admit/fork: indexed under this prefix
      const block_id parent = i == 0 ? kNoBlock : table[i - 1];
      const std::span<const token_id> block_ids(ids + i * block_size_, block_size_);
      const block_id existing = index.find(parent, block_ids);
      if (existing != kNoBlock) {
        pool.acquire(existing);
        pool.release(b);
        table[i] = existing;
      } else if (pool.ref_count(b) == 1) {
        index.insert(b, parent, block_ids);
        pool.mark_indexed(b);
      } else {
        break;
      }
    }
    s.committed = i;
  }

  CacheShape shape_;
  std::size_t num_blocks_;
  std::size_t block_size_;
  std::size_t max_batch_;
  std::size_t max_seq_len_ = 0;
  std::size_t max_blocks_per_seq_ = 0;
  std::size_t block_elems_ = 0;  // one block of one layer: K and V
  std::size_t layer_elems_ = 0;  // all blocks of one layer
  bool prefix_caching_;
  bool evict_when_full_;
  AlignedBuffer<T> storage_;
  std::unique_ptr<Shared> shared_;
  std::vector<Sequence> seqs_;
  std::vector<block_id> tables_;      // [seq][max_blocks_per_seq]
  std::vector<CowEntry> cow_;         // [seq][max_blocks_per_seq]: copy-on-write scratch
  std::vector<token_id> tokens_;      // [seq][max_seq_len]
  std::vector<std::size_t> lengths_;  // [seq][layer]
};

static_assert(CacheConcept<PagedCache<float>>);
static_assert(CacheConcept<PagedCache<half>>);
static_assert(CacheConcept<PagedCache<bfloat16>>);
static_assert(PrefixCacheConcept<PagedCache<float>>);
static_assert(PrefixCacheConcept<PagedCache<half>>);
static_assert(PrefixCacheConcept<PagedCache<bfloat16>>);

}  // namespace kvcache
