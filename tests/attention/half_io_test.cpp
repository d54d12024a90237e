// SPDX-License-Identifier: Apache-2.0
// Queries and outputs in half or bfloat16: attend() and attend_batch() with q of element type Q
// and out of type O give exactly (bit for bit) the float attend of q converted to float, with
// its output rounded to O (nearest even), for every combination of Q and O, every policy's view,
// cache element type and CPU kernel this machine has, with and without a thread pool.
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "attention/every_policy.hpp"
#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

using namespace kvcache;

namespace {

template <Element X>
std::vector<X> to_type(const std::vector<float>& x) {
  std::vector<X> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<X>(x[i]);
  return out;
}

template <Element X>
std::vector<float> to_floats(const std::vector<X>& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_float(x[i]);
  return out;
}

template <Element X>
bool same_bits(const std::vector<X>& a, const std::vector<X>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(X)) == 0;
}

// The first element where a and b differ, for the failure message.
template <Element X>
std::string first_difference(const std::vector<X>& a, const std::vector<X>& b) {
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(X)) != 0) {
      return "element " + std::to_string(i) + ": got " + std::to_string(to_float(a[i])) +
             ", expected " + std::to_string(to_float(b[i]));
    }
  }
  return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
}

constexpr std::size_t kGroup = 2;

// The reference for q of type Q and out of type O: the float attend of q converted, rounded.
template <Element O, KVView V>
std::vector<O> converted_float_attend(const std::vector<float>& q_as_float, std::size_t n,
                                      const V& view, const AttentionOptions& opts,
                                      cpu::Kernel kernel) {
  const std::size_t heads = view.num_kv_heads() * kGroup, dim = view.head_dim();
  std::vector<float> out(q_as_float.size());
  cpu::attend({q_as_float, n, heads, dim}, view, {out, n, heads, dim}, opts, kernel);
  return to_type<O>(out);
}

// Checks every (Q, O) pair over one view, mask and kernel, for one attend and a batch of two.
template <Element Q, Element O, KVView V>
void check_pair(std::mt19937_64& rng, const V& view, const AttentionOptions& mask,
                cpu::Kernel kernel, ThreadPool& pool) {
  INFO("q " << dtype_name(dtype_of<Q>) << ", out " << dtype_name(dtype_of<O>));
  const std::size_t heads = view.num_kv_heads() * kGroup, dim = view.head_dim();
  const std::size_t len = static_cast<std::size_t>(view.length());
  for (std::size_t n : {std::size_t{1}, std::size_t{5}}) {
    INFO(n << " queries");
    auto q_float = test::normal_floats(rng, n * heads * dim);
    q_float[(n - 1) * heads * dim + dim + 3] = std::numeric_limits<float>::infinity();  // a NaN row
    const std::vector<Q> q = to_type<Q>(q_float);
    const std::vector<float> q_as_float = to_floats(q);
    const std::vector<O> want = converted_float_attend<O>(q_as_float, n, view, mask, kernel);
    std::vector<O> got(want.size(), from_float<O>(-1.0f));
    cpu::attend(TokenBlock<const Q>{q, n, heads, dim}, view, TokenBlock<O>{got, n, heads, dim},
                mask, kernel);
    INFO(first_difference(got, want));
    REQUIRE(same_bits(got, want));
    // kvcache::attend (the kernel it picks), from a non-const block, with the pool.
    if (kernel == cpu::Kernel::portable) {
      std::vector<Q> q_mut = q;
      const std::vector<O> want_auto =
          converted_float_attend<O>(q_as_float, n, view, mask, cpu::Kernel::automatic);
      AttentionOptions threaded = mask;
      threaded.pool = &pool;
      std::fill(got.begin(), got.end(), from_float<O>(-1.0f));
      attend(TokenBlock<Q>{q_mut, n, heads, dim}, view, TokenBlock<O>{got, n, heads, dim},
             threaded);
      INFO("kvcache::attend, automatic kernel: " << first_difference(got, want_auto));
      REQUIRE(same_bits(got, want_auto));
    }
    // A batch: these queries and a second task of 3 earlier queries over the same view.
    const std::size_t m = 3;
    const auto first2 = static_cast<position_t>(len - n - m);
    const std::vector<Q> q2 = to_type<Q>(test::normal_floats(rng, m * heads * dim));
    AttentionOptions mask2 = mask;
    mask2.query_pos = first2;
    const std::vector<O> want2 = converted_float_attend<O>(to_floats(q2), m, view, mask2, kernel);
    std::vector<O> out1(want.size()), out2(want2.size());
    const std::vector<AttentionTask<V, Q, O>> tasks{
        {TokenBlock<const Q>{q, n, heads, dim}, view, TokenBlock<O>{out1, n, heads, dim}},
        {TokenBlock<const Q>{q2, m, heads, dim}, view, TokenBlock<O>{out2, m, heads, dim}, first2}};
    for (bool threads : {false, true}) {
      AttentionOptions opts = mask;
      if (threads) opts.pool = &pool;
      cpu::attend_batch(std::span<const AttentionTask<V, Q, O>>(tasks), opts, kernel);
      INFO("attend_batch, pool " << threads << ": " << first_difference(out1, want) << "; "
                                 << first_difference(out2, want2));
      REQUIRE(same_bits(out1, want));
      REQUIRE(same_bits(out2, want2));
    }
    if (kernel == cpu::Kernel::portable) {
      std::fill(out1.begin(), out1.end(), O{});
      attend_batch(std::span<const AttentionTask<V, Q, O>>(tasks), mask);
      REQUIRE(same_bits(
          out1, converted_float_attend<O>(q_as_float, n, view, mask, cpu::Kernel::automatic)));
    }
  }
}

template <Element Q, KVView V>
void check_outputs(std::mt19937_64& rng, const V& view, const AttentionOptions& mask,
                   cpu::Kernel kernel, ThreadPool& pool) {
  check_pair<Q, float>(rng, view, mask, kernel, pool);
  check_pair<Q, half>(rng, view, mask, kernel, pool);
  check_pair<Q, bfloat16>(rng, view, mask, kernel, pool);
}

template <Element T>
void check_cache_type(const char* name) {
  auto rng = test::make_rng(name);
  ThreadPool pool(2);
  // 64: every SIMD width; 24: AVX2 but not AVX-512; 12: portable only.
  for (std::size_t dim : {std::size_t{64}, std::size_t{24}, std::size_t{12}}) {
    const test::PolicySetup setup{.kv_heads = 2, .dim = dim, .len = 90, .window = 20, .sinks = 3};
    auto kv = test::random_kv(rng, setup.len, setup.kv_heads, dim);
    // KV head 1's V rows hold 70000 in element 0 unless T is half (where that is inf): those
    // outputs overflow half (inf) and round in bfloat16.
    if (!std::same_as<T, half>) {
      for (std::size_t t = 0; t < setup.len; ++t) kv.v[(t * setup.kv_heads + 1) * dim] = 70000.0f;
    }
    const test::EveryPolicy<T> caches(kv, setup);
    const AttentionOptions windowed{.window = setup.window, .num_sink_tokens = setup.sinks};
    caches.for_each_view([&](const char* view_name, const auto& view, bool needs_window) {
      for (const AttentionOptions& mask :
           {AttentionOptions{}, windowed, AttentionOptions{.scale = 0.3f, .softcap = 4.0f},
            AttentionOptions{.causal = false}}) {
        if (needs_window && mask.window == 0) continue;
        for (cpu::Kernel kernel : test::cpu_kernels(dim)) {
          INFO(view_name << " view of " << dtype_name(dtype_of<T>) << ", head_dim " << dim
                         << ", window " << mask.window << ", softcap " << mask.softcap
                         << ", causal " << mask.causal << ", kernel " << test::kernel_name(kernel));
          check_outputs<float>(rng, view, mask, kernel, pool);
          check_outputs<half>(rng, view, mask, kernel, pool);
          check_outputs<bfloat16>(rng, view, mask, kernel, pool);
        }
      }
    });
  }
}

}  // namespace

TEMPLATE_TEST_CASE(
    "attend with half or bfloat16 queries and outputs equals the float attend of the converted "
    "queries, rounded, bit for bit",
    "", float, half, bfloat16) {
  check_cache_type<TestType>("half-io");
}

TEST_CASE("attend with half queries and outputs checks shapes before writing anything") {
  StaticCache<half> cache({.num_layers = 1, .num_kv_heads = 2, .head_dim = 16, .max_seq_len = 8});
  const std::vector<float> kv(4 * 2 * 16, 0.5f);
  cache.append(0, 0, TokenBlock<const float>{kv, 4, 2, 16}, TokenBlock<const float>{kv, 4, 2, 16});
  const std::vector<half> q(2 * 4 * 16, half(1.0f));
  std::vector<bfloat16> out(2 * 4 * 16 - 1, bfloat16(-2.0f));
  test::require_throws<shape_error>(
      [&] {
        attend(TokenBlock<const half>{q, 2, 4, 16}, cache.view(0, 0),
               TokenBlock<bfloat16>{out, 2, 4, 16});
      },
      "output: buffer holds 127 elements");
  std::vector<bfloat16> wide(2 * 4 * 32);
  test::require_throws<shape_error>(
      [&] {
        attend(TokenBlock<const half>{q, 2, 4, 16}, cache.view(0, 0),
               TokenBlock<bfloat16>{wide, 2, 4, 32});
      },
      "output shape [2][4][32]");
  for (bfloat16 x : out) REQUIRE(x == bfloat16(-2.0f));
  test::require_throws<position_error>(
      [&] {
        std::vector<half> o(2 * 4 * 16);
        attend(TokenBlock<const half>{q, 2, 4, 16}, cache.view(0, 0), TokenBlock<half>{o, 2, 4, 16},
               {.query_pos = 3});
      },
      "query at position 4");
}
