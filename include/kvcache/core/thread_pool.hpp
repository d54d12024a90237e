// SPDX-License-Identifier: Apache-2.0
// ThreadPool: kvcache's ready-made executor, for engines without threads of their own (any
// ExecutorConcept type will do, see core/executor.hpp). The caller creates and owns it (there is
// no global pool and no hidden thread); parallel_for runs on the caller plus the pool's workers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvcache/core/error.hpp"
#include "kvcache/core/executor.hpp"

namespace kvcache {

/// A fixed set of worker threads for parallel_for. Models ExecutorConcept: `opts.pool = &pool`
/// hands it to an attention call as an Executor. Thread-safe: concurrent parallel_for calls
/// from several threads are serialised. Not reentrant: calling parallel_for from inside f runs
/// the nested loop serially on the calling thread instead of deadlocking.
class ThreadPool {
 public:
  /// A pool of `num_threads` threads in total: the caller of parallel_for plus
  /// num_threads - 1 workers started here. @throws shape_error for 0, std::system_error.
  explicit ThreadPool(std::size_t num_threads) {
    if (num_threads == 0) throw shape_error("ThreadPool: num_threads must be at least 1");
    workers_.reserve(num_threads - 1);
    try {
      for (std::size_t i = 0; i + 1 < num_threads; ++i) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop_workers();
      throw;
    }
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() { stop_workers(); }

  /// Threads that run a parallel_for: workers plus the caller.
  [[nodiscard]] std::size_t num_threads() const noexcept { return workers_.size() + 1; }

  /// Calls f(i) once for every i in [0, n), spread over all threads; returns when every call has
  /// finished. If a call throws, indices not yet started are skipped and the first exception is
  /// rethrown here.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    if (n == 0) return;
    if (workers_.empty() || n == 1 || running_on_worker()) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    using Fn = std::remove_reference_t<F>;
    std::lock_guard call_lock(call_mutex_);
    caller_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    struct ClearCaller {
      std::atomic<std::thread::id>& id;
      ~ClearCaller() { id.store(std::thread::id{}, std::memory_order_relaxed); }
    } clear_caller{caller_};
    {
      std::lock_guard lock(mutex_);
      job_ = const_cast<void*>(static_cast<const void*>(&f));
      invoke_ = [](void* fn, std::size_t i) { (*static_cast<Fn*>(fn))(i); };
      job_size_ = n;
      next_.store(0, std::memory_order_relaxed);
      finished_workers_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    run_indices();
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return finished_workers_ == workers_.size(); });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  /// True on a worker, or on the thread whose parallel_for is running (a nested call).
  [[nodiscard]] bool running_on_worker() const noexcept {
    const auto id = std::this_thread::get_id();
    if (caller_.load(std::memory_order_relaxed) == id) return true;
    for (const auto& w : workers_) {
      if (w.get_id() == id) return true;
    }
    return false;
  }

  void run_indices() noexcept {
    for (;;) {
      const std::size_t i = next_.fetch_add(1, std::memory_order_relaxed);
      if (i >= job_size_) return;
      try {
        invoke_(job_, i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(job_size_, std::memory_order_relaxed);
      }
    }
  }

  void work() {
    std::size_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      lock.unlock();
      run_indices();
      lock.lock();
      if (++finished_workers_ == workers_.size()) done_.notify_one();
    }
  }

  void stop_workers() noexcept {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) {
      if (w.joinable()) w.join();
    }
  }

  std::mutex call_mutex_;
  std::atomic<std::thread::id> caller_{};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  void* job_ = nullptr;
  void (*invoke_)(void*, std::size_t) = nullptr;
  std::size_t job_size_ = 0;
  std::atomic<std::size_t> next_{0};
  std::size_t generation_ = 0;
  std::size_t finished_workers_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

static_assert(ExecutorConcept<ThreadPool>);

}  // namespace kvcache
