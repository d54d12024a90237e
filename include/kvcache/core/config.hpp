// SPDX-License-Identifier: Apache-2.0
// The shape every cache shares (layers, KV heads, head_dim, dtype), the basic index types, and the
// memory formula kv_cache_bytes().
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
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
  DType dtype = DType::f32;

  /// Elements of K (or V) for one token in one layer: num_kv_heads * head_dim.
  [[nodiscard]] constexpr std::size_t token_elems() const noexcept {
    return num_kv_heads * head_dim;
  }
  friend constexpr bool operator==(const CacheShape&, const CacheShape&) = default;
};

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

/// kv_cache_bytes() for a CacheShape: 2 x layers x kv_heads x seq_len x batch rows of
/// row_bytes(dtype, head_dim) each, that is head_dim x dtype_bytes, plus a 2-byte scale per row for
/// the quantized formats (int8, fp8). Llama-3-8B's shape at 4096 tokens in int8: 2 x 32 x 8 x 4096
/// x (128 + 2) = 272,629,760 bytes, 0.508 of fp16's.
[[nodiscard]] constexpr std::size_t kv_cache_bytes(const CacheShape& shape, std::size_t seq_len,
                                                   std::size_t batch = 1) {
  return kv_cache_bytes(shape.num_layers, shape.num_kv_heads, 1, seq_len,
                        row_bytes(shape.dtype, shape.head_dim), batch);
}

}  // namespace kvcache
