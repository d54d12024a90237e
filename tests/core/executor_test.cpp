// SPDX-License-Identifier: Apache-2.0
// Executor: made from nothing, a ThreadPool, an engine's own pool type or a function pointer, it
// runs every task exactly once and returns after all of them, allocates nothing, and the
// attention API's options header no longer pulls in the thread machinery.
#include "kvcache/attention/options.hpp"  // first: what it includes is checked below

// libstdc++'s include guards of <thread>, <mutex> and <condition_variable>.
#if defined(_GLIBCXX_THREAD) || defined(_GLIBCXX_MUTEX) || defined(_GLIBCXX_CONDITION_VARIABLE)
constexpr bool kOptionsPullsThreads = true;
#else
constexpr bool kOptionsPullsThreads = false;
#endif

#include <atomic>
#include <cstddef>
#include <thread>
#include <type_traits>
#include <vector>

#include "kvcache/core/executor.hpp"
#include "kvcache/core/thread_pool.hpp"
#include "support/catch.hpp"
#include "support/counting_new.hpp"

using kvcache::Executor;
using kvcache::ExecutorConcept;
using kvcache::TaskList;
using kvcache::ThreadPool;
using kvcache::test::g_allocations;

namespace {

static_assert(!kOptionsPullsThreads,
              "attention/options.hpp includes <thread>, <mutex> or <condition_variable>");

// An engine's own executor: runs the tasks on the caller, last index first.
struct ReversePool {
  int threads = 4;  // an int thread count, as OpenMP reports it
  std::size_t calls = 0;
  [[nodiscard]] int num_threads() const noexcept { return threads; }
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    ++calls;
    for (std::size_t i = n; i-- > 0;) f(i);
  }
};

struct NoThreadCount {
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }
};

template <class F>
concept RunsThrough = requires(const Executor& e, const F& f) {
  e.parallel_for(std::size_t{1}, f);
};

struct Throwing {
  void operator()(std::size_t) const {}
};
struct NotThrowing {
  void operator()(std::size_t) const noexcept {}
};

static_assert(ExecutorConcept<ThreadPool>);
static_assert(ExecutorConcept<ReversePool>);
static_assert(ExecutorConcept<Executor>);
static_assert(!ExecutorConcept<NoThreadCount>);
static_assert(!ExecutorConcept<int>);
static_assert(std::is_convertible_v<ThreadPool*, Executor>);
static_assert(std::is_convertible_v<ThreadPool&, Executor>);
static_assert(std::is_convertible_v<ReversePool*, Executor>);
static_assert(std::is_convertible_v<std::nullptr_t, Executor>);
static_assert(!std::is_convertible_v<int*, Executor>);
static_assert(!std::is_convertible_v<NoThreadCount*, Executor>);
static_assert(std::is_trivially_copyable_v<Executor>);
static_assert(sizeof(Executor) <= 3 * sizeof(void*));
static_assert(RunsThrough<NotThrowing>);
static_assert(!RunsThrough<Throwing>, "tasks that may throw are refused at compile time");
static_assert(std::is_same_v<decltype(kvcache::AttentionOptions{}.pool), Executor>);

// Runs parallel_for(n) on `e` and requires every index exactly once.
void require_each_once(const Executor& e, std::size_t n) {
  std::vector<std::atomic<int>> hits(n);
  e.parallel_for(n, [&](std::size_t i) noexcept { hits[i].fetch_add(1); });
  for (std::size_t i = 0; i < n; ++i) {
    INFO("index " << i << " of " << n);
    REQUIRE(hits[i].load() == 1);
  }
}

}  // namespace

TEST_CASE("an empty executor runs every task on the calling thread, in order") {
  ThreadPool* no_pool = nullptr;
  for (const Executor& e : {Executor{}, Executor(nullptr), Executor(no_pool)}) {
    REQUIRE(!e);
    REQUIRE(e == nullptr);
    REQUIRE(e.num_threads() == 1);
    std::vector<std::size_t> order;
    const auto caller = std::this_thread::get_id();
    bool on_caller = true;
    e.parallel_for(5, [&](std::size_t i) noexcept {
      order.push_back(i);
      on_caller = on_caller && std::this_thread::get_id() == caller;
    });
    REQUIRE(order == std::vector<std::size_t>{0, 1, 2, 3, 4});
    REQUIRE(on_caller);
  }
}

TEST_CASE("an executor made from a ThreadPool runs every task exactly once on the pool") {
  ThreadPool pool(3);
  for (const Executor& e : {Executor(&pool), Executor(pool)}) {
    REQUIRE(static_cast<bool>(e));
    REQUIRE(e != nullptr);
    REQUIRE(e.num_threads() == 3);
    for (std::size_t n : {0u, 1u, 2u, 7u, 1000u}) require_each_once(e, n);
  }
  // The pool's threads run the tasks (a task blocks until another thread has joined in).
  std::atomic<int> arrived{0};
  Executor(pool).parallel_for(2, [&](std::size_t) noexcept {
    arrived.fetch_add(1);
    while (arrived.load() < 2) std::this_thread::yield();
  });
  REQUIRE(arrived.load() == 2);
}

TEST_CASE("an executor made from an engine's own pool type or a function pointer uses it") {
  ReversePool mine;
  const Executor e = &mine;
  REQUIRE(e.num_threads() == 4);
  std::vector<std::size_t> order;
  e.parallel_for(4, [&](std::size_t i) noexcept { order.push_back(i); });
  REQUIRE(order == std::vector<std::size_t>{3, 2, 1, 0});
  REQUIRE(mine.calls == 1);
  e.parallel_for(1, [&](std::size_t) noexcept {});  // one task: run here, not handed over
  REQUIRE(mine.calls == 1);
  // A copy of a (non-const) Executor refers to the same executor, not to the Executor copied.
  Executor first = &mine;
  Executor copy(first);
  first = nullptr;
  copy.parallel_for(3, [](std::size_t) noexcept {});
  REQUIRE(mine.calls == 2);

  struct Context {
    std::size_t runs = 0;
  } context;
  const Executor by_pointer(
      &context,
      [](void* c, const TaskList& tasks) {
        ++static_cast<Context*>(c)->runs;
        for (std::size_t i = 0; i < tasks.size(); i += 2) tasks(i);  // evens, then odds
        for (std::size_t i = 1; i < tasks.size(); i += 2) tasks(i);
      },
      0);
  REQUIRE(by_pointer.num_threads() == 1);  // 0 counts as 1
  require_each_once(by_pointer, 9);
  REQUIRE(context.runs == 1);
  REQUIRE(!Executor(&context, nullptr, 4));
}

TEST_CASE("parallel_for through an Executor allocates nothing and may nest") {
  ThreadPool pool(2);
  ReversePool mine;
  std::atomic<std::size_t> sum{0};
  const auto add = [&](std::size_t i) noexcept { sum.fetch_add(i); };
  Executor(pool).parallel_for(64, add);  // warm up: the pool's first job
  const std::size_t before = g_allocations.load();
  for (const Executor& e : {Executor(pool), Executor(&mine), Executor{}}) e.parallel_for(64, add);
  REQUIRE(g_allocations.load() == before);
  REQUIRE(sum.load() == 4 * (64 * 63 / 2));
  // A task that runs a parallel_for of its own on the same pool: serial inside, no deadlock.
  const Executor e(pool);
  std::atomic<std::size_t> inner{0};
  e.parallel_for(4, [&](std::size_t) noexcept {
    e.parallel_for(8, [&](std::size_t) noexcept { inner.fetch_add(1); });
  });
  REQUIRE(inner.load() == 32);
}
