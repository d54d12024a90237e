// SPDX-License-Identifier: Apache-2.0
// ThreadPool: kvcache's ready-made executor, for engines without threads of their own (any
// ExecutorConcept type will do, see core/executor.hpp). The caller creates and owns it (there is
// no global pool and no hidden thread); parallel_for runs on the caller plus the pool's workers.
// Its threads, locks and condition variables sit behind a pointer, defined in
// core/thread_pool_impl.hpp: compiled wherever this header is included, or, in a program built
// with KVCACHE_EXTERN_KERNELS, once, in its KVCACHE_INSTANTIATE_KERNELS file (README, "Compile
// time"), so that its other translation units do not parse <thread> and <condition_variable>.
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>

#include "kvcache/core/compiled_once.hpp"
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
  explicit ThreadPool(std::size_t num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  /// Stops and joins the workers.
  ~ThreadPool();

  /// Threads that run a parallel_for: workers plus the caller.
  [[nodiscard]] std::size_t num_threads() const noexcept;

  /// Calls f(i) once for every i in [0, n), spread over all threads; returns when every call has
  /// finished. If a call throws, indices not yet started are skipped and the first exception is
  /// rethrown here.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    using Fn = std::remove_reference_t<F>;
    run(n, const_cast<void*>(static_cast<const void*>(std::addressof(f))),
        [](void* fn, std::size_t i) { (*static_cast<Fn*>(fn))(i); });
  }

 private:
  struct State;
  /// parallel_for over invoke(job, i).
  void run(std::size_t n, void* job, void (*invoke)(void*, std::size_t));
  State* state_;  // owned (a std::unique_ptr here would cost every includer its instantiation)
};

static_assert(ExecutorConcept<ThreadPool>);

}  // namespace kvcache

#if KVCACHE_DETAIL_DEFINES_BODIES
#include "kvcache/core/thread_pool_impl.hpp"
#endif
