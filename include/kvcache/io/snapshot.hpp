// SPDX-License-Identifier: Apache-2.0
// Cache snapshots on disk: save_snapshot() writes any policy's sequences atomically;
// load_snapshot() validates the whole file, then restores it into a cache of the same shape and
// model, or throws and changes nothing. The format is documented in io/snapshot_format.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/io/crc32c.hpp"
#include "kvcache/io/error.hpp"
#include "kvcache/io/file.hpp"
#include "kvcache/io/model_id.hpp"
#include "kvcache/io/snapshot_format.hpp"
#include "kvcache/policy/dynamic_cache.hpp"
#include "kvcache/policy/paged_cache.hpp"
#include "kvcache/policy/sliding_window_cache.hpp"
#include "kvcache/policy/static_cache.hpp"
#include "kvcache/policy/token_tracked_cache.hpp"

namespace kvcache {

/// How a policy is written to and restored from a snapshot. Specialized below for each policy
/// (and TokenTrackedCache over any of the unpaged ones); a new policy adds its own. Members:
/// kPolicy, kTracksTokens, params(c), check_compatible(c, parsed, name) (policy parameters the
/// destination must share), capacity_misfit(c, state) ("" when the layer state fits, else why
/// not), restore(c, entries, tokens), and tokens(c, seq) when kTracksTokens.
template <class C>
struct SnapshotTraits;

namespace detail {

/// capacity_misfit() of the policies that hold every position: "" when the layer's length fits
/// max_seq_len `capacity`, else why not.
[[nodiscard]] inline std::string length_misfit(std::size_t capacity,
                                               const snapshot_format::LayerState& st) {
  if (static_cast<std::uint64_t>(st.length) <= capacity) return {};
  return message("holds ", st.length, " positions, more than the destination's max_seq_len ",
                 capacity);
}

}  // namespace detail

/// A cache that save_snapshot() and load_snapshot() accept.
template <class C>
concept SnapshotCache = CacheConcept<C> && requires {
  { SnapshotTraits<C>::kPolicy } -> std::convertible_to<SnapshotPolicy>;
  { SnapshotTraits<C>::kTracksTokens } -> std::convertible_to<bool>;
};

template <KVFormat T>
struct SnapshotTraits<StaticCache<T>> {
  using cache_type = StaticCache<T>;
  static constexpr SnapshotPolicy kPolicy = SnapshotPolicy::static_cache;
  static constexpr bool kTracksTokens = false;
  [[nodiscard]] static SnapshotParams params(const cache_type& c) noexcept {
    return {.max_batch = c.max_batch(), .max_seq_len = c.capacity()};
  }
  static void check_compatible(const cache_type&, const snapshot_format::Parsed&,
                               const std::string&) noexcept {}
  [[nodiscard]] static std::string capacity_misfit(const cache_type& c,
                                                   const snapshot_format::LayerState& st) {
    return detail::length_misfit(c.capacity(), st);
  }
  static void restore(cache_type& c, std::span<const LayerRestore<T>> entries,
                      std::span<const SequenceTokens>) {
    c.restore(entries);
  }
};

template <KVFormat T>
struct SnapshotTraits<DynamicCache<T>> {
  using cache_type = DynamicCache<T>;
  static constexpr SnapshotPolicy kPolicy = SnapshotPolicy::dynamic_cache;
  static constexpr bool kTracksTokens = false;
  [[nodiscard]] static SnapshotParams params(const cache_type& c) noexcept {
    const std::size_t cap = c.capacity();
    return {.max_batch = c.max_batch(),
            .max_seq_len = cap == std::numeric_limits<std::size_t>::max() ? 0 : cap,
            .chunk_len = c.chunk_len()};
  }
  static void check_compatible(const cache_type&, const snapshot_format::Parsed&,
                               const std::string&) noexcept {}
  [[nodiscard]] static std::string capacity_misfit(const cache_type& c,
                                                   const snapshot_format::LayerState& st) {
    return detail::length_misfit(c.capacity(), st);
  }
  static void restore(cache_type& c, std::span<const LayerRestore<T>> entries,
                      std::span<const SequenceTokens>) {
    c.restore(entries);
  }
};

template <KVFormat T>
struct SnapshotTraits<SlidingWindowCache<T>> {
  using cache_type = SlidingWindowCache<T>;
  static constexpr SnapshotPolicy kPolicy = SnapshotPolicy::sliding_window;
  static constexpr bool kTracksTokens = false;
  [[nodiscard]] static SnapshotParams params(const cache_type& c) noexcept {
    return {.max_batch = c.max_batch(),
            .window = c.window(),
            .num_sink_tokens = c.num_sink_tokens(),
            .max_append_len = c.max_append_len()};
  }
  /// The window and the sinks define what attention sees: they must match. max_append_len may
  /// differ (it only sizes the ring; capacity_misfit checks each layer against it).
  static void check_compatible(const cache_type& c, const snapshot_format::Parsed& p,
                               const std::string& name) {
    using snapshot_format::detail::fail;
    if (p.params.window != c.window()) {
      fail<snapshot_mismatch_error>(name, p.meta_offset + snapshot_format::kMetaWindow, "window ",
                                    p.params.window, " differs from the destination's ",
                                    c.window());
    }
    if (p.params.num_sink_tokens != c.num_sink_tokens()) {
      fail<snapshot_mismatch_error>(name, p.meta_offset + snapshot_format::kMetaNumSinks,
                                    "num_sink_tokens ", p.params.num_sink_tokens,
                                    " differs from the destination's ", c.num_sink_tokens());
    }
  }
  [[nodiscard]] static std::string capacity_misfit(const cache_type& c,
                                                   const snapshot_format::LayerState& st) {
    if (st.length <= static_cast<position_t>(c.num_sink_tokens()) ||
        static_cast<std::uint64_t>(st.length - st.recent_begin) <= c.ring_len()) {
      return {};
    }
    return detail::message("holds ", st.length - st.recent_begin,
                           " ring positions, more than the destination's ring_len ", c.ring_len(),
                           " (max_append_len ", c.max_append_len(), ")");
  }
  static void restore(cache_type& c, std::span<const LayerRestore<T>> entries,
                      std::span<const SequenceTokens>) {
    c.restore(entries);
  }
};

/// A PagedCache snapshot: each saved sequence's positions and token ids (always present: the
/// cache tracks ids itself), not its block layout. Loading takes fresh blocks from the
/// destination's pool, copies the rows in and indexes the full blocks in its prefix index
/// (PagedCache::restore), so a loaded prompt serves prefix-cache hits once released.
template <KVFormat T, BlockHasher H>
struct SnapshotTraits<PagedCache<T, H>> {
  using cache_type = PagedCache<T, H>;
  static constexpr SnapshotPolicy kPolicy = SnapshotPolicy::paged_cache;
  static constexpr bool kTracksTokens = true;
  [[nodiscard]] static SnapshotParams params(const cache_type& c) noexcept {
    return {.max_batch = c.max_batch(), .max_seq_len = c.capacity(), .block_len = c.block_size()};
  }
  /// Nothing beyond the shape: block_size may differ between the saved cache and the
  /// destination, because K/V rows are copied position by position into the destination's own
  /// blocks (block_len only says how the saved cache grouped them). The destination's
  /// max_seq_len is checked per sequence (capacity_misfit, and the ids against capacity()), its
  /// pool by restore() (pool_exhausted_error), and hashers never meet: the prefix index is
  /// rebuilt from the ids, not read from the file.
  static void check_compatible(const cache_type&, const snapshot_format::Parsed&,
                               const std::string&) noexcept {}
  [[nodiscard]] static std::string capacity_misfit(const cache_type& c,
                                                   const snapshot_format::LayerState& st) {
    return detail::length_misfit(c.capacity(), st);
  }
  static void restore(cache_type& c, std::span<const LayerRestore<T>> entries,
                      std::span<const SequenceTokens> tokens) {
    c.restore(entries, tokens);
  }
  [[nodiscard]] static std::span<const token_id> tokens(const cache_type& c, std::size_t seq) {
    return c.tokens(seq);
  }
};

/// A TokenTrackedCache is its policy plus the token ids of each sequence.
template <class C>
struct SnapshotTraits<TokenTrackedCache<C>> {
  using cache_type = TokenTrackedCache<C>;
  using inner = SnapshotTraits<C>;
  static constexpr SnapshotPolicy kPolicy = inner::kPolicy;
  static constexpr bool kTracksTokens = true;
  [[nodiscard]] static SnapshotParams params(const cache_type& c) noexcept {
    return inner::params(c.cache());
  }
  static void check_compatible(const cache_type& c, const snapshot_format::Parsed& p,
                               const std::string& name) {
    inner::check_compatible(c.cache(), p, name);
  }
  [[nodiscard]] static std::string capacity_misfit(const cache_type& c,
                                                   const snapshot_format::LayerState& st) {
    return inner::capacity_misfit(c.cache(), st);
  }
  static void restore(cache_type& c, std::span<const LayerRestore<typename C::value_type>> entries,
                      std::span<const SequenceTokens> tokens) {
    c.restore(entries, tokens);
  }
  [[nodiscard]] static std::span<const token_id> tokens(const cache_type& c, std::size_t seq) {
    return c.tokens(seq);
  }
};

/// Deliberately not defined: a PagedCache tracks its ids itself; wrapped in a TokenTrackedCache
/// they would be tracked twice. Snapshot the PagedCache itself (SnapshotCache is false here).
template <KVFormat T, BlockHasher H>
struct SnapshotTraits<TokenTrackedCache<PagedCache<T, H>>>;

/// Options of save_snapshot().
struct SaveOptions {
  /// fsync the file before the rename and the directory after it, so that the new snapshot
  /// survives a power loss. Atomicity against a killed process holds either way.
  bool durable = true;
  /// Remove temporaries of earlier saves to the same target whose process died mid-save
  /// (see remove_stale_temp_files()).
  bool remove_stale_temps = true;
};

/// How load_snapshot() reads the file.
enum class LoadMethod {
  /// mmap files of at least LoadOptions::mmap_threshold bytes, read() smaller ones.
  automatic,
  /// Map the file (MAP_POPULATE): the bytes are checksummed in the page cache and copied
  /// straight from it into the cache's storage; nothing is staged.
  mmap,
  /// read() the whole file into one buffer first (one more copy; works for any file).
  read,
};

/// Options of load_snapshot().
struct LoadOptions {
  /// Where the i-th saved sequence goes (dest_seqs.size() == number of saved sequences, each
  /// index unique and below max_batch); empty: each to the index it was saved from.
  std::span<const std::size_t> dest_seqs = {};
  LoadMethod method = LoadMethod::automatic;
  std::size_t mmap_threshold = std::size_t{1} << 20;
};

/// One saved sequence, as read_snapshot_info() or load_snapshot() report it.
struct SnapshotSequenceInfo {
  /// Index of the sequence in the cache it was saved from.
  std::size_t seq = 0;
  /// Positions appended to its layer 0 (its seq_length).
  std::size_t length = 0;
  /// Positions appended to its longest layer (what a paged cache needs blocks for).
  std::size_t longest = 0;
  /// The token ids (TokenTrackedCache snapshots: the committed ones; PagedCache snapshots: the
  /// registered ones, which may run ahead of length; empty otherwise).
  std::vector<token_id> token_ids;
};

/// What a snapshot holds, without its K/V.
struct SnapshotInfo {
  SnapshotPolicy policy{};
  CacheShape shape;
  SnapshotParams params;
  ModelId model_id;
  bool has_token_ids = false;
  std::uint64_t file_bytes = 0;
  std::vector<SnapshotSequenceInfo> sequences;
};

namespace detail {

/// memcpy that accepts empty ranges with null pointers.
inline void copy_bytes(void* dst, const void* src, std::size_t n) noexcept {
  if (n != 0) std::memcpy(dst, src, n);
}

/// Receives the bytes of a snapshot in order (put) and the header and table last (put_at).
template <class S>
concept SnapshotSink = requires(S& s, std::span<const std::byte> b, std::uint64_t off) {
  s.put(b);
  s.put_at(b, off);
};

/// Buffers small writes into 1 MiB blocks and passes large ones straight from the cache's
/// storage to write(2).
class FileSink {
 public:
  explicit FileSink(AtomicFileWriter& file) : file_(file), buffer_(kBufferBytes) {}
  void put(std::span<const std::byte> b) {
    if (b.size() >= kDirectBytes) {
      flush();
      file_.write(b);
      return;
    }
    if (b.size() > kBufferBytes - used_) flush();
    copy_bytes(buffer_.data() + used_, b.data(), b.size());
    used_ += b.size();
  }
  void put_at(std::span<const std::byte> b, std::uint64_t offset) {
    flush();
    file_.write_at(b, offset);
  }
  void flush() {
    if (used_ != 0) file_.write(std::span<const std::byte>(buffer_.data(), used_));
    used_ = 0;
  }

 private:
  static constexpr std::size_t kBufferBytes = std::size_t{1} << 20;
  static constexpr std::size_t kDirectBytes = std::size_t{256} << 10;
  AtomicFileWriter& file_;
  std::vector<std::byte> buffer_;
  std::size_t used_ = 0;
};

/// Fills a preallocated byte vector.
class MemorySink {
 public:
  explicit MemorySink(std::vector<std::byte>& out) : out_(out) {}
  void put(std::span<const std::byte> b) {
    copy_bytes(out_.data() + used_, b.data(), b.size());
    used_ += b.size();
  }
  void put_at(std::span<const std::byte> b, std::uint64_t offset) {
    copy_bytes(out_.data() + offset, b.data(), b.size());
  }

 private:
  std::vector<std::byte>& out_;
  std::size_t used_ = 0;
};

template <class T>
[[nodiscard]] std::span<const std::byte> as_bytes_of(const T* p, std::size_t n) noexcept {
  return {reinterpret_cast<const std::byte*>(p), n * sizeof(T)};
}

/// What save writes, decided (and validated) before the file is created.
template <class C>
struct SavePlan {
  struct Seq {
    std::size_t seq;
    std::vector<snapshot_format::LayerState> layers;
    std::span<const token_id> tokens;
    std::size_t exact_prefix = std::numeric_limits<std::size_t>::max();
    std::uint64_t extra_key = 0;
  };
  std::vector<Seq> seqs;
  std::vector<std::uint64_t> section_sizes;  // in file order
  std::uint64_t table_end = 0;
  std::uint64_t file_bytes = 0;

  /// @throws batch_error (seq >= max_batch), shape_error (a sequence listed twice).
  SavePlan(const C& cache, std::span<const std::size_t> selected) {
    using namespace snapshot_format;
    std::vector<std::size_t> ids(selected.begin(), selected.end());
    if (selected.empty()) {
      ids.resize(cache.max_batch());
      for (std::size_t s = 0; s < ids.size(); ++s) ids[s] = s;
    }
    const CacheShape shape = cache.shape();
    section_sizes.push_back(kMetaBytes);
    std::vector<bool> listed(cache.max_batch(), false);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      check_seq("save_snapshot", ids[i], cache.max_batch());
      if (listed[ids[i]]) {
        throw shape_error(
            kvcache::detail::message("save_snapshot: sequence ", ids[i], " listed twice"));
      }
      listed[ids[i]] = true;
      Seq s{ids[i], {}, {}};
      if constexpr (SnapshotTraits<C>::kTracksTokens) {
        s.tokens = SnapshotTraits<C>::tokens(cache, ids[i]);
      }
      if constexpr (requires { cache.exact_prefix(ids[i]); }) {
        s.exact_prefix = cache.exact_prefix(ids[i]);
      }
      if constexpr (requires { cache.extra_key(ids[i]); }) s.extra_key = cache.extra_key(ids[i]);
      s.layers.reserve(shape.num_layers);
      for (std::size_t l = 0; l < shape.num_layers; ++l) {
        const auto view = cache.view(l, ids[i]);
        s.layers.push_back({view.length(), view.sink_end(), view.recent_begin()});
      }
      section_sizes.push_back(kSequenceFixedBytes + kLayerStateBytes * shape.num_layers +
                              sizeof(token_id) * s.tokens.size());
      if (s.exact_prefix < s.tokens.size()) section_sizes.push_back(kExactPrefixBytes);
      if (s.extra_key != 0) section_sizes.push_back(kExtraKeyBytes);
      for (const LayerState& st : s.layers) {
        section_sizes.push_back(kLayerKvHeaderBytes +
                                snapshot_format::kv_payload(shape.dtype, shape.value_dtype,
                                                            st.held() * shape.num_kv_heads,
                                                            shape.head_dim)
                                    .end);
      }
      seqs.push_back(std::move(s));
    }
    table_end = kHeaderBytes + kEntryBytes * section_sizes.size();
    std::uint64_t end = table_end;
    for (std::uint64_t size : section_sizes) end = align_up(end) + size;
    file_bytes = end;
  }
};

/// Writes the planned snapshot of `cache` into `sink`. O(file bytes); reads each K/V row once.
template <class C, SnapshotSink Sink>
void write_snapshot(Sink& sink, const C& cache, const ModelId& model_id, const SavePlan<C>& plan) {
  using namespace snapshot_format;
  using T = typename C::value_type;
  const CacheShape shape = cache.shape();
  const std::size_t num_sections = plan.section_sizes.size();
  if (num_sections > std::numeric_limits<std::uint32_t>::max()) {
    throw capacity_error(kvcache::detail::message("save_snapshot: ", num_sections,
                                                  " sections exceed the format's 2^32 - 1"));
  }
  std::vector<std::byte> head(align_up(plan.table_end));
  sink.put(head);  // placeholder; the real header and table are written last
  std::uint64_t pos = head.size();
  std::size_t section = 0;
  std::uint32_t crc = 0;
  static constexpr std::array<std::byte, kAlign> kZeros{};
  auto begin_section = [&] {
    const std::uint64_t at = align_up(pos);
    sink.put(std::span<const std::byte>(kZeros).first(at - pos));
    pos = at;
    crc = 0;
  };
  auto emit = [&](std::span<const std::byte> b) {
    crc = crc32c_extend(crc, b);
    sink.put(b);
    pos += b.size();
  };
  auto end_section = [&](SectionKind kind) {
    const std::uint64_t e = kHeaderBytes + kEntryBytes * section;
    const std::uint64_t size = plan.section_sizes[section];
    const std::span<std::byte> h(head);
    put(h, e + kEntKind, static_cast<std::uint32_t>(kind));
    put(h, e + kEntFlags, std::uint32_t{0});
    put(h, e + kEntOffset, pos - size);
    put(h, e + kEntSize, size);
    put(h, e + kEntPayloadCrc, crc);
    put(h, e + kEntCrc, crc32c(std::span<const std::byte>(head).subspan(e, kEntCrc)));
    ++section;
  };

  {  // META
    std::array<std::byte, kMetaBytes> meta{};
    const SnapshotParams p = SnapshotTraits<C>::params(cache);
    put(std::span<std::byte>(meta), kMetaPolicy,
        static_cast<std::uint32_t>(SnapshotTraits<C>::kPolicy));
    put(std::span<std::byte>(meta), kMetaDtype, static_cast<std::uint32_t>(shape.dtype));
    const std::pair<std::size_t, std::uint64_t> fields[] = {{kMetaNumLayers, shape.num_layers},
                                                            {kMetaNumKvHeads, shape.num_kv_heads},
                                                            {kMetaHeadDim, shape.head_dim},
                                                            {kMetaMaxBatch, p.max_batch},
                                                            {kMetaMaxSeqLen, p.max_seq_len},
                                                            {kMetaChunkLen, p.chunk_len},
                                                            {kMetaWindow, p.window},
                                                            {kMetaNumSinks, p.num_sink_tokens},
                                                            {kMetaMaxAppendLen, p.max_append_len},
                                                            {kMetaBlockLen, p.block_len},
                                                            {kMetaNumSequences, plan.seqs.size()}};
    for (const auto& [off, v] : fields) put(std::span<std::byte>(meta), off, v);
    const bool pair = shape.value_dtype != shape.dtype;
    put(std::span<std::byte>(meta), kMetaFlags,
        std::uint32_t{(SnapshotTraits<C>::kTracksTokens ? kMetaFlagTokenIds : 0u) |
                      (pair ? kMetaFlagValueDtype : 0u)});
    if (pair) {
      put(std::span<std::byte>(meta), kMetaValueDtype,
          static_cast<std::uint32_t>(shape.value_dtype));
    }
    put(std::span<std::byte>(meta), kMetaModelIdLen, static_cast<std::uint32_t>(model_id.size()));
    copy_bytes(meta.data() + kMetaModelId, model_id.bytes().data(), model_id.size());
    begin_section();
    emit(meta);
    end_section(SectionKind::meta);
  }
  for (std::size_t r = 0; r < plan.seqs.size(); ++r) {
    const auto& s = plan.seqs[r];
    begin_section();
    std::array<std::byte, kSequenceFixedBytes> fixed{};
    put(std::span<std::byte>(fixed), kSeqIndex, std::uint64_t{s.seq});
    put(std::span<std::byte>(fixed), kSeqNumTokenIds, std::uint64_t{s.tokens.size()});
    emit(fixed);
    for (const LayerState& st : s.layers) {
      std::array<std::byte, kLayerStateBytes> b{};
      put(std::span<std::byte>(b), 0, static_cast<std::uint64_t>(st.length));
      put(std::span<std::byte>(b), 8, static_cast<std::uint64_t>(st.sink_end));
      put(std::span<std::byte>(b), 16, static_cast<std::uint64_t>(st.recent_begin));
      emit(b);
    }
    emit(as_bytes_of(s.tokens.data(), s.tokens.size()));
    end_section(SectionKind::sequence);
    if (s.exact_prefix < s.tokens.size()) {
      begin_section();
      std::array<std::byte, kExactPrefixBytes> exact{};
      put(std::span<std::byte>(exact), 0, std::uint64_t{s.exact_prefix});
      emit(exact);
      end_section(SectionKind::exact_prefix);
    }
    if (s.extra_key != 0) {
      begin_section();
      std::array<std::byte, kExtraKeyBytes> key{};
      put(std::span<std::byte>(key), 0, std::uint64_t{s.extra_key});
      emit(key);
      end_section(SectionKind::extra_key);
    }
    for (std::size_t l = 0; l < shape.num_layers; ++l) {
      begin_section();
      std::array<std::byte, kLayerKvHeaderBytes> kv{};
      put(std::span<std::byte>(kv), kKvRecord, std::uint64_t{r});
      put(std::span<std::byte>(kv), kKvLayer, std::uint64_t{l});
      put(std::span<std::byte>(kv), kKvHeld, s.layers[l].held());
      emit(kv);
      const auto view = cache.view(l, s.seq);
      // K rows, V rows, then a quantized side's scales laid out as the rows, each array at the
      // offset kv_payload() gives (padding only where K and V differ in format)
      const KVPayload at = kv_payload(shape.dtype, shape.value_dtype,
                                      s.layers[l].held() * shape.num_kv_heads, shape.head_dim);
      const std::uint64_t rows_begin = pos;
      const auto pad_to = [&](std::uint64_t offset) {
        emit(std::span<const std::byte>(kZeros).first(rows_begin + offset - pos));
      };
      const auto emit_side = [&](auto pick) {
        for (std::size_t h = 0; h < shape.num_kv_heads; ++h) {
          for (std::size_t i = 0; i < view.num_segments(); ++i) {
            const KVSegment<T> seg = view.segment(i);
            emit(pick(seg, h));
          }
        }
      };
      const std::size_t d = shape.head_dim;
      emit_side([&](const KVSegment<T>& seg, std::size_t h) {
        return as_bytes_of(seg.k + h * seg.head_stride, seg.len * d);
      });
      pad_to(at.v);
      emit_side([&](const KVSegment<T>& seg, std::size_t h) {
        return as_bytes_of(seg.v + h * seg.head_stride, seg.len * d);
      });
      pad_to(at.k_scale);
      if constexpr (scaled_v<key_format_t<T>>) {
        emit_side([&](const KVSegment<T>& seg, std::size_t h) {
          return as_bytes_of(seg.k_scale + h * seg.head_stride / d, seg.len);
        });
      }
      pad_to(at.v_scale);
      if constexpr (scaled_v<value_format_t<T>>) {
        emit_side([&](const KVSegment<T>& seg, std::size_t h) {
          return as_bytes_of(seg.v_scale + h * seg.head_stride / d, seg.len);
        });
      }
      end_section(SectionKind::layer_kv);
    }
  }
  const std::span<std::byte> h(head);
  std::memcpy(head.data(), kMagic, sizeof kMagic);
  put(h, kHdrVersion, kVersion);
  put(h, kHdrEndian, kEndianMarker);
  put(h, kHdrHeaderBytes, static_cast<std::uint32_t>(kHeaderBytes));
  put(h, kHdrNumSections, static_cast<std::uint32_t>(num_sections));
  put(h, kHdrFileBytes, pos);
  put(h, kHdrTableOffset, std::uint64_t{kHeaderBytes});
  put(h, kHdrCrc, crc32c(std::span<const std::byte>(head).first(kHdrCrc)));
  sink.put_at(std::span<const std::byte>(head).first(plan.table_end), 0);
}

/// The parsed file, re-expressed for callers (token ids copied out).
inline SnapshotInfo make_info(const snapshot_format::Parsed& p, std::span<const std::byte> bytes) {
  SnapshotInfo info;
  info.policy = p.policy;
  info.shape = p.shape;
  info.params = p.params;
  info.model_id = ModelId(p.model_id);
  info.has_token_ids = p.has_token_ids;
  info.file_bytes = bytes.size();
  info.sequences.reserve(p.sequences.size());
  for (const auto& s : p.sequences) {
    SnapshotSequenceInfo si;
    si.seq = static_cast<std::size_t>(s.seq);
    si.length = static_cast<std::size_t>(s.layers.front().length);
    for (const auto& st : s.layers) {
      si.longest = std::max(si.longest, static_cast<std::size_t>(st.length));
    }
    si.token_ids.resize(s.num_token_ids);
    copy_bytes(si.token_ids.data(), bytes.data() + s.token_ids_offset,
               s.num_token_ids * sizeof(token_id));
    info.sequences.push_back(std::move(si));
  }
  return info;
}

/// Validates `bytes` completely against `cache` and restores it. `bytes` must be aligned for
/// the cache's element type.
template <SnapshotCache C>
SnapshotInfo load_aligned(std::span<const std::byte> bytes, C& cache, const ModelId& model_id,
                          const LoadOptions& options, const std::string& name) {
  using namespace snapshot_format;
  using snapshot_format::detail::fail;
  using T = typename C::value_type;
  using Traits = SnapshotTraits<C>;
  const Parsed p = parse(bytes, name);
  const std::uint64_t m = p.meta_offset;
  const CacheShape shape = cache.shape();
  const ModelId saved_id(p.model_id);
  if (!(saved_id == model_id)) {
    fail<snapshot_mismatch_error>(name, m + kMetaModelId, "model id '", saved_id.hex(),
                                  "' differs from the caller's '", model_id.hex(),
                                  "' (K/V of another model)");
  }
  if (p.policy != Traits::kPolicy) {
    fail<snapshot_mismatch_error>(name, m + kMetaPolicy, "saved by a ",
                                  snapshot_policy_name(p.policy), ", the destination is a ",
                                  snapshot_policy_name(Traits::kPolicy));
  }
  if (p.dtype != shape.dtype) {
    fail<snapshot_mismatch_error>(name, m + kMetaDtype, "dtype ", dtype_name(p.dtype),
                                  " differs from the destination's ", dtype_name(shape.dtype));
  }
  if (p.shape.value_dtype != shape.value_dtype) {
    fail<snapshot_mismatch_error>(name, m + kMetaValueDtype, "V is stored in ",
                                  dtype_name(p.shape.value_dtype), ", the destination's V in ",
                                  dtype_name(shape.value_dtype));
  }
  const std::pair<std::size_t, std::pair<std::size_t, std::size_t>> dims[] = {
      {kMetaNumLayers, {p.shape.num_layers, shape.num_layers}},
      {kMetaNumKvHeads, {p.shape.num_kv_heads, shape.num_kv_heads}},
      {kMetaHeadDim, {p.shape.head_dim, shape.head_dim}}};
  for (const auto& [off, v] : dims) {
    if (v.first != v.second) {
      fail<snapshot_mismatch_error>(name, m + off,
                                    off == kMetaNumLayers    ? "num_layers "
                                    : off == kMetaNumKvHeads ? "num_kv_heads "
                                                             : "head_dim ",
                                    v.first, " differs from the destination's ", v.second);
    }
  }
  Traits::check_compatible(cache, p, name);
  if (Traits::kTracksTokens && !p.has_token_ids) {
    fail<snapshot_mismatch_error>(name, m + kMetaFlags,
                                  "the snapshot carries no token ids, which a TokenTrackedCache "
                                  "needs (save it from a TokenTrackedCache)");
  }

  // Destination sequences.
  const std::size_t n = p.sequences.size();
  std::vector<std::size_t> dest(n);
  if (options.dest_seqs.empty()) {
    for (std::size_t i = 0; i < n; ++i) {
      dest[i] = static_cast<std::size_t>(p.sequences[i].seq);
      if (dest[i] >= cache.max_batch()) {
        fail<snapshot_mismatch_error>(name, p.sequences[i].section_offset + kSeqIndex, "sequence ",
                                      dest[i], " does not exist in the destination ", "(max_batch ",
                                      cache.max_batch(),
                                      "); pass LoadOptions::dest_seqs to place it");
      }
    }
  } else {
    if (options.dest_seqs.size() != n) {
      throw shape_error(kvcache::detail::message("load_snapshot: ", options.dest_seqs.size(),
                                                 " dest_seqs for ", n, " saved sequences in '",
                                                 name, "'"));
    }
    std::vector<bool> named(cache.max_batch(), false);
    for (std::size_t i = 0; i < n; ++i) {
      dest[i] = options.dest_seqs[i];
      kvcache::detail::check_seq("load_snapshot: dest_seqs", dest[i], cache.max_batch());
      if (named[dest[i]]) {
        throw shape_error(kvcache::detail::message("load_snapshot: dest_seqs names sequence ",
                                                   dest[i], " twice"));
      }
      named[dest[i]] = true;
    }
  }

  // Every layer against the destination's capacity, then the restore itself.
  std::vector<LayerRestore<T>> entries;
  entries.reserve(n * shape.num_layers);
  std::vector<std::vector<token_id>> ids(Traits::kTracksTokens ? n : 0);
  std::vector<SequenceTokens> tokens;
  const std::size_t row = shape.token_elems();
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& s = p.sequences[i];
    for (std::size_t l = 0; l < shape.num_layers; ++l) {
      const LayerState& st = s.layers[l];
      if (const std::string why = Traits::capacity_misfit(cache, st); !why.empty()) {
        fail<snapshot_mismatch_error>(name, s.layer_state_offset(l), "sequence ", s.seq, " layer ",
                                      l, " ", why);
      }
      const std::size_t elems = static_cast<std::size_t>(st.held()) * row;
      const std::size_t rows = static_cast<std::size_t>(st.held()) * shape.num_kv_heads;
      // each array aligned for its type: the payload is 64-aligned, and kv_payload() keeps
      // every array of a pair file at a multiple of 8 (of one format: sizes keep them aligned)
      const std::byte* base = bytes.data() + s.kv_offset[l];
      const KVPayload at = kv_payload(shape.dtype, shape.value_dtype, rows, shape.head_dim);
      LayerRestore<T>& e = entries.emplace_back();
      e.layer = l;
      e.seq = dest[i];
      e.length = st.length;
      e.sink_end = st.sink_end;
      e.recent_begin = st.recent_begin;
      e.k = std::span(reinterpret_cast<const key_format_t<T>*>(base), elems);
      e.v = std::span(reinterpret_cast<const value_format_t<T>*>(base + at.v), elems);
      if constexpr (scaled_v<key_format_t<T>>) {
        e.k_scale = std::span(reinterpret_cast<const scale_type*>(base + at.k_scale), rows);
      }
      if constexpr (scaled_v<value_format_t<T>>) {
        e.v_scale = std::span(reinterpret_cast<const scale_type*>(base + at.v_scale), rows);
      }
    }
    if constexpr (Traits::kTracksTokens) {
      if (s.num_token_ids > cache.capacity()) {
        fail<snapshot_mismatch_error>(
            name, s.section_offset + kSeqNumTokenIds, "sequence ", s.seq, " has ", s.num_token_ids,
            " token ids, more than the destination's max_seq_len ", cache.capacity());
      }
      ids[i].resize(s.num_token_ids);
      copy_bytes(ids[i].data(), bytes.data() + s.token_ids_offset,
                 s.num_token_ids * sizeof(token_id));
      tokens.push_back({.seq = dest[i],
                        .ids = ids[i],
                        .exact_prefix = static_cast<std::size_t>(
                            std::min<std::uint64_t>(s.exact_prefix, s.num_token_ids)),
                        .extra_key = s.extra_key});
    }
  }
  SnapshotInfo info = make_info(p, bytes);
  Traits::restore(cache, entries, tokens);
  return info;
}

}  // namespace detail

/// Serializes sequences of `cache` into a snapshot in memory (the file format of
/// save_snapshot(), e.g. to send elsewhere or for tests). `seqs` empty: every sequence
/// 0 .. max_batch - 1 (empty ones too, so that loading reproduces the whole cache).
/// O(bytes of the K/V held).
/// @throws batch_error, shape_error (a sequence listed twice), std::bad_alloc.
template <SnapshotCache C>
[[nodiscard]] std::vector<std::byte> snapshot_to_bytes(const C& cache, const ModelId& model_id,
                                                       std::span<const std::size_t> seqs = {}) {
  const detail::SavePlan<C> plan(cache, seqs);
  std::vector<std::byte> out(plan.file_bytes);
  detail::MemorySink sink(out);
  detail::write_snapshot(sink, cache, model_id, plan);
  return out;
}

/// Saves sequences of `cache` to `path` atomically: the snapshot is written to a temporary file
/// in the same directory, fsynced, renamed over `path`, and the directory fsynced (see
/// SaveOptions). Whenever this process dies, `path` holds the previous snapshot or the new one,
/// complete; an exception leaves `path` untouched and removes the temporary. `seqs` empty: every
/// sequence 0 .. max_batch - 1. The cache is only read. O(bytes of the K/V held), written
/// straight from the cache's storage.
/// @pre no other thread mutates `cache` during the call.
/// @throws batch_error, shape_error (bad `seqs`), io_error (the directory is missing, the disk
///         is full...), std::bad_alloc.
template <SnapshotCache C>
void save_snapshot(const std::filesystem::path& path, const C& cache, const ModelId& model_id,
                   std::span<const std::size_t> seqs = {}, const SaveOptions& options = {}) {
  const detail::SavePlan<C> plan(cache, seqs);
  if (options.remove_stale_temps) remove_stale_temp_files(path);
  AtomicFileWriter file(path, options.durable);
  detail::FileSink sink(file);
  detail::write_snapshot(sink, cache, model_id, plan);
  sink.flush();
  file.commit();
}

/// Restores a snapshot held in memory (see load_snapshot(path, ...)); `name` appears in messages.
template <SnapshotCache C>
SnapshotInfo load_snapshot_bytes(std::span<const std::byte> bytes, C& cache,
                                 const ModelId& model_id, const LoadOptions& options = {},
                                 const std::string& name = "<memory>") {
  using T = typename C::value_type;
  constexpr std::size_t align =
      std::max({alignof(key_format_t<T>), alignof(value_format_t<T>), alignof(scale_type)});
  if (reinterpret_cast<std::uintptr_t>(bytes.data()) % align != 0) {
    AlignedBuffer<std::byte> copy(bytes.size());
    std::copy(bytes.begin(), bytes.end(), copy.data());
    return detail::load_aligned(std::span<const std::byte>(copy.data(), copy.size()), cache,
                                model_id, options, name);
  }
  return detail::load_aligned(bytes, cache, model_id, options, name);
}

/// Loads the snapshot at `path` into `cache`. First the whole file is validated (magic,
/// version, endianness, every checksum, every count against the file size), then compared with
/// the destination (model id, policy, dtype, num_layers, num_kv_heads, head_dim, a sliding
/// window's window and sinks, each sequence against max_batch and capacity), and only then are
/// the saved sequences restored: each replaces the destination sequence (LoadOptions::dest_seqs,
/// default the saved index) in every layer, with its lengths, absolute positions, evicted gap
/// and (TokenTrackedCache, PagedCache) token ids exactly as saved. Other sequences are
/// untouched. Into a PagedCache the replaced sequences' blocks are released, fresh ones taken
/// from the pool and the full blocks indexed for prefix caching (PagedCache::restore).
/// Large files are mapped and copied from the page cache into the cache's storage (no staging
/// buffer). O(file bytes).
/// @pre the file is not truncated while it is loaded (snapshots written by save_snapshot() never
///      are; another program truncating a mapped file would raise SIGBUS; use LoadMethod::read).
/// @post on throw, `cache` is exactly as before (strong guarantee).
/// @throws io_error (missing or unreadable file), snapshot_truncated_error,
///         snapshot_checksum_error, snapshot_format_error (malformed, with the file offset),
///         snapshot_mismatch_error (valid, but for another model or shape, or too large for the
///         destination), batch_error / shape_error (bad dest_seqs), pool_exhausted_error (a
///         PagedCache whose pool lacks the blocks; names needed, free, evictable),
///         position_error (a PagedCache sequence whose K/V runs past its token ids, which no
///         PagedCache of this version writes), std::bad_alloc.
template <SnapshotCache C>
SnapshotInfo load_snapshot(const std::filesystem::path& path, C& cache, const ModelId& model_id,
                           const LoadOptions& options = {}) {
  const detail::UniqueFd fd = detail::open_for_reading(path);
  const std::uint64_t size = detail::regular_file_size(fd.get(), path);
  const bool map = size >= snapshot_format::kHeaderBytes &&
                   (options.method == LoadMethod::mmap ||
                    (options.method == LoadMethod::automatic && size >= options.mmap_threshold));
  if (map) {
    const detail::MappedFile mapping(fd.get(), static_cast<std::size_t>(size), path);
    return detail::load_aligned(mapping.bytes(), cache, model_id, options, path.string());
  }
  AlignedBuffer<std::byte> buffer(static_cast<std::size_t>(size));
  detail::read_exact_at(fd.get(), buffer.data(), buffer.size(), 0, path);
  return detail::load_aligned(std::span<const std::byte>(buffer.data(), buffer.size()), cache,
                              model_id, options, path.string());
}

/// Validates the snapshot at `path` completely (as load_snapshot() does) and describes it,
/// restoring nothing. O(file bytes).
/// @throws as load_snapshot(), less the destination checks.
[[nodiscard]] inline SnapshotInfo read_snapshot_info(const std::filesystem::path& path) {
  const detail::UniqueFd fd = detail::open_for_reading(path);
  const std::uint64_t size = detail::regular_file_size(fd.get(), path);
  AlignedBuffer<std::byte> buffer;
  detail::MappedFile mapping;
  std::span<const std::byte> bytes;
  if (size >= snapshot_format::kHeaderBytes) {
    mapping = detail::MappedFile(fd.get(), static_cast<std::size_t>(size), path);
    bytes = mapping.bytes();
  } else {
    buffer = AlignedBuffer<std::byte>(static_cast<std::size_t>(size));
    detail::read_exact_at(fd.get(), buffer.data(), buffer.size(), 0, path);
    bytes = std::span<const std::byte>(buffer.data(), buffer.size());
  }
  return detail::make_info(snapshot_format::parse(bytes, path.string()), bytes);
}

}  // namespace kvcache
