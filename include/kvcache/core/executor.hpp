// SPDX-License-Identifier: Apache-2.0
// Executor: how kvcache's parallel functions borrow the caller's threads. A three-word reference
// to anything that can run n independent tasks and return when all are done (kvcache's
// ThreadPool, OpenMP, TBB, an engine's own pool); no threads, locks or allocations of its own.
#pragma once

#include <concepts>
#include <cstddef>
#include <memory>
#include <type_traits>

namespace kvcache {

/// n independent tasks handed to an executor: task i runs by calling tasks(i). Borrowed for one
/// Executor run; calling it does not throw. Non-allocating: a pointer to the caller's function
/// object and a function pointer that calls it.
class TaskList {
 public:
  /// Tasks f(0), ..., f(n - 1). f is called through a const reference, possibly from several
  /// threads at once. @pre f outlives the TaskList.
  template <class F>
  requires std::is_nothrow_invocable_v<const F&, std::size_t>
  constexpr TaskList(std::size_t n, const F& f) noexcept
      : fn_(static_cast<const void*>(&f)), call_(&call_as<F>), size_(n) {}

  /// The number of tasks.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  /// Runs task i. @pre i < size().
  void operator()(std::size_t i) const noexcept { call_(fn_, i); }

 private:
  template <class F>
  static void call_as(const void* f, std::size_t i) noexcept {
    (*static_cast<const F*>(f))(i);
  }

  const void* fn_;
  void (*call_)(const void*, std::size_t) noexcept;
  std::size_t size_;
};

/// What Executor can wrap (for `P& p`, `std::size_t n`, `const TaskList& tasks`):
///  1. `p.parallel_for(n, tasks)` calls tasks(i) exactly once for every i in [0, n), on any
///     threads (the caller's included) in any order, and returns when every call has finished.
///  2. `p.num_threads()` -> convertible to std::size_t: how many threads such a call may use
///     (work is cut into about that many shares or more; 1 runs it all on the caller).
/// A parallel_for called from inside a task (a nested call) must not deadlock. Tasks never
/// throw, so the executor needs no exception handling (an OpenMP loop suits).
template <class P>
concept ExecutorConcept = requires(P& p, std::size_t n, const TaskList& tasks) {
  { p.num_threads() } -> std::convertible_to<std::size_t>;
  p.parallel_for(n, tasks);
};

class Executor;

namespace detail {
/// An ExecutorConcept type other than Executor itself (an Executor is copied, not wrapped).
template <class P>
concept ForeignExecutor = !std::same_as<std::remove_cv_t<P>, Executor> && ExecutorConcept<P>;
}  // namespace detail

/// A borrowed reference to an executor (see ExecutorConcept), or none: then parallel_for runs
/// every task on the calling thread. A cheap value (a context pointer, a function pointer and a
/// thread count) that never allocates; the executor it refers to must outlive its uses.
/// Implicitly made from a pointer or reference to any ExecutorConcept type (ThreadPool*, a null
/// pointer gives none), or from a function pointer and a context:
///
///     Executor omp(nullptr, [](void*, const TaskList& tasks) {
///       #pragma omp parallel for schedule(dynamic)
///       for (long i = 0; i < static_cast<long>(tasks.size()); ++i)
///         tasks(static_cast<std::size_t>(i));
///     }, static_cast<std::size_t>(omp_get_max_threads()));
class Executor {
 public:
  /// Runs every task of `tasks` once (as ExecutorConcept's parallel_for) and returns when all have
  /// finished; `context` is the pointer the Executor was made with.
  using RunFn = void (*)(void* context, const TaskList& tasks);

  /// No executor: every task runs on the calling thread.
  constexpr Executor() noexcept = default;
  constexpr Executor(std::nullptr_t) noexcept {}

  /// `run(context, tasks)` runs the tasks on up to `num_threads` threads (0 counts as 1);
  /// a null `run` gives no executor.
  constexpr Executor(void* context, RunFn run, std::size_t num_threads) noexcept
      : context_(context), run_(run), num_threads_(num_threads == 0 ? 1 : num_threads) {}

  /// Refers to `*p` (a ThreadPool, or an engine's own pool); a null p gives no executor.
  /// The thread count is read here, once.
  template <detail::ForeignExecutor P>
  Executor(P* p) noexcept {
    if (p == nullptr) return;
    context_ = const_cast<void*>(static_cast<const void*>(p));
    run_ = [](void* context, const TaskList& tasks) {
      static_cast<P*>(context)->parallel_for(tasks.size(), tasks);
    };
    const auto n = static_cast<std::size_t>(p->num_threads());
    num_threads_ = n == 0 ? 1 : n;
  }

  /// Refers to `p`, as Executor(&p).
  template <detail::ForeignExecutor P>
  Executor(P& p) noexcept : Executor(std::addressof(p)) {}

  /// True when this refers to an executor.
  [[nodiscard]] constexpr explicit operator bool() const noexcept { return run_ != nullptr; }
  /// `opts.pool == nullptr`: no executor.
  [[nodiscard]] friend constexpr bool operator==(const Executor& e, std::nullptr_t) noexcept {
    return e.run_ == nullptr;
  }

  /// Threads a parallel_for may use: the executor's, 1 without one.
  [[nodiscard]] constexpr std::size_t num_threads() const noexcept { return num_threads_; }

  /// Calls f(i) once for every i in [0, n) and returns when all calls have finished: through the
  /// executor, or on the calling thread without one (and for n <= 1). f must not throw.
  template <class F>
  requires std::is_nothrow_invocable_v<const F&, std::size_t>
  void parallel_for(std::size_t n, const F& f) const {
    if (run_ == nullptr || n <= 1) {
      for (std::size_t i = 0; i < n; ++i) f(i);
      return;
    }
    run_(context_, TaskList(n, f));
  }

 private:
  void* context_ = nullptr;
  RunFn run_ = nullptr;
  std::size_t num_threads_ = 1;
};

static_assert(ExecutorConcept<Executor>);

}  // namespace kvcache
