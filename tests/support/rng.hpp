// SPDX-License-Identifier: Apache-2.0
// Seeded random numbers for tests. Every generator prints its seed, and KVCACHE_TEST_SEED=<n>
// replays a failing run.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string_view>
#include <vector>

namespace kvcache::test {

/// The run's base seed: $KVCACHE_TEST_SEED if set, else fresh from std::random_device.
inline std::uint64_t base_seed() {
  static const std::uint64_t seed = [] {
    if (const char* env = std::getenv("KVCACHE_TEST_SEED")) {
      return static_cast<std::uint64_t>(std::strtoull(env, nullptr, 10));
    }
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}

/// A generator for one test, seeded from the base seed and the test's name; prints both.
inline std::mt19937_64 make_rng(std::string_view name) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the name
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  std::cerr << "[rng] " << name << ": KVCACHE_TEST_SEED=" << base_seed() << "\n";
  return std::mt19937_64(base_seed() ^ h);
}

/// n floats from N(0, 1).
inline std::vector<float> normal_floats(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

/// A uniform integer in [lo, hi].
inline std::size_t uniform(std::mt19937_64& rng, std::size_t lo, std::size_t hi) {
  return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
}

}  // namespace kvcache::test
