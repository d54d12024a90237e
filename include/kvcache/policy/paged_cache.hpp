// SPDX-License-Identifier: Apache-2.0
// PagedCache: a fixed pool of KV blocks shared by many sequences through block tables, with
// automatic prefix caching (a new prompt reuses the cached blocks of its longest cached prefix),
// reference counts, LRU eviction, copy-on-write, fork and beam reordering, safe across threads:
// a BlockManager's bookkeeping over HostBlocks' bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
#include "kvcache/manager/block_manager.hpp"
#include "kvcache/prefix/prefix_index.hpp"
#include "kvcache/prefix/types.hpp"
#include "kvcache/storage/host_blocks.hpp"

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
  /// Largest length of one sequence (< 2^31); 0 means min(num_blocks * block_size, 2^31 - 1).
  /// Each slot's block table
  /// and token-id buffer are allocated for it at construction: about
  /// max_batch * max_seq_len * (4 + 12 / block_size) bytes besides the pool.
  std::size_t max_seq_len = 0;
  /// Index full blocks by their token ids so that later prompts reuse them (admit()).
  bool enable_prefix_caching = true;
  /// Opt-in: when an operation needs more blocks than are free, evict cached (unreferenced)
  /// blocks, least recently released first, instead of throwing pool_exhausted_error.
  bool evict_when_full = false;
};

/// PagedCache's view: one layer of one sequence in a paged layout (LayoutView), one segment per
/// block, read in place from the pool (no gather). Block i of the sequence's table
/// (block_table()) holds positions [i * block_size, (i + 1) * block_size) clipped to length; its
/// K is [num_kv_heads][block_size][head_dim], V follows.
template <KVFormat T>
using PagedView = LayoutView<T>;

/// Paged KV cache with automatic prefix caching: a BlockManager (the bookkeeping: tables, ids,
/// reference counts, copy-on-write, fork/reorder, the prefix index, eviction, locking) over
/// HostBlocks (the bytes). Its rules are the manager's; read BlockManager's comment for
/// "Sequences and blocks", "Token ids and commitment", "Where indexed blocks sit", "Moved K/V",
/// the prefix index, "Cache salt", pool exhaustion and thread safety. In short:
///  - a sequence's block table lists the blocks holding its positions; layers fill
///    independently; a write into a block another sequence holds or the index holds copies it
///    first (copy-on-write);
///  - **a token's id is registered before (or with) its K/V** (admit(), add_tokens(), append()
///    with ids); a sequence with ids never holds K/V past them, and the first call that would
///    break this throws position_error and changes nothing. A sequence with no ids takes K/V
///    freely and is never indexed;
///  - a block full in every layer whose ids are registered is committed and indexed, so later
///    prompts (admit()) share it; hits are confirmed id by id;
///  - admit() takes an optional extra key (a cache salt per tenant, an adapter id): prompts
///    share blocks only under the same key ("Cache salt": a hit shortens time to first token,
///    which another tenant could measure);
///  - an operation that lacks blocks throws pool_exhausted_error and changes nothing, unless
///    evict_when_full lets it evict cached blocks, least recently released first.
///
/// Storage: one allocation at construction, [layer][block][K, V][kv_head][block_size][head_dim]
/// (HostBlocks), so a layer's blocks form one array and a segment's heads are block_size *
/// head_dim apart. Every slot's block table and token-id buffer are allocated then too;
/// afterwards no operation allocates except reorder(), restore() (scratch for its validation)
/// and error messages.
///
/// Thread safety. Operations on *different* sequences may run concurrently from any threads:
/// admit, append, add_tokens, view, crop, reset/release, fork(src, dst) (which reads src and
/// writes dst; several forks may read one src at once) and the per-sequence queries
/// (layer_length, seq_length, tokens, block_table). match_prefix, evict_cached, stats,
/// ref_count and the const shape queries are safe at any time. Operations on the *same*
/// sequence must not overlap unless all of them are reads. reorder() counts as an operation on
/// every sequence it names, and so does restore() (on every sequence its entries or ids name);
/// check_consistency() needs no concurrent mutation. K/V rows are written and copied outside the
/// manager's lock, only into blocks the writing sequence holds alone. A view is valid until the
/// next mutating call on its own sequence; other sequences' operations never invalidate it.
/// T: any storage format, or KVFormats<K, V> (K and V then in two pools: layer_pool()).
template <KVFormat T, BlockHasher Hasher = DefaultBlockHasher>
class PagedCache {
 public:
  using value_type = T;
  using view_type = PagedView<T>;
  using hasher_type = Hasher;
  using manager_type = BlockManager<Hasher>;

  /// Allocates the pool, block tables and id buffers.
  /// @throws shape_error for a zero num_layers, num_kv_heads, head_dim, num_blocks, block_size
  ///         or max_batch, or num_blocks >= 2^32 - 1; capacity_error if a size overflows;
  ///         std::bad_alloc.
  explicit PagedCache(const PagedCacheConfig& config, Hasher hasher = {})
      : shape_(cache_shape<T>(config.num_layers, config.num_kv_heads, config.head_dim)),
        manager_(checked(config), std::move(hasher), kName),
        blocks_(shape_, config.num_blocks, config.block_size, kName) {}

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
  template <AppendRows<T> U>
  void append(std::size_t layer, std::size_t seq, TokenBlock<U> k, TokenBlock<U> v) {
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
  template <AppendRows<T> U>
  void append(std::size_t layer, std::size_t seq, std::span<const token_id> ids, TokenBlock<U> k,
              TokenBlock<U> v) {
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
    const auto len = static_cast<position_t>(layer_length(layer, seq));
    const auto table = manager_.block_table(seq);
    // the sequence alone: its table is row 0
    const KVLayout<T> layout =
        paged_layout(blocks_.layer_bases(layer), static_cast<int>(shape_.num_kv_heads),
                     static_cast<int>(shape_.head_dim), static_cast<int>(block_size()),
                     table.data(), 1, static_cast<int>(table.size()));
    return view_type(layout, 0, KeyRange{0, 0, len});
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    return manager_.layer_length(layer, seq);
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return manager_.seq_length(seq); }
  /// The largest length of one sequence (max_seq_len).
  [[nodiscard]] std::size_t capacity() const noexcept { return manager_.max_seq_len(); }
  [[nodiscard]] std::size_t max_batch() const noexcept { return manager_.max_batch(); }
  [[nodiscard]] CacheShape shape() const noexcept { return shape_; }
  /// Bytes of the block pool (all of it, from construction on).
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return blocks_.bytes(); }

  /// True when crop(seq, n) would succeed: n <= seq_length(seq). @throws batch_error.
  [[nodiscard]] bool can_crop(std::size_t seq, std::size_t n) const { return n <= seq_length(seq); }

  /// Rolls every layer of `seq` back to at most n tokens and its token ids to at most n ids
  /// (dropping ids registered ahead of their K/V), releasing the blocks no layer needs any
  /// more. O(num_layers + released blocks). Never allocates.
  /// @throws batch_error, position_error (n > seq_length); unchanged on throw.
  void crop(std::size_t seq, std::size_t n) { manager_.crop(seq, n); }

  /// CacheConcept's name for release(). @throws batch_error.
  void reset(std::size_t seq) { release(seq); }

  // ---- Prefix caching (PrefixCacheConcept) -----------------------------------------------

  /// Starts the empty sequence `seq` with `prompt`: registers its ids and shares the blocks of
  /// the longest prefix cached under `extra_key` (0: none; a tenant's cache salt or an adapter
  /// id, see BlockManager "Cache salt"), which the sequence keeps: its own blocks are indexed
  /// under it, so only prompts admitted under the same key share them. Returns m, the number of
  /// leading prompt tokens whose K/V every layer now holds: a multiple of block_size, except that m
  /// < prompt.size() always (when the whole prompt is cached, its last token is left to run, for
  /// its logits). The caller appends K/V for prompt[m..] layer by layer; those blocks are indexed
  /// as they complete. Never allocates. O(prompt.size() + num_layers) (with the default hasher).
  /// @post seq_length(seq) == m, tokens(seq) == prompt.
  /// @throws batch_error; position_error when seq is not empty; capacity_error when the prompt
  ///         exceeds max_seq_len. Unchanged on throw.
  [[nodiscard]] std::size_t admit(std::size_t seq, std::span<const token_id> prompt,
                                  std::uint64_t extra_key = 0) {
    return manager_.admit(seq, prompt, extra_key);
  }

  /// How many leading tokens of `ids` are cached right now under `extra_key`: a multiple of
  /// block_size. Changes nothing (statistics included). O(ids.size()) with the default hasher.
  [[nodiscard]] std::size_t match_prefix(std::span<const token_id> ids,
                                         std::uint64_t extra_key = 0) const {
    return manager_.match_prefix(ids, extra_key);
  }

  /// The extra key `seq` was admitted under; 0 for none (or after release()).
  /// @throws batch_error.
  [[nodiscard]] std::uint64_t extra_key(std::size_t seq) const { return manager_.extra_key(seq); }

  /// Registers the ids of the tokens at positions tokens(seq).size() .. + ids.size() - 1, ahead
  /// of their K/V (see "Token ids and commitment"), then indexes the blocks this completes.
  /// Never allocates. O(ids.size()).
  /// @throws batch_error; capacity_error past max_seq_len; position_error when seq has no ids
  ///         but holds K/V (appended without ids, so not theirs to claim). Unchanged on throw.
  void add_tokens(std::size_t seq, std::span<const token_id> ids) { manager_.add_tokens(seq, ids); }

  /// The token ids registered for `seq`. @throws batch_error.
  [[nodiscard]] std::span<const token_id> tokens(std::size_t seq) const {
    return manager_.tokens(seq);
  }

  /// How many leading positions of `seq` hold K/V that follows from their ids alone: SIZE_MAX
  /// unless a context shift moved its later tokens (see "Moved K/V"). @throws batch_error.
  [[nodiscard]] std::size_t exact_prefix(std::size_t seq) const {
    return manager_.exact_prefix(seq);
  }

  /// Makes the empty sequence `dst` a copy of `src` sharing all of its blocks (parallel
  /// sampling, beam search); the first append of either into a shared block copies that block.
  /// Never allocates or needs a free block. O(blocks + tokens + num_layers).
  /// @throws batch_error (an index out of range, or src == dst); position_error when dst is not
  ///         empty. Unchanged on throw.
  void fork(std::size_t src, std::size_t dst) { manager_.fork(src, dst); }

  /// Beam reordering on block tables: for every i at once, sequence dst[i] becomes a copy of
  /// what sequence src[i] was before the call (sharing its blocks; nothing is copied but block
  /// ids, token ids and lengths). Sequences not named in dst are unchanged. Allocates a
  /// snapshot of the sources. O(sum of their blocks + tokens).
  /// @throws shape_error (dst.size() != src.size()); batch_error (an index out of range, or an
  ///         index twice in dst); std::bad_alloc. Unchanged on throw.
  void reorder(std::span<const std::size_t> dst, std::span<const std::size_t> src) {
    manager_.reorder(dst, src);
  }

  /// Snapshot restore hook (load_snapshot() calls it): replaces every *named* sequence (one
  /// that an entry or `tokens` names) by the one described; other sequences are untouched.
  /// BlockManager::begin_restore() (manager/restore.hpp) says which blocks are shared rather
  /// than filled (leading blocks equal to indexed ones or to another named sequence's, so
  /// sequences that shared a prefix when saved share it again, in a pool of the same size),
  /// how many blocks it needs and when it throws; the rows of the others are copied in here.
  /// Then the full blocks with their ids are indexed, as after append(): after a restore and
  /// release(seq), the restored prefix stays cached and a later admit() of a prompt starting
  /// with those ids shares it, so a prompt prefilled by one process serves prefix hits in
  /// another. A layer without an entry is left empty; ids may run ahead of the K/V, never
  /// behind.
  ///
  /// Allocates scratch: O(num_layers * max_batch + max_seq_len / block_size), the ids of the
  /// blocks the named sequences hold, and a scratch index of the committable blocks. O(elements
  /// of the entries + num_layers * max_batch + H log H + I) for the H blocks the named
  /// sequences held and the I ids they are given, plus O(block_size) per block committed.
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
    detail::check_restore_entries(kName, entries, shape_, max_batch());
    std::vector<RestoreExtent> extents(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const LayerRestore<T>& e = entries[i];
      if (e.sink_end != 0 || e.recent_begin != 0) {
        throw position_error(detail::message(kName, ": restore entry ", i, " drops positions [",
                                             e.sink_end, ", ", e.recent_begin,
                                             "), but a PagedCache holds every position"));
      }
      extents[i] = {e.layer, e.seq, static_cast<std::size_t>(e.length)};
    }
    const RestorePlan plan = manager_.begin_restore(extents, tokens);
    for (const LayerRestore<T>& e : entries) {  // into the fresh blocks only
      const std::span<const block_id> table = manager_.block_table(e.seq);
      for (const RestorePlan::Range r : plan.fresh_blocks(e.seq)) {
        for (std::size_t i = r.begin; i < r.end; ++i) blocks_.fill_block(e, i, table[i]);
      }
    }
    manager_.end_restore(plan);
  }

  /// Forgets `seq`: length 0 in every layer, no ids; its blocks lose a holder, and those no
  /// sequence holds become cached (indexed ones, reusable by later prompts) or free. Never
  /// allocates. O(blocks + num_layers). @throws batch_error.
  void release(std::size_t seq) { manager_.release(seq); }

  /// Evicts up to max_blocks cached blocks, least recently released first (a block's cached
  /// children before it); returns how many. Never allocates. O(evicted).
  std::size_t evict_cached(std::size_t max_blocks) { return manager_.evict_cached(max_blocks); }

  /// Pool occupancy and prefix-cache counters, read together under the lock. O(1).
  [[nodiscard]] PrefixCacheStats stats() const { return manager_.stats(); }

  // ---- Inspection ------------------------------------------------------------------------

  [[nodiscard]] std::size_t block_size() const noexcept { return manager_.block_size(); }
  [[nodiscard]] std::size_t num_blocks() const noexcept { return manager_.num_blocks(); }
  [[nodiscard]] bool prefix_caching() const noexcept { return manager_.prefix_caching(); }

  /// The blocks `seq` holds, in position order. Valid until its next mutating call.
  /// @throws batch_error.
  [[nodiscard]] std::span<const block_id> block_table(std::size_t seq) const {
    return manager_.block_table(seq);
  }

  /// How many block-table entries name block b. @throws shape_error unless b < num_blocks.
  [[nodiscard]] std::size_t ref_count(block_id b) const { return manager_.ref_count(b); }

  /// The bookkeeping (read-only): what an engine with its own kernels reads block tables from
  /// (export_csr(cache.manager(), layer, seqs, ...) in manager/csr.hpp).
  [[nodiscard]] const manager_type& manager() const noexcept { return manager_; }

  /// Layer `layer`'s pool, [num_blocks][K, V][num_kv_heads][block_size][head_dim]: what block
  /// ids (block_table(), export_csr()) index, for kernels of the engine's own. One format only
  /// (a KVFormats pair keeps K and V apart: layer_pool()). @pre layer < num_layers.
  [[nodiscard]] const T* layer_data(std::size_t layer) const noexcept requires KVElement<T> {
    return blocks_.layer_bases(layer).k;
  }

  /// Layer `layer`'s pool for any format: K of block b at k + b * slab_stride, laid out
  /// [num_kv_heads][block_size][head_dim], its V rows at the same offsets from v; the row scales
  /// of a quantized side at k_scale / v_scale, one per row, indexed as the rows (element offset
  /// / head_dim). One format: layer_data()'s [K, V] blocks (v = k + num_kv_heads * block_size *
  /// head_dim); a KVFormats pair: a K pool and a V pool. @pre layer < num_layers.
  [[nodiscard]] KVBases<T> layer_pool(std::size_t layer) const noexcept {
    return blocks_.layer_bases(layer);
  }

  /// BlockManager::check_consistency(): "" or the first broken invariant. For tests; needs no
  /// concurrent mutation.
  [[nodiscard]] std::string check_consistency() const { return manager_.check_consistency(); }

 private:
  static constexpr const char* kName = "PagedCache";

  // The config's checks, in the order its fields are documented; then the manager's part.
  static BlockManagerConfig checked(const PagedCacheConfig& config) {
    detail::require_nonzero(config.num_layers, kName, "num_layers");
    detail::require_nonzero(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_nonzero(config.head_dim, kName, "head_dim");
    detail::require_int(config.num_kv_heads, kName, "num_kv_heads");
    detail::require_int(config.head_dim, kName, "head_dim");
    return {.num_layers = config.num_layers,
            .num_blocks = config.num_blocks,
            .block_size = config.block_size,
            .max_batch = config.max_batch,
            .max_seq_len = config.max_seq_len,
            .enable_prefix_caching = config.enable_prefix_caching,
            .evict_when_full = config.evict_when_full};
  }

  // append() and append() with ids (ids == nullptr: none): the manager plans (checks, takes and
  // marks blocks to copy), the rows are copied and written here, the manager finishes.
  template <class U>
  void append_rows(std::size_t layer, std::size_t seq, const token_id* ids,
                   const TokenBlock<const U>& kin, const TokenBlock<const U>& vin) {
    detail::check_layer(kName, layer, shape_.num_layers);
    detail::check_seq(kName, seq, max_batch());
    const std::size_t n = detail::check_kv_input(kName, shape_, kin, vin);
    const auto plan = manager_.begin_append(layer, seq, n, ids);
    for (const BlockCopy& c : plan.copies) {
      blocks_.copy_block(c.from, c.to,
                         [&](std::size_t l) { return manager_.block_rows(seq, l, c.index); });
    }
    blocks_.write_rows(layer, plan.table, plan.position, kin, vin);
    manager_.end_append(plan);
  }

  CacheShape shape_;
  manager_type manager_;
  HostBlocks<T> blocks_;
};

}  // namespace kvcache
