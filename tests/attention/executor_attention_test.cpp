// SPDX-License-Identifier: Apache-2.0
// Attention through executors other than ThreadPool (an engine's own pool type, a function
// pointer over threads the test owns) gives the same bits as on the calling thread alone and as
// through ThreadPool, and kvcache allocates nothing per call to use them. OpenMP has its own
// test (openmp_executor_test.cpp), built where the compiler has OpenMP.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <iterator>
#include <mutex>
#include <thread>

#include "attention/executor_checks.hpp"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/counting_new.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

// An engine's own executor: runs the tasks on the calling thread, last index first.
struct ReverseExecutor {
  std::size_t calls = 0;
  [[nodiscard]] std::size_t num_threads() const noexcept { return 4; }
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    ++calls;
    for (std::size_t i = n; i-- > 0;) f(i);
  }
};

// Threads the engine already has: two workers, woken for each job, and the caller, taking
// indices from a shared counter (the test's stand-in for an engine's own pool).
class EngineThreads {
 public:
  EngineThreads() {
    for (auto& w : workers_) w = std::thread([this] { work(); });
  }
  EngineThreads(const EngineThreads&) = delete;
  EngineThreads& operator=(const EngineThreads&) = delete;
  ~EngineThreads() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  /// Executor::RunFn: runs `tasks` on the workers and the caller; returns when all are done.
  static void run(void* self, const TaskList& tasks) {
    auto& t = *static_cast<EngineThreads*>(self);
    t.calls.fetch_add(1);
    {
      std::lock_guard lock(t.mutex_);
      t.tasks_ = &tasks;
      t.next_.store(0);
      t.finished_ = 0;
      ++t.generation_;
    }
    t.wake_.notify_all();
    t.take(tasks);
    std::unique_lock lock(t.mutex_);
    t.done_.wait(lock, [&] { return t.finished_ == std::size(t.workers_); });
    t.tasks_ = nullptr;
  }

  std::atomic<std::size_t> calls{0};

 private:
  void take(const TaskList& tasks) {
    for (std::size_t i = next_.fetch_add(1); i < tasks.size(); i = next_.fetch_add(1)) tasks(i);
  }
  void work() {
    std::size_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const TaskList* tasks = tasks_;
      lock.unlock();
      take(*tasks);
      lock.lock();
      if (++finished_ == std::size(workers_)) done_.notify_one();
    }
  }

  std::thread workers_[2];
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const TaskList* tasks_ = nullptr;
  std::atomic<std::size_t> next_{0};
  std::size_t finished_ = 0;
  std::size_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace

TEST_CASE("attention through an engine's own executor type equals the single-threaded result") {
  auto rng = test::make_rng("executor: engine type");
  ReverseExecutor mine;
  test::require_executor_matches(&mine, rng, &test::g_allocations);
  REQUIRE(mine.calls > 0);  // the calls were large enough to be handed to the executor
}

TEST_CASE(
    "attention through a function-pointer executor over the engine's threads equals the "
    "single-threaded result") {
  auto rng = test::make_rng("executor: function pointer");
  EngineThreads threads;
  const Executor executor(&threads, &EngineThreads::run, 3);
  test::require_executor_matches(executor, rng, &test::g_allocations);
  REQUIRE(threads.calls.load() > 0);
}
