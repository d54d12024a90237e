// SPDX-License-Identifier: Apache-2.0
// The Llama forward pass over any kvcache policy: RMSNorm, RoPE at each token's absolute position
// (the cache's length before the append), K/V appended to the cache, GQA attention through
// kvcache::attend, SwiGLU FFN, classifier. A prompt chunk runs as one batch of GEMMs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/attention/attend.hpp"
#include "kvcache/attention/rope.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/thread_pool.hpp"
#include "kvcache/policy/dynamic_cache.hpp"
#include "llama/caches.hpp"
#include "llama/gemm.hpp"
#include "llama/model.hpp"

namespace llama {

/// RMSNorm epsilon and RoPE of llama2.c's run.c (base 10000, adjacent pairs, every dimension).
inline constexpr float kNormEps = 1e-5f;
inline constexpr kvcache::RopeConfig kRope{.base = 10000.0f};

/// Runs a Model: owns the scratch buffers of one forward pass (sized for `max_chunk` tokens) and
/// an internal scratch cache for cache-less passes. One Engine serves one caller at a time; the
/// model may be shared by several engines.
class Engine {
 public:
  /// @param pool executor for the GEMMs and attention (nullptr: the calling thread only).
  /// @param max_chunk the most prompt tokens run as one batch; longer prompts run in chunks.
  /// @throws usage_error for max_chunk 0; std::bad_alloc.
  explicit Engine(const Model& model, kvcache::ThreadPool* pool = nullptr,
                  std::size_t max_chunk = 256)
      : model_(&model),
        pool_(pool),
        max_chunk_(max_chunk),
        rope_(kRope, model.config().head_dim()),
        scratch_({.num_layers = model.config().num_layers,
                  .num_kv_heads = model.config().num_kv_heads,
                  .head_dim = model.config().head_dim()}) {
    if (max_chunk == 0) throw usage_error("Engine: max_chunk must be at least 1");
    const ModelConfig& c = model.config();
    const std::size_t n = max_chunk;
    x_.resize(n * c.dim);
    xb_.resize(n * c.dim);
    qkv_.resize(n * (c.dim + 2 * c.kv_dim()));
    q_.resize(n * c.dim);
    k_.resize(n * c.kv_dim());
    v_.resize(n * c.kv_dim());
    att_.resize(n * c.dim);
    ffn_.resize(n * 2 * c.hidden_dim);
    hb_.resize(n * c.hidden_dim);
    cos_.resize(n * c.head_dim() / 2);
    sin_.resize(n * c.head_dim() / 2);
    last_.resize(c.dim);
    logits_.resize(c.vocab_size);
  }

  /// How attention sees the sinks of a sliding window (kvcache::PositionMode): absolute (the
  /// default) or cache_relative, which keeps every query-key distance within window + sinks, so
  /// a model keeps its quality however far a sliding window has moved past its training length.
  void set_positions(kvcache::PositionMode mode) noexcept { positions_ = mode; }
  [[nodiscard]] kvcache::PositionMode positions() const noexcept { return positions_; }

  [[nodiscard]] const Model& model() const noexcept { return *model_; }
  [[nodiscard]] kvcache::ThreadPool* pool() const noexcept { return pool_; }
  [[nodiscard]] std::size_t max_chunk() const noexcept { return max_chunk_; }

  /// Runs `tokens` at the positions after what sequence `seq` of `cache` holds (p0 =
  /// seq_length(seq), then p0 + 1, ...), appends their K/V to every layer, and returns the
  /// logits [vocab_size] of the last token (valid until the next call). Attention uses the
  /// cache's own window and sinks (attention_window). Prompts longer than min(max_chunk,
  /// max_append_len(cache)) run in chunks, each as one batch of matrix-matrix products.
  /// O(tokens x (weights + num_heads x head_dim x visible keys)).
  /// @throws kvcache::shape_error (no tokens, a cache shaped for another model),
  ///         usage_error (a token id outside the vocabulary), kvcache::capacity_error (the
  ///         tokens do not fit the cache), kvcache::position_error (layers of seq disagree), the
  ///         cache's batch_error; all before anything is appended. If a later step throws
  ///         (std::bad_alloc), seq is cropped back to p0 where the policy can, else reset.
  template <kvcache::CacheConcept C>
  std::span<const float> forward(C& cache, std::size_t seq, std::span<const token_id> tokens) {
    return forward(cache, seq, tokens, attention_window(cache));
  }

  /// forward() with an explicit attention window instead of the cache's (e.g. to run a
  /// cache-less pass that attends exactly like a sliding window cache).
  template <kvcache::CacheConcept C>
  std::span<const float> forward(C& cache, std::size_t seq, std::span<const token_id> tokens,
                                 const AttentionWindow& window) {
    const std::size_t p0 = check_forward(cache, seq, tokens);
    const std::size_t chunk = std::min(max_chunk_, max_append_len(cache));
    try {
      for (std::size_t done = 0; done < tokens.size(); done += chunk) {
        const std::size_t n = std::min(chunk, tokens.size() - done);
        run_chunk(cache, seq, tokens.subspan(done, n), window, done + n == tokens.size());
      }
    } catch (...) {
      if (cache.can_crop(seq, p0)) {
        cache.crop(seq, p0);
      } else {
        cache.reset(seq);
      }
      throw;
    }
    return logits_;
  }

  /// Logits after `tokens` computed with no K/V kept from any earlier call: every token's K/V
  /// is recomputed in this pass (a scratch cache emptied first). With a window, attention is
  /// masked exactly as a SlidingWindowCache with that window and sinks would mask it.
  /// @throws as forward().
  std::span<const float> forward_uncached(std::span<const token_id> tokens,
                                          const AttentionWindow& window = {}) {
    return forward_uncached(scratch_, tokens, window);
  }

  /// forward_uncached() with the pass's K/V held in `scratch` (sequence 0, emptied first): a
  /// cache of another storage format (f16, int8, ...) makes the pass store K/V exactly as a
  /// cache of that format does, so that it recomputes that cache's results bit for bit.
  template <kvcache::CacheConcept C>
  std::span<const float> forward_uncached(C& scratch, std::span<const token_id> tokens,
                                          const AttentionWindow& window = {}) {
    scratch.reset(0);
    return forward(scratch, 0, tokens, window);
  }

 private:
  template <class C>
  std::size_t check_forward(const C& cache, std::size_t seq, std::span<const token_id> tokens) {
    using kvcache::detail::message;
    const ModelConfig& c = model_->config();
    if (tokens.empty()) throw kvcache::shape_error("Engine::forward: no tokens to run");
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || static_cast<std::size_t>(tokens[i]) >= c.vocab_size) {
        throw usage_error(message("Engine::forward: token ", i, " has id ", tokens[i],
                                  ", outside the vocabulary [0, ", c.vocab_size, ")"));
      }
    }
    const kvcache::CacheShape want =
        model_->cache_shape(cache.shape().dtype, cache.shape().value_dtype);
    if (cache.shape() != want) {
      throw kvcache::shape_error(
          message("Engine::forward: the cache has ", cache.shape().num_layers, " layers x ",
                  cache.shape().num_kv_heads, " KV heads x head_dim ", cache.shape().head_dim,
                  " but the model needs ", want.num_layers, " x ", want.num_kv_heads, " x ",
                  want.head_dim));
    }
    const std::size_t p0 = cache.seq_length(seq);
    for (std::size_t l = 1; l < c.num_layers; ++l) {
      if (cache.layer_length(l, seq) != p0) {
        throw kvcache::position_error(message("Engine::forward: sequence ", seq, " holds ", p0,
                                              " tokens in layer 0 but ", cache.layer_length(l, seq),
                                              " in layer ", l));
      }
    }
    if (tokens.size() > cache.capacity() - p0) {
      throw kvcache::capacity_error(message("Engine::forward: ", tokens.size(),
                                            " tokens do not fit sequence ", seq, " (holds ", p0,
                                            ", capacity ", cache.capacity(), ")"));
    }
    return p0;
  }

  // Per-row helpers. rmsnorm as run.c: w * x / sqrt(mean(x^2) + eps), the sum in float.
  static void rmsnorm(const float* x, const float* w, float* out, std::size_t d) noexcept {
    float ss = 0.0f;
    for (std::size_t i = 0; i < d; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + kNormEps);
    for (std::size_t i = 0; i < d; ++i) out[i] = w[i] * (inv * x[i]);
  }

  template <class C>
  void run_chunk(C& cache, std::size_t seq, std::span<const token_id> tokens,
                 const AttentionWindow& window, bool want_logits) {
    const ModelConfig& c = model_->config();
    const std::size_t n = tokens.size(), d = c.dim, kv = c.kv_dim(), hd = c.head_dim();
    const std::size_t h = c.hidden_dim, wide = d + 2 * kv, half = hd / 2;
    const std::size_t p0 = cache.seq_length(seq);
    for (std::size_t t = 0; t < n; ++t) model_->embed(tokens[t], x_.data() + t * d);
    for (std::size_t t = 0; t < n; ++t) {
      rope_.angles(static_cast<double>(p0 + t), cos_.data() + t * half, sin_.data() + t * half);
    }
    const kvcache::AttentionOptions attn{.window = window.window,
                                         .num_sink_tokens = window.num_sink_tokens,
                                         .pool = pool_,
                                         .positions = positions_,
                                         .rope = &rope_};
    for (std::size_t l = 0; l < c.num_layers; ++l) {
      const Model::Layer& layer = model_->layers()[l];
      for (std::size_t t = 0; t < n; ++t) {
        rmsnorm(x_.data() + t * d, layer.rms_att.data(), xb_.data() + t * d, d);
      }
      matmul(xb_.data(), n, d, layer.wqkv, qkv_.data(), wide, false, pool_);
      for (std::size_t t = 0; t < n; ++t) {
        const float* row = qkv_.data() + t * wide;
        std::copy(row, row + d, q_.data() + t * d);
        std::copy(row + d, row + d + kv, k_.data() + t * kv);
        std::copy(row + d + kv, row + wide, v_.data() + t * kv);
        rope_.rotate(q_.data() + t * d, c.num_heads, cos_.data() + t * half,
                     sin_.data() + t * half);
        rope_.rotate(k_.data() + t * kv, c.num_kv_heads, cos_.data() + t * half,
                     sin_.data() + t * half);
      }
      const std::span<const float> k(k_.data(), n * kv), v(v_.data(), n * kv);
      cache.append(l, seq, kvcache::TokenBlock<const float>{k, n, c.num_kv_heads, hd},
                   kvcache::TokenBlock<const float>{v, n, c.num_kv_heads, hd});
      kvcache::attend(
          kvcache::TokenBlock<const float>{std::span<const float>(q_.data(), n * d), n, c.num_heads,
                                           hd},
          cache.view(l, seq),
          kvcache::TokenBlock<float>{std::span<float>(att_.data(), n * d), n, c.num_heads, hd},
          attn);
      matmul(att_.data(), n, d, layer.wo, x_.data(), d, true, pool_);  // x += attention
      for (std::size_t t = 0; t < n; ++t) {
        rmsnorm(x_.data() + t * d, layer.rms_ffn.data(), xb_.data() + t * d, d);
      }
      matmul(xb_.data(), n, d, layer.w13, ffn_.data(), 2 * h, false, pool_);
      for (std::size_t t = 0; t < n; ++t) {
        const float* g = ffn_.data() + t * 2 * h;  // w1 x, then w3 x
        float* out = hb_.data() + t * h;
        for (std::size_t j = 0; j < h; ++j) {
          const float a = g[j];
          out[j] = a * (1.0f / (1.0f + std::exp(-a))) * g[h + j];  // silu(w1 x) * (w3 x)
        }
      }
      matmul(hb_.data(), n, h, layer.w2, x_.data(), d, true, pool_);  // x += FFN
    }
    if (want_logits) {
      rmsnorm(x_.data() + (n - 1) * d, model_->rms_final().data(), last_.data(), d);
      matmul(last_.data(), 1, d, model_->classifier(), logits_.data(), c.vocab_size, false, pool_);
    }
  }

  const Model* model_;
  kvcache::ThreadPool* pool_;
  std::size_t max_chunk_;
  kvcache::Rope rope_;
  kvcache::PositionMode positions_ = kvcache::PositionMode::absolute;
  kvcache::DynamicCache<float> scratch_;
  std::vector<float> x_, xb_, qkv_, q_, k_, v_, att_, ffn_, hb_, cos_, sin_, last_, logits_;
};

}  // namespace llama
