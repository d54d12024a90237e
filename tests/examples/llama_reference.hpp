// SPDX-License-Identifier: Apache-2.0
// An independent reference of the Llama forward pass for the engine's tests: plain loops in
// double precision over the raw llama2.c payload (its own offset arithmetic, no packing, no
// kvcache). Two forms: a from-scratch pass over a whole sequence, and run.c's token-by-token loop.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "llama/model.hpp"

namespace kvcache::test {

/// The semantics of llama2.c's run.c: RMSNorm with eps 1e-5, RoPE base 10000 rotating adjacent
/// (even, odd) pairs within each head, GQA query head h -> KV head h / (n_heads / n_kv_heads),
/// attention scale 1/sqrt(head_dim), SwiGLU FFN, tied or separate classifier. A query at position
/// p sees keys at j <= p with j > p - window or j < sinks (window 0: every earlier key).
class ReferenceModel {
 public:
  using Vec = std::vector<double>;

  explicit ReferenceModel(const llama::Checkpoint& ckpt) : c_(ckpt.config), w_(ckpt.data.data()) {
    const std::size_t V = c_.vocab_size, D = c_.dim, L = c_.num_layers, H = c_.hidden_dim;
    hd_ = D / c_.num_heads;
    kv_ = c_.num_kv_heads * hd_;
    // Offsets in floats, in the order llama2.c's export writes the tensors.
    o_rms_att_ = V * D;
    o_wq_ = o_rms_att_ + L * D;
    o_wk_ = o_wq_ + L * D * D;
    o_wv_ = o_wk_ + L * kv_ * D;
    o_wo_ = o_wv_ + L * kv_ * D;
    o_rms_ffn_ = o_wo_ + L * D * D;
    o_w1_ = o_rms_ffn_ + L * D;
    o_w2_ = o_w1_ + L * H * D;
    o_w3_ = o_w2_ + L * D * H;
    o_rms_final_ = o_w3_ + L * H * D;
    const std::size_t o_rope_tables = o_rms_final_ + D;
    o_wcls_ = c_.shared_classifier ? 0 : o_rope_tables + c_.seq_len * hd_;
  }

  /// Logits [vocab] after the last of `tokens`, recomputing every position from scratch.
  [[nodiscard]] std::vector<double> logits(std::span<const llama::token_id> tokens,
                                           std::size_t window = 0, std::size_t sinks = 0) const {
    const std::size_t D = c_.dim, T = tokens.size();
    std::vector<Vec> x(T);
    for (std::size_t t = 0; t < T; ++t) x[t] = embed(tokens[t]);
    for (std::size_t l = 0; l < c_.num_layers; ++l) {
      std::vector<Vec> q(T), k(T), v(T);
      for (std::size_t t = 0; t < T; ++t) qkv(l, x[t], t, q[t], k[t], v[t]);
      for (std::size_t t = 0; t < T; ++t) {
        const Vec att = attention(q[t], t, k, v, window, sinks);
        const Vec o = matvec(o_wo_ + l * D * D, D, D, att);
        for (std::size_t i = 0; i < D; ++i) x[t][i] += o[i];
        ffn(l, x[t]);
      }
    }
    return classify(x[T - 1]);
  }

  /// run.c's generation loop: one token at a time, keeping every position's K and V.
  class Decoder {
   public:
    explicit Decoder(const ReferenceModel& m) : m_(&m), k_(m.c_.num_layers), v_(m.c_.num_layers) {}

    /// Logits after `token`, placed at the next position.
    std::vector<double> step(llama::token_id token) {
      const ReferenceModel& m = *m_;
      const std::size_t D = m.c_.dim, pos = k_[0].size();
      Vec x = m.embed(token);
      for (std::size_t l = 0; l < m.c_.num_layers; ++l) {
        Vec q, k, v;
        m.qkv(l, x, pos, q, k, v);
        k_[l].push_back(std::move(k));
        v_[l].push_back(std::move(v));
        const Vec att = m.attention(q, pos, k_[l], v_[l], 0, 0);
        const Vec o = m.matvec(m.o_wo_ + l * D * D, D, D, att);
        for (std::size_t i = 0; i < D; ++i) x[i] += o[i];
        m.ffn(l, x);
      }
      return m.classify(x);
    }

   private:
    const ReferenceModel* m_;
    std::vector<std::vector<Vec>> k_, v_;  // [layer][pos][kv_dim]
  };

 private:
  [[nodiscard]] Vec embed(llama::token_id token) const {
    Vec x(c_.dim);
    for (std::size_t i = 0; i < c_.dim; ++i) x[i] = w_[std::size_t(token) * c_.dim + i];
    return x;
  }

  [[nodiscard]] Vec matvec(std::size_t offset, std::size_t rows, std::size_t cols,
                           const Vec& x) const {
    Vec y(rows, 0.0);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t k = 0; k < cols; ++k) y[r] += double(w_[offset + r * cols + k]) * x[k];
    }
    return y;
  }

  [[nodiscard]] Vec rmsnorm(const Vec& x, std::size_t offset) const {
    double ss = 0;
    for (double e : x) ss += e * e;
    const double inv = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
    Vec y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = double(w_[offset + i]) * (x[i] * inv);
    return y;
  }

  void rope(Vec& v, std::size_t pos) const {
    for (std::size_t i = 0; i < v.size(); i += 2) {
      const double freq = 1.0 / std::pow(10000.0, double(i % hd_) / double(hd_));
      const double a = double(pos) * freq, cs = std::cos(a), sn = std::sin(a);
      const double x0 = v[i], x1 = v[i + 1];
      v[i] = x0 * cs - x1 * sn;
      v[i + 1] = x0 * sn + x1 * cs;
    }
  }

  void qkv(std::size_t l, const Vec& x, std::size_t pos, Vec& q, Vec& k, Vec& v) const {
    const std::size_t D = c_.dim;
    const Vec xb = rmsnorm(x, o_rms_att_ + l * D);
    q = matvec(o_wq_ + l * D * D, D, D, xb);
    k = matvec(o_wk_ + l * kv_ * D, kv_, D, xb);
    v = matvec(o_wv_ + l * kv_ * D, kv_, D, xb);
    rope(q, pos);
    rope(k, pos);
  }

  [[nodiscard]] Vec attention(const Vec& q, std::size_t pos, const std::vector<Vec>& k,
                              const std::vector<Vec>& v, std::size_t window,
                              std::size_t sinks) const {
    const std::size_t NH = c_.num_heads, group = NH / c_.num_kv_heads;
    Vec out(c_.dim, 0.0);
    for (std::size_t h = 0; h < NH; ++h) {
      const std::size_t kvh = h / group;
      Vec score(pos + 1, 0.0);
      std::vector<bool> seen(pos + 1);
      double top = -INFINITY, sum = 0;
      for (std::size_t j = 0; j <= pos; ++j) {
        seen[j] = window == 0 || j + window > pos || j < sinks;
        if (!seen[j]) continue;
        double s = 0;
        for (std::size_t e = 0; e < hd_; ++e) s += q[h * hd_ + e] * k[j][kvh * hd_ + e];
        score[j] = s / std::sqrt(double(hd_));
        top = std::max(top, score[j]);
      }
      for (std::size_t j = 0; j <= pos; ++j) {
        score[j] = seen[j] ? std::exp(score[j] - top) : 0.0;
        sum += score[j];
      }
      for (std::size_t j = 0; j <= pos; ++j) {
        for (std::size_t e = 0; e < hd_; ++e)
          out[h * hd_ + e] += score[j] / sum * v[j][kvh * hd_ + e];
      }
    }
    return out;
  }

  void ffn(std::size_t l, Vec& x) const {
    const std::size_t D = c_.dim, H = c_.hidden_dim;
    const Vec xb = rmsnorm(x, o_rms_ffn_ + l * D);
    const Vec h1 = matvec(o_w1_ + l * H * D, H, D, xb);
    const Vec h3 = matvec(o_w3_ + l * H * D, H, D, xb);
    Vec g(H);
    for (std::size_t i = 0; i < H; ++i) g[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
    const Vec f = matvec(o_w2_ + l * D * H, D, H, g);
    for (std::size_t i = 0; i < D; ++i) x[i] += f[i];
  }

  [[nodiscard]] Vec classify(const Vec& x) const {
    return matvec(o_wcls_, c_.vocab_size, c_.dim, rmsnorm(x, o_rms_final_));
  }

  llama::ModelConfig c_;
  const float* w_;
  std::size_t hd_ = 0, kv_ = 0;
  std::size_t o_rms_att_ = 0, o_wq_ = 0, o_wk_ = 0, o_wv_ = 0, o_wo_ = 0, o_rms_ffn_ = 0, o_w1_ = 0,
              o_w2_ = 0, o_w3_ = 0, o_rms_final_ = 0, o_wcls_ = 0;
};

/// Index of the largest value (the lowest on ties).
inline std::size_t argmax(std::span<const double> v) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = i;
  }
  return best;
}

/// The gap between the largest and second largest value (how decisive a greedy choice is).
inline double top2_margin(std::span<const double> v) {
  double a = -INFINITY, b = -INFINITY;
  for (double x : v) {
    if (x > a) {
      b = a;
      a = x;
    } else if (x > b) {
      b = x;
    }
  }
  return a - b;
}

}  // namespace kvcache::test
