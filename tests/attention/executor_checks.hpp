// SPDX-License-Identifier: Apache-2.0
// The property an executor must keep: attention run through it gives the same bits as on the
// calling thread alone and as through kvcache's ThreadPool, over every policy's view, kernel,
// query/output type, single calls and batches; and kvcache allocates nothing to use it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "attention/every_policy.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"

namespace kvcache::test {

namespace detail {

constexpr std::size_t kExecGroup = 2;

template <Element X>
[[nodiscard]] bool same_elements(const std::vector<X>& a, const std::vector<X>& b) noexcept {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0;
}

// Three tasks over `view`: the last n queries, 3 queries ending 5 positions earlier and one
// query at position 2 (kept on the windowed masks' sinks): outputs per task, by `pool`.
template <Element Q, Element O, KVView V>
std::vector<std::vector<O>> run_batch(const V& view, const std::vector<std::vector<Q>>& qs,
                                      std::span<const std::size_t> counts,
                                      std::span<const position_t> first, AttentionOptions opts,
                                      cpu::Kernel kernel, Executor pool,
                                      const std::atomic<std::size_t>* allocations) {
  const std::size_t heads = view.num_kv_heads() * kExecGroup, dim = view.head_dim();
  std::vector<std::vector<O>> outs;
  std::vector<AttentionTask<V, Q, O>> tasks;
  for (std::size_t i = 0; i < qs.size(); ++i) outs.emplace_back(qs[i].size(), from_float<O>(-1.0f));
  for (std::size_t i = 0; i < qs.size(); ++i) {
    tasks.push_back({TokenBlock<const Q>{qs[i], counts[i], heads, dim}, view,
                     TokenBlock<O>{outs[i], counts[i], heads, dim}, first[i]});
  }
  opts.pool = pool;
  const std::size_t before = allocations != nullptr ? allocations->load() : 0;
  if (tasks.size() == 1) {
    opts.query_pos = first[0];
    cpu::attend(tasks[0].q, view, tasks[0].out, opts, kernel);
  } else {
    cpu::attend_batch(std::span<const AttentionTask<V, Q, O>>(tasks), opts, kernel);
  }
  if (allocations != nullptr) {
    const std::size_t after = allocations->load();
    INFO("allocations during the attention call");
    REQUIRE(after == before);
  }
  return outs;
}

template <Element Q, Element O, KVView V>
void check_types(std::mt19937_64& rng, const V& view, const AttentionOptions& mask,
                 cpu::Kernel kernel, Executor executor, ThreadPool& pool,
                 const std::atomic<std::size_t>* allocations) {
  INFO("q " << dtype_name(dtype_of<Q>) << ", out " << dtype_name(dtype_of<O>));
  const std::size_t heads = view.num_kv_heads() * kExecGroup, dim = view.head_dim();
  const position_t len = view.length();
  // One call of 1, 9 or 16 queries (one row block per KV head, two, and lockstep-sized), and a
  // batch of three tasks.
  const std::vector<std::vector<std::size_t>> shapes{{1}, {9}, {16}, {9, 3, 1}};
  for (const auto& counts : shapes) {
    INFO(counts.size() << " task(s), the first of " << counts[0] << " queries");
    std::vector<std::vector<Q>> qs;
    std::vector<position_t> first;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      std::vector<Q> q(counts[i] * heads * dim);
      const auto values = normal_floats(rng, q.size());
      for (std::size_t j = 0; j < q.size(); ++j) q[j] = from_float<Q>(values[j]);
      qs.push_back(std::move(q));
      const position_t end = i == 0 ? len : i == 1 ? len - 5 : 3;
      first.push_back(end - static_cast<position_t>(counts[i]));
    }
    const auto alone =
        run_batch<Q, O>(view, qs, counts, first, mask, kernel, Executor{}, allocations);
    const auto through =
        run_batch<Q, O>(view, qs, counts, first, mask, kernel, executor, allocations);
    const auto pooled =
        run_batch<Q, O>(view, qs, counts, first, mask, kernel, Executor(pool), allocations);
    for (std::size_t i = 0; i < counts.size(); ++i) {
      INFO("task " << i);
      REQUIRE(same_elements(through[i], alone[i]));
      REQUIRE(same_elements(pooled[i], alone[i]));
    }
  }
}

template <Element T>
void check_cache_type(std::mt19937_64& rng, Executor executor, ThreadPool& pool,
                      const std::atomic<std::size_t>* allocations) {
  // Big enough for the kernel to use threads (K/V elements swept x items >= 2^16) on every view.
  const PolicySetup setup{
      .kv_heads = 4, .dim = 64, .len = 400, .window = 128, .sinks = 4, .max_append = 16};
  const auto kv = random_kv(rng, setup.len, setup.kv_heads, setup.dim);
  const EveryPolicy<T> caches(kv, setup);
  const AttentionOptions windowed{.window = setup.window, .num_sink_tokens = setup.sinks};
  caches.for_each_view([&](const char* view_name, const auto& view, bool needs_window) {
    for (const AttentionOptions& mask : {AttentionOptions{}, windowed}) {
      if (needs_window && mask.window == 0) continue;
      for (cpu::Kernel kernel : cpu_kernels(setup.dim)) {
        INFO(view_name << " view of " << dtype_name(dtype_of<T>) << ", window " << mask.window
                       << ", kernel " << kernel_name(kernel));
        check_types<float, float>(rng, view, mask, kernel, executor, pool, allocations);
        check_types<half, half>(rng, view, mask, kernel, executor, pool, allocations);
        check_types<bfloat16, float>(rng, view, mask, kernel, executor, pool, allocations);
      }
    }
  });
}

}  // namespace detail

/// Requires that attention through `executor` gives the same bits as on the calling thread and
/// as through a ThreadPool of 3 threads, over every policy's view of float and half caches, each
/// CPU kernel of this machine, float, half and bfloat16 queries and outputs, single calls and
/// batches. With `allocations` (a global allocation counter), also that no call allocates.
inline void require_executor_matches(Executor executor, std::mt19937_64& rng,
                                     const std::atomic<std::size_t>* allocations = nullptr) {
  ThreadPool pool(3);
  detail::check_cache_type<float>(rng, executor, pool, allocations);
  detail::check_cache_type<half>(rng, executor, pool, allocations);
}

}  // namespace kvcache::test
