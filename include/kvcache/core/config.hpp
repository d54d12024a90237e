// SPDX-License-Identifier: Apache-2.0
// The shape every cache shares (layers, KV heads, head_dim, dtype), the basic index types, and the
// memory formula kv_cache_bytes().
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/format.hpp"
#include "kvcache/core/host_device.hpp"

namespace kvcache {

/// Absolute position of a token in its sequence (0 = first token). Signed so that window
/// arithmetic (p - window) never wraps; 64-bit so that unbounded sliding-window generation
/// never overflows.
using position_t = std::int64_t;

/// A token id of the model's vocabulary.
using token_id = std::int32_t;

/// Index of a block in a paged cache's pool, 0 .. num_blocks - 1 (host and device block tables).
using block_id = std::uint32_t;

/// "No block": the parent of a first block, an empty slot, a miss.
inline constexpr block_id kNoBlock = std::numeric_limits<block_id>::max();

/// Alignment, in bytes, of every K/V storage buffer kvcache allocates (a cache line; enough for
/// any SIMD load the kernels issue).
inline constexpr std::size_t kStorageAlignment = 64;

/// The model-side shape of a cache: what a K or V row of one token looks like in every layer.
struct CacheShape {
  std::size_t num_layers = 0;
  std::size_t num_kv_heads = 0;
  std::size_t head_dim = 0;
  /// The storage format of K, and of V unless value_dtype says otherwise.
  DType dtype = DType::f32;
  /// The storage format of V: dtype unless the cache stores KVFormats<K, V> with V in another
  /// format (a shape written {layers, heads, head_dim, dtype} has value_dtype == dtype).
  DType value_dtype = dtype;

  /// Elements of K (or V) for one token in one layer: num_kv_heads * head_dim.
  [[nodiscard]] constexpr std::size_t token_elems() const noexcept {
    return num_kv_heads * head_dim;
  }
  friend constexpr bool operator==(const CacheShape&, const CacheShape&) = default;
};

/// The CacheShape of a cache storing format F (one element type, or KVFormats<K, V>: dtype is K's,
/// value_dtype V's).
template <KVFormat F>
[[nodiscard]] constexpr CacheShape cache_shape(std::size_t num_layers, std::size_t num_kv_heads,
                                               std::size_t head_dim) noexcept {
  return {num_layers, num_kv_heads, head_dim, dtype_of<key_format_t<F>>,
          dtype_of<value_format_t<F>>};
}

namespace detail {

/// a * b, or throws capacity_error naming `what` when the product overflows size_t.
[[nodiscard]] constexpr std::size_t checked_mul(std::size_t a, std::size_t b, const char* what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw capacity_error(detail::message(what, ": ", a, " x ", b, " overflows size_t"));
  }
  return r;
}

/// Throws shape_error naming the first zero field of a cache configuration.
inline void require_nonzero(std::size_t value, const char* cache, const char* field) {
  if (value == 0) {
    throw shape_error(detail::message(cache, ": config field ", field, " must be at least 1"));
  }
}

/// @throws shape_error unless `value` fits the layout descriptor's int fields (KVLayout).
inline void require_int(std::size_t value, const char* cache, const char* field) {
  if (value > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw shape_error(detail::message(cache, ": config field ", field, " is ", value,
                                      ", more than the layout's limit 2^31 - 1"));
  }
}

}  // namespace detail

/// Bytes of K and V for a cache of the given shape:
/// 2 x layers x kv_heads x head_dim x seq_len x dtype_bytes x batch.
/// Example: Llama-3-8B (32 layers, 8 KV heads, head_dim 128), 4096 tokens, fp16, batch 1:
/// 2 x 32 x 8 x 128 x 4096 x 2 x 1 = 536,870,912 bytes (512 MiB).
/// @throws capacity_error when the product overflows size_t.
[[nodiscard]] constexpr std::size_t kv_cache_bytes(std::size_t num_layers, std::size_t num_kv_heads,
                                                   std::size_t head_dim, std::size_t seq_len,
                                                   std::size_t dtype_bytes, std::size_t batch = 1) {
  std::size_t n = 2;
  for (std::size_t f : {num_layers, num_kv_heads, head_dim, seq_len, dtype_bytes, batch}) {
    n = detail::checked_mul(n, f, "kv_cache_bytes");
  }
  return n;
}

/// kv_cache_bytes() for a CacheShape: layers x kv_heads x seq_len x batch K rows of
/// row_bytes(dtype, head_dim) each, that is head_dim x dtype_bytes, plus a 2-byte scale per row for
/// the quantized formats (int8, fp8), and as many V rows of row_bytes(value_dtype, head_dim).
/// Llama-3-8B's shape at 4096 tokens in int8: 2 x 32 x 8 x 4096 x (128 + 2) = 272,629,760 bytes,
/// 0.508 of fp16's; with f16 keys and int8 values: 32 x 8 x 4096 x (256 + 130) = 404,750,336,
/// 0.754.
/// @throws capacity_error when the product overflows size_t.
[[nodiscard]] constexpr std::size_t kv_cache_bytes(const CacheShape& shape, std::size_t seq_len,
                                                   std::size_t batch = 1) {
  const std::size_t k = row_bytes(shape.dtype, shape.head_dim);
  const std::size_t v = row_bytes(shape.value_dtype, shape.head_dim);
  std::size_t rows = 1;  // of each side
  for (std::size_t f : {shape.num_layers, shape.num_kv_heads, seq_len, batch}) {
    rows = detail::checked_mul(rows, f, "kv_cache_bytes");
  }
  std::size_t row_pair = 0;
  if (__builtin_add_overflow(k, v, &row_pair)) {
    throw capacity_error(
        detail::message("kv_cache_bytes: row bytes ", k, " + ", v, " overflow size_t"));
  }
  return detail::checked_mul(rows, row_pair, "kv_cache_bytes");
}

}  // namespace kvcache
