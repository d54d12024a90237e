// SPDX-License-Identifier: Apache-2.0
// Rope's constructor (the frequencies, with their scaling) and its checks (attention/rope.hpp
// includes this file where they are to be compiled, core/compiled_once.hpp; include that header,
// not this one).
#pragma once

#include <algorithm>
#include <cstddef>
#include <numbers>

#include "kvcache/attention/rope.hpp"
#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/math.hpp"
#include "kvcache/core/tensor.hpp"

namespace kvcache {

KVCACHE_DETAIL_BODY_INLINE Rope::Rope(const RopeConfig& config, std::size_t head_dim)
    : config_(config),
      head_dim_(head_dim),
      rotary_dims_(config.rotary_dims == 0 ? head_dim : config.rotary_dims) {
  validate();
  inv_freq_.resize(rotary_dims_ / 2);
  const double dims = static_cast<double>(rotary_dims_);
  for (std::size_t i = 0; i < inv_freq_.size(); ++i) {
    if (config.scaling == RopeScaling::none) {
      inv_freq_[i] = 1.0f / detail::math::pow(config.base, static_cast<float>(2 * i) /
                                                               static_cast<float>(rotary_dims_));
      continue;
    }
    const double theta =
        detail::math::pow(static_cast<double>(config.base), -static_cast<double>(2 * i) / dims);
    inv_freq_[i] = static_cast<float>(scaled(theta, i));
  }
  if (config.scaling == RopeScaling::yarn) {
    const double factor = static_cast<double>(config.factor);
    magnitude_ = config.attention_factor > 0.0f ? config.attention_factor
                 : factor <= 1.0                ? 1.0f
                                 : static_cast<float>(0.1 * detail::math::log(factor) + 1.0);
  }
}

KVCACHE_DETAIL_BODY_INLINE void Rope::apply(TokenBlock<float> x, position_t first_pos) const {
  if (x.head_dim != head_dim_) {
    throw shape_error(
        detail::message("Rope: head_dim ", x.head_dim, " but the RoPE is for ", head_dim_));
  }
  for (std::size_t t = 0; t < x.num_tokens; ++t) {
    rotate_by(x.data.data() + t * x.num_heads * head_dim_, x.num_heads,
              static_cast<double>(first_pos + static_cast<position_t>(t)), magnitude_);
  }
}

KVCACHE_DETAIL_BODY_INLINE void Rope::validate() const {
  const auto fail = [](const auto&... parts) {
    throw shape_error(detail::message("Rope: ", parts...));
  };
  const auto positive = [](float x) { return detail::math::isfinite(x) && x > 0.0f; };
  if (head_dim_ == 0) fail("head_dim must be at least 1");
  if (rotary_dims_ % 2 != 0 || rotary_dims_ > head_dim_) {
    fail("rotary_dims ", rotary_dims_, " must be even and at most head_dim ", head_dim_);
  }
  if (!positive(config_.base)) fail("base ", config_.base, " must be finite and > 0");
  if (config_.scaling == RopeScaling::none) return;
  if (!positive(config_.factor)) fail("factor ", config_.factor, " must be finite and > 0");
  if (config_.scaling == RopeScaling::linear) return;
  if (config_.original_max_position == 0) {
    fail("llama3 and yarn scaling need original_max_position (the pre-training length)");
  }
  if (config_.scaling == RopeScaling::llama3 &&
      !(positive(config_.low_freq_factor) && positive(config_.high_freq_factor) &&
        config_.low_freq_factor < config_.high_freq_factor)) {
    fail("llama3 scaling needs 0 < low_freq_factor < high_freq_factor, got ",
         config_.low_freq_factor, " and ", config_.high_freq_factor);
  }
  if (config_.scaling == RopeScaling::yarn &&
      !(positive(config_.beta_slow) && positive(config_.beta_fast) &&
        config_.beta_slow < config_.beta_fast)) {
    fail("yarn scaling needs beta_fast > beta_slow > 0, got ", config_.beta_fast, " and ",
         config_.beta_slow);
  }
  if (!(detail::math::isfinite(config_.attention_factor) && config_.attention_factor >= 0.0f)) {
    fail("attention_factor ", config_.attention_factor, " must be finite and >= 0");
  }
}

KVCACHE_DETAIL_BODY_INLINE double Rope::scaled(double theta, std::size_t i) const noexcept {
  const double factor = static_cast<double>(config_.factor);
  const double original = static_cast<double>(config_.original_max_position);
  const double two_pi = 2.0 * std::numbers::pi;
  switch (config_.scaling) {
    case RopeScaling::linear:
      return theta / factor;
    case RopeScaling::llama3: {
      const double low = static_cast<double>(config_.low_freq_factor);
      const double high = static_cast<double>(config_.high_freq_factor);
      const double wavelength = two_pi / theta;
      if (wavelength < original / high) return theta;          // high frequency: kept
      if (wavelength > original / low) return theta / factor;  // low frequency: interpolated
      const double smooth = (original / wavelength - low) / (high - low);
      return (1.0 - smooth) * theta / factor + smooth * theta;
    }
    case RopeScaling::yarn: {
      // The pair index at which a frequency turns `rotations` times over the original length.
      const double dims = static_cast<double>(rotary_dims_);
      const double base = static_cast<double>(config_.base);
      const auto dim_of = [&](float rotations) {
        return dims * detail::math::log(original / (static_cast<double>(rotations) * two_pi)) /
               (2.0 * detail::math::log(base));
      };
      const double lo = std::max(detail::math::floor(dim_of(config_.beta_fast)), 0.0);
      double hi = std::min(detail::math::ceil(dim_of(config_.beta_slow)), dims - 1.0);
      if (hi == lo) hi += 0.001;
      const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
      const double extrapolate = 1.0 - ramp;  // 1 for the fast (high-frequency) pairs
      return theta / factor * (1.0 - extrapolate) + theta * extrapolate;
    }
    case RopeScaling::none:
      break;
  }
  return theta;
}

}  // namespace kvcache
