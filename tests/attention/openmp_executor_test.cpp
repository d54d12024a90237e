// SPDX-License-Identifier: Apache-2.0
// Attention on an engine's OpenMP threads: an Executor whose function runs the tasks in an
// OpenMP parallel loop, and a small type with an OpenMP parallel_for, give the same bits as
// ThreadPool and as the calling thread alone. Built only where CMake finds OpenMP for C++.
#include <omp.h>

#include <atomic>
#include <cstddef>

#include "attention/executor_checks.hpp"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

// Parallel regions entered, and the most OpenMP threads one of them had.
std::atomic<int> g_regions{0};
std::atomic<int> g_most_threads{0};

void note_region() {
  if (omp_get_thread_num() != 0) return;
  g_regions.fetch_add(1);
  const int n = omp_get_num_threads();
  for (int m = g_most_threads.load(); n > m && !g_most_threads.compare_exchange_weak(m, n);) {
  }
}

// The form an engine writes in a few lines: a capture-less function and no context.
void run_openmp(void* /*context*/, const TaskList& tasks) {
  const auto n = static_cast<long>(tasks.size());
#pragma omp parallel
  {
    note_region();
#pragma omp for schedule(dynamic)
    for (long i = 0; i < n; ++i) tasks(static_cast<std::size_t>(i));
  }
}

// The same as a type modelling ExecutorConcept, with a fixed team size.
struct OpenMPExecutor {
  int threads = 3;
  [[nodiscard]] int num_threads() const noexcept { return threads; }
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
#pragma omp parallel num_threads(threads)
    {
      note_region();
#pragma omp for schedule(static, 1)
      for (long i = 0; i < static_cast<long>(n); ++i) f(static_cast<std::size_t>(i));
    }
  }
};

}  // namespace

TEST_CASE(
    "attention through an OpenMP executor equals ThreadPool and single-threaded, bit for bit") {
  auto rng = test::make_rng("openmp executor");
  SECTION("function pointer") {
    g_regions = 0;
    const Executor omp(nullptr, &run_openmp, static_cast<std::size_t>(omp_get_max_threads()));
    test::require_executor_matches(omp, rng);
  }
  SECTION("ExecutorConcept type") {
    g_regions = 0;
    OpenMPExecutor omp;
    test::require_executor_matches(&omp, rng);
    REQUIRE(g_most_threads.load() > 1);
  }
  INFO("OpenMP regions entered: " << g_regions.load()
                                  << ", most threads in one: " << g_most_threads.load());
  REQUIRE(g_regions.load() > 0);
}
