// SPDX-License-Identifier: Apache-2.0
// DeviceCache: K/V storage in GPU memory in the layouts of the CPU policies — contiguous
// (StaticCache), ring with sinks (SlidingWindowCache) and paged (PagedCache's BlockManager, so
// prefix caching, fork, reorder and eviction) — with the bookkeeping kept on the host, so every
// check happens before a launch. Appends scatter a batch of sequences' new tokens in one launch;
// metadata reaches the device through kernel parameters (no host-to-device copies, no hidden
// synchronisation).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/buffer.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/cuda/cache_kernels.cuh"
#include "kvcache/cuda/paged_tables.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache::cuda {

/// Construction parameters of a DeviceCache.
struct DeviceCacheConfig {
  Layout layout = Layout::contiguous;
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t max_batch = 1;
  /// contiguous: slots per sequence; paged: the most tokens one sequence may hold.
  std::size_t max_seq_len = 0;
  /// ring: as SlidingWindowCacheConfig (window >= 1, max_append_len >= 1).
  std::size_t window = 0;
  std::size_t num_sink_tokens = 0;
  std::size_t max_append_len = 1;
  /// paged: tokens per block and blocks in the pool (shared by all sequences and layers).
  std::size_t block_size = 16;
  std::size_t num_blocks = 0;
  /// paged: as PagedCacheConfig. Only sequences with token ids (admit(), append with ids) are
  /// indexed for later prompts; sequences without ids are never shared.
  bool enable_prefix_caching = true;
  bool evict_when_full = false;
};

/// GPU-resident K/V for num_layers x max_batch sequences in one of three layouts. Host-side
/// bookkeeping mirrors the CPU policies (lengths, ring eviction, block tables), so appends are
/// validated before anything is launched; all device work is asynchronous on the caller's
/// stream. Not thread-safe: use one DeviceCache per stream of control, and give every call the
/// same stream (a block one call frees, the next may write).
///
/// Paged layout: the bookkeeping is a BlockManager, the one behind PagedCache, with its rules
/// (manager/block_manager.hpp), so the same operations in the same order give the same block
/// tables. Besides append, crop and reset, a paged cache offers admit() (automatic prefix
/// caching, with a cache salt), add_tokens(), append with ids, fork(), reorder(), release(),
/// evict_cached(), stats() and the per-sequence queries (paged_queries()). An append batch's
/// copy-on-write copies go to the device in one launch; the block-table entries and lengths an
/// operation changes follow in batched launches, all on the caller's stream.
///
/// T is any storage format (KVFormat): f32, f16, bf16, or int8 / fp8 e4m3 codes with one
/// bfloat16 scale per (token, KV head) row, as the host caches keep them (core/format.hpp), or a
/// pair KVFormats<K, V> storing K in K and V in V. A quantized side takes float rows and quantizes
/// them on the device, bit for bit as the host caches do, so a device cache and a host cache fed
/// the same rows hold the same codes and scales. Its views carry the scales (k_scale, v_scale);
/// decode attention reads the codes directly (DecodeKernel::cuda_cores), prefill on tensor cores
/// as fp16 values (cuda/prefill.cuh). Storage: KVRows<T, DeviceArrays> (core/buffer.hpp), so one
/// format keeps each slab's K rows then its V rows in one allocation, a pair a K and a V
/// allocation laid out alike.
template <KVFormat T>
class DeviceCache {
 public:
  using value_type = T;

  /// Allocates all storage (and, for paged, the pool and the block table) and zeroes the
  /// metadata. @throws shape_error for a bad config, capacity_error if the storage's size
  /// overflows, cuda_error.
  explicit DeviceCache(const DeviceCacheConfig& c) : config_(c) {
    detail_require(c.num_layers, "num_layers");
    detail_require(c.num_kv_heads, "num_kv_heads");
    detail_require(c.head_dim, "head_dim");
    detail_require(c.max_batch, "max_batch");
    if (c.max_batch > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      throw shape_error("DeviceCache: max_batch too large");
    }
    std::size_t num_slabs = 0, slab_rows = 0;  // a slab: one sequence, or one block, of a layer
    switch (c.layout) {
      case Layout::contiguous:
        detail_require(c.max_seq_len, "max_seq_len");
        slots_ = c.max_seq_len;
        break;
      case Layout::ring:
        detail_require(c.window, "window");
        detail_require(c.max_append_len, "max_append_len");
        ring_len_ = c.window + c.max_append_len - 1;
        slots_ = c.num_sink_tokens + ring_len_;
        break;
      case Layout::paged:
        detail_require(c.max_seq_len, "max_seq_len");
        if (c.max_seq_len > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
          throw shape_error(kvcache::detail::message("DeviceCache: paged max_seq_len ",
                                                     c.max_seq_len, " exceeds 2^31 - 1"));
        }
        detail_require(c.block_size, "block_size");
        detail_require(c.num_blocks, "num_blocks");
        if (c.num_blocks > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
          throw shape_error(kvcache::detail::message("DeviceCache: num_blocks ", c.num_blocks,
                                                     " exceeds 2^31 - 1 (CSR page ids are int32)"));
        }
        paged_.emplace(BlockManagerConfig{.num_layers = c.num_layers,
                                          .num_blocks = c.num_blocks,
                                          .block_size = c.block_size,
                                          .max_batch = c.max_batch,
                                          .max_seq_len = c.max_seq_len,
                                          .enable_prefix_caching = c.enable_prefix_caching,
                                          .evict_when_full = c.evict_when_full});
        break;
    }
    if (paged_) {
      num_slabs = kvcache::detail::checked_mul(c.num_layers, c.num_blocks, "DeviceCache");
      slab_rows = kvcache::detail::checked_mul(c.num_kv_heads, c.block_size, "DeviceCache");
    } else {
      num_slabs = kvcache::detail::checked_mul(c.num_layers, c.max_batch, "DeviceCache");
      slab_rows = kvcache::detail::checked_mul(c.num_kv_heads, slots_, "DeviceCache");
    }
    storage_ = KVRows<T, DeviceArrays>(num_slabs, slab_rows, c.head_dim);
    state_.assign(c.num_layers * c.max_batch, State{0, static_cast<std::int64_t>(sinks())});
    meta_ = DeviceBuffer<std::int64_t>(c.num_layers * 3 * c.max_batch);
    // all zero: every sequence empty ([0, 0) and [0, 0) present)
    check(cudaMemset(meta_.data(), 0, meta_.bytes()), "cudaMemset(metadata)");
  }

  /// Appends counts[i] new tokens to sequence seqs[i] of `layer`, for every i, in one launch per
  /// kMaxSeqsPerLaunch sequences. k, v: device arrays [sum(counts)][num_kv_heads][head_dim] of
  /// float (rounded to T; quantized per row for int8 and fp8; a pair: k to K's format, v to V's)
  /// or, for f32/f16/bf16 caches, T, tokens grouped by sequence in the order of `seqs`. Paged:
  /// the whole batch takes its blocks at once (the shared or indexed ones it writes into are
  /// copied first, one launch per array of the storage), or none.
  /// @throws layer_error, batch_error, shape_error (sizes, a sequence listed twice, zero count),
  ///         capacity_error (max_seq_len, max_append_len), pool_exhausted_error (paged: names
  ///         blocks needed, free and evictable), position_error (paged: a sequence with ids, past
  ///         them), cuda_error. Nothing is launched and nothing changes on throw.
  template <AppendRows<T> U>
  void append(std::size_t layer, std::span<const std::size_t> seqs,
              std::span<const std::size_t> counts, const U* k, const U* v, cudaStream_t stream) {
    append_rows(layer, seqs, counts, nullptr, k, v, stream);
  }

  /// append() of tokens with their ids (paged layout only): `ids` (host memory) holds
  /// sum(counts) ids grouped like the rows. As PagedCache::append with ids, per sequence: ids at
  /// registered positions must equal those, the others are registered, and the blocks this
  /// completes are indexed for later prompts.
  /// @throws as append(); shape_error (ids.size() != sum(counts), or not paged), position_error
  ///         (an id differs from the registered one; a sequence holding K/V without ids).
  template <AppendRows<T> U>
  void append(std::size_t layer, std::span<const std::size_t> seqs,
              std::span<const std::size_t> counts, std::span<const token_id> ids, const U* k,
              const U* v, cudaStream_t stream) {
    require_paged("append with ids");
    std::size_t total = 0;
    for (std::size_t n : counts) total += n;
    if (ids.size() != total) {
      throw shape_error(kvcache::detail::message("DeviceCache::append: ", ids.size(),
                                                 " token ids for ", total, " tokens"));
    }
    append_rows(layer, seqs, counts, ids.data(), k, v, stream);
  }

  /// The device view of `layer` for all max_batch sequences. O(max_batch) host work (for
  /// max_keys).
  [[nodiscard]] DeviceKVView<T> view(std::size_t layer) const {
    check_layer(layer);
    const KVBases<T> at = storage_.bases(layer_offset(layer));
    const auto heads = static_cast<int>(config_.num_kv_heads);
    const auto dim = static_cast<int>(config_.head_dim);
    DeviceKVView<T> v =
        config_.layout == Layout::paged
            ? paged_layout(at, heads, dim, static_cast<int>(config_.block_size),
                           paged_->device_table(), static_cast<int>(config_.max_batch),
                           static_cast<int>(paged_->max_blocks()))
            : slab_layout(at, static_cast<int>(config_.max_batch), heads, dim,
                          static_cast<std::int64_t>(slots_),
                          static_cast<int>(config_.num_sink_tokens),
                          config_.layout == Layout::ring ? static_cast<int>(ring_len_) : 0);
    const std::int64_t* m = meta_.data() + layer * 3 * config_.max_batch;
    v.length = m;
    v.sink_end = m + config_.max_batch;
    v.recent_begin = m + 2 * config_.max_batch;
    v.max_keys = max_view_tokens(layer);
    return v;
  }

  /// Largest number of keys any sequence's view holds in `layer` (DeviceKVView::max_keys).
  [[nodiscard]] std::int64_t max_view_tokens(std::size_t layer) const {
    check_layer(layer);
    std::int64_t most = 0;
    for (std::size_t s = 0; s < config_.max_batch; ++s) {
      const auto [se, rb, len] = present(state(layer, s));
      most = std::max(most, se + (len - rb));
    }
    return most;
  }

  [[nodiscard]] std::size_t layer_length(std::size_t layer, std::size_t seq) const {
    check_layer(layer);
    check_seq(seq);
    return static_cast<std::size_t>(state(layer, seq).length);
  }
  [[nodiscard]] std::size_t seq_length(std::size_t seq) const { return layer_length(0, seq); }
  /// The positions `layer` of `seq` holds, [0, sink_end) and [recent_begin, length) (a ring that
  /// has evicted leaves a gap; other layouts hold every position). @throws layer_error,
  /// batch_error.
  [[nodiscard]] KeyRange keys(std::size_t layer, std::size_t seq) const {
    check_layer(layer);
    check_seq(seq);
    const auto [se, rb, len] = present(state(layer, seq));
    return {se, rb, len};
  }
  [[nodiscard]] std::size_t max_batch() const noexcept { return config_.max_batch; }
  [[nodiscard]] const DeviceCacheConfig& config() const noexcept { return config_; }
  /// Device bytes of K/V storage, a quantized side's scales included (plus the block table for
  /// paged).
  [[nodiscard]] std::size_t memory_bytes() const noexcept {
    return storage_.bytes() + (paged_ ? paged_->device_bytes() : 0);
  }
  /// Paged: blocks in the pool that are free (neither held nor cached); 0 for other layouts.
  [[nodiscard]] std::size_t free_blocks() const {
    return paged_ ? paged_->manager().stats().blocks_free : 0;
  }

  /// Empties `seq` in every layer (paged: release(): its blocks lose a holder, indexed ones stay
  /// cached for later prompts). @throws batch_error.
  void reset(std::size_t seq, cudaStream_t stream) {
    check_seq(seq);
    if (paged_) {
      release(seq, stream);
    } else {
      crop_to(seq, 0, stream);
    }
  }

  /// Rolls `seq` back to n tokens in every layer. @throws batch_error, position_error when
  /// n > seq_length or (ring) the window needed at n was evicted; unchanged on throw.
  void crop(std::size_t seq, std::size_t n, cudaStream_t stream) {
    check_seq(seq);
    const std::int64_t target = static_cast<std::int64_t>(n);
    if (target > state(0, seq).length) {
      throw position_error(kvcache::detail::message("DeviceCache::crop: sequence ", seq, " to ", n,
                                                    " tokens, but it holds only ",
                                                    state(0, seq).length));
    }
    if (config_.layout == Layout::ring && n > config_.num_sink_tokens) {
      const std::int64_t need =
          std::max<std::int64_t>(static_cast<std::int64_t>(config_.num_sink_tokens),
                                 target - static_cast<std::int64_t>(config_.window) + 1);
      for (std::size_t l = 0; l < config_.num_layers; ++l) {
        const State& st = state(l, seq);
        if (st.length > target && st.ring_begin > need) {
          throw position_error(kvcache::detail::message(
              "DeviceCache::crop: sequence ", seq, " to ", n, " tokens needs positions from ", need,
              " but layer ", l, " evicted everything before ", st.ring_begin));
        }
      }
    }
    if (paged_) {
      paged_->manager().crop(seq, n);
      sync_sequence(seq, stream);
    } else {
      crop_to(seq, n, stream);
    }
  }

  /// The position checks kvcache::attend makes on the CPU, on the host-side state: the last
  /// q_lens[s] positions of each sequence s, as queries, must find every key their mask allows
  /// (q_lens[s] == 0 skips s). @throws shape_error, position_error.
  void check_attention(std::size_t layer, std::span<const std::size_t> q_lens,
                       const AttentionOptions& opts) const {
    check_layer(layer);
    if (q_lens.size() != config_.max_batch) {
      throw shape_error(kvcache::detail::message("DeviceCache::check_attention: ", q_lens.size(),
                                                 " query counts for ", config_.max_batch,
                                                 " sequences"));
    }
    kvcache::detail::check_options(opts);
    for (std::size_t s = 0; s < q_lens.size(); ++s) {
      if (q_lens[s] == 0) continue;
      const auto [se, rb, len] = present(state(layer, s));
      kvcache::detail::check_query_positions(static_cast<position_t>(q_lens[s]), std::nullopt, len,
                                             se, rb, opts);
    }
  }

  // ---- Paged layout: prefix caching, fork, reorder, eviction (BlockManager) ----------------

  /// PagedCache::admit() on the device: starts the empty sequence `seq` with `prompt`, sharing
  /// the blocks of its longest prefix cached under `extra_key`; returns the tokens every layer
  /// now holds (the caller appends K/V for prompt[m..]). @throws shape_error (not paged), and as
  /// PagedCache::admit(); unchanged on throw.
  [[nodiscard]] std::size_t admit(std::size_t seq, std::span<const token_id> prompt,
                                  std::uint64_t extra_key, cudaStream_t stream) {
    require_paged("admit");
    const std::size_t m = paged_->manager().admit(seq, prompt, extra_key);
    sync_sequence(seq, stream);
    return m;
  }
  /// PagedCache::add_tokens(): registers ids ahead of their K/V, indexing what they complete.
  void add_tokens(std::size_t seq, std::span<const token_id> ids, cudaStream_t stream) {
    require_paged("add_tokens");
    paged_->manager().add_tokens(seq, ids);
    sync_sequence(seq, stream);
  }
  /// PagedCache::fork(): dst becomes a copy of src sharing its blocks (nothing is copied until
  /// one of them writes into a shared block).
  void fork(std::size_t src, std::size_t dst, cudaStream_t stream) {
    require_paged("fork");
    paged_->manager().fork(src, dst);
    sync_sequence(dst, stream);
  }
  /// PagedCache::reorder(): beam reordering on block tables. Allocates (host) a snapshot.
  void reorder(std::span<const std::size_t> dst, std::span<const std::size_t> src,
               cudaStream_t stream) {
    require_paged("reorder");
    paged_->manager().reorder(dst, src);
    for (std::size_t d : dst) sync_sequence(d, stream);
  }
  /// PagedCache::release(): empties seq; its indexed blocks stay cached for later prompts.
  void release(std::size_t seq, cudaStream_t stream) {
    require_paged("release");
    paged_->manager().release(seq);
    sync_sequence(seq, stream);
  }
  /// PagedCache::evict_cached(): evicts up to max_blocks cached blocks (no device work).
  std::size_t evict_cached(std::size_t max_blocks) {
    require_paged("evict_cached");
    return paged_->manager().evict_cached(max_blocks);
  }
  /// PagedCache::match_prefix(): leading tokens of ids cached under extra_key. Changes nothing.
  [[nodiscard]] std::size_t match_prefix(std::span<const token_id> ids,
                                         std::uint64_t extra_key = 0) const {
    require_paged("match_prefix");
    return paged_->manager().match_prefix(ids, extra_key);
  }
  /// The bookkeeping of the paged layout, for its queries: tokens(), block_table(), stats(),
  /// extra_key(), exact_prefix(), ref_count(), check_consistency(). @throws shape_error (not
  /// paged).
  [[nodiscard]] const BlockManager<>& paged() const {
    require_paged("paged");
    return paged_->manager();
  }
  /// The host caches' restore() on the device, every layout (cuda/cache_restore.cuh).
  void restore(std::span<const LayerRestore<T>> entries, std::span<const SequenceTokens> tokens,
               cudaStream_t stream);
  /// The rows of `layer` of `seq` in host memory, packed, with their scales: k_scale (v_scale)
  /// [num_kv_heads][held] for a quantized K (V) side, empty otherwise (cuda/cache_restore.cuh).
  void read_rows(std::size_t layer, std::size_t seq, std::span<key_format_t<T>> k,
                 std::span<value_format_t<T>> v, std::span<scale_type> k_scale,
                 std::span<scale_type> v_scale, cudaStream_t stream) const;
  /// read_rows() of an f32/f16/bf16 cache, whose rows have no scales.
  void read_rows(std::size_t layer, std::size_t seq, std::span<T> k, std::span<T> v,
                 cudaStream_t stream) const requires Element<T> {
    read_rows(layer, seq, k, v, {}, {}, stream);
  }

  /// "" or a description of the first difference between the device's block table and lengths
  /// and the bookkeeping's (downloads them: synchronises), else the manager's
  /// check_consistency(). For tests.
  [[nodiscard]] std::string check_device_mirror(cudaStream_t stream) const {
    require_paged("check_device_mirror");
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (std::string table = paged_->check_device(); !table.empty()) return table;
    std::vector<std::int64_t> meta(meta_.size());
    check(cudaMemcpy(meta.data(), meta_.data(), meta_.bytes(), cudaMemcpyDeviceToHost),
          "download metadata");
    for (std::size_t q = 0; q < config_.max_batch; ++q) {
      for (std::size_t l = 0; l < config_.num_layers; ++l) {
        const auto len = static_cast<std::int64_t>(paged_->manager().layer_length(l, q));
        if (meta[l * 3 * config_.max_batch + q] != len) {
          return kvcache::detail::message("sequence ", q, " layer ", l, " holds ", len,
                                          " positions but the device says ",
                                          meta[l * 3 * config_.max_batch + q]);
        }
      }
    }
    return paged_->manager().check_consistency();
  }

 private:
  template <class U>
  void append_rows(std::size_t layer, std::span<const std::size_t> seqs,
                   std::span<const std::size_t> counts, const token_id* ids, const U* k, const U* v,
                   cudaStream_t stream) {
    check_layer(layer);
    if (seqs.size() != counts.size() || seqs.empty()) {
      throw shape_error(kvcache::detail::message("DeviceCache::append: ", seqs.size(),
                                                 " sequences but ", counts.size(), " counts"));
    }
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      check_seq(seqs[i]);
      for (std::size_t j = 0; j < i; ++j) {
        if (seqs[j] == seqs[i]) {
          throw shape_error(
              kvcache::detail::message("DeviceCache::append: sequence ", seqs[i], " listed twice"));
        }
      }
      const std::size_t n = counts[i];
      const std::size_t len = static_cast<std::size_t>(state(layer, seqs[i]).length);
      if (n == 0) throw shape_error("DeviceCache::append: zero-length append");
      if (config_.layout == Layout::ring && n > config_.max_append_len) {
        throw capacity_error(
            kvcache::detail::message("DeviceCache::append: ", n, " tokens to sequence ", seqs[i],
                                     " exceed max_append_len ", config_.max_append_len));
      }
      if (config_.layout != Layout::ring && n > config_.max_seq_len - len) {
        throw capacity_error(kvcache::detail::message(
            "DeviceCache::append: ", n, " tokens to sequence ", seqs[i], " layer ", layer,
            " exceed max_seq_len ", config_.max_seq_len, " (holds ", len, ")"));
      }
    }
    // paged: the manager checks the ids and takes the blocks (or throws, changing nothing),
    // the copy-on-write copies and new table entries go out
    std::span<const BlockManager<>::AppendPlan> plans;
    if (paged_) {
      plans = paged_->begin_append(layer, seqs, counts, ids, storage_, stream);
    }
    // validated: from here on only launches, whose failure is reported as cuda_error
    const DeviceKVView<T> v_layer = view(layer);
    const std::size_t at = layer_offset(layer);
    key_format_t<T>* k_out = storage_.k(at);
    value_format_t<T>* v_out = storage_.v(at);
    scale_type* ks_out = storage_.k_scale(at);
    scale_type* vs_out = storage_.v_scale(at);
    std::size_t token = 0;
    for (std::size_t i0 = 0; i0 < seqs.size(); i0 += kMaxSeqsPerLaunch) {
      detail::AppendBatch batch;
      batch.num_seqs = static_cast<int>(std::min<std::size_t>(kMaxSeqsPerLaunch, seqs.size() - i0));
      const std::size_t token0 = token;
      batch.token_begin[0] = 0;
      for (int i = 0; i < batch.num_seqs; ++i) {
        batch.seq[i] = static_cast<std::int32_t>(seqs[i0 + i]);
        batch.first_pos[i] = state(layer, seqs[i0 + i]).length;
        token += counts[i0 + i];
        batch.token_begin[i + 1] = static_cast<std::int32_t>(token - token0);
      }
      const dim3 grid(static_cast<unsigned>(token - token0),
                      static_cast<unsigned>(config_.num_kv_heads));
      const std::size_t src = token0 * config_.num_kv_heads * config_.head_dim;
      detail::append_kernel<T, U><<<grid, detail::kAppendThreads<T>, 0, stream>>>(
          v_layer, k_out, v_out, ks_out, vs_out, k + src, v + src, batch);
      check_launch("kvcache::cuda::append_kernel");
    }
    if (paged_) paged_->end_append(plans, stream);
    detail::MetaBatch meta;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      State& st = state(layer, seqs[i]);
      st.length += static_cast<std::int64_t>(counts[i]);
      if (config_.layout == Layout::ring) {
        st.ring_begin = std::max(st.ring_begin, st.length - static_cast<std::int64_t>(ring_len_));
      }
      push_meta(meta, layer, seqs[i], stream);
    }
    flush_meta(meta, stream);
  }

  void require_paged(const char* op) const {
    if (config_.layout != Layout::paged) {
      throw shape_error(kvcache::detail::message("DeviceCache::", op,
                                                 ": only the paged layout has token ids and "
                                                 "shared blocks"));
    }
  }

  // After an operation on the whole of seq: its table entries and every layer's length.
  void sync_sequence(std::size_t seq, cudaStream_t stream) {
    paged_->sync(seq, 0, stream);
    detail::MetaBatch meta;
    for (std::size_t l = 0; l < config_.num_layers; ++l) {
      State& st = state(l, seq);
      const auto len = static_cast<std::int64_t>(paged_->manager().layer_length(l, seq));
      if (st.length == len) continue;
      st.length = len;
      push_meta(meta, l, seq, stream);
    }
    flush_meta(meta, stream);
  }

  struct State {
    std::int64_t length;
    std::int64_t ring_begin;  // ring: oldest ring position still held (>= num_sinks)
  };

  static void detail_require(std::size_t v, const char* field) {
    kvcache::detail::require_nonzero(v, "DeviceCache", field);
  }
  void check_layer(std::size_t layer) const {
    if (layer >= config_.num_layers) {
      throw layer_error(kvcache::detail::message(
          "DeviceCache: layer ", layer, " out of range (num_layers ", config_.num_layers, ")"));
    }
  }
  void check_seq(std::size_t seq) const {
    if (seq >= config_.max_batch) {
      throw batch_error(kvcache::detail::message(
          "DeviceCache: sequence ", seq, " out of range (max_batch ", config_.max_batch, ")"));
    }
  }
  [[nodiscard]] std::size_t sinks() const noexcept {
    return config_.layout == Layout::ring ? config_.num_sink_tokens : 0;
  }
  [[nodiscard]] State& state(std::size_t layer, std::size_t seq) {
    return state_[layer * config_.max_batch + seq];
  }
  [[nodiscard]] const State& state(std::size_t layer, std::size_t seq) const {
    return state_[layer * config_.max_batch + seq];
  }
  /// Element offset (each side) of `layer`'s first slab in the storage.
  [[nodiscard]] std::size_t layer_offset(std::size_t layer) const noexcept {
    const std::size_t units =
        config_.layout == Layout::paged ? config_.num_blocks : config_.max_batch;
    return layer * units * storage_.slab_stride();
  }

  /// (sink_end, recent_begin, length) of a sequence's present positions.
  [[nodiscard]] std::tuple<std::int64_t, std::int64_t, std::int64_t> present(
      const State& st) const {
    if (config_.layout != Layout::ring) return {0, 0, st.length};
    const std::int64_t s = static_cast<std::int64_t>(config_.num_sink_tokens);
    const std::int64_t se = std::min(st.length, s);
    return {se, st.length <= s ? st.length : st.ring_begin, st.length};
  }

  void push_meta(detail::MetaBatch& meta, std::size_t layer, std::size_t seq, cudaStream_t stream) {
    if (meta.count == detail::kMaxMetaPerLaunch) flush_meta(meta, stream);
    const auto [se, rb, len] = present(state(layer, seq));
    meta.entry[meta.count++] = {static_cast<std::int32_t>(layer), static_cast<std::int32_t>(seq),
                                len, se, rb};
  }
  void flush_meta(detail::MetaBatch& meta, cudaStream_t stream) {
    if (meta.count == 0) return;
    detail::update_meta_kernel<><<<1, detail::entry_threads(meta.count), 0, stream>>>(
        meta_.data(), static_cast<int>(config_.max_batch), meta);
    check_launch("kvcache::cuda::update_meta_kernel");
    meta.count = 0;
  }

  void crop_to(std::size_t seq, std::size_t n, cudaStream_t stream) {
    detail::MetaBatch meta;
    for (std::size_t l = 0; l < config_.num_layers; ++l) {
      State& st = state(l, seq);
      if (st.length <= static_cast<std::int64_t>(n)) continue;
      st.length = static_cast<std::int64_t>(n);
      if (n <= config_.num_sink_tokens)
        st.ring_begin = static_cast<std::int64_t>(config_.num_sink_tokens);
      push_meta(meta, l, seq, stream);
    }
    flush_meta(meta, stream);
  }

  DeviceCacheConfig config_;
  std::size_t slots_ = 0;
  std::size_t ring_len_ = 0;
  KVRows<T, DeviceArrays> storage_;   // a slab per (layer, sequence) or (layer, block)
  DeviceBuffer<std::int64_t> meta_;   // [layer][length, sink_end, recent_begin][seq]
  std::vector<State> state_;          // [layer][seq]: what meta_ holds
  std::optional<PagedTables> paged_;  // paged: the bookkeeping and the device block table
};

}  // namespace kvcache::cuda

#include "kvcache/cuda/cache_restore.cuh"  // IWYU pragma: export
