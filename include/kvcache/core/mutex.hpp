// SPDX-License-Identifier: Apache-2.0
// detail::Mutex: a std::mutex behind a pointer, and detail::MutexLock, its scoped lock, for the
// headers every file parses (BlockManager's shared block metadata). The std::mutex and its header
// are in core/mutex_impl.hpp: parsed wherever this header is included, or, in a program built
// with KVCACHE_EXTERN_KERNELS, only in its KVCACHE_INSTANTIATE_KERNELS file (README, "Compile
// time"), so that its other translation units do not parse <mutex>.
#pragma once

#include "kvcache/core/compiled_once.hpp"

namespace kvcache::detail {

/// A non-recursive mutex with std::mutex's semantics (it is one). Not movable: its owner holds it
/// where it stays put (BlockManager's SharedBlocks sit behind a pointer).
class Mutex {
 public:
  /// @throws std::bad_alloc.
  Mutex();
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  ~Mutex();

  /// Blocks until this thread holds the mutex. @throws std::system_error (as std::mutex does).
  void lock();
  /// @pre this thread holds the mutex.
  void unlock() noexcept;

 private:
  struct Impl;
  Impl* impl_;  // owned (a std::unique_ptr here would cost every includer its instantiation)
};

/// Holds a Mutex from construction to destruction (std::lock_guard's job).
class [[nodiscard]] MutexLock {
 public:
  explicit MutexLock(Mutex& m) : mutex_(m) { mutex_.lock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() { mutex_.unlock(); }

 private:
  Mutex& mutex_;
};

}  // namespace kvcache::detail

#if KVCACHE_DETAIL_DEFINES_BODIES
#include "kvcache/core/mutex_impl.hpp"
#endif
