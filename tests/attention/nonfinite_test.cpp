// SPDX-License-Identifier: Apache-2.0
// Non-finite keys, values and queries: the reference and every CPU kernel agree that a query row
// that sees an inf or NaN (in its q, or in the K or V row of a key it may see) is NaN throughout,
// that inf and NaN it cannot see (masked, evicted, another KV head's) change none of its bits,
// and that a row that sees no key is zeros whatever its q holds.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"

using namespace kvcache;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kBad[] = {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()};

enum class Layout { contiguous, paged, ring };

const char* layout_name(Layout l) {
  return l == Layout::contiguous ? "contiguous" : l == Layout::paged ? "paged" : "ring";
}

struct Setup {
  Layout layout = Layout::contiguous;
  std::size_t queries = 5;  // the last `queries` positions, appended as one prefill chunk
  AttentionOptions opts;
};

constexpr std::size_t kKvHeads = 2, kGroup = 2, kQHeads = kKvHeads * kGroup, kDim = 16;
constexpr std::size_t kLength = 70;  // three tiles of keys, the last one partly filled

// The test's own mask: may a query at qpos see the key at kpos?
bool sees(const AttentionOptions& o, position_t qpos, position_t kpos) {
  if (!o.causal) return true;
  if (kpos > qpos) return false;
  return o.window == 0 || kpos > qpos - static_cast<position_t>(o.window) ||
         kpos < static_cast<position_t>(o.num_sink_tokens);
}

// A cache of T holding K/V [kLength][kKvHeads][kDim] (the last s.queries tokens appended as one
// chunk, the others in chunks of 5 and 13), attended by each kernel and by the reference.
template <Element T>
class Runner {
 public:
  explicit Runner(const Setup& s) : s_(s) {}

  // Output [queries][kQHeads][kDim] of `kernel` (nullopt: the reference).
  std::vector<float> run(const std::vector<float>& q, const std::vector<float>& k,
                         const std::vector<float>& v, std::optional<cpu::Kernel> kernel) const {
    switch (s_.layout) {
      case Layout::contiguous: {
        StaticCache<T> c(
            {.num_layers = 1, .num_kv_heads = kKvHeads, .head_dim = kDim, .max_seq_len = kLength});
        return fill_and_attend(c, q, k, v, kernel);
      }
      case Layout::paged: {
        PagedCache<T> c({.num_layers = 1,
                         .num_kv_heads = kKvHeads,
                         .head_dim = kDim,
                         .num_blocks = (kLength + 3) / 4,
                         .block_size = 4});
        return fill_and_attend(c, q, k, v, kernel);
      }
      default: {
        SlidingWindowCache<T> c({.num_layers = 1,
                                 .num_kv_heads = kKvHeads,
                                 .head_dim = kDim,
                                 .window = s_.opts.window,
                                 .num_sink_tokens = s_.opts.num_sink_tokens,
                                 .max_append_len = 13});
        return fill_and_attend(c, q, k, v, kernel);
      }
    }
  }

 private:
  template <class Cache>
  std::vector<float> fill_and_attend(Cache& c, const std::vector<float>& q,
                                     const std::vector<float>& k, const std::vector<float>& v,
                                     std::optional<cpu::Kernel> kernel) const {
    const kvcache::test::TokenKV kv{k, v, kLength, kKvHeads, kDim};
    const std::size_t prefix = kLength - s_.queries;
    kvcache::test::append_in_chunks(c, 0, 0, kv, 0, prefix, {5, 13});
    c.append(0, 0, kv.k_block(prefix, s_.queries), kv.v_block(prefix, s_.queries));
    std::vector<float> out(q.size(), -1.0f);
    const TokenBlock<const float> qb{q, s_.queries, kQHeads, kDim};
    const TokenBlock<float> ob{out, s_.queries, kQHeads, kDim};
    if (kernel) {
      cpu::attend(qb, c.view(0, 0), ob, s_.opts, *kernel);
    } else {
      reference::attend(qb, c.view(0, 0), ob, s_.opts);
    }
    return out;
  }

  Setup s_;
};

// Row (t, h) of `got` ([queries][heads][dim]): NaN throughout when nan(t, h), else the same bits
// as in `base`.
void require_rows_for(const std::vector<float>& got, const std::vector<float>& base,
                      std::size_t queries, std::size_t heads, std::size_t dim,
                      const std::function<bool(std::size_t, std::size_t)>& nan) {
  for (std::size_t t = 0; t < queries; ++t) {
    for (std::size_t h = 0; h < heads; ++h) {
      const float* g = got.data() + (t * heads + h) * dim;
      const float* b = base.data() + (t * heads + h) * dim;
      INFO("query token " << t << " head " << h << ": first element " << g[0] << ", finite run "
                          << b[0]);
      if (nan(t, h)) {
        for (std::size_t x = 0; x < dim; ++x) REQUIRE(std::isnan(g[x]));
      } else {
        REQUIRE(std::memcmp(g, b, dim * sizeof(float)) == 0);
      }
    }
  }
}

void require_rows(const std::vector<float>& got, const std::vector<float>& base,
                  std::size_t queries, const std::function<bool(std::size_t, std::size_t)>& nan) {
  require_rows_for(got, base, queries, kQHeads, kDim, nan);
}

template <Element T>
void check_setup(const Setup& s, std::mt19937_64& rng) {
  const Runner<T> runner(s);
  const position_t first_q = static_cast<position_t>(kLength - s.queries);
  // Values exact in every element type, so that the finite runs are the same for all of them.
  const auto k = kvcache::test::rounded<bfloat16>(
      kvcache::test::normal_floats(rng, kLength * kKvHeads * kDim));
  const auto v = kvcache::test::rounded<bfloat16>(
      kvcache::test::normal_floats(rng, kLength * kKvHeads * kDim));
  const auto q = kvcache::test::normal_floats(rng, s.queries * kQHeads * kDim);
  std::vector<std::optional<cpu::Kernel>> kernels{std::nullopt};
  for (cpu::Kernel kernel : kvcache::test::cpu_kernels(kDim)) kernels.emplace_back(kernel);
  for (const auto& kernel : kernels) {
    const char* name = kernel ? kvcache::test::kernel_name(*kernel) : "reference";
    INFO(name << ", " << layout_name(s.layout) << " cache of " << dtype_name(dtype_of<T>) << ", "
              << s.queries << " queries, window " << s.opts.window << " sinks "
              << s.opts.num_sink_tokens << " softcap " << s.opts.softcap << " causal "
              << s.opts.causal);
    const auto base = runner.run(q, k, v, kernel);
    for (float x : base) REQUIRE(std::isfinite(x));
    // (a) q: that row only
    for (std::size_t i = 0; i < 6; ++i) {
      const std::size_t t = i % s.queries, h = (i * 3) % kQHeads, x = (i * 5) % kDim;
      auto bad_q = q;
      bad_q[(t * kQHeads + h) * kDim + x] = kBad[i % 3];
      INFO("q[" << t << "][" << h << "][" << x << "] = " << kBad[i % 3]);
      require_rows(runner.run(bad_q, k, v, kernel), base, s.queries,
                   [&](std::size_t rt, std::size_t rh) { return rt == t && rh == h; });
    }
    // (b), (c), (d): one element of the K or V row of every key in turn, of either KV head;
    // the rows of that KV head that may see the key are NaN, all others keep their bits
    for (int side = 0; side < 2; ++side) {
      for (std::size_t p = 0; p < kLength; ++p) {
        const std::size_t kv_head = p % kKvHeads, x = (p * 7) % kDim;
        const float bad = kBad[(p + static_cast<std::size_t>(side)) % 3];
        auto bad_k = k, bad_v = v;
        (side == 0 ? bad_k : bad_v)[(p * kKvHeads + kv_head) * kDim + x] = bad;
        INFO((side == 0 ? "K" : "V") << "[" << p << "][" << kv_head << "][" << x << "] = " << bad);
        require_rows(runner.run(q, bad_k, bad_v, kernel), base, s.queries,
                     [&](std::size_t t, std::size_t h) {
                       return h / kGroup == kv_head &&
                              sees(s.opts, first_q + static_cast<position_t>(t),
                                   static_cast<position_t>(p));
                     });
      }
    }
  }
}

template <Element T>
void check_all_setups(const char* name) {
  auto rng = kvcache::test::make_rng(name);
  const AttentionOptions windowed{.window = 9, .num_sink_tokens = 3};
  const AttentionOptions windowed_capped{.scale = 0.3f, .window = 9, .softcap = 2.0f};
  const AttentionOptions capped{.scale = 0.3f, .softcap = 2.0f};
  for (std::size_t queries : {std::size_t{5}, std::size_t{1}}) {
    for (Layout layout : {Layout::contiguous, Layout::paged}) {
      for (const AttentionOptions& opts :
           {AttentionOptions{}, windowed, capped, AttentionOptions{.causal = false}}) {
        check_setup<T>({layout, queries, opts}, rng);
      }
    }
    // A ring: keys it still holds beyond the queries' window, and holes where it evicted.
    for (const AttentionOptions& opts : {windowed, windowed_capped}) {
      check_setup<T>({Layout::ring, queries, opts}, rng);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE(
    "inf or NaN in q, or in a seen key's K or V, makes exactly the rows that see it NaN, in the "
    "reference and every CPU kernel; unseen ones change no bit",
    "", float, half, bfloat16) {
  check_all_setups<TestType>((std::string("nonfinite-") + dtype_name(dtype_of<TestType>)).c_str());
}

TEST_CASE("a query that sees no key is zeros even with a NaN q (reference)") {
  // The fast kernels cannot be asked this: a causal query always sees its own position.
  std::vector<float> q{std::numeric_limits<float>::quiet_NaN(), 1.0f}, k{1.0f, kInf, 2.0f, 3.0f};
  std::vector<float> v{kInf, 1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f}, out(2, -1.0f);
  const std::vector<position_t> q_pos{0}, k_pos{1, 2};
  reference::attend_dense({q, 1, 1, 2}, q_pos, {k, 2, 1, 2}, {v, 2, 1, 2}, k_pos, {out, 1, 1, 2});
  REQUIRE(out == std::vector<float>{0.0f, 0.0f});
  // A window that ends before the keys: nothing seen either.
  const std::vector<position_t> q_pos5{5};
  reference::attend_dense({q, 1, 1, 2}, q_pos5, {k, 2, 1, 2}, {v, 2, 1, 2}, k_pos, {out, 1, 1, 2},
                          {.window = 2});
  REQUIRE(out == std::vector<float>{0.0f, 0.0f});
}

TEST_CASE(
    "a float beyond half's range appended to a half cache is stored as inf, and the rows that "
    "see it are NaN (with and without soft-cap)") {
  auto rng = kvcache::test::make_rng("half-overflow");
  constexpr std::size_t n = 40, heads = 2, dim = 16, queries = 3;
  auto k = kvcache::test::normal_floats(rng, n * heads * dim);
  auto v = kvcache::test::normal_floats(rng, n * heads * dim);
  const auto q = kvcache::test::normal_floats(rng, queries * heads * dim);
  const auto attend_all = [&](const std::vector<float>& kk, const std::vector<float>& vv,
                              const AttentionOptions& opts) {
    StaticCache<half> cache(
        {.num_layers = 1, .num_kv_heads = heads, .head_dim = dim, .max_seq_len = n});
    cache.append(0, 0, TokenBlock<const float>{kk, n, heads, dim},
                 TokenBlock<const float>{vv, n, heads, dim});
    std::vector<std::vector<float>> outs;
    std::vector<float> out(q.size());
    reference::attend({q, queries, heads, dim}, cache.view(0, 0), {out, queries, heads, dim}, opts);
    outs.push_back(out);
    for (cpu::Kernel kernel : kvcache::test::cpu_kernels(dim)) {
      cpu::attend({q, queries, heads, dim}, cache.view(0, 0), {out, queries, heads, dim}, opts,
                  kernel);
      outs.push_back(out);
    }
    // What the cache stores for element 4 of key 38, KV head 1 (read while the cache lives).
    const auto seg = cache.view(0, 0).segment(0);
    const std::size_t slot = seg.head_stride + 38 * dim + 4;
    return std::tuple{static_cast<float>(seg.k[slot]), static_cast<float>(seg.v[slot]), outs};
  };
  // Key 38 of KV head 1: seen by query tokens 1 and 2 (positions 38, 39), not by token 0.
  const std::size_t at = (38 * heads + 1) * dim + 4;
  for (const AttentionOptions& opts :
       {AttentionOptions{}, AttentionOptions{.scale = 0.5f, .softcap = 3.0f}}) {
    INFO("softcap " << opts.softcap);
    const auto base = std::get<2>(attend_all(k, v, opts));
    for (float big : {70000.0f, 65520.0f, -1e30f}) {
      auto kk = k, vv = v;
      for (int side = 0; side < 2; ++side) {
        (side == 0 ? kk : vv)[at] = big;
        const auto [stored_k, stored_v, outs] = attend_all(kk, vv, opts);
        const float stored = side == 0 ? stored_k : stored_v;
        INFO((side == 0 ? "K" : "V") << " element " << big << " stored as " << stored);
        REQUIRE(stored == std::copysign(kInf, big));
        for (std::size_t i = 0; i < outs.size(); ++i) {
          require_rows_for(outs[i], base[i], queries, heads, dim,
                           [](std::size_t t, std::size_t h) { return h == 1 && t >= 1; });
        }
        (side == 0 ? kk : vv)[at] = (side == 0 ? k : v)[at];
      }
    }
    // 65519 rounds down to the largest half, 65504: finite, every row finite.
    auto kk = k;
    kk[at] = 65519.0f;
    const auto [stored_k, stored_v, outs] = attend_all(kk, v, opts);
    REQUIRE(stored_k == 65504.0f);
    for (const auto& out : outs) {
      for (float x : out) REQUIRE(std::isfinite(x));
    }
  }
}
