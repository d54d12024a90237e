// SPDX-License-Identifier: Apache-2.0
// The engine's GEMM: matmul over a packed matrix equals a double-precision product for ragged
// shapes (partial panels, several K blocks, row tails), threaded or not, and a row's result is the
// same bits whatever rows it is computed with (what makes cached and uncached runs agree exactly).
#include <cmath>
#include <span>
#include <vector>

#include "llama/gemm.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using llama::GemmKernel;
using llama::PackedMatrix;

namespace {

std::vector<float> naive(const std::vector<float>& a, std::size_t m, std::size_t k,
                         const std::vector<float>& w, std::size_t n, const std::vector<float>* c0) {
  std::vector<float> c(m * n);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double s = c0 ? (*c0)[i * n + j] : 0.0;
      for (std::size_t x = 0; x < k; ++x) s += double(a[i * k + x]) * w[j * k + x];
      c[i * n + j] = static_cast<float>(s);
    }
  }
  return c;
}

}  // namespace

TEST_CASE("matmul equals the double-precision product for ragged shapes") {
  auto rng = test::make_rng("matmul equals the double-precision product");
  ThreadPool pool(3);
  struct Shape {
    std::size_t m, n, k;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{1, 17, 5}, Shape{5, 33, 300}, Shape{6, 16, 256},
                        Shape{7, 40, 513}, Shape{13, 97, 64}, Shape{100, 50, 70}}) {
    for (GemmKernel kernel : {GemmKernel::automatic, GemmKernel::portable}) {
      for (bool accumulate : {false, true}) {
        for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
          INFO("m " << s.m << " n " << s.n << " k " << s.k << " portable "
                    << (kernel == GemmKernel::portable) << " accumulate " << accumulate << " pool "
                    << (p != nullptr));
          const auto a = test::normal_floats(rng, s.m * s.k);
          const auto w = test::normal_floats(rng, s.n * s.k);
          auto c = test::normal_floats(rng, s.m * s.n);
          const auto c0 = c;
          const PackedMatrix packed(w, s.n, s.k);
          REQUIRE(packed.rows() == s.n);
          REQUIRE(packed.cols() == s.k);
          llama::matmul(a.data(), s.m, s.k, packed, c.data(), s.n, accumulate, p, kernel);
          const auto want = naive(a, s.m, s.k, w, s.n, accumulate ? &c0 : nullptr);
          // fp32 accumulation of k products of N(0,1) values: error ~ sqrt(k) * 2^-24 * |terms|.
          test::require_close(c, want, {.abs = 2e-5 * std::sqrt(double(s.k)), .rel = 1e-5});
        }
      }
    }
  }
}

TEST_CASE("matmul honours row strides and leaves other columns alone") {
  auto rng = test::make_rng("matmul honours row strides");
  const std::size_t m = 9, n = 21, k = 30, lda = 37, ldc = 25;
  const auto a = test::normal_floats(rng, m * lda);
  const auto w = test::normal_floats(rng, n * k);
  std::vector<float> c(m * ldc, 7.0f);
  llama::matmul(a.data(), m, lda, PackedMatrix(w, n, k), c.data(), ldc, false, nullptr);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < ldc; ++j) {
      if (j >= n) {
        REQUIRE(c[i * ldc + j] == 7.0f);
        continue;
      }
      double s = 0;
      for (std::size_t x = 0; x < k; ++x) s += double(a[i * lda + x]) * w[j * k + x];
      REQUIRE(std::abs(c[i * ldc + j] - s) <= 1e-4);
    }
  }
}

TEST_CASE("a row's matmul result does not depend on the rows computed with it") {
  auto rng = test::make_rng("a row's matmul result does not depend on the rows");
  ThreadPool pool(2);
  const std::size_t m = 203, n = 70, k = 600;  // several row blocks, K blocks, a partial panel
  const auto a = test::normal_floats(rng, m * k);
  const PackedMatrix w(test::normal_floats(rng, n * k), n, k);
  for (GemmKernel kernel : {GemmKernel::automatic, GemmKernel::portable}) {
    std::vector<float> all(m * n);
    llama::matmul(a.data(), m, k, w, all.data(), n, false, &pool, kernel);
    for (std::size_t first : {std::size_t{0}, std::size_t{5}, std::size_t{97}, m - 1}) {
      for (std::size_t rows : {std::size_t{1}, std::size_t{4}}) {
        const std::size_t r = std::min(rows, m - first);
        std::vector<float> part(r * n);
        llama::matmul(a.data() + first * k, r, k, w, part.data(), n, false, nullptr, kernel);
        INFO("rows " << first << ".." << first + r);
        REQUIRE(kvcache::test::same_bits(
            part, std::span<const float>(all).subspan(first * n, part.size())));
      }
    }
  }
}

TEST_CASE("PackedMatrix rejects inconsistent shapes") {
  std::vector<float> w(12);
  test::require_throws<shape_error>([&] { PackedMatrix(w, 5, 3); }, "12 values", "[5][3]");
  test::require_throws<shape_error>([&] { PackedMatrix(std::span<const float>(), 0, 3); },
                                    "zero dimension");
}
