// SPDX-License-Identifier: Apache-2.0
// Choosing the next token from logits: greedy (argmax), or seeded sampling with a temperature and
// optional top-p (nucleus) truncation. The generator is a fixed xorshift64*, so a seed gives the
// same tokens on every platform.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvcache/core/error.hpp"
#include "llama/model.hpp"

namespace llama {

/// How a Sampler picks tokens.
struct SamplerConfig {
  /// 0 = greedy (argmax, lowest id on ties); > 0 divides the logits before the softmax.
  float temperature = 0.0f;
  /// Nucleus sampling: sample among the most likely tokens whose probabilities add up to top_p
  /// (1 = the whole vocabulary). Ignored when greedy.
  float top_p = 1.0f;
  /// Seed of the random generator (sampling only).
  std::uint64_t seed = 0;
};

/// Picks tokens from logits according to a SamplerConfig. Holds its generator state; not
/// thread-safe.
class Sampler {
 public:
  /// @throws usage_error for a negative or non-finite temperature, or top_p outside (0, 1].
  explicit Sampler(const SamplerConfig& config = {}) : config_(config) {
    if (!(config.temperature >= 0.0f) || !std::isfinite(config.temperature)) {
      throw usage_error(kvcache::detail::message("sampler: temperature ", config.temperature,
                                                 " must be finite and >= 0"));
    }
    if (!(config.top_p > 0.0f && config.top_p <= 1.0f)) {
      throw usage_error(
          kvcache::detail::message("sampler: top_p ", config.top_p, " must be in (0, 1]"));
    }
    state_ = config.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (state_ == 0) state_ = 1;
  }

  [[nodiscard]] const SamplerConfig& config() const noexcept { return config_; }
  [[nodiscard]] bool greedy() const noexcept { return config_.temperature == 0.0f; }

  /// The index of the largest logit (the lowest on ties). @pre !logits.empty().
  [[nodiscard]] static token_id argmax(std::span<const float> logits) noexcept {
    return static_cast<token_id>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

  /// The next token. O(vocab) greedy, O(vocab log vocab) with top_p < 1.
  /// @pre !logits.empty().
  [[nodiscard]] token_id sample(std::span<const float> logits) {
    if (greedy()) return argmax(logits);
    const float top = *std::max_element(logits.begin(), logits.end());
    probs_.resize(logits.size());
    double total = 0.0;
    for (std::size_t i = 0; i < logits.size(); ++i) {
      probs_[i] = std::exp(static_cast<double>((logits[i] - top) / config_.temperature));
      total += probs_[i];
    }
    order_.resize(logits.size());
    std::iota(order_.begin(), order_.end(), token_id{0});
    std::size_t candidates = logits.size();
    if (config_.top_p < 1.0f) {
      std::sort(order_.begin(), order_.end(), [&](token_id a, token_id b) {
        const double pa = probs_[static_cast<std::size_t>(a)];
        const double pb = probs_[static_cast<std::size_t>(b)];
        return pa > pb || (pa == pb && a < b);
      });
      double kept = 0.0;
      candidates = 0;
      while (candidates < order_.size() && kept < config_.top_p * total) {
        kept += probs_[static_cast<std::size_t>(order_[candidates++])];
      }
      total = kept;
    }
    const double coin = uniform() * total;
    double acc = 0.0;
    for (std::size_t i = 0; i < candidates; ++i) {
      acc += probs_[static_cast<std::size_t>(order_[i])];
      if (coin < acc) return order_[i];
    }
    return order_[candidates - 1];  // rounding left coin at the very top
  }

 private:
  /// Uniform in [0, 1) from xorshift64*.
  double uniform() noexcept {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return static_cast<double>((state_ * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
  }

  SamplerConfig config_;
  std::uint64_t state_ = 1;
  std::vector<double> probs_;
  std::vector<token_id> order_;
};

}  // namespace llama
