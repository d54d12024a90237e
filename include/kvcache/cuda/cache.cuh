// SPDX-License-Identifier: Apache-2.0
// DeviceCache: K/V storage in GPU memory in the layouts of the CPU policies — contiguous
// (StaticCache), ring with sinks (SlidingWindowCache) and paged (a block pool with block tables) —
// with the bookkeeping kept on the host, so every check happens before a launch. Appends scatter a
// batch of sequences' new tokens in one launch; metadata reaches the device through kernel
// parameters (no host-to-device copies, no hidden synchronisation).
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <tuple>
#include <vector>

#include "kvcache/attention/options.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/cuda/view.cuh"

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
};

/// Most sequences one append launch covers (its metadata travels as kernel parameters, which
/// CUDA 12.1+ allows up to 32 764 bytes on Volta and later); larger batches take several launches.
inline constexpr int kMaxSeqsPerLaunch = 512;
/// Bytes of kernel parameters a launch may pass (CUDA 12.1+, sm_70+), less room for the others.
inline constexpr std::size_t kMaxParamBatchBytes = 32764 - 512;

namespace detail {

struct AppendBatch {
  int num_seqs = 0;
  std::int32_t seq[kMaxSeqsPerLaunch];
  std::int64_t first_pos[kMaxSeqsPerLaunch];
  std::int32_t
      token_begin[kMaxSeqsPerLaunch + 1];  // tokens of batch entry i: [begin[i], begin[i+1])
};

struct MetaEntry {
  std::int32_t layer, seq;
  std::int64_t length, sink_end, recent_begin;
};
inline constexpr int kMaxMetaPerLaunch = 512;
struct MetaBatch {
  int count = 0;
  MetaEntry entry[kMaxMetaPerLaunch];
};

struct BlockEntry {
  std::int32_t seq, index, block;
};
inline constexpr int kMaxBlocksPerLaunch = 1024;  // also the threads of its one block
struct BlockBatch {
  int count = 0;
  BlockEntry entry[kMaxBlocksPerLaunch];
};

static_assert(sizeof(AppendBatch) <= kMaxParamBatchBytes);
static_assert(sizeof(MetaBatch) <= kMaxParamBatchBytes);
static_assert(sizeof(BlockBatch) <= kMaxParamBatchBytes);

/// Grid (tokens of the batch, KV heads): converts and writes one K row and one V row.
template <Element T, class U>
__global__ void append_kernel(DeviceKVView<T> view, T* k_out, T* v_out, const U* __restrict__ k,
                              const U* __restrict__ v, AppendBatch batch) {
  const int token = blockIdx.x, head = blockIdx.y;
  int entry = 0, hi = batch.num_seqs - 1;  // the last entry whose tokens begin at or before token
  while (entry < hi) {
    const int mid = (entry + hi + 1) / 2;
    if (batch.token_begin[mid] <= token) {
      entry = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int seq = batch.seq[entry];
  const std::int64_t pos = batch.first_pos[entry] + (token - batch.token_begin[entry]);
  const std::int64_t dst = view.row_offset(seq, head, pos);
  const std::int64_t src =
      (static_cast<std::int64_t>(token) * view.num_kv_heads + head) * view.head_dim;
  for (int d = threadIdx.x; d < view.head_dim; d += blockDim.x) {
    if constexpr (std::is_same_v<U, T>) {
      k_out[dst + d] = k[src + d];
      v_out[dst + d] = v[src + d];
    } else {
      k_out[dst + d] = from_f32<T>(k[src + d]);
      v_out[dst + d] = from_f32<T>(v[src + d]);
    }
  }
}

/// Writes (length, sink_end, recent_begin) entries into the device metadata [layer][3][batch].
__global__ void update_meta_kernel(std::int64_t* meta, int max_batch, MetaBatch batch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.count) return;
  const MetaEntry e = batch.entry[i];
  std::int64_t* m = meta + static_cast<std::int64_t>(e.layer) * 3 * max_batch;
  m[e.seq] = e.length;
  m[max_batch + e.seq] = e.sink_end;
  m[2 * max_batch + e.seq] = e.recent_begin;
}

__global__ void update_blocks_kernel(std::int32_t* table, int max_blocks, BlockBatch batch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch.count) return;
  const BlockEntry e = batch.entry[i];
  table[static_cast<std::int64_t>(e.seq) * max_blocks + e.index] = e.block;
}

}  // namespace detail

/// GPU-resident K/V for num_layers x max_batch sequences in one of three layouts. Host-side
/// bookkeeping mirrors the CPU policies (lengths, ring eviction, block tables), so appends are
/// validated before anything is launched; all device work is asynchronous on the caller's
/// stream. Not thread-safe: use one DeviceCache per stream of control.
template <Element T>
class DeviceCache {
 public:
  using value_type = T;

  /// Allocates all storage (and, for paged, the pool and the block table) and zeroes the
  /// metadata. @throws shape_error for a bad config, cuda_error.
  explicit DeviceCache(const DeviceCacheConfig& c) : config_(c) {
    detail_require(c.num_layers, "num_layers");
    detail_require(c.num_kv_heads, "num_kv_heads");
    detail_require(c.head_dim, "head_dim");
    detail_require(c.max_batch, "max_batch");
    if (c.max_batch > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
      throw shape_error("DeviceCache: max_batch too large");
    }
    switch (c.layout) {
      case Layout::contiguous:
        detail_require(c.max_seq_len, "max_seq_len");
        slots_ = c.max_seq_len;
        storage_ = DeviceBuffer<T>(kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim, slots_,
                                                  sizeof(T), c.max_batch) /
                                   sizeof(T));
        break;
      case Layout::ring:
        detail_require(c.window, "window");
        detail_require(c.max_append_len, "max_append_len");
        ring_len_ = c.window + c.max_append_len - 1;
        slots_ = c.num_sink_tokens + ring_len_;
        storage_ = DeviceBuffer<T>(kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim, slots_,
                                                  sizeof(T), c.max_batch) /
                                   sizeof(T));
        break;
      case Layout::paged:
        detail_require(c.max_seq_len, "max_seq_len");
        if (c.max_seq_len > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
          throw shape_error(kvcache::detail::message("DeviceCache: paged max_seq_len ",
                                                     c.max_seq_len, " exceeds 2^31 - 1"));
        }
        detail_require(c.block_size, "block_size");
        detail_require(c.num_blocks, "num_blocks");
        max_blocks_ = (c.max_seq_len + c.block_size - 1) / c.block_size;
        storage_ = DeviceBuffer<T>(kv_cache_bytes(c.num_layers, c.num_kv_heads, c.head_dim,
                                                  c.block_size, sizeof(T), c.num_blocks) /
                                   sizeof(T));
        block_table_ = DeviceBuffer<std::int32_t>(c.max_batch * max_blocks_);
        blocks_.resize(c.max_batch);
        for (auto& b : blocks_) b.reserve(max_blocks_);
        free_blocks_.reserve(c.num_blocks);
        for (std::size_t b = c.num_blocks; b-- > 0;)
          free_blocks_.push_back(static_cast<std::int32_t>(b));
        check(cudaMemset(block_table_.data(), 0, block_table_.bytes()), "cudaMemset(block table)");
        break;
    }
    state_.assign(c.num_layers * c.max_batch, State{0, static_cast<std::int64_t>(sinks())});
    meta_ = DeviceBuffer<std::int64_t>(c.num_layers * 3 * c.max_batch);
    // all zero: every sequence empty ([0, 0) and [0, 0) present)
    check(cudaMemset(meta_.data(), 0, meta_.bytes()), "cudaMemset(metadata)");
  }

  /// Appends counts[i] new tokens to sequence seqs[i] of `layer`, for every i, in one launch per
  /// kMaxSeqsPerLaunch sequences. k, v: device arrays [sum(counts)][num_kv_heads][head_dim] of
  /// float (rounded to T) or T, tokens grouped by sequence in the order of `seqs`.
  /// @throws layer_error, batch_error, shape_error (sizes, a sequence listed twice, zero count),
  ///         capacity_error (max_seq_len, max_append_len, pool exhausted), cuda_error. Nothing is
  ///         launched and nothing changes on throw.
  template <class U>
  requires std::same_as<U, T> || std::same_as<U, float>
  void append(std::size_t layer, std::span<const std::size_t> seqs,
              std::span<const std::size_t> counts, const U* k, const U* v, cudaStream_t stream) {
    check_layer(layer);
    if (seqs.size() != counts.size() || seqs.empty()) {
      throw shape_error(kvcache::detail::message("DeviceCache::append: ", seqs.size(),
                                                 " sequences but ", counts.size(), " counts"));
    }
    std::size_t new_blocks = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      check_seq(seqs[i]);
      for (std::size_t j = 0; j < i; ++j) {
        if (seqs[j] == seqs[i]) {
          throw shape_error(
              kvcache::detail::message("DeviceCache::append: sequence ", seqs[i], " listed twice"));
        }
      }
      const std::size_t n = counts[i];
      const State& st = state(layer, seqs[i]);
      const std::size_t len = static_cast<std::size_t>(st.length);
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
      if (config_.layout == Layout::paged) {
        const std::size_t need = (len + n + config_.block_size - 1) / config_.block_size;
        if (need > blocks_[seqs[i]].size()) new_blocks += need - blocks_[seqs[i]].size();
      }
    }
    if (new_blocks > free_blocks_.size()) {
      throw capacity_error(kvcache::detail::message("DeviceCache::append: needs ", new_blocks,
                                                    " new blocks, ", free_blocks_.size(),
                                                    " free of ", config_.num_blocks));
    }
    // validated: from here on only launches, whose failure is reported as cuda_error
    if (config_.layout == Layout::paged) grow_blocks(layer, seqs, counts, stream);
    const DeviceKVView<T> v_layer = view(layer);
    T* k_out = storage_.data() + layer_offset(layer);
    T* v_out = k_out + v_offset();
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
      detail::append_kernel<T, U>
          <<<grid, 64, 0, stream>>>(v_layer, k_out, v_out, k + src, v + src, batch);
      check_launch("kvcache::cuda::append_kernel");
    }
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

  /// The device view of `layer` for all max_batch sequences. O(max_batch) host work (for
  /// max_keys).
  [[nodiscard]] DeviceKVView<T> view(std::size_t layer) const {
    check_layer(layer);
    DeviceKVView<T> v;
    v.k = storage_.data() + layer_offset(layer);
    v.v = v.k + v_offset();
    v.num_seqs = static_cast<int>(config_.max_batch);
    v.num_kv_heads = static_cast<int>(config_.num_kv_heads);
    v.head_dim = static_cast<int>(config_.head_dim);
    v.layout = config_.layout;
    const std::int64_t d = static_cast<std::int64_t>(config_.head_dim);
    const std::int64_t h = static_cast<std::int64_t>(config_.num_kv_heads);
    if (config_.layout == Layout::paged) {
      const std::int64_t bs = static_cast<std::int64_t>(config_.block_size);
      v.head_stride = bs * d;
      v.block_stride = 2 * h * bs * d;
      v.block_table = block_table_.data();
      v.max_blocks = static_cast<int>(max_blocks_);
      v.block_size = static_cast<int>(bs);
    } else {
      v.head_stride = static_cast<std::int64_t>(slots_) * d;
      v.seq_stride = 2 * h * v.head_stride;
      v.num_sinks = static_cast<int>(config_.num_sink_tokens);
      v.ring_len = static_cast<int>(std::max<std::size_t>(ring_len_, 1));
    }
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
  [[nodiscard]] std::size_t max_batch() const noexcept { return config_.max_batch; }
  [[nodiscard]] const DeviceCacheConfig& config() const noexcept { return config_; }
  /// Device bytes of K/V storage (plus the block table for paged).
  [[nodiscard]] std::size_t memory_bytes() const noexcept {
    return storage_.bytes() + block_table_.bytes();
  }
  [[nodiscard]] std::size_t free_blocks() const noexcept { return free_blocks_.size(); }

  /// Empties `seq` in every layer (paged: its blocks return to the pool). @throws batch_error.
  void reset(std::size_t seq, cudaStream_t stream) {
    check_seq(seq);
    crop_to(seq, 0, stream);
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
    crop_to(seq, n, stream);
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

 private:
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
  [[nodiscard]] std::size_t v_offset() const noexcept {
    const std::size_t rows = config_.layout == Layout::paged ? config_.block_size : slots_;
    return config_.num_kv_heads * rows * config_.head_dim;
  }
  [[nodiscard]] std::size_t layer_offset(std::size_t layer) const noexcept {
    const std::size_t units =
        config_.layout == Layout::paged ? config_.num_blocks : config_.max_batch;
    return layer * units * 2 * v_offset();
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
    detail::update_meta_kernel<<<1, detail::kMaxMetaPerLaunch, 0, stream>>>(
        meta_.data(), static_cast<int>(config_.max_batch), meta);
    check_launch("kvcache::cuda::update_meta_kernel");
    meta.count = 0;
  }

  void grow_blocks(std::size_t layer, std::span<const std::size_t> seqs,
                   std::span<const std::size_t> counts, cudaStream_t stream) {
    detail::BlockBatch batch;
    auto flush = [&] {
      if (batch.count == 0) return;
      detail::update_blocks_kernel<<<1, detail::kMaxBlocksPerLaunch, 0, stream>>>(
          block_table_.data(), static_cast<int>(max_blocks_), batch);
      check_launch("kvcache::cuda::update_blocks_kernel");
      batch.count = 0;
    };
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      auto& list = blocks_[seqs[i]];
      const std::size_t len = static_cast<std::size_t>(state(layer, seqs[i]).length);
      const std::size_t need = (len + counts[i] + config_.block_size - 1) / config_.block_size;
      while (list.size() < need) {
        if (batch.count == detail::kMaxBlocksPerLaunch) flush();
        const std::int32_t b = free_blocks_.back();
        free_blocks_.pop_back();
        batch.entry[batch.count++] = {static_cast<std::int32_t>(seqs[i]),
                                      static_cast<std::int32_t>(list.size()), b};
        list.push_back(b);
      }
    }
    flush();
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
    if (config_.layout == Layout::paged) {
      std::int64_t longest = 0;  // blocks are shared by all layers: keep what the longest needs
      for (std::size_t l = 0; l < config_.num_layers; ++l)
        longest = std::max(longest, state(l, seq).length);
      const std::size_t keep =
          (static_cast<std::size_t>(longest) + config_.block_size - 1) / config_.block_size;
      auto& list = blocks_[seq];
      while (list.size() > keep) {
        free_blocks_.push_back(list.back());
        list.pop_back();
      }
    }
  }

  DeviceCacheConfig config_;
  std::size_t slots_ = 0;
  std::size_t ring_len_ = 0;
  std::size_t max_blocks_ = 0;
  DeviceBuffer<T> storage_;
  DeviceBuffer<std::int32_t> block_table_;
  DeviceBuffer<std::int64_t> meta_;                // [layer][length, sink_end, recent_begin][seq]
  std::vector<State> state_;                       // [layer][seq]
  std::vector<std::vector<std::int32_t>> blocks_;  // paged: block ids per sequence
  std::vector<std::int32_t> free_blocks_;
};

}  // namespace kvcache::cuda
