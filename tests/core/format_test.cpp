// SPDX-License-Identifier: Apache-2.0
// Quantized storage formats: fp8 e4m3 decodes and rounds as the OCP definition says (checked
// against an independent nearest-code search), int8 and fp8 rows quantize with a scale that
// bounds every code, errors within half a code step, and non-finite rows read back as NaN; the
// memory formula of the quantized formats.
#include "kvcache/core/format.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvcache/core/config.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

// Independent decode of e4m3: sign * 2^(e-7) * (1 + m/8), subnormals 2^-6 * m/8, 0x7f/0xff NaN.
double e4m3_value(std::uint8_t b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> 3) & 0xf;
  const int m = b & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(m / 8.0, -6);
  return sign * std::ldexp(1.0 + m / 8.0, e - 7);
}

// Independent float -> e4m3: the nearest finite code by search, ties to the even code (the one
// whose lowest mantissa bit is 0), magnitudes beyond 448 saturated to 448.
std::uint8_t e4m3_nearest(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7e;
  std::uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (std::uint8_t c = 0; c <= 0x7e; ++c) {
    const double err = std::fabs(e4m3_value(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | best;
}

}  // namespace

TEST_CASE("fp8 e4m3 decodes every code as the OCP definition", "[format]") {
  for (int b = 0; b < 256; ++b) {
    const auto code = static_cast<std::uint8_t>(b);
    const double want = e4m3_value(code);
    const float got = fp8_e4m3::to_float(code);
    INFO("code 0x" << std::hex << b);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(static_cast<double>(got) == want);
      REQUIRE(std::signbit(got) == ((b & 0x80) != 0));
      REQUIRE(fp8_e4m3::from_float_bits(got) == code);  // every finite code round-trips
    }
  }
}

TEST_CASE("fp8 e4m3 rounds to nearest even and saturates", "[format]") {
  std::vector<float> probes = {
      0.0f,           -0.0f,         448.0f,        -448.0f,        449.0f,    463.99f, 464.0f,
      480.0f,         1e30f,         -1e30f,        INFINITY,       -INFINITY, 1e-30f,  -1e-30f,
      0.00048828125f, 0.0009765625f, 0.0029296875f, 0.01513671875f, 240.0f,    248.0f};
  // Every midpoint between adjacent codes, and values just either side of it.
  for (std::uint8_t c = 0; c < 0x7e; ++c) {
    const double mid = (e4m3_value(c) + e4m3_value(static_cast<std::uint8_t>(c + 1))) / 2.0;
    const auto m = static_cast<float>(mid);
    for (float x : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e9f)}) {
      probes.push_back(x);
      probes.push_back(-x);
    }
  }
  auto rng = test::make_rng("fp8 rounding");
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(exponent(rng)) * (i % 2 == 0 ? 1.0f : -1.0f);
    probes.push_back(x);
  }
  for (float x : probes) {
    INFO("x = " << x);
    REQUIRE(fp8_e4m3::from_float_bits(x) == e4m3_nearest(x));
  }
  REQUIRE(std::isnan(static_cast<float>(fp8_e4m3(std::numeric_limits<float>::quiet_NaN()))));
}

TEMPLATE_TEST_CASE("quantize_row bounds each code by its row's scale", "[format]", qint8,
                   fp8_e4m3) {
  using T = TestType;
  auto rng = test::make_rng("quantize_row");
  for (std::size_t d : {1u, 8u, 64u, 128u, 256u}) {
    for (float magnitude : {1e-30f, 1e-3f, 1.0f, 300.0f, 1e30f}) {
      std::vector<float> x = test::normal_floats(rng, d);
      for (float& e : x) e *= magnitude;
      std::vector<T> codes(d);
      scale_type scale;
      quantize_row(x.data(), d, codes.data(), &scale);
      std::vector<float> back(d);
      dequantize_row(codes.data(), &scale, d, back.data());
      float amax = 0.0f;
      for (float e : x) amax = std::max(amax, std::fabs(e));
      const auto s = static_cast<float>(scale);
      INFO("head_dim " << d << ", magnitude " << magnitude << ", scale " << s);
      // The scale: amax / code_max rounded up to a bfloat16, so within one bfloat16 step.
      REQUIRE(static_cast<double>(s) >= static_cast<double>(amax) / code_max<T>);
      REQUIRE(static_cast<double>(s) <=
              static_cast<double>(amax) / code_max<T> * (1.0 + 1.0 / 128));
      float code_peak = 0.0f;
      for (std::size_t i = 0; i < d; ++i) {
        const float c = decode(codes[i]);
        code_peak = std::max(code_peak, std::fabs(c));
        REQUIRE(std::fabs(c) <= code_max<T>);
        // Nearest code: within half a step of x / scale. int8 steps are 1; e4m3 steps are
        // 2^-9 below 2^-6 and 1/8 of the binade above.
        const double q = static_cast<double>(x[i]) / static_cast<double>(s);
        double step = 1.0;
        if constexpr (std::same_as<T, fp8_e4m3>) {
          step = std::fabs(q) < std::ldexp(1.0, -6)
                     ? std::ldexp(1.0, -9)
                     : std::ldexp(1.0, static_cast<int>(std::floor(std::log2(std::fabs(q)))) - 3);
        }
        REQUIRE(std::fabs(static_cast<double>(c) - q) <= step / 2 * (1 + 1e-6) + 1e-12);
        REQUIRE(back[i] == c * s);
      }
      // The row's largest value uses (nearly) the whole code range.
      REQUIRE(code_peak >= code_max<T> * 0.99f);
    }
  }
}

TEMPLATE_TEST_CASE("quantize_row: rows near the bottom of float's range", "[format]", qint8,
                   fp8_e4m3) {
  // amax / code_max is a subnormal here (a bfloat16 subnormal scale keeps few bits, so a code
  // step can reach the row's largest), and 1 / scale would overflow: every value still reads
  // back finite, within a quarter of the row's largest or one scale step (or as zero where
  // amax / code_max underflows), and zeros stay zero.
  using T = TestType;
  for (float tiny : {1e-37f, 1e-38f, 1e-40f, 1e-44f}) {
    // below code_max x the smallest subnormal the scale underflows to 0: the row reads as zeros
    const bool underflows = tiny / code_max<T> == 0.0f;
    std::vector<float> x = {tiny, -tiny / 2, 0.0f, tiny / 8, -tiny, 0.0f, tiny / 3, -0.0f};
    std::vector<T> codes(x.size());
    std::vector<float> back(x.size());
    scale_type scale;
    quantize_row(x.data(), x.size(), codes.data(), &scale);
    dequantize_row(codes.data(), &scale, x.size(), back.data());
    INFO("largest " << tiny << ", scale " << static_cast<float>(scale));
    for (std::size_t i = 0; i < x.size(); ++i) {
      REQUIRE(std::isfinite(back[i]));
      const float bound = underflows ? tiny : std::max(tiny / 4, static_cast<float>(scale));
      REQUIRE(std::fabs(back[i] - x[i]) <= bound);
      if (x[i] == 0.0f) REQUIRE(back[i] == 0.0f);
    }
  }
}

TEMPLATE_TEST_CASE("quantize_row: zero rows and non-finite rows", "[format]", qint8, fp8_e4m3) {
  using T = TestType;
  std::vector<float> zeros(16, 0.0f), back(16);
  std::vector<T> codes(16);
  scale_type scale;
  quantize_row(zeros.data(), 16, codes.data(), &scale);
  REQUIRE(static_cast<float>(scale) == 0.0f);
  dequantize_row(codes.data(), &scale, 16, back.data());
  for (float b : back) REQUIRE(b == 0.0f);
  for (float bad : {INFINITY, -INFINITY, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x(16, 1.0f);
    x[5] = bad;
    quantize_row(x.data(), 16, codes.data(), &scale);
    REQUIRE(std::isnan(static_cast<float>(scale)));
    dequantize_row(codes.data(), &scale, 16, back.data());
    for (float b : back) REQUIRE(std::isnan(b));
  }
}

TEST_CASE("row_bytes and kv_cache_bytes of the quantized formats", "[format]") {
  STATIC_REQUIRE(row_bytes(DType::f16, 128) == 256);
  STATIC_REQUIRE(row_bytes(DType::i8, 128) == 130);
  STATIC_REQUIRE(row_bytes(DType::e4m3, 64) == 66);
  STATIC_REQUIRE(dtype_bytes(DType::i8) == 1 && dtype_bytes(DType::e4m3) == 1);
  for (std::size_t d : {64u, 128u, 256u}) {
    const CacheShape half_shape{32, 8, d, DType::f16};
    for (DType q : {DType::i8, DType::e4m3}) {
      const CacheShape shape{32, 8, d, q};
      const double ratio = static_cast<double>(kv_cache_bytes(shape, 4096, 3)) /
                           static_cast<double>(kv_cache_bytes(half_shape, 4096, 3));
      INFO(dtype_name(q) << ", head_dim " << d << ": " << ratio);
      REQUIRE(ratio <= 0.53);
      REQUIRE(kv_cache_bytes(shape, 4096, 3) == 2u * 32 * 8 * 4096 * 3 * (d + 2));
    }
  }
}

TEST_CASE("a cache appends float rows, or rows of its own element format, never codes",
          "[format]") {
  STATIC_REQUIRE(AppendRows<float, float> && AppendRows<const float, half>);
  STATIC_REQUIRE(AppendRows<float, qint8> && AppendRows<const float, fp8_e4m3>);
  STATIC_REQUIRE(AppendRows<half, half> && AppendRows<const bfloat16, bfloat16>);
  STATIC_REQUIRE(!AppendRows<half, bfloat16> && !AppendRows<bfloat16, float>);
  STATIC_REQUIRE(!AppendRows<qint8, qint8> && !AppendRows<const fp8_e4m3, fp8_e4m3>);
  STATIC_REQUIRE(!AppendRows<half, qint8> && !AppendRows<double, float>);
}
