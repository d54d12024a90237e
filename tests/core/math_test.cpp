// SPDX-License-Identifier: Apache-2.0
// core/math.hpp: the umbrella header of a program that compiles its kernels once parses no
// <cmath>, and the functions that stand in for it there return exactly what <cmath>'s do.
#include "kvcache/kvcache.hpp"  // first: what it includes is checked below

// libstdc++'s and libc++'s include guards of <cmath>. This test is built with
// KVCACHE_EXTERN_KERNELS (it links kvcache_kernels), as a program that compiles its kernels once.
#if defined(_GLIBCXX_CMATH) || defined(_LIBCPP_CMATH)
constexpr bool kUmbrellaPullsCmath = true;
#else
constexpr bool kUmbrellaPullsCmath = false;
#endif

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "support/catch.hpp"

namespace {

namespace math = kvcache::detail::math;

#if KVCACHE_DETAIL_MATH_BUILTINS && defined(KVCACHE_EXTERN_KERNELS)
static_assert(!kUmbrellaPullsCmath, "kvcache/kvcache.hpp includes <cmath>");
#endif

// Finite values of every magnitude and sign, the infinities, a NaN, signed zeros, subnormals.
std::vector<double> samples() {
  std::vector<double> x{0.0,
                        -0.0,
                        0.5,
                        -0.5,
                        1.0,
                        -1.0,
                        2.5,
                        3.0,
                        -3.5,
                        1e-40,
                        1e-310,
                        1e30,
                        -1e30,
                        12345.678,
                        std::numeric_limits<double>::infinity(),
                        -std::numeric_limits<double>::infinity(),
                        std::numeric_limits<double>::quiet_NaN()};
  for (int i = -20; i <= 20; ++i) x.push_back(0.37 * i + 0.011 * i * i);
  return x;
}

// Equal bits, or both NaN (a NaN's payload is the library's business).
template <class T>
bool same(T a, T b) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<Bits>(a) == std::bit_cast<Bits>(b);
}

}  // namespace

TEST_CASE("core/math.hpp returns what <cmath> returns, bit for bit", "[math]") {
  for (const double x : samples()) {
    INFO("x = " << x);
    const auto f = static_cast<float>(x);
    CHECK(same(math::sqrt(f), std::sqrt(f)));
    CHECK(same(math::sqrt(x), std::sqrt(x)));
    CHECK(same(math::exp(x), std::exp(x)));
    CHECK(same(math::log(x), std::log(x)));
    CHECK(same(math::tanh(x), std::tanh(x)));
    CHECK(same(math::cos(x), std::cos(x)));
    CHECK(same(math::sin(x), std::sin(x)));
    CHECK(same(math::floor(x), std::floor(x)));
    CHECK(same(math::ceil(x), std::ceil(x)));
    CHECK(math::isfinite(f) == std::isfinite(f));
    CHECK(math::isfinite(x) == std::isfinite(x));
    CHECK(same(math::nearbyint(f), std::nearbyint(f)));
    for (const double y : {-2.0, -0.5, 0.0, 0.25, 1.0, 3.0, 7.5}) {
      INFO("y = " << y);
      CHECK(same(math::pow(x, y), std::pow(x, y)));
      CHECK(same(math::pow(f, static_cast<float>(y)), std::pow(f, static_cast<float>(y))));
    }
  }
}

TEST_CASE("core/math.hpp rounds halfway cases to even, as the quantized appends need", "[math]") {
  CHECK(math::nearbyint(0.5f) == 0.0f);
  CHECK(math::nearbyint(1.5f) == 2.0f);
  CHECK(math::nearbyint(2.5f) == 2.0f);
  CHECK(math::nearbyint(-2.5f) == -2.0f);
  CHECK(math::nearbyint(126.5f) == 126.0f);
  CHECK(math::nearbyint(-127.4f) == -127.0f);
}
