// SPDX-License-Identifier: Apache-2.0
// Rope: frequencies for every scaling against values computed independently (Python, the
// published formulas), rotation against complex multiplication in double for both pairings and
// partial rotary, dot products that depend on relative positions only, and typed errors.
#include <cmath>
#include <complex>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

using namespace kvcache;
using kvcache::test::require_throws;

namespace {

// Rotation by complex multiplication in double: pair i of x at `pos`, with the Rope's own
// frequencies (tested separately against independent values below).
std::vector<float> rotated_reference(const Rope& rope, std::vector<float> x, std::size_t heads,
                                     double pos) {
  const std::size_t pairs = rope.rotary_dims() / 2, d = rope.head_dim();
  const bool adjacent = rope.config().pairing == RopePairing::interleaved;
  for (std::size_t h = 0; h < heads; ++h) {
    for (std::size_t i = 0; i < pairs; ++i) {
      const std::size_t a = h * d + (adjacent ? 2 * i : i);
      const std::size_t b = adjacent ? a + 1 : a + pairs;
      const std::complex<double> z(x[a], x[b]);
      const std::complex<double> turned =
          z * std::polar(static_cast<double>(rope.magnitude()),
                         pos * static_cast<double>(rope.inv_freq()[i]));
      x[a] = static_cast<float>(turned.real());
      x[b] = static_cast<float>(turned.imag());
    }
  }
  return x;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

std::vector<float> rotate_copy(const Rope& rope, std::vector<float> x, std::size_t heads,
                               position_t pos) {
  rope.apply({x, 1, heads, rope.head_dim()}, pos);
  return x;
}

}  // namespace

TEST_CASE("RoPE frequencies: unscaled as llama2.c computes them, scaled as published") {
  const Rope plain({}, 64);
  REQUIRE(plain.rotary_dims() == 64);
  REQUIRE(plain.inv_freq().size() == 32);
  REQUIRE(plain.magnitude() == 1.0f);
  for (std::size_t i = 0; i < 32; ++i) {
    // llama2.c's run.c: 1.0f / powf(10000.0f, head_dim / (float)head_size), head_dim = 2i
    REQUIRE(plain.inv_freq()[i] == 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / 64.0f));
    REQUIRE(std::abs(plain.inv_freq()[i] / std::pow(10000.0, -static_cast<double>(2 * i) / 64) -
                     1.0) < 1e-6);
  }
  const Rope linear({.scaling = RopeScaling::linear, .factor = 4}, 64);
  for (std::size_t i = 0; i < 32; ++i) {
    REQUIRE(std::abs(linear.inv_freq()[i] * 4.0 / plain.inv_freq()[i] - 1.0) < 1e-6);
  }

  // Llama 3.1 (base 500000, factor 8, low 1, high 4, 8192 original), head_dim 128: values from
  // an independent Python implementation of the published scaling.
  const Rope llama3({.base = 500000.0f,
                     .pairing = RopePairing::neox,
                     .scaling = RopeScaling::llama3,
                     .factor = 8.0f,
                     .original_max_position = 8192},
                    128);
  const std::pair<std::size_t, double> llama3_expect[] = {{0, 1.0},
                                                          {20, 0.016560440080994446},
                                                          {40, 3.428102195952591e-05},
                                                          {44, 1.509621717643313e-05},
                                                          {46, 1.0017868402809974e-05},
                                                          {48, 6.647869871181236e-06},
                                                          {50, 4.411534674558404e-06},
                                                          {63, 3.068925988914511e-07}};
  for (const auto& [i, want] : llama3_expect) {
    INFO("llama3 pair " << i);
    REQUIRE(std::abs(llama3.inv_freq()[i] / want - 1.0) < 1e-6);
  }
  REQUIRE(llama3.magnitude() == 1.0f);

  // YaRN (base 10000, factor 4, 2048 original, beta 32 / 1), rotary dims 64 of head_dim 80:
  // the ramp runs over pairs 8 .. 21, extrapolated before, interpolated after.
  const Rope yarn({.rotary_dims = 64,
                   .scaling = RopeScaling::yarn,
                   .factor = 4.0f,
                   .original_max_position = 2048},
                  80);
  REQUIRE(yarn.inv_freq().size() == 32);
  const std::pair<std::size_t, double> yarn_expect[] = {{0, 1.0},
                                                        {5, 0.23713737056616555},
                                                        {8, 0.1},
                                                        {10, 0.049745578766838564},
                                                        {12, 0.024325212770525993},
                                                        {16, 0.005384615384615384},
                                                        {20, 0.0009730085108210396},
                                                        {31, 3.33380358040831e-05}};
  for (const auto& [i, want] : yarn_expect) {
    INFO("yarn pair " << i);
    REQUIRE(std::abs(yarn.inv_freq()[i] / want - 1.0) < 1e-6);
  }
  REQUIRE(std::abs(yarn.magnitude() - 1.138629436111989) < 1e-6);
  REQUIRE(Rope({.scaling = RopeScaling::yarn,
                .factor = 4.0f,
                .original_max_position = 2048,
                .attention_factor = 1.5f},
               64)
              .magnitude() == 1.5f);
}

TEST_CASE(
    "RoPE rotates every pair like complex multiplication, for both pairings and partial "
    "rotary; apply() equals angles() + rotate() bit for bit") {
  auto rng = kvcache::test::make_rng("rope-rotate");
  const std::size_t heads = 3;
  const RopeConfig configs[] = {
      {},
      {.pairing = RopePairing::neox},
      {.rotary_dims = 16, .pairing = RopePairing::neox},
      {.rotary_dims = 16},
      {.base = 500000.0f,
       .pairing = RopePairing::neox,
       .scaling = RopeScaling::llama3,
       .factor = 8.0f,
       .original_max_position = 64},
      {.scaling = RopeScaling::yarn, .factor = 4.0f, .original_max_position = 128},
  };
  for (const RopeConfig& config : configs) {
    const Rope rope(config, 48);
    for (const position_t pos :
         {position_t{0}, position_t{1}, position_t{37}, position_t{4099}, position_t{1234567}}) {
      INFO("rotary_dims " << rope.rotary_dims() << " pairing " << static_cast<int>(config.pairing)
                          << " scaling " << static_cast<int>(config.scaling) << " position "
                          << pos);
      const auto x = kvcache::test::normal_floats(rng, heads * 48);
      const auto got = rotate_copy(rope, x, heads, pos);
      const auto want = rotated_reference(rope, x, heads, static_cast<double>(pos));
      for (std::size_t j = 0; j < x.size(); ++j) {
        REQUIRE(std::abs(got[j] - want[j]) <= 1e-5f * (1.0f + std::abs(want[j])));
        const std::size_t dim = j % 48;
        if (dim >= rope.rotary_dims()) REQUIRE(got[j] == x[j]);  // not rotated
      }
      std::vector<float> cs(rope.rotary_dims() / 2), sn(cs.size()), split = x;
      rope.angles(static_cast<double>(pos), cs.data(), sn.data());
      rope.rotate(split.data(), heads, cs.data(), sn.data());
      REQUIRE(split == got);
    }
  }
}

TEST_CASE("RoPE makes q . k depend on the distance between their positions only") {
  auto rng = kvcache::test::make_rng("rope-relative");
  for (const RopeConfig& config :
       {RopeConfig{},
        RopeConfig{.pairing = RopePairing::neox, .scaling = RopeScaling::linear, .factor = 2.0f},
        RopeConfig{.rotary_dims = 32,
        .scaling = RopeScaling::yarn,
        .factor = 8.0f,
        .original_max_position = 256}}) {
    const Rope rope(config, 64);
    const auto q = kvcache::test::normal_floats(rng, 64), k = kvcache::test::normal_floats(rng, 64);
    for (const position_t shift : {position_t{1}, position_t{250}, position_t{100000}}) {
      for (const position_t gap : {position_t{0}, position_t{3}, position_t{511}}) {
        const double near = dot(rotate_copy(rope, q, 1, 10 + gap), rotate_copy(rope, k, 1, 10));
        const double far =
            dot(rotate_copy(rope, q, 1, 10 + gap + shift), rotate_copy(rope, k, 1, 10 + shift));
        INFO("gap " << gap << " shift " << shift);
        REQUIRE(std::abs(near - far) < 1e-4 * (1.0 + std::abs(near)));
      }
    }
  }
}

TEST_CASE("RoPE turn() moves rotated vectors by a position delta, either way") {
  auto rng = kvcache::test::make_rng("rope-turn");
  for (const RopeConfig& config :
       {RopeConfig{}, RopeConfig{.rotary_dims = 16, .pairing = RopePairing::neox},
        RopeConfig{.scaling = RopeScaling::yarn, .factor = 4.0f, .original_max_position = 64}}) {
    const Rope rope(config, 32);
    const auto x = kvcache::test::normal_floats(rng, 2 * 32);
    for (const auto& [from, delta] :
         {std::pair<position_t, position_t>{5, 1000}, {100000, -99990}, {300, -300}}) {
      auto moved = rotate_copy(rope, x, 2, from);
      rope.turn(moved.data(), 2, static_cast<double>(delta));
      const auto want = rotate_copy(rope, x, 2, from + delta);
      INFO("from " << from << " by " << delta);
      for (std::size_t j = 0; j < x.size(); ++j) {
        REQUIRE(std::abs(moved[j] - want[j]) <= 1e-5f * (1.0f + std::abs(want[j])));
      }
    }
  }
}

TEST_CASE("RoPE refuses what it cannot apply, naming the numbers") {
  require_throws<shape_error>([] { Rope r({.rotary_dims = 7}, 8); }, "rotary_dims 7", "even",
                              "head_dim 8");
  require_throws<shape_error>([] { Rope r({.rotary_dims = 16}, 8); }, "rotary_dims 16",
                              "head_dim 8");
  require_throws<shape_error>([] { Rope r({}, 0); }, "head_dim");
  require_throws<shape_error>([] { Rope r({.base = 0.0f}, 8); }, "base 0");
  require_throws<shape_error>([] { Rope r({.scaling = RopeScaling::linear, .factor = -1.0f}, 8); },
                              "factor -1");
  require_throws<shape_error>([] { Rope r({.scaling = RopeScaling::llama3, .factor = 8}, 8); },
                              "original_max_position");
  require_throws<shape_error>(
      [] {
        Rope r({.scaling = RopeScaling::llama3,
                .factor = 8,
                .original_max_position = 8192,
                .low_freq_factor = 4,
                .high_freq_factor = 1},
               8);
      },
      "low_freq_factor < high_freq_factor", "4", "1");
  require_throws<shape_error>(
      [] {
        Rope r({.scaling = RopeScaling::yarn,
                .factor = 4,
                .original_max_position = 2048,
                .beta_fast = 1,
                .beta_slow = 32},
               8);
      },
      "beta_fast > beta_slow");
  const Rope rope({}, 8);
  std::vector<float> x(16);
  require_throws<shape_error>(
      [&] {
        rope.apply({x, 1, 1, 16}, 0);
      },
      "head_dim 16", "RoPE is for 8");
}
