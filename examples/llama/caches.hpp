// SPDX-License-Identifier: Apache-2.0
// What the engine asks of a cache policy beyond CacheConcept (its attention window and append
// limit, read from the policy when it has them), and the runtime choice of policy (--cache) and
// K/V format (--kv-format): a CacheKind, a DType and with_cache(), which builds the cache and
// hands it to a generic lambda. The
// paged policy (PagedCache, automatic prefix caching) is a kvcache::PrefixCacheConcept: callers
// serve it by admit()-ing whole prompts instead of wrapping it in a TokenTrackedCache.
#pragma once

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvcache/core/cache_concept.hpp"
#include "kvcache/policy/dynamic_cache.hpp"
#include "kvcache/policy/paged_cache.hpp"
#include "kvcache/policy/sliding_window_cache.hpp"
#include "kvcache/policy/static_cache.hpp"
#include "llama/model.hpp"

namespace llama {

/// The attention mask a cache's contents call for: a sliding window of `window` positions plus
/// `num_sink_tokens` sinks, or window 0 for full causal attention.
struct AttentionWindow {
  std::size_t window = 0;
  std::size_t num_sink_tokens = 0;
  friend constexpr bool operator==(const AttentionWindow&, const AttentionWindow&) = default;
};

/// The window of a policy that has one (window() and num_sink_tokens(), as SlidingWindowCache),
/// looking through wrappers that expose cache() (TokenTrackedCache); {} otherwise.
template <class C>
[[nodiscard]] AttentionWindow attention_window(const C& c) noexcept {
  if constexpr (requires {
                  { c.window() } -> std::convertible_to<std::size_t>;
                  { c.num_sink_tokens() } -> std::convertible_to<std::size_t>;
                }) {
    return {c.window(), c.num_sink_tokens()};
  } else if constexpr (requires { c.cache(); }) {
    return attention_window(c.cache());
  } else {
    return {};
  }
}

/// The most tokens one append may carry (max_append_len() where the policy has it), looking
/// through wrappers; SIZE_MAX otherwise.
template <class C>
[[nodiscard]] std::size_t max_append_len(const C& c) noexcept {
  if constexpr (requires {
                  { c.max_append_len() } -> std::convertible_to<std::size_t>;
                }) {
    return c.max_append_len();
  } else if constexpr (requires { c.cache(); }) {
    return max_append_len(c.cache());
  } else {
    return std::numeric_limits<std::size_t>::max();
  }
}

/// The cache policies selectable at run time. Adding one: an enumerator, its name in
/// cache_kind_name(), and a branch in with_cache().
enum class CacheKind { dynamic, static_cache, sliding, paged };

[[nodiscard]] constexpr std::string_view cache_kind_name(CacheKind k) noexcept {
  switch (k) {
    case CacheKind::dynamic:
      return "dynamic";
    case CacheKind::static_cache:
      return "static";
    case CacheKind::sliding:
      return "sliding";
    case CacheKind::paged:
      return "paged";
  }
  return "?";
}

/// @throws usage_error listing the supported names.
[[nodiscard]] inline CacheKind parse_cache_kind(std::string_view name) {
  for (CacheKind k :
       {CacheKind::dynamic, CacheKind::static_cache, CacheKind::sliding, CacheKind::paged}) {
    if (name == cache_kind_name(k)) return k;
  }
  throw usage_error("--cache " + std::string(name) +
                    ": unknown cache policy; supported: dynamic, static, sliding, paged");
}

/// A K/V storage format selectable at run time (--kv-format): one format for K and V, or K and V
/// in different formats (a kvcache::KVFormats<K, V> cache), named "f16" or "f16+int8".
struct KvFormat {
  kvcache::DType k = kvcache::DType::f32;
  kvcache::DType v = kvcache::DType::f32;

  constexpr KvFormat() noexcept = default;
  /// One format for both (implicit: a DType names a format).
  constexpr KvFormat(kvcache::DType both) noexcept : k(both), v(both) {}
  constexpr KvFormat(kvcache::DType key, kvcache::DType value) noexcept : k(key), v(value) {}

  /// "f16", or "f16+int8" (K's format, then V's).
  [[nodiscard]] std::string name() const {
    return k == v ? std::string(kvcache::dtype_name(k))
                  : std::string(kvcache::dtype_name(k)) + "+" + kvcache::dtype_name(v);
  }
  friend constexpr bool operator==(const KvFormat&, const KvFormat&) = default;
};

/// The formats --kv-format offers: each of the library's, and f16 keys with int8 values (each
/// format here is compiled into every cached scenario; the library takes any pair).
inline constexpr KvFormat kKvFormats[] = {
    kvcache::DType::f32, kvcache::DType::f16,  kvcache::DType::bf16,
    kvcache::DType::i8,  kvcache::DType::e4m3, KvFormat(kvcache::DType::f16, kvcache::DType::i8)};

/// @throws usage_error listing the supported names.
[[nodiscard]] inline KvFormat parse_kv_format(std::string_view name) {
  std::string supported;
  for (const KvFormat& f : kKvFormats) {
    if (name == f.name()) return f;
    supported += (supported.empty() ? "" : ", ") + f.name();
  }
  throw usage_error("--kv-format " + std::string(name) +
                    ": unknown K/V format; supported: " + supported);
}

/// Calls f(std::type_identity<T>{}) with the storage type of format `d` (one of kKvFormats: an
/// element type, or KVFormats<half, qint8>).
template <class F>
decltype(auto) with_kv_format(const KvFormat& d, F&& f) {
  if (d == KvFormat(kvcache::DType::f16, kvcache::DType::i8)) {
    return f(std::type_identity<kvcache::KVFormats<kvcache::half, kvcache::qint8>>{});
  }
  switch (d.k) {
    case kvcache::DType::f16:
      return f(std::type_identity<kvcache::half>{});
    case kvcache::DType::bf16:
      return f(std::type_identity<kvcache::bfloat16>{});
    case kvcache::DType::i8:
      return f(std::type_identity<kvcache::qint8>{});
    case kvcache::DType::e4m3:
      return f(std::type_identity<kvcache::fp8_e4m3>{});
    case kvcache::DType::f32:
      break;
  }
  return f(std::type_identity<float>{});
}

/// What with_cache() needs to size a cache; each policy reads the fields it uses.
struct CacheParams {
  /// How K/V is stored: f32 (the reference), f16, bf16, quantized int8 / fp8, or f16 keys with
  /// int8 values (kKvFormats).
  KvFormat format = kvcache::DType::f32;
  std::size_t max_batch = 1;
  /// static: slots per sequence; dynamic: limit (0 = unbounded).
  std::size_t max_seq_len = 0;
  /// dynamic: tokens per allocated chunk.
  std::size_t chunk_len = 256;
  /// sliding: attention window and sinks.
  std::size_t window = 256;
  std::size_t num_sink_tokens = 4;
  /// sliding: the longest single append (the engine's prefill chunk is capped to it).
  std::size_t max_append_len = 64;
  /// paged: tokens per block, and blocks in the pool (0: max_batch x ceil(max_seq_len /
  /// block_size), room for every slot at full length without any sharing). Cached blocks are
  /// evicted, least recently released first, when the pool runs out.
  std::size_t block_size = 16;
  std::size_t num_blocks = 0;

  /// The pool of a paged cache whose sequences reach seq_len tokens.
  [[nodiscard]] std::size_t paged_num_blocks(std::size_t seq_len) const noexcept {
    return num_blocks != 0 ? num_blocks : max_batch * ((seq_len + block_size - 1) / block_size);
  }
};

/// A cache of policy kKind (StaticCache, SlidingWindowCache, PagedCache or DynamicCache) storing
/// T, shaped for `model` with the fields of `p` that policy reads (p.format is not read); paged
/// with max_seq_len 0 is sized for the model's seq_len.
/// @throws what the policy's constructor throws (shape_error, bad_alloc).
template <CacheKind kKind, kvcache::KVFormat T>
[[nodiscard]] auto make_cache(const Model& model, const CacheParams& p) {
  const ModelConfig& c = model.config();
  if constexpr (kKind == CacheKind::static_cache) {
    return kvcache::StaticCache<T>({.num_layers = c.num_layers,
                                    .num_kv_heads = c.num_kv_heads,
                                    .head_dim = c.head_dim(),
                                    .max_batch = p.max_batch,
                                    .max_seq_len = p.max_seq_len});
  } else if constexpr (kKind == CacheKind::sliding) {
    return kvcache::SlidingWindowCache<T>({.num_layers = c.num_layers,
                                           .num_kv_heads = c.num_kv_heads,
                                           .head_dim = c.head_dim(),
                                           .max_batch = p.max_batch,
                                           .window = p.window,
                                           .num_sink_tokens = p.num_sink_tokens,
                                           .max_append_len = p.max_append_len});
  } else if constexpr (kKind == CacheKind::paged) {
    const std::size_t seq_len =
        std::max<std::size_t>(1, p.max_seq_len != 0 ? p.max_seq_len : c.seq_len);
    return kvcache::PagedCache<T>({.num_layers = c.num_layers,
                                   .num_kv_heads = c.num_kv_heads,
                                   .head_dim = c.head_dim(),
                                   .num_blocks = p.paged_num_blocks(seq_len),
                                   .block_size = p.block_size,
                                   .max_batch = p.max_batch,
                                   .max_seq_len = seq_len,
                                   .evict_when_full = true});
  } else {
    static_assert(kKind == CacheKind::dynamic);
    return kvcache::DynamicCache<T>({.num_layers = c.num_layers,
                                     .num_kv_heads = c.num_kv_heads,
                                     .head_dim = c.head_dim(),
                                     .max_batch = p.max_batch,
                                     .max_seq_len = p.max_seq_len,
                                     .chunk_len = p.chunk_len});
  }
}

/// Builds a cache of policy `kind` storing T (make_cache) and returns f(cache).
/// Every branch instantiates f for its policy and format, so f must be generic (auto&) and
/// return the same type for each (a caller that needs one policy only: make_cache).
/// @throws as make_cache.
template <kvcache::KVFormat T, class F>
decltype(auto) with_cache_as(CacheKind kind, const Model& model, const CacheParams& p, F&& f) {
  switch (kind) {
    case CacheKind::static_cache: {
      auto cache = make_cache<CacheKind::static_cache, T>(model, p);
      return f(cache);
    }
    case CacheKind::sliding: {
      auto cache = make_cache<CacheKind::sliding, T>(model, p);
      return f(cache);
    }
    case CacheKind::paged: {
      auto cache = make_cache<CacheKind::paged, T>(model, p);
      return f(cache);
    }
    case CacheKind::dynamic:
    default: {
      auto cache = make_cache<CacheKind::dynamic, T>(model, p);
      return f(cache);
    }
  }
}

/// with_cache_as() in the format p.format names.
template <class F>
decltype(auto) with_cache(CacheKind kind, const Model& model, const CacheParams& p, F&& f) {
  return with_kv_format(p.format, [&](auto format) -> decltype(auto) {
    return with_cache_as<typename decltype(format)::type>(kind, model, p, f);
  });
}

}  // namespace llama
