// SPDX-License-Identifier: Apache-2.0
// CacheConcept: the contract every cache policy (dynamic, static, sliding window, paged) meets,
// and the argument checks the policies share at their API boundary.
#pragma once

#include <concepts>
#include <cstddef>

#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/view.hpp"

namespace kvcache {

/// A KV cache policy.
///
/// Requirements (for `C c`, `const C cc`, `std::size_t layer, seq, n`, and K/V blocks `k`, `v`
/// of type TokenBlock<const float>, or TokenBlock<const C::value_type> when value_type is f32,
/// f16 or bf16):
///  1. `C::value_type` is the stored format: an element type, or KVFormats<K, V> for keys and
///     values stored in different formats; `C::view_type` models KVView over it.
///  2. `c.append(layer, seq, k, v)`: stores n = k.num_tokens >= 1 new tokens of one layer of one
///     sequence, k and v shaped [n][num_kv_heads][head_dim]. float input is rounded to
///     value_type (nearest even), value_type input is copied; a quantized format (qint8,
///     fp8_e4m3) takes float input only and quantizes each row with its own scale
///     (core/format.hpp quantize_row: a row holding inf or NaN reads back as NaN); a KVFormats
///     pair takes float input only, k written in K's format and v in V's. The tokens take
///     the positions
///     layer_length(layer, seq), ..., + n - 1. Values are stored as the IEEE conversion gives
///     them: a float beyond half's or bfloat16's range becomes ±inf, NaN stays NaN; append
///     neither saturates nor throws (attention then gives NaN for the rows that see them).
///  3. `cc.view(layer, seq)` -> view_type over what that layer holds for that sequence, with
///     length() == layer_length(layer, seq); valid until the next mutating call.
///  4. `cc.layer_length(layer, seq)` and `cc.seq_length(seq)` -> std::size_t: positions appended
///     to a layer; seq_length is layer 0's (all layers agree between forward passes).
///  5. `cc.capacity()` -> std::size_t: the largest seq_length a sequence may reach
///     (SIZE_MAX when unbounded); `cc.max_batch()` -> std::size_t: sequences are 0..max_batch-1.
///  6. `cc.can_crop(seq, n)` -> bool and `c.crop(seq, n)`: roll every layer back to at most n
///     tokens (e.g. rejected speculative tokens). crop throws position_error exactly when
///     can_crop is false (n > seq_length, or a sliding window already evicted what it needs).
///  7. `c.reset(seq)`: forget the sequence (length 0 in every layer; memory may be released).
///  8. `cc.memory_bytes()` -> std::size_t: bytes of K/V storage the cache holds right now.
///  9. `cc.shape()` -> CacheShape, with shape().dtype the dtype of K's format and
///     shape().value_dtype that of V's (both dtype_of<value_type> for one format).
///
/// Semantics the compiler cannot check: bad arguments throw a kvcache::error subclass
/// (layer_error, batch_error, shape_error, capacity_error, position_error) whose message names
/// the numbers, and leave the cache exactly as it was (strong guarantee). Sequences never share
/// or see each other's tokens unless a policy documents sharing (the paged prefix cache).
template <class C>
concept CacheConcept = requires(C& c, const C& cc, std::size_t layer, std::size_t seq,
                                std::size_t n, TokenBlock<const float> kv_float) {
  typename C::value_type;
  typename C::view_type;
  requires KVView<typename C::view_type>;
  requires std::same_as<typename C::view_type::value_type, typename C::value_type>;
  requires(!Element<typename C::value_type>) ||
      requires(TokenBlock<const typename C::value_type> kv) {
    { c.append(layer, seq, kv, kv) } -> std::same_as<void>;
  };
  { c.append(layer, seq, kv_float, kv_float) } -> std::same_as<void>;
  { cc.view(layer, seq) } -> std::same_as<typename C::view_type>;
  { cc.layer_length(layer, seq) } -> std::same_as<std::size_t>;
  { cc.seq_length(seq) } -> std::same_as<std::size_t>;
  { cc.capacity() } -> std::same_as<std::size_t>;
  { cc.max_batch() } -> std::same_as<std::size_t>;
  { cc.can_crop(seq, n) } -> std::same_as<bool>;
  { c.crop(seq, n) } -> std::same_as<void>;
  { c.reset(seq) } -> std::same_as<void>;
  { cc.memory_bytes() } -> std::same_as<std::size_t>;
  { cc.shape() } -> std::same_as<CacheShape>;
};

namespace detail {

/// @throws layer_error unless layer < num_layers.
inline void check_layer(const char* cache, std::size_t layer, std::size_t num_layers) {
  if (layer >= num_layers) {
    throw layer_error(
        detail::message(cache, ": layer ", layer, " out of range (num_layers ", num_layers, ")"));
  }
}

/// @throws batch_error unless seq < max_batch.
inline void check_seq(const char* cache, std::size_t seq, std::size_t max_batch) {
  if (seq >= max_batch) {
    throw batch_error(
        detail::message(cache, ": sequence ", seq, " out of range (max_batch ", max_batch, ")"));
  }
}

/// Validates new K/V for an append against the cache shape and returns the token count.
/// @throws shape_error for zero tokens, mismatched k/v, or a shape other than
///         [n][num_kv_heads][head_dim].
template <class U>
std::size_t check_kv_input(const char* cache, const CacheShape& shape, const TokenBlock<U>& k,
                           const TokenBlock<U>& v) {
  k.validate("append: k");
  v.validate("append: v");
  if (k.num_tokens == 0) {
    throw shape_error(detail::message(cache, ": zero-length append (n must be >= 1)"));
  }
  if (k.num_tokens != v.num_tokens) {
    throw shape_error(detail::message(cache, ": append of ", k.num_tokens, " K tokens but ",
                                      v.num_tokens, " V tokens"));
  }
  for (const TokenBlock<U>* t : {&k, &v}) {
    if (t->num_heads != shape.num_kv_heads || t->head_dim != shape.head_dim) {
      throw shape_error(detail::message(cache, ": append ", t == &k ? "k" : "v", " has [",
                                        t->num_heads, " heads][head_dim ", t->head_dim,
                                        "] but the cache has [", shape.num_kv_heads,
                                        " heads][head_dim ", shape.head_dim, "]"));
    }
  }
  return k.num_tokens;
}

/// @throws position_error for crop(seq, n) with n > seq_length.
inline void check_crop_length(const char* cache, std::size_t seq, std::size_t n,
                              std::size_t length) {
  if (n > length) {
    throw position_error(detail::message(cache, ": crop of sequence ", seq, " to ", n,
                                         " tokens, but it holds only ", length));
  }
}

/// Writes n token rows of one KV head from an append block into [n][head_dim] destination rows
/// in format T (core/format.hpp: copied, rounded, or quantized with one scale per row into
/// `scales`, which quantized formats need and the others ignore).
template <KVElement T, class U>
void store_rows(T* dst, scale_type* scales, const TokenBlock<const U>& src, std::size_t first_token,
                std::size_t n, std::size_t head) noexcept {
  detail::write_rows(dst, scales, src.row(first_token, head), src.token_elems(), n, src.head_dim);
}

}  // namespace detail
}  // namespace kvcache
