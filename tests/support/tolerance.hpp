// SPDX-License-Identifier: Apache-2.0
// Element-wise comparison for tests: every element must be within tolerance (never "most of
// them"), and a failure reports how many missed, the worst one, and its index.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <sstream>
#include <string>

#include "support/catch.hpp"

namespace kvcache::test {

/// The same floats bit for bit (sizes included): for paths promised to give identical results.
[[nodiscard]] inline bool same_bits(std::span<const float> a, std::span<const float> b) noexcept {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

/// |actual - expected| <= abs + rel * |expected| for every element; NaN never passes.
struct Tolerance {
  double abs = 0.0;
  double rel = 0.0;
};

/// Describes the elements of `actual` outside `tol` of `expected` ("" when all are within).
inline std::string mismatch_report(std::span<const float> actual, std::span<const float> expected,
                                   Tolerance tol) {
  if (actual.size() != expected.size()) {
    return "size " + std::to_string(actual.size()) + " != expected size " +
           std::to_string(expected.size());
  }
  std::size_t bad = 0, worst = 0;
  double worst_excess = -1.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    const double err = std::abs(a - e), allowed = tol.abs + tol.rel * std::abs(e);
    if (!(err <= allowed)) {
      ++bad;
      const double excess = std::isnan(err) ? 1e300 : err - allowed;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
  }
  if (bad == 0) return {};
  std::ostringstream os;
  os << bad << " of " << actual.size() << " elements outside tolerance (abs " << tol.abs << ", rel "
     << tol.rel << "); worst at index " << worst << ": got " << actual[worst] << ", expected "
     << expected[worst];
  return os.str();
}

/// REQUIREs that every element of `actual` is within `tol` of `expected`.
inline void require_close(std::span<const float> actual, std::span<const float> expected,
                          Tolerance tol) {
  const std::string report = mismatch_report(actual, expected, tol);
  INFO(report);
  REQUIRE(report.empty());
}

/// As require_close, but a miss is recorded and the test goes on (CHECK): for sweeps where every
/// failing case should be reported in one run, e.g. the CUDA tests on a briefly lent GPU.
inline void check_close(std::span<const float> actual, std::span<const float> expected,
                        Tolerance tol) {
  const std::string report = mismatch_report(actual, expected, tol);
  INFO(report);
  CHECK(report.empty());
}

}  // namespace kvcache::test
