// SPDX-License-Identifier: Apache-2.0
// ThreadPool: every index runs exactly once, exceptions reach the caller, concurrent and nested
// calls are safe.
#include "kvcache/core/thread_pool.hpp"

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/throws.hpp"

using kvcache::ThreadPool;

TEST_CASE("parallel_for runs every index exactly once") {
  for (std::size_t threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    REQUIRE(pool.num_threads() == threads);
    for (std::size_t n : {0, 1, 3, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      for (int round = 0; round < 20; ++round) {
        pool.parallel_for(n, [&](std::size_t i) { hits[i].fetch_add(1); });
      }
      for (auto& h : hits) REQUIRE(h.load() == 20);
    }
  }
}

TEST_CASE("an exception in one index reaches the caller and the pool stays usable") {
  ThreadPool pool(2);
  REQUIRE_THROWS_AS(pool.parallel_for(100,
                                      [](std::size_t i) {
                                        if (i == 37) throw std::runtime_error("index 37");
                                      }),
                    std::runtime_error);
  std::atomic<std::size_t> sum{0};
  pool.parallel_for(10, [&](std::size_t i) { sum += i; });
  REQUIRE(sum == 45);
}

TEST_CASE("concurrent callers are serialised and nested calls run inline") {
  ThreadPool pool(3);
  std::atomic<std::size_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) {
        pool.parallel_for(8, [&](std::size_t) {
          pool.parallel_for(3, [&](std::size_t) { total.fetch_add(1); });
        });
      }
    });
  }
  for (auto& t : callers) t.join();
  REQUIRE(total == 4u * 50u * 8u * 3u);
}

TEST_CASE("a pool of zero threads is refused") {
  kvcache::test::require_throws<kvcache::shape_error>([] { ThreadPool pool(0); }, "num_threads");
}
