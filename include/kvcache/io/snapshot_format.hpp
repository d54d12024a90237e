// SPDX-License-Identifier: Apache-2.0
// The kvcache snapshot file format, field by field, and its validating parser: parse_snapshot()
// checks every byte of a file (structure, ranges, checksums) before anyone looks at the contents.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/io/crc32c.hpp"
#include "kvcache/io/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "kvcache snapshots are little-endian and read by memcpy: little-endian hosts only");

/// @file
/// Snapshot format, version 1. All integers are little-endian; u64 counts are at most 2^63 - 1.
/// Checksums are CRC32C (Castagnoli, see io/crc32c.hpp). Every byte of a valid file is covered
/// by a checksum or required to be zero, so any corruption of any byte is detected.
///
/// File header, 64 bytes at offset 0:
///   off size  field
///     0    8  magic            89 4B 56 43 0D 0A 1A 0A  ("\x89KVC\r\n\x1a\n", PNG-style: catches
///                              7-bit and CR/LF-mangling transfers)
///     8    4  format_version   1
///    12    4  endian_marker    0x0A0B0C0D (bytes 0D 0C 0B 0A; a big-endian writer would show
///                              0A 0B 0C 0D)
///    16    4  header_bytes     64
///    20    4  num_sections     >= 1
///    24    8  file_bytes       the file's total length (truncation is caught before anything else)
///    32    8  table_offset     64: the section table follows the header
///    40   20  reserved         zero
///    60    4  header_crc       CRC32C of bytes [0, 60)
///
/// Section table, num_sections entries of 32 bytes at offset 64:
///     0    4  kind             see SectionKind
///     4    4  flags            bit 0 "optional": a reader that does not know `kind` skips the
///                              section (never set on kinds 1-3); other bits zero. A required
///                              unknown kind is an error.
///     8    8  offset           where the payload starts, a multiple of 64
///    16    8  size             payload bytes
///    24    4  payload_crc      CRC32C of the payload
///    28    4  entry_crc        CRC32C of entry bytes [0, 28)
/// Payloads are laid out in table order without overlap: section 0 starts at the first multiple
/// of 64 after the table, section i + 1 at the first multiple of 64 at or after the end of
/// section i, the padding in between is zero, and the last payload ends at file_bytes.
///
/// Section order: META first; then for each saved sequence its SEQUENCE section, its
/// EXACT_PREFIX section if it has one, its EXTRA_KEY section if it has one, and num_layers
/// LAYER_KV sections in layer order. Optional
/// sections may appear anywhere after META. Every policy, the paged cache (policy 4) included, uses
/// exactly these sections: a paged snapshot stores each sequence's positions and token ids, not the
/// pool's block layout, which the loader rebuilds in the destination's pool. Kinds 4 and 5 stay
/// reserved.
///
/// META payload, 192 bytes: the shape fingerprint and the model identity.
///     0    4  policy           SnapshotPolicy: 1 StaticCache, 2 DynamicCache,
///                              3 SlidingWindowCache, 4 PagedCache
///     4    4  dtype            DType numbering: 0 f32, 1 f16, 2 bf16, 3 int8, 4 fp8 (e4m3)
///     8    8  num_layers       >= 1
///    16    8  num_kv_heads     >= 1
///    24    8  head_dim         >= 1
///    32    8  max_batch        of the saved cache (>= 1; sequence indices are below it)
///    40    8  max_seq_len      StaticCache (>= 1), DynamicCache (0 = unbounded) and
///                              PagedCache (>= 1, its capacity()); else 0
///    48    8  chunk_len        DynamicCache (>= 1); else 0
///    56    8  window           SlidingWindowCache (>= 1); else 0
///    64    8  num_sink_tokens  SlidingWindowCache; else 0
///    72    8  max_append_len   SlidingWindowCache (>= 1); else 0
///    80    8  block_len        PagedCache (>= 1): its block_size (tokens per block); else 0
///    88    4  flags            bit 0: token ids present (saved from a TokenTrackedCache or a
///                              PagedCache; always set for PagedCache); bit 1: V is stored in
///                              value_dtype, another format than K's (a KVFormats<K, V> cache);
///                              other bits zero
///    92    4  model_id_len     0..64
///    96   64  model_id         the caller's ModelId bytes, zero after model_id_len
///   160    8  num_sequences    number of SEQUENCE sections
///   168    4  value_dtype      flags bit 1: V's format (DType numbering, not dtype); else 0
///                              (V in dtype, as in every file written before K/V pairs)
///   172   20  reserved         zero
///
/// SEQUENCE payload, 16 + 24 * num_layers + 4 * num_token_ids bytes:
///     0    8  seq              index of the sequence in the saved cache (< max_batch, unique)
///     8    8  num_token_ids    0 unless META flag bit 0; at most every layer's length, except
///                              for PagedCache: at most max_seq_len (a paged sequence may
///                              register ids ahead of their K/V: an admitted prompt not yet
///                              prefilled, a sampled token not yet appended), and, when not
///                              0, at least every layer's length (PagedCache::restore refuses
///                              K/V past the ids with position_error)
///    16       per layer, 24 bytes: length, sink_end, recent_begin (what the layer's view
///             reports: positions [0, sink_end) and [recent_begin, length) are held, with
///             0 <= sink_end <= recent_begin <= length). StaticCache, DynamicCache and
///             PagedCache: sink_end = recent_begin = 0, length within max_seq_len (unless 0
///             for DynamicCache). SlidingWindowCache: either
///             length <= num_sink_tokens and sink_end = recent_begin = length, or sink_end =
///             num_sink_tokens <= recent_begin and length - recent_begin <= window +
///             max_append_len - 1 (the ring).
///   ...       num_token_ids token ids, i32 each, in position order
///
/// EXACT_PREFIX payload (kind 6, required), 8 bytes, only for a PagedCache sequence that a
/// context shift moved (PagedCache::exact_prefix() below its number of ids); files without a
/// shifted sequence have none and read the same as before this kind existed:
///     0    8  exact_prefix     < num_token_ids: only the K/V of the first exact_prefix
///                              positions follows from their ids; the loader shares and indexes
///                              no block past it. A reader that does not know kind 6 refuses the
///                              file (the kind is required) rather than share moved K/V.
///
/// EXTRA_KEY payload (kind 7, required), 8 bytes, only for a PagedCache sequence admitted under
/// an extra key (PagedCache::extra_key() not 0: a cache salt, an adapter id); files without one
/// read the same as before this kind existed:
///     0    8  extra_key        not 0: the key the loader shares and indexes the sequence's
///                              blocks under. A reader that does not know kind 7 refuses the
///                              file (the kind is required) rather than share the sequence's
///                              blocks with prompts of another key.
///
/// LAYER_KV payload, 64 + num_kv_heads * held * (row_bytes(dtype, head_dim) + row_bytes(V's
/// dtype, head_dim)) bytes (row_bytes: head_dim * dtype_bytes, plus 2 for int8 and fp8), plus, in
/// a file whose V format differs from K's, the zero padding that starts each of its arrays at a
/// multiple of 8 bytes (kv_payload()):
///     0    8  sequence_record  0-based index of the SEQUENCE section this layer belongs to
///     8    8  layer            0 .. num_layers - 1, in order
///    16    8  held             sink_end + length - recent_begin of that layer
///    24   40  reserved         zero
///    64       K: [num_kv_heads][held][head_dim] elements (held positions in increasing order),
///             then V of the same shape. Elements are the raw little-endian bits of f32 / IEEE
///             fp16 / bfloat16, or the codes of int8 (two's complement) / fp8 e4m3. The payload
///             starts 64-aligned, so K and V are 64-byte aligned in the file and in a mapping
///             of it. int8 and fp8 only: then the K rows' scales [num_kv_heads][held], then the
///             V rows', each a bfloat16 (a row's values are code x scale, core/format.hpp).
///             Files of dtype 0-2 are laid out exactly as before these formats existed. With
///             K and V in different formats (META flags bit 1): K rows in dtype, V rows in
///             value_dtype, then the K scales if K is int8 or fp8, then the V scales if V is;
///             each of these arrays starts at a multiple of 8 bytes from the K rows (zero
///             padding in between), so each is aligned for its type in a mapping.
namespace kvcache {

/// Which cache policy wrote a snapshot (META.policy). Stable numbering.
enum class SnapshotPolicy : std::uint32_t {
  static_cache = 1,
  dynamic_cache = 2,
  sliding_window = 3,
  paged_cache = 4,
};

[[nodiscard]] constexpr const char* snapshot_policy_name(SnapshotPolicy p) noexcept {
  switch (p) {
    case SnapshotPolicy::static_cache:
      return "StaticCache";
    case SnapshotPolicy::dynamic_cache:
      return "DynamicCache";
    case SnapshotPolicy::sliding_window:
      return "SlidingWindowCache";
    case SnapshotPolicy::paged_cache:
      return "PagedCache";
  }
  return "unknown policy";
}

/// The policy parameters a snapshot records (META offsets 32..87); unused ones are 0.
struct SnapshotParams {
  std::uint64_t max_batch = 0;
  std::uint64_t max_seq_len = 0;
  std::uint64_t chunk_len = 0;
  std::uint64_t window = 0;
  std::uint64_t num_sink_tokens = 0;
  std::uint64_t max_append_len = 0;
  /// PagedCache: tokens per block of the saved cache.
  std::uint64_t block_len = 0;
  friend constexpr bool operator==(const SnapshotParams&, const SnapshotParams&) = default;
};

namespace snapshot_format {

inline constexpr std::uint8_t kMagic[8] = {0x89, 'K', 'V', 'C', '\r', '\n', 0x1a, '\n'};
inline constexpr std::uint32_t kVersion = 1;
inline constexpr std::uint32_t kEndianMarker = 0x0A0B0C0Du;
inline constexpr std::size_t kHeaderBytes = 64;
inline constexpr std::size_t kEntryBytes = 32;
inline constexpr std::size_t kAlign = 64;
inline constexpr std::size_t kMetaBytes = 192;
inline constexpr std::size_t kSequenceFixedBytes = 16;
inline constexpr std::size_t kLayerStateBytes = 24;
inline constexpr std::size_t kLayerKvHeaderBytes = 64;
inline constexpr std::size_t kExactPrefixBytes = 8;
inline constexpr std::size_t kExtraKeyBytes = 8;
inline constexpr std::size_t kModelIdMaxBytes = 64;
inline constexpr std::uint32_t kFlagOptional = 1;
inline constexpr std::uint32_t kMetaFlagTokenIds = 1;
inline constexpr std::uint32_t kMetaFlagValueDtype = 2;
inline constexpr std::uint64_t kMaxCount = std::uint64_t{1} << 63;  // u64 fields stay below

// Header field offsets.
inline constexpr std::size_t kHdrVersion = 8, kHdrEndian = 12, kHdrHeaderBytes = 16,
                             kHdrNumSections = 20, kHdrFileBytes = 24, kHdrTableOffset = 32,
                             kHdrReserved = 40, kHdrCrc = 60;
// Section table entry field offsets.
inline constexpr std::size_t kEntKind = 0, kEntFlags = 4, kEntOffset = 8, kEntSize = 16,
                             kEntPayloadCrc = 24, kEntCrc = 28;
// META field offsets.
inline constexpr std::size_t kMetaPolicy = 0, kMetaDtype = 4, kMetaNumLayers = 8,
                             kMetaNumKvHeads = 16, kMetaHeadDim = 24, kMetaMaxBatch = 32,
                             kMetaMaxSeqLen = 40, kMetaChunkLen = 48, kMetaWindow = 56,
                             kMetaNumSinks = 64, kMetaMaxAppendLen = 72, kMetaBlockLen = 80,
                             kMetaFlags = 88, kMetaModelIdLen = 92, kMetaModelId = 96,
                             kMetaNumSequences = 160, kMetaValueDtype = 168, kMetaReserved = 172;
// SEQUENCE and LAYER_KV field offsets.
inline constexpr std::size_t kSeqIndex = 0, kSeqNumTokenIds = 8, kSeqLayers = 16;
inline constexpr std::size_t kKvRecord = 0, kKvLayer = 8, kKvHeld = 16, kKvReserved = 24;

/// Section kinds (table entry `kind`). Stable numbering.
enum class SectionKind : std::uint32_t {
  meta = 1,
  sequence = 2,
  layer_kv = 3,
  exact_prefix = 6,
  extra_key = 7,
  // 4, 5: reserved (e.g. a dump of a paged cache's block pool and prefix index); a paged
  // snapshot (policy 4) needs neither.
};

[[nodiscard]] constexpr std::uint64_t align_up(std::uint64_t x) noexcept {
  return (x + (kAlign - 1)) & ~std::uint64_t{kAlign - 1};
}

// Little-endian field access (hosts are little-endian, see the static_assert above).
template <class U>
[[nodiscard]] inline U get(std::span<const std::byte> bytes, std::uint64_t offset) noexcept {
  U v;
  std::memcpy(&v, bytes.data() + offset, sizeof v);
  return v;
}
template <class U>
inline void put(std::span<std::byte> bytes, std::uint64_t offset, U v) noexcept {
  std::memcpy(bytes.data() + offset, &v, sizeof v);
}

/// One table entry, decoded.
struct Section {
  SectionKind kind;
  std::uint32_t flags;
  std::uint64_t offset;
  std::uint64_t size;
};

/// One layer's state as the SEQUENCE section records it.
struct LayerState {
  position_t length = 0;
  position_t sink_end = 0;
  position_t recent_begin = 0;
  [[nodiscard]] constexpr std::uint64_t held() const noexcept {
    return static_cast<std::uint64_t>(sink_end + (length - recent_begin));
  }
};

/// A parsed SEQUENCE section with the file offsets of its parts.
struct Sequence {
  std::uint64_t section_offset = 0;  // payload offset of the SEQUENCE section
  std::uint64_t seq = 0;
  std::vector<LayerState> layers;
  std::uint64_t num_token_ids = 0;
  std::uint64_t token_ids_offset = 0;  // file offset of the first i32 id
  /// From an EXACT_PREFIX section; UINT64_MAX (all) without one.
  std::uint64_t exact_prefix = std::numeric_limits<std::uint64_t>::max();
  /// From an EXTRA_KEY section; 0 (none) without one.
  std::uint64_t extra_key = 0;
  std::vector<std::uint64_t> kv_offset;  // per layer: file offset of K (kv_payload() for the rest)

  /// File offset of layer l's 24-byte state.
  [[nodiscard]] std::uint64_t layer_state_offset(std::size_t l) const noexcept {
    return section_offset + kSeqLayers + kLayerStateBytes * l;
  }
};

/// Everything parse() found, as offsets into the validated bytes.
struct Parsed {
  std::uint64_t meta_offset = 0;
  SnapshotPolicy policy{};
  DType dtype{};  ///< K's (and V's, unless shape.value_dtype differs)
  CacheShape shape;
  SnapshotParams params;
  bool has_token_ids = false;
  std::span<const std::byte> model_id;
  std::vector<Sequence> sequences;
};

/// Byte offsets, from the K rows of a LAYER_KV payload, of its other arrays, and its size: for
/// `rows` rows (num_kv_heads x held) of head_dim elements of K in `k` and V in `v`. One format:
/// back to back (V, K scales, V scales: the layout of every file before K/V pairs). Two: each
/// array present from a multiple of 8 bytes (a side that is not quantized has no scales: its
/// offset is where they would start, with no padding). @pre rows x (both rows' bytes) + 24 fits in
/// uint64 (parse() bounds it below 2^63 first).
struct KVPayload {
  std::uint64_t v = 0, k_scale = 0, v_scale = 0, end = 0;
};
[[nodiscard]] constexpr KVPayload kv_payload(DType k, DType v, std::uint64_t rows,
                                             std::uint64_t head_dim) noexcept {
  const bool pair = k != v;
  const auto next = [pair](std::uint64_t at) { return pair ? (at + 7) / 8 * 8 : at; };
  KVPayload out;
  out.v = next(rows * head_dim * dtype_bytes(k));
  const std::uint64_t v_end = out.v + rows * head_dim * dtype_bytes(v);
  out.k_scale = dtype_scaled(k) ? next(v_end) : v_end;
  const std::uint64_t k_scale_end = out.k_scale + (dtype_scaled(k) ? rows * 2 : 0);
  out.v_scale = dtype_scaled(v) ? next(k_scale_end) : k_scale_end;
  out.end = out.v_scale + (dtype_scaled(v) ? rows * 2 : 0);
  return out;
}

namespace detail {

/// Throws the error type E with "<name>: <message parts> (offset N)".
template <class E, class... Parts>
[[noreturn]] void fail(const std::string& name, std::uint64_t offset, const Parts&... parts) {
  throw E(kvcache::detail::message("kvcache snapshot '", name, "': ", parts..., " (file offset ",
                                   offset, ")"),
          offset);
}

[[nodiscard]] inline std::string hex32(std::uint32_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int i = 7; i >= 0; --i) s += kDigits[(v >> (4 * i)) & 15u];
  return s;
}

inline void check_crc(const std::string& name, std::span<const std::byte> covered,
                      std::uint64_t offset, std::uint32_t stored, const char* what) {
  const std::uint32_t computed = crc32c(covered);
  if (computed != stored) {
    fail<snapshot_checksum_error>(name, offset, what, " checksum mismatch over bytes [", offset,
                                  ", ", offset + covered.size(), "): stored ", hex32(stored),
                                  ", computed ", hex32(computed));
  }
}

inline void check_zero(const std::string& name, std::span<const std::byte> bytes,
                       std::uint64_t offset, std::uint64_t n, const char* what) {
  for (std::uint64_t i = 0; i < n; ++i) {
    if (bytes[offset + i] != std::byte{0}) {
      fail<snapshot_format_error>(name, offset + i, what, " byte ", i, " is ",
                                  static_cast<unsigned>(bytes[offset + i]), ", must be 0");
    }
  }
}

/// u64 field that must be below 2^63 (so that it converts to position_t / size_t).
[[nodiscard]] inline std::uint64_t get_count(const std::string& name,
                                             std::span<const std::byte> bytes, std::uint64_t offset,
                                             const char* what) {
  const auto v = get<std::uint64_t>(bytes, offset);
  if (v >= kMaxCount) fail<snapshot_format_error>(name, offset, what, " ", v, " exceeds 2^63 - 1");
  return v;
}

/// a * b, or fails naming `what` when the product reaches 2^63.
[[nodiscard]] inline std::uint64_t mul_count(const std::string& name, std::uint64_t offset,
                                             std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r >= kMaxCount) {
    fail<snapshot_format_error>(name, offset, what, ": ", a, " x ", b, " overflows");
  }
  return r;
}

}  // namespace detail

/// Validates a whole snapshot held in memory and decodes its structure: header, table, every
/// checksum, every reserved and padding byte, META ranges, the section order, each SEQUENCE's
/// layer states against the saved policy, and each LAYER_KV's size. Reads every byte once
/// (CRC32C) plus the small structures; allocates O(num_sequences * num_layers), bounded by the
/// file size. `name` appears in messages.
/// @throws snapshot_truncated_error, snapshot_checksum_error, snapshot_format_error naming the
///         file offset.
[[nodiscard]] inline Parsed parse(std::span<const std::byte> bytes, const std::string& name) {
  using detail::fail;
  const std::uint64_t actual = bytes.size();
  if (actual < kHeaderBytes) {
    fail<snapshot_truncated_error>(name, actual, "file is ", actual, " bytes, shorter than the ",
                                   kHeaderBytes, "-byte header");
  }
  for (std::size_t i = 0; i < 8; ++i) {
    if (bytes[i] != std::byte{kMagic[i]}) {
      fail<snapshot_format_error>(name, i, "not a kvcache snapshot (bad magic byte ", i, ": ",
                                  static_cast<unsigned>(bytes[i]), ", expected ",
                                  static_cast<unsigned>(kMagic[i]), ")");
    }
  }
  const auto endian = get<std::uint32_t>(bytes, kHdrEndian);
  if (endian != kEndianMarker) {
    fail<snapshot_format_error>(
        name, kHdrEndian, "endianness marker is ", detail::hex32(endian), ", expected ",
        detail::hex32(kEndianMarker),
        endian == 0x0D0C0B0Au ? " (a big-endian snapshot; this reader is little-endian)" : "");
  }
  const auto version = get<std::uint32_t>(bytes, kHdrVersion);
  if (version != kVersion) {
    fail<snapshot_format_error>(name, kHdrVersion, "format version ", version,
                                version > kVersion ? " is newer than" : " is not supported by",
                                " this reader (supports ", kVersion, ")");
  }
  detail::check_crc(name, bytes.first(kHdrCrc), 0, get<std::uint32_t>(bytes, kHdrCrc), "header");
  if (const auto hb = get<std::uint32_t>(bytes, kHdrHeaderBytes); hb != kHeaderBytes) {
    fail<snapshot_format_error>(name, kHdrHeaderBytes, "header_bytes ", hb, ", expected ",
                                kHeaderBytes);
  }
  detail::check_zero(name, bytes, kHdrReserved, kHdrCrc - kHdrReserved, "header reserved");
  const auto file_bytes = get<std::uint64_t>(bytes, kHdrFileBytes);
  if (file_bytes != actual) {
    if (file_bytes > actual) {
      fail<snapshot_truncated_error>(name, actual, "file is ", actual,
                                     " bytes but its header says ", file_bytes, " (truncated)");
    }
    fail<snapshot_format_error>(name, kHdrFileBytes, "file is ", actual,
                                " bytes but its header says ", file_bytes,
                                " (trailing bytes after the last section)");
  }
  if (const auto t = get<std::uint64_t>(bytes, kHdrTableOffset); t != kHeaderBytes) {
    fail<snapshot_format_error>(name, kHdrTableOffset, "table_offset ", t, ", expected ",
                                kHeaderBytes);
  }
  const std::uint64_t num_sections = get<std::uint32_t>(bytes, kHdrNumSections);
  if (num_sections == 0 || num_sections > (actual - kHeaderBytes) / kEntryBytes) {
    fail<snapshot_format_error>(name, kHdrNumSections, "num_sections ", num_sections,
                                " does not fit a ", actual, "-byte file (at least 1, at most ",
                                (actual - kHeaderBytes) / kEntryBytes, ")");
  }

  // The table: entry checksums, then the payload layout.
  std::vector<Section> sections;
  sections.reserve(num_sections);
  std::uint64_t expect_offset = align_up(kHeaderBytes + num_sections * kEntryBytes);
  std::uint64_t prev_end = kHeaderBytes + num_sections * kEntryBytes;
  for (std::uint64_t i = 0; i < num_sections; ++i) {
    const std::uint64_t e = kHeaderBytes + i * kEntryBytes;
    detail::check_crc(name, bytes.subspan(e, kEntCrc), e, get<std::uint32_t>(bytes, e + kEntCrc),
                      "section table entry");
    const Section s{static_cast<SectionKind>(get<std::uint32_t>(bytes, e + kEntKind)),
                    get<std::uint32_t>(bytes, e + kEntFlags),
                    get<std::uint64_t>(bytes, e + kEntOffset),
                    get<std::uint64_t>(bytes, e + kEntSize)};
    if ((s.flags & ~kFlagOptional) != 0) {
      fail<snapshot_format_error>(name, e + kEntFlags, "section ", i, " has unknown flags ",
                                  detail::hex32(s.flags));
    }
    const auto kind = static_cast<std::uint32_t>(s.kind);
    if ((s.flags & kFlagOptional) != 0 && kind >= 1 && kind <= 3) {
      fail<snapshot_format_error>(name, e + kEntFlags, "section ", i, " of kind ", kind,
                                  " is marked optional, but kinds 1-3 are required");
    }
    if (s.offset != expect_offset) {
      fail<snapshot_format_error>(name, e + kEntOffset, "section ", i, " starts at ", s.offset,
                                  ", expected ", expect_offset);
    }
    if (s.offset > actual || s.size > actual - s.offset) {
      fail<snapshot_truncated_error>(name, e + kEntSize, "section ", i, " [", s.offset, ", +",
                                     s.size, ") extends past the end of the ", actual,
                                     "-byte file");
    }
    detail::check_zero(name, bytes, prev_end, s.offset - prev_end, "padding");
    prev_end = s.offset + s.size;
    expect_offset = align_up(prev_end);
    sections.push_back(s);
  }
  if (prev_end != actual) {
    fail<snapshot_format_error>(name, prev_end, "the last section ends at ", prev_end,
                                " but the file is ", actual, " bytes");
  }
  for (std::uint64_t i = 0; i < num_sections; ++i) {
    const Section& s = sections[i];
    const std::uint64_t e = kHeaderBytes + i * kEntryBytes;
    detail::check_crc(name, bytes.subspan(s.offset, s.size), s.offset,
                      get<std::uint32_t>(bytes, e + kEntPayloadCrc), "section payload");
  }

  // META.
  Parsed out;
  std::size_t next = 0;
  auto expect_section = [&](SectionKind kind, const char* what) -> const Section& {
    while (next < sections.size() && (sections[next].flags & kFlagOptional) != 0 &&
           sections[next].kind != kind) {
      ++next;  // optional sections this reader does not use
    }
    if (next == sections.size()) {
      fail<snapshot_format_error>(name, kHeaderBytes + next * kEntryBytes, "expected a ", what,
                                  " section as section ", next, ", but the table ends");
    }
    const Section& s = sections[next];
    if (s.kind != kind) {
      fail<snapshot_format_error>(name, kHeaderBytes + next * kEntryBytes + kEntKind, "section ",
                                  next, " has kind ", static_cast<std::uint32_t>(s.kind),
                                  ", expected ", static_cast<std::uint32_t>(kind), " (", what, ")");
    }
    ++next;
    return s;
  };
  if (sections.front().kind != SectionKind::meta) {
    fail<snapshot_format_error>(name, kHeaderBytes + kEntKind, "section 0 has kind ",
                                static_cast<std::uint32_t>(sections.front().kind),
                                ", but the first section must be META (1)");
  }
  const Section& meta = expect_section(SectionKind::meta, "META");
  const std::uint64_t m = meta.offset;
  out.meta_offset = m;
  if (meta.size != kMetaBytes) {
    fail<snapshot_format_error>(name, kHeaderBytes + kEntSize, "META is ", meta.size,
                                " bytes, expected ", kMetaBytes);
  }
  const auto policy = get<std::uint32_t>(bytes, m + kMetaPolicy);
  if (policy < 1 || policy > 4) {
    fail<snapshot_format_error>(name, m + kMetaPolicy, "unknown policy ", policy,
                                " (1 static, 2 dynamic, 3 sliding window, 4 paged)");
  }
  out.policy = static_cast<SnapshotPolicy>(policy);
  const auto dtype = get<std::uint32_t>(bytes, m + kMetaDtype);
  if (dtype > 4) {
    fail<snapshot_format_error>(name, m + kMetaDtype, "unknown dtype ", dtype,
                                " (0 f32, 1 f16, 2 bf16, 3 int8, 4 fp8)");
  }
  out.dtype = static_cast<DType>(dtype);
  auto count_field = [&](std::size_t off, const char* what, bool nonzero) {
    const std::uint64_t v = detail::get_count(name, bytes, m + off, what);
    if (nonzero && v == 0) fail<snapshot_format_error>(name, m + off, what, " is 0");
    return v;
  };
  const std::uint64_t layers = count_field(kMetaNumLayers, "num_layers", true);
  const std::uint64_t heads = count_field(kMetaNumKvHeads, "num_kv_heads", true);
  const std::uint64_t head_dim = count_field(kMetaHeadDim, "head_dim", true);
  const std::uint64_t row_elems =
      detail::mul_count(name, m + kMetaHeadDim, heads, head_dim, "num_kv_heads x head_dim");
  out.shape = CacheShape{static_cast<std::size_t>(layers), static_cast<std::size_t>(heads),
                         static_cast<std::size_t>(head_dim), out.dtype};
  SnapshotParams& p = out.params;
  p.max_batch = count_field(kMetaMaxBatch, "max_batch", true);
  const bool is_static = out.policy == SnapshotPolicy::static_cache;
  const bool is_dynamic = out.policy == SnapshotPolicy::dynamic_cache;
  const bool is_sliding = out.policy == SnapshotPolicy::sliding_window;
  const bool is_paged = out.policy == SnapshotPolicy::paged_cache;
  auto policy_field = [&](std::size_t off, const char* what, bool used, bool nonzero) {
    const std::uint64_t v = count_field(off, what, used && nonzero);
    if (!used && v != 0) {
      fail<snapshot_format_error>(name, m + off, what, " is ", v, " but ",
                                  snapshot_policy_name(out.policy), " does not use it (must be 0)");
    }
    return v;
  };
  p.max_seq_len = policy_field(kMetaMaxSeqLen, "max_seq_len", is_static || is_dynamic || is_paged,
                               is_static || is_paged);
  p.chunk_len = policy_field(kMetaChunkLen, "chunk_len", is_dynamic, true);
  p.window = policy_field(kMetaWindow, "window", is_sliding, true);
  p.num_sink_tokens = policy_field(kMetaNumSinks, "num_sink_tokens", is_sliding, false);
  p.max_append_len = policy_field(kMetaMaxAppendLen, "max_append_len", is_sliding, true);
  p.block_len = policy_field(kMetaBlockLen, "block_len", is_paged, true);
  std::uint64_t ring_len = 0;
  if (is_sliding && __builtin_add_overflow(p.window, p.max_append_len - 1, &ring_len)) {
    fail<snapshot_format_error>(name, m + kMetaWindow, "window + max_append_len overflows");
  }
  const auto flags = get<std::uint32_t>(bytes, m + kMetaFlags);
  if ((flags & ~(kMetaFlagTokenIds | kMetaFlagValueDtype)) != 0) {
    fail<snapshot_format_error>(name, m + kMetaFlags, "unknown META flags ", detail::hex32(flags));
  }
  out.has_token_ids = (flags & kMetaFlagTokenIds) != 0;
  const auto value_dtype = get<std::uint32_t>(bytes, m + kMetaValueDtype);
  if ((flags & kMetaFlagValueDtype) != 0) {
    if (value_dtype > 4 || value_dtype == dtype) {
      fail<snapshot_format_error>(name, m + kMetaValueDtype, "value_dtype ", value_dtype,
                                  value_dtype > 4
                                      ? " is unknown (0 f32, 1 f16, 2 bf16, 3 int8, 4 fp8)"
                                      : " equals dtype (META flags bit 1 means it differs)");
    }
    out.shape.value_dtype = static_cast<DType>(value_dtype);
  } else if (value_dtype != 0) {
    fail<snapshot_format_error>(name, m + kMetaValueDtype, "value_dtype ", value_dtype,
                                " without META flags bit 1 (must be 0)");
  }
  if (is_paged && !out.has_token_ids) {
    fail<snapshot_format_error>(name, m + kMetaFlags, "META flags ", detail::hex32(flags),
                                " lack bit 0 (token ids), which a PagedCache snapshot always has");
  }
  const auto id_len = get<std::uint32_t>(bytes, m + kMetaModelIdLen);
  if (id_len > kModelIdMaxBytes) {
    fail<snapshot_format_error>(name, m + kMetaModelIdLen, "model_id_len ", id_len, " exceeds ",
                                kModelIdMaxBytes);
  }
  out.model_id = bytes.subspan(m + kMetaModelId, id_len);
  detail::check_zero(name, bytes, m + kMetaModelId + id_len, kModelIdMaxBytes - id_len,
                     "model_id padding");
  detail::check_zero(name, bytes, m + kMetaReserved, kMetaBytes - kMetaReserved, "META reserved");
  const std::uint64_t num_sequences =
      detail::get_count(name, bytes, m + kMetaNumSequences, "num_sequences");
  if (num_sequences > num_sections) {
    fail<snapshot_format_error>(name, m + kMetaNumSequences, "num_sequences ", num_sequences,
                                " exceeds the ", num_sections, " sections of the file");
  }
  // Each sequence needs 1 + num_layers sections: bounds every allocation below by the table.
  if (num_sequences != 0 && layers > num_sections) {
    fail<snapshot_format_error>(name, m + kMetaNumLayers, "num_layers ", layers, " needs ", layers,
                                " LAYER_KV sections per sequence, but the file has ", num_sections,
                                " sections");
  }
  // K and V of one position: the elements, plus a scale per row for int8 and fp8.
  const auto side_row = [&](DType d) {
    return detail::mul_count(name, m + kMetaHeadDim, head_dim, dtype_bytes(d), "row bytes") +
           (dtype_scaled(d) ? 2 : 0);
  };
  const std::uint64_t token_bytes = detail::mul_count(
      name, m + kMetaHeadDim, heads, side_row(out.dtype) + side_row(out.shape.value_dtype),
      "K/V bytes per position");

  // SEQUENCE and LAYER_KV sections.
  out.sequences.reserve(num_sequences);
  for (std::uint64_t r = 0; r < num_sequences; ++r) {
    const Section& ss = expect_section(SectionKind::sequence, "SEQUENCE");
    Sequence seq;
    seq.section_offset = ss.offset;
    const std::uint64_t o = ss.offset;
    const std::uint64_t fixed = kSequenceFixedBytes + kLayerStateBytes * layers;
    if (ss.size < fixed) {
      fail<snapshot_format_error>(name, o, "SEQUENCE section of record ", r, " is ", ss.size,
                                  " bytes, too small for ", layers, " layer states");
    }
    seq.seq = detail::get_count(name, bytes, o + kSeqIndex, "seq");
    if (seq.seq >= p.max_batch) {
      fail<snapshot_format_error>(name, o + kSeqIndex, "sequence ", seq.seq,
                                  " is not below the saved max_batch ", p.max_batch);
    }
    seq.num_token_ids = detail::get_count(name, bytes, o + kSeqNumTokenIds, "num_token_ids");
    if ((ss.size - fixed) % sizeof(token_id) != 0 ||
        (ss.size - fixed) / sizeof(token_id) != seq.num_token_ids) {
      fail<snapshot_format_error>(name, o + kSeqNumTokenIds, "SEQUENCE of record ", r, " holds ",
                                  ss.size - fixed, " bytes of token ids but num_token_ids is ",
                                  seq.num_token_ids);
    }
    if (!out.has_token_ids && seq.num_token_ids != 0) {
      fail<snapshot_format_error>(name, o + kSeqNumTokenIds, "num_token_ids ", seq.num_token_ids,
                                  " but META says the snapshot has no token ids");
    }
    if (is_paged && seq.num_token_ids > p.max_seq_len) {
      fail<snapshot_format_error>(name, o + kSeqNumTokenIds, "sequence ", seq.seq, " has ",
                                  seq.num_token_ids, " token ids, more than the saved max_seq_len ",
                                  p.max_seq_len);
    }
    seq.token_ids_offset = o + fixed;
    seq.layers.resize(layers);
    for (std::uint64_t l = 0; l < layers; ++l) {
      const std::uint64_t so = seq.layer_state_offset(l);
      LayerState st;
      st.length = static_cast<position_t>(detail::get_count(name, bytes, so, "length"));
      st.sink_end = static_cast<position_t>(detail::get_count(name, bytes, so + 8, "sink_end"));
      st.recent_begin =
          static_cast<position_t>(detail::get_count(name, bytes, so + 16, "recent_begin"));
      bool ok = st.sink_end <= st.recent_begin && st.recent_begin <= st.length;
      if (is_static || is_dynamic || is_paged) {
        ok = ok && st.sink_end == 0 && st.recent_begin == 0 &&
             (p.max_seq_len == 0 || static_cast<std::uint64_t>(st.length) <= p.max_seq_len);
      } else {
        const auto sinks = static_cast<position_t>(p.num_sink_tokens);
        ok = ok && (st.length <= sinks
                        ? st.sink_end == st.length && st.recent_begin == st.length
                        : st.sink_end == sinks &&
                              static_cast<std::uint64_t>(st.length - st.recent_begin) <= ring_len);
      }
      if (!ok) {
        fail<snapshot_format_error>(name, so, "sequence ", seq.seq, " layer ", l, ": length ",
                                    st.length, ", sink_end ", st.sink_end, ", recent_begin ",
                                    st.recent_begin, " is not a state of the saved ",
                                    snapshot_policy_name(out.policy));
      }
      if (!is_paged && seq.num_token_ids > static_cast<std::uint64_t>(st.length)) {
        fail<snapshot_format_error>(name, o + kSeqNumTokenIds, "sequence ", seq.seq, " has ",
                                    seq.num_token_ids, " token ids but layer ", l, " holds only ",
                                    st.length, " positions");
      }
      seq.layers[l] = st;
    }
    // The paged-only sections of 8 bytes that may follow a SEQUENCE: the offset of the value, or
    // 0 when the next section is not of `kind`.
    auto paged_u64_section = [&](SectionKind kind, const char* what) -> std::uint64_t {
      if (next == sections.size() || sections[next].kind != kind) return 0;
      const Section& s = sections[next++];
      if (!is_paged) {
        fail<snapshot_format_error>(name, s.offset, what, " section in a snapshot of a ",
                                    snapshot_policy_name(out.policy), ", which has none");
      }
      if (s.size != 8) {
        fail<snapshot_format_error>(name, s.offset, what, " section of sequence ", seq.seq, " is ",
                                    s.size, " bytes, expected 8");
      }
      return s.offset;
    };
    static_assert(kExactPrefixBytes == 8 && kExtraKeyBytes == 8);
    if (const std::uint64_t at = paged_u64_section(SectionKind::exact_prefix, "EXACT_PREFIX")) {
      seq.exact_prefix = get<std::uint64_t>(bytes, at);
      if (seq.exact_prefix >= seq.num_token_ids) {
        fail<snapshot_format_error>(name, at, "exact_prefix ", seq.exact_prefix, " of sequence ",
                                    seq.seq, " is not below its ", seq.num_token_ids, " token ids");
      }
    }
    if (const std::uint64_t at = paged_u64_section(SectionKind::extra_key, "EXTRA_KEY")) {
      seq.extra_key = get<std::uint64_t>(bytes, at);
      if (seq.extra_key == 0) {
        fail<snapshot_format_error>(name, at, "EXTRA_KEY section of sequence ", seq.seq,
                                    " holds key 0, which is written as no section");
      }
    }
    seq.kv_offset.resize(layers);
    for (std::uint64_t l = 0; l < layers; ++l) {
      const Section& ks = expect_section(SectionKind::layer_kv, "LAYER_KV");
      const std::uint64_t k = ks.offset;
      const std::uint64_t held = seq.layers[l].held();
      const std::uint64_t elems =
          detail::mul_count(name, k + kKvHeld, 2 * held, row_elems, "LAYER_KV elements");
      (void)detail::mul_count(name, k + kKvHeld, held, token_bytes, "LAYER_KV bytes");
      (void)elems;  // checked first: the element count must fit too
      const std::uint64_t data =
          kv_payload(out.dtype, out.shape.value_dtype, held * heads, head_dim).end;
      if (ks.size < kLayerKvHeaderBytes || ks.size - kLayerKvHeaderBytes != data) {
        fail<snapshot_format_error>(name, k, "LAYER_KV of sequence ", seq.seq, " layer ", l, " is ",
                                    ks.size, " bytes, expected ", kLayerKvHeaderBytes, " + ", data,
                                    " for ", held, " positions");
      }
      if (const auto v = get<std::uint64_t>(bytes, k + kKvRecord); v != r) {
        fail<snapshot_format_error>(name, k + kKvRecord, "LAYER_KV names sequence record ", v,
                                    ", expected ", r);
      }
      if (const auto v = get<std::uint64_t>(bytes, k + kKvLayer); v != l) {
        fail<snapshot_format_error>(name, k + kKvLayer, "LAYER_KV names layer ", v, ", expected ",
                                    l);
      }
      if (const auto v = get<std::uint64_t>(bytes, k + kKvHeld); v != held) {
        fail<snapshot_format_error>(name, k + kKvHeld, "LAYER_KV holds ", v,
                                    " positions but its SEQUENCE says ", held);
      }
      detail::check_zero(name, bytes, k + kKvReserved, kLayerKvHeaderBytes - kKvReserved,
                         "LAYER_KV reserved");
      seq.kv_offset[l] = k + kLayerKvHeaderBytes;
    }
    out.sequences.push_back(std::move(seq));
  }
  {  // each sequence at most once: O(n log n) over the (file-bounded) records
    std::vector<std::pair<std::uint64_t, std::size_t>> order;
    order.reserve(out.sequences.size());
    for (std::size_t r = 0; r < out.sequences.size(); ++r)
      order.emplace_back(out.sequences[r].seq, r);
    std::sort(order.begin(), order.end());
    for (std::size_t i = 1; i < order.size(); ++i) {
      if (order[i].first == order[i - 1].first) {
        const Sequence& dup = out.sequences[std::max(order[i].second, order[i - 1].second)];
        fail<snapshot_format_error>(name, dup.section_offset + kSeqIndex, "sequence ", dup.seq,
                                    " saved twice");
      }
    }
  }
  for (; next < sections.size(); ++next) {
    if ((sections[next].flags & kFlagOptional) == 0) {
      fail<snapshot_format_error>(name, kHeaderBytes + next * kEntryBytes + kEntKind, "section ",
                                  next, " of kind ",
                                  static_cast<std::uint32_t>(sections[next].kind),
                                  " is not expected after the last sequence and not optional");
    }
  }
  return out;
}

}  // namespace snapshot_format
}  // namespace kvcache
