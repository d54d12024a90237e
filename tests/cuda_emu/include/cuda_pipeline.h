// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for cuda_pipeline.h: cp.async copies (__pipeline_memcpy_async) are queued per
// thread and land, group by group, at random either when committed or as late as
// __pipeline_wait_prior allows, so that a kernel reading a buffer before waiting for it, or
// refilling one still in use, sees the wrong data. Alignment and zero-fill as on the device.
#pragma once
#include "kvemu.hpp"

inline void __pipeline_memcpy_async(void* dst, const void* src, std::size_t size_and_align,
                                    std::size_t zfill = 0) {
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  if ((size_and_align != 4 && size_and_align != 8 && size_and_align != 16) ||
      zfill > size_and_align || d % size_and_align != 0 || s % size_and_align != 0) {
    kvemu::fail("__pipeline_memcpy_async: size must be 4, 8 or 16, both pointers aligned to it");
  }
  const auto* smem = kvcache::cuda::detail::smem;
  if (d < reinterpret_cast<std::uintptr_t>(smem) ||
      d + size_and_align > reinterpret_cast<std::uintptr_t>(smem + kvemu::kSharedBytes)) {
    kvemu::fail("__pipeline_memcpy_async: the destination is not shared memory");
  }
  kvemu::fiber().pending.push_back({dst, src, size_and_align - zfill, size_and_align});
}

inline void __pipeline_commit() {
  kvemu::Fiber& f = kvemu::fiber();
  if (kvemu::g_rng() % 2 == 0) {
    for (const auto& group : f.in_flight)  // in order: earlier groups first
      for (const kvemu::Copy& c : group) kvemu::land(c);
    f.in_flight.clear();
    for (const kvemu::Copy& c : f.pending) kvemu::land(c);
    f.in_flight.emplace_back();  // an empty group keeps wait_prior's count right
  } else {
    f.in_flight.push_back(std::move(f.pending));
  }
  f.pending.clear();
}

inline void __pipeline_wait_prior(std::size_t n) {
  kvemu::Fiber& f = kvemu::fiber();
  while (f.in_flight.size() > n) {
    for (const kvemu::Copy& c : f.in_flight.front()) kvemu::land(c);
    f.in_flight.erase(f.in_flight.begin());
  }
}
