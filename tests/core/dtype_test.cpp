// SPDX-License-Identifier: Apache-2.0
// Element types: half and bfloat16 convert exactly like the hardware (round-to-nearest-even),
// checked exhaustively or against independent references, and against F16C where the CPU has it.
#include "kvcache/core/dtype.hpp"  // first: what it includes is checked below

// GCC's and clang's include guards of <immintrin.h>: the header everything includes pulls in no
// intrinsic headers (they are most of an x86 translation unit's front-end time).
#if defined(_IMMINTRIN_H_INCLUDED) || defined(__IMMINTRIN_H)
constexpr bool kDtypePullsIntrinsics = true;
#else
constexpr bool kDtypePullsIntrinsics = false;
#endif
static_assert(!kDtypePullsIntrinsics, "core/dtype.hpp includes <immintrin.h>");

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

#if KVCACHE_X86_DISPATCH
#include <immintrin.h>  // the scalar F16C conversions the tests compare against
#endif

using namespace kvcache;

namespace {

// Independent decode of binary16: sign * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024.
double half_value(std::uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m / 1024.0, -14);
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

// Independent round-to-nearest-even float -> half: pick the nearest of the finite halves by
// value (ties to the even bit pattern), overflow to infinity at 65520 (the tie between the
// largest half, 65504, and 2^16).
std::uint16_t half_reference(float f) {
  if (std::isnan(f)) return 0x7e00;  // only NaN-ness is compared for NaN
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  std::uint16_t lo = 0, hi = 0x7bff;  // binary search the largest half <= a
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (half_value(mid) <= a)
      lo = mid;
    else
      hi = static_cast<std::uint16_t>(mid - 1);
  }
  if (half_value(lo) == a || lo == 0x7bff) return sign | lo;
  const double below = half_value(lo), above = half_value(static_cast<std::uint16_t>(lo + 1));
  const double d_lo = a - below, d_hi = above - a;
  if (d_lo < d_hi) return sign | lo;
  if (d_hi < d_lo) return sign | static_cast<std::uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<std::uint16_t>(lo + 1) : lo);
}

// Independent round-to-nearest-even float -> bfloat16 by exact double arithmetic on the two
// candidates that bracket f.
std::uint16_t bf16_reference(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t down = static_cast<std::uint16_t>(u >> 16);
  if ((u & 0xffffu) == 0) return down;
  const std::uint16_t up = static_cast<std::uint16_t>(down + 1);  // next magnitude, same sign
  const double x = std::fabs(static_cast<double>(f));
  const double a = std::fabs(static_cast<double>(std::bit_cast<float>(std::uint32_t{down} << 16)));
  const double b =
      (up & 0x7fff) == 0x7f80
          ? std::ldexp(1.0, 128)
          : std::fabs(static_cast<double>(std::bit_cast<float>(std::uint32_t{up} << 16)));
  if (x - a < b - x) return down;
  if (b - x < x - a) return up;
  return (down & 1) ? up : down;
}

#if KVCACHE_X86_DISPATCH
__attribute__((target("f16c"))) std::uint16_t f16c_from_float(float f) {
  return static_cast<std::uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}
__attribute__((target("f16c"))) float f16c_to_float(std::uint16_t h) { return _cvtsh_ss(h); }
#endif

std::vector<float> interesting_floats(std::mt19937_64& rng) {
  std::vector<float> xs;
  // every half value, every midpoint between neighbours, and one float ulp either side
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = half_value(static_cast<std::uint16_t>(h));
    const double mid = (v + half_value(static_cast<std::uint16_t>(h + 1))) / 2;
    for (double x : {v, mid}) {
      const float f = static_cast<float>(x);
      for (float g : {f, std::nextafter(f, 0.0f), std::nextafter(f, INFINITY)}) {
        xs.push_back(g);
        xs.push_back(-g);
      }
    }
  }
  for (float f : {0.0f, -0.0f, INFINITY, -INFINITY, 65504.0f, 65519.996f, 65520.0f, 1e-8f, 3e-8f,
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()}) {
    xs.push_back(f);
  }
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 1'000'000; ++i) xs.push_back(std::bit_cast<float>(bits(rng)));
  return xs;
}

}  // namespace

TEST_CASE("half -> float is exact for all 65536 bit patterns") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(half::from_bits(h));
    const double want = half_value(h);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::signbit(f) == ((h & 0x8000) != 0));
    } else {
      INFO("half bits " << b);
      REQUIRE(static_cast<double>(f) == want);
      REQUIRE(std::signbit(f) == ((h & 0x8000) != 0));
    }
  }
}

TEST_CASE("float -> half rounds to nearest even (reference and round trip)") {
  auto rng = kvcache::test::make_rng("float-to-half");
  for (float f : interesting_floats(rng)) {
    const std::uint16_t got = half(f).bits;
    INFO("float bits " << std::bit_cast<std::uint32_t>(f) << " value " << f);
    if (std::isnan(f)) {
      REQUIRE(((got & 0x7c00) == 0x7c00 && (got & 0x3ff) != 0));
    } else {
      REQUIRE(got == half_reference(f));
    }
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {  // every non-NaN half survives a round trip
    const half h = half::from_bits(static_cast<std::uint16_t>(b));
    if (!std::isnan(static_cast<float>(h))) REQUIRE(half(static_cast<float>(h)).bits == b);
  }
}

TEST_CASE("half conversions equal the CPU's F16C instructions bit for bit, NaNs included") {
#if KVCACHE_X86_DISPATCH
  if (!kvcache::detail::cpu_has_avx2_fma_f16c()) {
    WARN("skipped: this CPU lacks F16C");
    return;
  }
  auto rng = kvcache::test::make_rng("f16c");
  for (float f : interesting_floats(rng)) {
    INFO("float bits " << std::bit_cast<std::uint32_t>(f));
    REQUIRE(half(f).bits == f16c_from_float(f));
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    INFO("half bits " << b);
    REQUIRE(std::bit_cast<std::uint32_t>(half::to_float(h)) ==
            std::bit_cast<std::uint32_t>(f16c_to_float(h)));
  }
  // the bulk F16C path equals the scalar path
  const auto xs = interesting_floats(rng);
  std::vector<half> bulk(xs.size());
  convert_from_float<half>(xs, bulk.data());
  std::vector<float> back(xs.size());
  convert_to_float<half>(bulk, back.data());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    REQUIRE(bulk[i].bits == half(xs[i]).bits);
    REQUIRE(std::bit_cast<std::uint32_t>(back[i]) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(bulk[i])));
  }
#else
  WARN("skipped: not an x86-64 build");
#endif
}

TEST_CASE("float -> bfloat16 rounds to nearest even; bfloat16 -> float is exact") {
  auto rng = kvcache::test::make_rng("bf16");
  std::uniform_int_distribution<std::uint32_t> bits;
  std::vector<std::uint32_t> xs;
  for (std::uint32_t hi = 0; hi < 65536; ++hi) {  // every tie and every neighbour of a tie
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      xs.push_back(hi << 16 | lo);
    }
  }
  for (int i = 0; i < 1'000'000; ++i) xs.push_back(bits(rng));
  for (std::uint32_t u : xs) {
    const float f = std::bit_cast<float>(u);
    const std::uint16_t got = bfloat16(f).bits;
    INFO("float bits " << u);
    if (std::isnan(f)) {
      REQUIRE(std::isnan(bfloat16::to_float(got)));
      REQUIRE((got & 0x8000) == ((u >> 16) & 0x8000));
    } else {
      REQUIRE(got == bf16_reference(f));
    }
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    REQUIRE(std::bit_cast<std::uint32_t>(bfloat16::to_float(static_cast<std::uint16_t>(b))) ==
            b << 16);
  }
}

TEST_CASE(
    "a float beyond half's or bfloat16's range becomes inf in every conversion path, never the "
    "largest finite value; NaN stays NaN") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // half: 65520 is the tie between 65504 and 2^16 and rounds (to even) to inf; 65519 to 65504
  const std::vector<float> in{65520.0f, -65520.0f, 65519.0f, -65519.0f, 1e30f,    -1e30f,
                              inf,      -inf,      nan,      -nan,      65504.0f, 3.4e38f};
  const std::vector<float> half_want{inf, -inf, 65504.0f, -65504.0f, inf,      -inf,
                                     inf, -inf, nan,      nan,       65504.0f, inf};
  std::vector<half> bulk(in.size());
  convert_from_float<half>(in, bulk.data());  // F16C where the CPU has it
  for (std::size_t i = 0; i < in.size(); ++i) {
    INFO("half(" << in[i] << ")");
    for (const float got : {static_cast<float>(half(in[i])), static_cast<float>(bulk[i])}) {
      if (std::isnan(half_want[i])) {
        REQUIRE(std::isnan(got));
      } else {
        REQUIRE(got == half_want[i]);
      }
    }
  }
  // bfloat16: the largest float rounds up past the largest bfloat16 (0x7f7f) to inf
  const float max_bf16 = bfloat16::to_float(0x7f7f);
  for (const auto& [x, want] :
       {std::pair{std::numeric_limits<float>::max(), inf},
        std::pair{-std::numeric_limits<float>::max(), -inf}, std::pair{max_bf16, max_bf16},
        std::pair{inf, inf}, std::pair{-inf, -inf}}) {
    INFO("bfloat16(" << x << ")");
    REQUIRE(static_cast<float>(bfloat16(x)) == want);
  }
  REQUIRE(std::isnan(static_cast<float>(bfloat16(nan))));
  std::vector<bfloat16> bulk_bf16(1);
  convert_from_float<bfloat16>(std::vector<float>{nan}, bulk_bf16.data());
  REQUIRE(std::isnan(static_cast<float>(bulk_bf16[0])));
}

TEST_CASE("DType tags, sizes, names and dispatch") {
  STATIC_REQUIRE(dtype_of<float> == DType::f32);
  STATIC_REQUIRE(dtype_of<half> == DType::f16);
  STATIC_REQUIRE(dtype_of<bfloat16> == DType::bf16);
  STATIC_REQUIRE(dtype_bytes(DType::f32) == 4);
  STATIC_REQUIRE(dtype_bytes(DType::bf16) == 2);
  REQUIRE(std::string(dtype_name(DType::f16)) == "f16");
  REQUIRE(format_name(DType::i8, DType::i8) == "int8");
  REQUIRE(format_name(DType::f16, DType::i8) == "K f16 + V int8");
  REQUIRE(format_name(DType::e4m3, DType::bf16) == "K fp8 + V bf16");
  for (DType d : {DType::f32, DType::f16, DType::bf16}) {
    const std::size_t size =
        dispatch_dtype(d, [](auto tag) { return sizeof(typename decltype(tag)::type); });
    REQUIRE(size == dtype_bytes(d));
  }
  kvcache::test::require_throws<shape_error>(
      [] { (void)dispatch_dtype(static_cast<DType>(7), [](auto) { return 0; }); }, "dtype 7", "f32",
      "f16", "bf16");
}
