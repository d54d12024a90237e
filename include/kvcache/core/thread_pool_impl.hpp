// SPDX-License-Identifier: Apache-2.0
// ThreadPool's definitions (core/thread_pool.hpp includes this file where they are to be
// compiled; include that header, not this one). Inline, for any number of translation units;
// out of line in the one file of a program that defines KVCACHE_INSTANTIATE_KERNELS, where the
// others, built with KVCACHE_EXTERN_KERNELS, find them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/thread_pool.hpp"

namespace kvcache {

struct ThreadPool::State {
  std::mutex call_mutex;
  std::atomic<std::thread::id> caller{};
  std::mutex mutex;
  std::condition_variable wake;
  std::condition_variable done;
  std::vector<std::thread> workers;
  void* job = nullptr;
  void (*invoke)(void*, std::size_t) = nullptr;
  std::size_t job_size = 0;
  std::atomic<std::size_t> next{0};
  std::size_t generation = 0;
  std::size_t finished_workers = 0;
  bool stop = false;
  std::exception_ptr error;

  /// True on a worker, or on the thread whose parallel_for is running (a nested call).
  [[nodiscard]] bool running_on_worker() const noexcept {
    const auto id = std::this_thread::get_id();
    if (caller.load(std::memory_order_relaxed) == id) return true;
    for (const auto& w : workers) {
      if (w.get_id() == id) return true;
    }
    return false;
  }

  void run_indices() noexcept {
    for (;;) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job_size) return;
      try {
        invoke(job, i);
      } catch (...) {
        std::lock_guard lock(mutex);
        if (!error) error = std::current_exception();
        next.store(job_size, std::memory_order_relaxed);
      }
    }
  }

  void work() {
    std::size_t seen = 0;
    std::unique_lock lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return stop || generation != seen; });
      if (stop) return;
      seen = generation;
      lock.unlock();
      run_indices();
      lock.lock();
      if (++finished_workers == workers.size()) done.notify_one();
    }
  }

  void stop_workers() noexcept {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    wake.notify_all();
    for (auto& w : workers) {
      if (w.joinable()) w.join();
    }
  }
};

KVCACHE_DETAIL_BODY_INLINE ThreadPool::ThreadPool(std::size_t num_threads) {
  if (num_threads == 0) throw shape_error("ThreadPool: num_threads must be at least 1");
  std::unique_ptr<State> state = std::make_unique<State>();
  State& s = *state;
  s.workers.reserve(num_threads - 1);
  try {
    for (std::size_t i = 0; i + 1 < num_threads; ++i) s.workers.emplace_back([&s] { s.work(); });
  } catch (...) {
    s.stop_workers();
    throw;
  }
  state_ = state.release();
}

KVCACHE_DETAIL_BODY_INLINE ThreadPool::~ThreadPool() {
  state_->stop_workers();
  delete state_;
}

KVCACHE_DETAIL_BODY_INLINE std::size_t ThreadPool::num_threads() const noexcept {
  return state_->workers.size() + 1;
}

KVCACHE_DETAIL_BODY_INLINE void ThreadPool::run(std::size_t n, void* job,
                                                void (*invoke)(void*, std::size_t)) {
  if (n == 0) return;
  State& s = *state_;
  if (s.workers.empty() || n == 1 || s.running_on_worker()) {
    for (std::size_t i = 0; i < n; ++i) invoke(job, i);
    return;
  }
  std::lock_guard call_lock(s.call_mutex);
  s.caller.store(std::this_thread::get_id(), std::memory_order_relaxed);
  struct ClearCaller {
    std::atomic<std::thread::id>& id;
    ~ClearCaller() { id.store(std::thread::id{}, std::memory_order_relaxed); }
  } clear_caller{s.caller};
  {
    std::lock_guard lock(s.mutex);
    s.job = job;
    s.invoke = invoke;
    s.job_size = n;
    s.next.store(0, std::memory_order_relaxed);
    s.finished_workers = 0;
    s.error = nullptr;
    ++s.generation;
  }
  s.wake.notify_all();
  s.run_indices();
  std::unique_lock lock(s.mutex);
  s.done.wait(lock, [&] { return s.finished_workers == s.workers.size(); });
  s.job = nullptr;
  if (s.error) std::rethrow_exception(std::exchange(s.error, nullptr));
}

}  // namespace kvcache
