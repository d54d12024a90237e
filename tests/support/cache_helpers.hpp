// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the cache tests: random token K/V, rounding through an element type, filling
// a cache in chunks, checking a view's invariants, and from-scratch reference attention.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"

namespace kvcache::test {

/// K and V of `tokens` tokens for one layer: [tokens][heads][dim] floats each.
struct TokenKV {
  std::vector<float> k, v;
  std::size_t tokens = 0, heads = 0, dim = 0;

  [[nodiscard]] TokenBlock<const float> k_block(std::size_t first, std::size_t n) const {
    return {std::span<const float>(k).subspan(first * heads * dim, n * heads * dim), n, heads, dim};
  }
  [[nodiscard]] TokenBlock<const float> v_block(std::size_t first, std::size_t n) const {
    return {std::span<const float>(v).subspan(first * heads * dim, n * heads * dim), n, heads, dim};
  }
};

inline TokenKV random_kv(std::mt19937_64& rng, std::size_t tokens, std::size_t heads,
                         std::size_t dim) {
  return {normal_floats(rng, tokens * heads * dim), normal_floats(rng, tokens * heads * dim),
          tokens, heads, dim};
}

/// Each value rounded to T and back (what a cache of T stores for float input).
template <Element T>
std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_float(from_float<T>(x[i]));
  return out;
}

/// What a cache of format T stores for float rows of `dim` values: each row rounded, or quantized
/// with its own scale, and read back.
template <KVElement T>
std::vector<float> rounded(const std::vector<float>& x, std::size_t dim) {
  std::vector<float> out(x.size());
  std::vector<T> codes(dim);
  for (std::size_t r = 0; r < x.size() / dim; ++r) {
    scale_type scale;
    quantize_row(x.data() + r * dim, dim, codes.data(), &scale);
    dequantize_row(codes.data(), &scale, dim, out.data() + r * dim);
  }
  return out;
}

/// Appends tokens [first, first + n) of `kv` to `layer` of `seq`, in chunks of the given sizes
/// (cycled), each chunk no longer than `max_chunk`.
template <class Cache>
void append_in_chunks(Cache& cache, std::size_t layer, std::size_t seq, const TokenKV& kv,
                      std::size_t first, std::size_t n, const std::vector<std::size_t>& sizes) {
  std::size_t done = 0;
  for (std::size_t i = 0; done < n; ++i) {
    const std::size_t c = std::min(sizes[i % sizes.size()], n - done);
    cache.append(layer, seq, kv.k_block(first + done, c), kv.v_block(first + done, c));
    done += c;
  }
}

/// Checks KVView requirement 5 (ordered, non-empty, disjoint segments covering exactly
/// [0, sink_end) and [recent_begin, length)) and returns the positions in order.
template <KVView V>
std::vector<position_t> check_view_invariants(const V& view) {
  REQUIRE(view.sink_end() >= 0);
  REQUIRE(view.sink_end() <= view.recent_begin());
  REQUIRE(view.recent_begin() <= view.length());
  std::vector<position_t> expect;
  for (position_t p = 0; p < view.sink_end(); ++p) expect.push_back(p);
  for (position_t p = view.recent_begin(); p < view.length(); ++p) expect.push_back(p);
  std::vector<position_t> got;
  for (std::size_t i = 0; i < view.num_segments(); ++i) {
    const auto seg = view.segment(i);
    REQUIRE(seg.len > 0);
    for (std::size_t j = 0; j < seg.len; ++j)
      got.push_back(seg.first_pos + static_cast<position_t>(j));
  }
  REQUIRE(got == expect);
  REQUIRE(view_num_tokens(view) == got.size());
  return got;
}

/// Reference attention recomputed from scratch over tokens [0, num_keys) of `kv` (positions
/// 0..num_keys-1), with queries q at positions first_q, first_q + 1, ...
inline std::vector<float> scratch_attention(const std::vector<float>& q, std::size_t num_q,
                                            std::size_t q_heads, const std::vector<float>& k,
                                            const std::vector<float>& v, std::size_t num_keys,
                                            std::size_t kv_heads, std::size_t dim,
                                            position_t first_q, const AttentionOptions& opts) {
  std::vector<position_t> q_pos(num_q), k_pos(num_keys);
  for (std::size_t i = 0; i < num_q; ++i) q_pos[i] = first_q + static_cast<position_t>(i);
  for (std::size_t i = 0; i < num_keys; ++i) k_pos[i] = static_cast<position_t>(i);
  std::vector<float> out(num_q * q_heads * dim);
  const std::size_t used = num_keys * kv_heads * dim;
  reference::attend_dense({q, num_q, q_heads, dim}, q_pos,
                          {std::span<const float>(k).first(used), num_keys, kv_heads, dim},
                          {std::span<const float>(v).first(used), num_keys, kv_heads, dim}, k_pos,
                          {out, num_q, q_heads, dim}, opts);
  return out;
}

/// Snapshot of everything a view exposes (positions and converted K/V) for "unchanged" checks.
template <KVView V>
std::vector<float> view_contents(const V& view) {
  std::vector<float> k, v;
  std::vector<position_t> pos;
  reference::gather_view(view, k, v, pos);
  std::vector<float> all(k);
  all.insert(all.end(), v.begin(), v.end());
  for (position_t p : pos) all.push_back(static_cast<float>(p));
  all.push_back(static_cast<float>(view.length()));
  return all;
}

/// Contents of every (layer, sequence) of a cache, for strong-guarantee checks.
template <class Cache>
std::vector<std::vector<float>> cache_contents(const Cache& cache) {
  std::vector<std::vector<float>> all;
  for (std::size_t l = 0; l < cache.shape().num_layers; ++l) {
    for (std::size_t s = 0; s < cache.max_batch(); ++s)
      all.push_back(view_contents(cache.view(l, s)));
  }
  return all;
}

}  // namespace kvcache::test
