// SPDX-License-Identifier: Apache-2.0
// Attention: the reference against hand-computed values, and the fast CPU kernel (portable, AVX2
// and AVX-512 micro-kernels, serial and threaded) against the reference over random shapes and
// options.
#include <cmath>
#include <span>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;
using kvcache::test::Tolerance;

namespace {

// Two keys in two dims, one query: every option's effect can be computed by hand.
struct TinyCase {
  std::vector<float> q{1.0f, 0.0f};
  std::vector<float> k{1.0f, 0.0f, 0.0f, 1.0f};
  std::vector<float> v{1.0f, 2.0f, 3.0f, 4.0f};
  std::vector<position_t> k_pos{0, 1};

  std::vector<float> run(const AttentionOptions& opts, position_t q_pos = 1) const {
    std::vector<float> out(2);
    std::vector<position_t> qp{q_pos};
    reference::attend_dense({q, 1, 1, 2}, qp, {k, 2, 1, 2}, {v, 2, 1, 2}, k_pos, {out, 1, 1, 2},
                            opts);
    return out;
  }
};

std::vector<float> softmax_mix(double s0, double s1) {
  const double p0 = std::exp(s0) / (std::exp(s0) + std::exp(s1));
  return {static_cast<float>(p0 * 1 + (1 - p0) * 3), static_cast<float>(p0 * 2 + (1 - p0) * 4)};
}

}  // namespace

TEST_CASE("reference attention equals hand-computed softmax for every option") {
  const TinyCase c;
  const Tolerance tight{1e-6, 1e-6};
  // scores q.k = (1, 0); default scale 1/sqrt(2)
  kvcache::test::require_close(c.run({}), softmax_mix(1 / std::sqrt(2.0), 0), tight);
  kvcache::test::require_close(c.run({.scale = 1.0f}), softmax_mix(1, 0), tight);
  // causal: a query at position 0 sees only key 0
  kvcache::test::require_close(c.run({.scale = 1.0f}, 0), std::vector<float>{1.0f, 2.0f}, tight);
  // window 1: only the key at the query's own position
  kvcache::test::require_close(c.run({.scale = 1.0f, .window = 1}), std::vector<float>{3.0f, 4.0f},
                               tight);
  // window 1 plus one sink: both keys again
  kvcache::test::require_close(c.run({.scale = 1.0f, .window = 1, .num_sink_tokens = 1}),
                               softmax_mix(1, 0), tight);
  // soft-cap 0.5: scores become 0.5 * tanh(1 / 0.5) and 0
  kvcache::test::require_close(c.run({.scale = 1.0f, .softcap = 0.5f}),
                               softmax_mix(0.5 * std::tanh(2.0), 0), tight);
  // non-causal from position 0 sees both keys
  kvcache::test::require_close(c.run({.scale = 1.0f, .causal = false}, 0), softmax_mix(1, 0),
                               tight);
}

namespace {

struct RandomCase {
  std::size_t kv_heads, group, dim, context, queries;
  AttentionOptions opts;
};

// Head dims for each kernel: any, multiples of 8 (AVX2), multiples of 16 with every remainder of
// the AVX-512 kernel's 64-column passes (AVX-512).
constexpr std::size_t kOddDims[] = {1, 3, 7, 13, 64, 100};
constexpr std::size_t kAvx2Dims[] = {8, 16, 24, 64, 96, 128, 256};
constexpr std::size_t kAvx512Dims[] = {16, 32, 48, 64, 80, 112, 128, 256};
// Multiples of 4 with every remainder of the NEON kernel's 16-column passes.
constexpr std::size_t kNeonDims[] = {4, 8, 12, 20, 64, 100, 128, 256};

RandomCase random_case(std::mt19937_64& rng, std::span<const std::size_t> dims) {
  using kvcache::test::uniform;
  static const std::size_t kGroups[] = {1, 2, 3, 4, 5, 8, 16, 20};
  RandomCase c{};
  c.kv_heads = uniform(rng, 1, 4);
  c.group = kGroups[uniform(rng, 0, 7)];
  c.dim = dims[uniform(rng, 0, dims.size() - 1)];
  c.context = uniform(rng, 1, 300);
  c.queries = uniform(rng, 1, std::min<std::size_t>(c.context, 40));
  switch (uniform(rng, 0, 4)) {
    case 0:
      break;  // plain causal
    case 1:
      c.opts.window = uniform(rng, 1, c.context);
      break;
    case 2:
      c.opts.window = uniform(rng, 1, c.context);
      c.opts.num_sink_tokens = uniform(rng, 1, 8);
      break;
    case 3:
      c.opts.softcap = 0.5f + static_cast<float>(uniform(rng, 0, 30));
      c.opts.scale = 0.05f * static_cast<float>(uniform(rng, 1, 20));
      break;
    default:
      c.opts.causal = false;
      break;
  }
  return c;
}

template <Element T>
void fast_matches_reference(cpu::Kernel kernel, std::span<const std::size_t> dims,
                            const char* name) {
  auto rng = kvcache::test::make_rng(name);
  for (int iter = 0; iter < 60; ++iter) {
    const RandomCase c = random_case(rng, dims);
    const std::size_t q_heads = c.kv_heads * c.group;
    StaticCache<T> cache({.num_layers = 1,
                          .num_kv_heads = c.kv_heads,
                          .head_dim = c.dim,
                          .max_batch = 1,
                          .max_seq_len = c.context});
    const auto kv = kvcache::test::random_kv(rng, c.context, c.kv_heads, c.dim);
    kvcache::test::append_in_chunks(cache, 0, 0, kv, 0, c.context, {1, 7, 64, 3});
    const auto q = kvcache::test::normal_floats(rng, c.queries * q_heads * c.dim);
    const TokenBlock<const float> qb{q, c.queries, q_heads, c.dim};
    std::vector<float> expect(q.size()), got(q.size(), -1.0f);
    reference::attend(qb, cache.view(0, 0), {expect, c.queries, q_heads, c.dim}, c.opts);
    cpu::attend(qb, cache.view(0, 0), {got, c.queries, q_heads, c.dim}, c.opts, kernel);
    INFO("iter " << iter << ": kv_heads " << c.kv_heads << " group " << c.group << " dim " << c.dim
                 << " context " << c.context << " queries " << c.queries << " window "
                 << c.opts.window << " sinks " << c.opts.num_sink_tokens << " softcap "
                 << c.opts.softcap << " causal " << c.opts.causal);
    // Same stored K/V on both sides: the only differences are fp32 vs double accumulation.
    kvcache::test::require_close(got, expect, Tolerance{2e-5, 2e-5});
  }
}

}  // namespace

TEMPLATE_TEST_CASE("portable kernel equals the reference over random shapes and options", "", float,
                   half, bfloat16) {
  fast_matches_reference<TestType>(cpu::Kernel::portable, kOddDims, "portable-odd-dims");
  fast_matches_reference<TestType>(cpu::Kernel::portable, kAvx2Dims, "portable-simd-dims");
}

TEMPLATE_TEST_CASE("AVX2 kernel equals the reference over random shapes and options", "", float,
                   half, bfloat16) {
  if (!cpu::avx2_supported(8)) {
    WARN("skipped: this CPU lacks AVX2+FMA+F16C");
    return;
  }
  fast_matches_reference<TestType>(cpu::Kernel::avx2, kAvx2Dims, "avx2");
}

TEMPLATE_TEST_CASE("AVX-512 kernel equals the reference over random shapes and options", "", float,
                   half, bfloat16) {
  if (!cpu::avx512_supported(16)) {
    WARN("skipped: this CPU lacks AVX-512F");
    return;
  }
  fast_matches_reference<TestType>(cpu::Kernel::avx512, kAvx512Dims, "avx512");
}

TEMPLATE_TEST_CASE("NEON kernel equals the reference over random shapes and options", "[neon]",
                   float, half, bfloat16) {
  if (!cpu::neon_supported(4)) {
    WARN("skipped: not an AArch64 build");
    return;
  }
  fast_matches_reference<TestType>(cpu::Kernel::neon, kNeonDims, "neon");
}

TEST_CASE("the automatic kernel is the widest one the CPU and head_dim allow, bit for bit") {
  auto rng = kvcache::test::make_rng("automatic-kernel");
  for (std::size_t dim : {std::size_t{12}, std::size_t{24}, std::size_t{64}}) {
    StaticCache<half> cache(
        {.num_layers = 1, .num_kv_heads = 2, .head_dim = dim, .max_seq_len = 70});
    const auto kv = kvcache::test::random_kv(rng, 70, 2, dim);
    cache.append(0, 0, kv.k_block(0, 70), kv.v_block(0, 70));
    const auto q = kvcache::test::normal_floats(rng, 3 * 8 * dim);
    const auto run = [&](cpu::Kernel kernel) {
      std::vector<float> out(q.size());
      cpu::attend({q, 3, 8, dim}, cache.view(0, 0), {out, 3, 8, dim}, {}, kernel);
      return out;
    };
    const cpu::Kernel widest = kvcache::test::cpu_kernels(dim).back();
    INFO("head_dim " << dim << ": expecting " << kvcache::test::kernel_name(widest));
    REQUIRE(run(cpu::Kernel::automatic) == run(widest));
  }
}

TEST_CASE(
    "automatic kernel choice falls back to portable for head_dim not a multiple of 8, and "
    "an explicit kernel the head_dim does not allow throws") {
  StaticCache<float> cache({.num_layers = 1, .num_kv_heads = 1, .head_dim = 5, .max_seq_len = 4});
  std::vector<float> k(20, 0.5f), v(20, 1.0f), q(5, 1.0f), out(5);
  cache.append(0, 0, TokenBlock<const float>{k, 4, 1, 5}, TokenBlock<const float>{v, 4, 1, 5});
  attend({q, 1, 1, 5}, cache.view(0, 0), {out, 1, 1, 5});
  kvcache::test::require_close(out, std::vector<float>(5, 1.0f), Tolerance{1e-6, 0});
  kvcache::test::require_throws<shape_error>(
      [&] {
        cpu::attend({q, 1, 1, 5}, cache.view(0, 0), {out, 1, 1, 5}, {}, cpu::Kernel::avx2);
      },
      "avx2", "multiple of 8");
  StaticCache<float> eight({.num_layers = 1, .num_kv_heads = 1, .head_dim = 8, .max_seq_len = 4});
  std::vector<float> k8(32, 0.5f), q8(8, 1.0f), out8(8);
  eight.append(0, 0, TokenBlock<const float>{k8, 4, 1, 8}, TokenBlock<const float>{k8, 4, 1, 8});
  kvcache::test::require_throws<shape_error>(
      [&] {
        cpu::attend({q8, 1, 1, 8}, eight.view(0, 0), {out8, 1, 1, 8}, {}, cpu::Kernel::avx512);
      },
      "avx512", "multiple of 16");
}

TEST_CASE("threaded attention is bitwise equal to serial attention") {
  auto rng = kvcache::test::make_rng("threaded");
  ThreadPool pool(2);
  for (std::size_t queries : {1, 17}) {
    StaticCache<half> cache(
        {.num_layers = 1, .num_kv_heads = 8, .head_dim = 64, .max_seq_len = 900});
    const auto kv = kvcache::test::random_kv(rng, 900, 8, 64);
    kvcache::test::append_in_chunks(cache, 0, 0, kv, 0, 900, {100});
    const auto q = kvcache::test::normal_floats(rng, queries * 32 * 64);
    std::vector<float> serial(q.size()), threaded(q.size());
    attend({q, queries, 32, 64}, cache.view(0, 0), {serial, queries, 32, 64});
    attend({q, queries, 32, 64}, cache.view(0, 0), {threaded, queries, 32, 64}, {.pool = &pool});
    REQUIRE(serial == threaded);
  }
}

TEST_CASE("attend_batch equals attending each sequence alone") {
  auto rng = kvcache::test::make_rng("batch");
  ThreadPool pool(2);
  const std::size_t heads = 2, group = 4, dim = 32, batch = 5;
  StaticCache<bfloat16> cache({.num_layers = 1,
                               .num_kv_heads = heads,
                               .head_dim = dim,
                               .max_batch = batch,
                               .max_seq_len = 256});
  std::vector<std::vector<float>> qs, outs;
  std::vector<AttentionTask<StaticCache<bfloat16>::view_type>> tasks;
  for (std::size_t s = 0; s < batch; ++s) {
    const std::size_t len = 1 + 50 * s;
    const auto kv = kvcache::test::random_kv(rng, len, heads, dim);
    kvcache::test::append_in_chunks(cache, 0, s, kv, 0, len, {13});
    qs.push_back(kvcache::test::normal_floats(rng, heads * group * dim));
    outs.emplace_back(heads * group * dim);
  }
  for (std::size_t s = 0; s < batch; ++s) {
    tasks.push_back(
        {{qs[s], 1, heads * group, dim}, cache.view(0, s), {outs[s], 1, heads * group, dim}, {}});
  }
  attend_batch(std::span<const AttentionTask<StaticCache<bfloat16>::view_type>>(tasks),
               {.pool = &pool});
  for (std::size_t s = 0; s < batch; ++s) {
    std::vector<float> alone(outs[s].size());
    attend({qs[s], 1, heads * group, dim}, cache.view(0, s), {alone, 1, heads * group, dim});
    REQUIRE(alone == outs[s]);
  }
}

TEST_CASE("queries at explicit earlier positions see only keys up to their positions") {
  auto rng = kvcache::test::make_rng("query_pos");
  StaticCache<float> cache({.num_layers = 1, .num_kv_heads = 2, .head_dim = 16, .max_seq_len = 50});
  const auto kv = kvcache::test::random_kv(rng, 50, 2, 16);
  kvcache::test::append_in_chunks(cache, 0, 0, kv, 0, 50, {50});
  const auto q = kvcache::test::normal_floats(rng, 3 * 4 * 16);
  std::vector<float> got(q.size());
  attend({q, 3, 4, 16}, cache.view(0, 0), {got, 3, 4, 16}, {.query_pos = 10});
  const auto expect = kvcache::test::scratch_attention(q, 3, 4, kv.k, kv.v, 13, 2, 16, 10, {});
  kvcache::test::require_close(got, expect, Tolerance{2e-5, 2e-5});
}

TEST_CASE("attention rejects bad shapes and positions with the numbers") {
  StaticCache<float> cache({.num_layers = 1, .num_kv_heads = 4, .head_dim = 8, .max_seq_len = 16});
  std::vector<float> kv(4 * 4 * 8, 0.25f);
  cache.append(0, 0, TokenBlock<const float>{kv, 4, 4, 8}, TokenBlock<const float>{kv, 4, 4, 8});
  const auto view = cache.view(0, 0);
  std::vector<float> q6(6 * 8), out6(6 * 8), q(4 * 8), out(4 * 8), q16(3 * 16), out16(3 * 16);
  using kvcache::test::require_throws;
  require_throws<shape_error>(
      [&] {
        attend({q6, 1, 6, 8}, view, {out6, 1, 6, 8});
      },
      "num_q_heads 6", "num_kv_heads 4");
  require_throws<shape_error>(
      [&] {
        attend({q16, 1, 3, 16}, view, {out16, 1, 3, 16});
      },
      "head_dim 16", "head_dim 8");
  require_throws<shape_error>(
      [&] {
        attend({q, 1, 4, 8}, view, {std::span<float>(out).first(28), 1, 4, 7});
      },
      "output shape [1][4][7]", "[1][4][8]");
  require_throws<shape_error>(
      [&] {
        attend({std::span<const float>(q).first(10), 1, 4, 8}, view, {out, 1, 4, 8});
      },
      "holds 10", "needs 32");
  require_throws<position_error>(
      [&] {
        attend({q, 1, 4, 8}, view, {out, 1, 4, 8}, {.query_pos = 4});
      },
      "position 4", "ends at position 3");
  require_throws<shape_error>(
      [&] {
        attend({q, 1, 4, 8}, view, {out, 1, 4, 8}, {.causal = false, .window = 2});
      },
      "window 2", "causal");
  require_throws<shape_error>(
      [&] {
        attend({q, 1, 4, 8}, view, {out, 1, 4, 8}, {.scale = -1.0f});
      },
      "scale");
  StaticCache<float> wide({.num_layers = 1, .num_kv_heads = 1, .head_dim = 1024, .max_seq_len = 1});
  std::vector<float> w(1024);
  wide.append(0, 0, TokenBlock<const float>{w, 1, 1, 1024}, TokenBlock<const float>{w, 1, 1, 1024});
  std::vector<float> wout(1024);
  require_throws<shape_error>(
      [&] {
        attend({w, 1, 1, 1024}, wide.view(0, 0), {wout, 1, 1, 1024});
      },
      "head_dim 1024", "512");
}
