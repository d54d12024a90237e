// SPDX-License-Identifier: Apache-2.0
// detail::Mutex's definitions (core/mutex.hpp includes this file where they are to be compiled,
// core/compiled_once.hpp; include that header, not this one).
#pragma once

#include <mutex>

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/core/mutex.hpp"

namespace kvcache::detail {

struct Mutex::Impl {
  std::mutex mutex;
};

KVCACHE_DETAIL_BODY_INLINE Mutex::Mutex() : impl_(new Impl) {}
KVCACHE_DETAIL_BODY_INLINE Mutex::~Mutex() { delete impl_; }
KVCACHE_DETAIL_BODY_INLINE void Mutex::lock() { impl_->mutex.lock(); }
KVCACHE_DETAIL_BODY_INLINE void Mutex::unlock() noexcept { impl_->mutex.unlock(); }

}  // namespace kvcache::detail
