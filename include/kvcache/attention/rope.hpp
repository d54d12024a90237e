// SPDX-License-Identifier: Apache-2.0
// Rotary position embedding (RoPE) as the library knows it: a small description of how a model
// rotates q and k (base, rotary dims, pairing, frequency scaling) and the functions that apply it.
// Engines rotate q and k with it before attention; the library needs it to move keys between
// positions (context shift, cache-relative positions). Its constructor and checks are in
// attention/rope_impl.hpp (where they are compiled: core/compiled_once.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/math.hpp"
#include "kvcache/core/tensor.hpp"

namespace kvcache {

/// Which dimensions of a head form the pairs that RoPE rotates together.
enum class RopePairing {
  /// Adjacent pairs (x[2i], x[2i + 1]): Meta's Llama, llama2.c, GPT-J, GGUF "norm" models.
  interleaved,
  /// Halves (x[i], x[i + rotary_dims / 2]): Hugging Face Llama/Mistral/Qwen, GPT-NeoX.
  neox,
};

/// How the frequencies are stretched for contexts beyond the pre-training length.
enum class RopeScaling {
  none,    ///< theta_i = base^(-2i / rotary_dims)
  linear,  ///< position interpolation: theta_i / factor
  llama3,  ///< Llama 3.1: low frequencies / factor, high ones kept, a smooth ramp between
  yarn,    ///< YaRN: per-frequency ramp between interpolation and extrapolation, plus an
           ///< attention factor on cos and sin
};

/// A model's RoPE, as its config states it. Designated initializers read like the config:
///   RopeConfig{.base = 500000, .scaling = RopeScaling::llama3, .factor = 8,
///              .original_max_position = 8192}
struct RopeConfig {
  /// theta: pair i turns by base^(-2i / rotary_dims) radians per position (> 0).
  float base = 10000.0f;
  /// Leading dimensions of each head that rotate (even, <= head_dim); 0 means all of head_dim.
  /// The others pass unchanged (partial rotary: Phi, GPT-NeoX, StableLM).
  std::size_t rotary_dims = 0;
  RopePairing pairing = RopePairing::interleaved;
  RopeScaling scaling = RopeScaling::none;
  /// linear, llama3, yarn: how much longer the target context is (> 0).
  float factor = 1.0f;
  /// llama3, yarn: the pre-training context length (> 0).
  std::size_t original_max_position = 0;
  /// llama3: wavelengths above original_max_position / low_freq_factor are divided by factor,
  /// those below original_max_position / high_freq_factor kept (0 < low < high).
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  /// yarn: the ramp runs between the dims that turn beta_fast and beta_slow times over
  /// original_max_position (beta_fast > beta_slow > 0).
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
  /// yarn: cos and sin are scaled by it (it sharpens attention); 0 means 0.1 ln(factor) + 1
  /// (1 for a factor <= 1), as Hugging Face computes it without mscale settings.
  float attention_factor = 0.0f;
};

/// RoPE for one head size: the frequencies of a RopeConfig, computed once, and the rotation.
///
/// Position p rotates pair i by the angle p * inv_freq()[i], computed in double from the float
/// frequency (exact enough for positions in the millions), then cos and sin rounded to float and
/// multiplied by magnitude(). Rotating q by p and k by p' makes their dot product depend on
/// p - p' only: that is what lets the library move keys between positions.
/// Unscaled frequencies are 1 / base^(2i / rotary_dims) computed in float, as llama2.c does (so
/// an engine ported from it keeps its bits); scaled ones are computed in double.
class Rope {
 public:
  /// @throws shape_error naming the numbers: head_dim 0, rotary_dims odd or above head_dim, a
  ///         base or factor not finite and > 0, llama3/yarn without original_max_position,
  ///         llama3 without 0 < low_freq_factor < high_freq_factor, yarn without
  ///         beta_fast > beta_slow > 0, a negative attention_factor. std::bad_alloc.
  Rope(const RopeConfig& config, std::size_t head_dim);

  [[nodiscard]] const RopeConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] std::size_t rotary_dims() const noexcept { return rotary_dims_; }
  /// Radians per position of each of the rotary_dims / 2 pairs, scaling applied.
  [[nodiscard]] std::span<const float> inv_freq() const noexcept { return inv_freq_; }
  /// What cos and sin are multiplied by: yarn's attention factor, else 1.
  [[nodiscard]] float magnitude() const noexcept { return magnitude_; }

  /// cos and sin of position `pos` for every pair, magnitude() applied: rotary_dims / 2 floats
  /// each into cs and sn. O(rotary_dims).
  void angles(double pos, float* cs, float* sn) const noexcept {
    fill_angles(pos, 0, inv_freq_.size(), cs, sn, magnitude_);
  }

  /// Rotates `num_heads` heads of head_dim floats each, back to back at x, by the angles of one
  /// position (from angles()): every pair (a, b) becomes (a c - b s, a s + b c). O(num_heads *
  /// rotary_dims); the heads of q and of k at one position share one angles() call.
  void rotate(float* x, std::size_t num_heads, const float* cs, const float* sn) const noexcept {
    rotate_pairs(x, num_heads, 0, inv_freq_.size(), cs, sn);
  }

  /// Moves `num_heads` heads at x, already rotated for some position p, to position p + delta:
  /// a pure rotation by delta * inv_freq()[i] (magnitude() is not applied again), so that
  /// q . k of a moved key equals q . k of one rotated at p + delta in the first place. delta may
  /// be negative. What re-rotates keys (context shift) and turns queries back for cache-relative
  /// positions. Allocates nothing. O(num_heads * rotary_dims).
  void turn(float* x, std::size_t num_heads, double delta) const noexcept {
    rotate_by(x, num_heads, delta, 1.0f);
  }

  /// Rotates every token t of x ([n][num_heads][head_dim]) to position first_pos + t, in place.
  /// Allocates nothing. O(n * (num_heads + 1) * rotary_dims).
  /// @throws shape_error when x.head_dim != head_dim().
  void apply(TokenBlock<float> x, position_t first_pos) const;

 private:
  void validate() const;
  // The scaled frequency of pair i whose unscaled one is theta.
  [[nodiscard]] double scaled(double theta, std::size_t i) const noexcept;

  // Rotates num_heads heads at x by the angles of position `pos`, cos and sin times
  // `magnitude`, computing them a stack-sized chunk of pairs at a time (no allocation).
  void rotate_by(float* x, std::size_t num_heads, double pos, float magnitude) const noexcept {
    constexpr std::size_t kChunk = 64;
    float cs[kChunk], sn[kChunk];
    const std::size_t pairs = inv_freq_.size();
    for (std::size_t i0 = 0; i0 < pairs; i0 += kChunk) {
      const std::size_t m = std::min(kChunk, pairs - i0);
      fill_angles(pos, i0, m, cs, sn, magnitude);
      rotate_pairs(x, num_heads, i0, m, cs, sn);
    }
  }

  // angles() of pairs [first, first + m) only, into cs[0..m) and sn[0..m), times `magnitude`.
  void fill_angles(double pos, std::size_t first, std::size_t m, float* cs, float* sn,
                   float magnitude) const noexcept {
    for (std::size_t j = 0; j < m; ++j) {
      const double angle = pos * static_cast<double>(inv_freq_[first + j]);
      cs[j] = static_cast<float>(detail::math::cos(angle)) * magnitude;
      sn[j] = static_cast<float>(detail::math::sin(angle)) * magnitude;
    }
  }

  // rotate() of pairs [first, first + m) only, with cs[0..m) and sn[0..m).
  void rotate_pairs(float* x, std::size_t num_heads, std::size_t first, std::size_t m,
                    const float* cs, const float* sn) const noexcept {
    const std::size_t pairs = inv_freq_.size();
    const std::size_t step = config_.pairing == RopePairing::interleaved ? 2 : 1;
    const std::size_t other = config_.pairing == RopePairing::interleaved ? 1 : pairs;
    for (std::size_t h = 0; h < num_heads; ++h) {
      float* v = x + h * head_dim_;
      for (std::size_t j = 0; j < m; ++j) {
        const std::size_t i = first + j;
        const float a = v[i * step], b = v[i * step + other];
        v[i * step] = a * cs[j] - b * sn[j];
        v[i * step + other] = a * sn[j] + b * cs[j];
      }
    }
  }

  RopeConfig config_;
  std::size_t head_dim_;
  std::size_t rotary_dims_;
  std::vector<float> inv_freq_;
  float magnitude_ = 1.0f;
};

}  // namespace kvcache

#if KVCACHE_DETAIL_DEFINES_BODIES
#include "kvcache/attention/rope_impl.hpp"
#endif
