// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels against the CPU, prefill half (cuda_decode_test.cu is the other half of the
// executable, test.cuda.cuda_kernels_test): prefill attention must equal kvcache::reference over
// the same cached tokens (every format and pair, layout and head_dim, windows, sinks,
// cache_relative positions) and give NaN exactly to the rows that see an inf or NaN; the device
// kvcache::attend runs the decode launcher or the prefill one, refusing a RoPE or workspace that
// does not fit; context shifts, restores and row reads of every layout leave what the host caches
// do. Every test skips with a message when no CUDA device is present.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <typeinfo>
#include <vector>

#include "kernels_test.cuh"
#include "kvcache/cuda/cuda.cuh"
#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"
#include "support/tolerance.hpp"

using namespace kvcache::test::cuda_kernels;

TEMPLATE_TEST_CASE("CUDA prefill attention equals the CPU reference", "[cuda][prefill]",
                   KVCACHE_TEST_CUDA_PREFILL_FORMATS) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-prefill");
  using Operand = kcuda::detail::prefill_operand_t<TestType>;
  for (kcuda::Layout layout : kLayouts) {
#if KVCACHE_TEST_ASAN
    // int8/fp8 under AddressSanitizer (5x slower): the paged layout; the plain build runs all
    if (kQuantizedOrPair<TestType> && layout != kcuda::Layout::paged) continue;
#endif
    // 256: one K/V buffer for fp16/bf16 (tf32 tiles reject it), as for tf32 tiles at 128
    const std::vector<std::size_t> dims = std::is_same_v<Operand, float>
                                              ? std::vector<std::size_t>{64, 128}
                                              : std::vector<std::size_t>{64, 128, 256};
    for (std::size_t dim : dims) {
      const std::size_t kv_heads = 2, group = 2, q_heads = kv_heads * group;
      const Twin t{layout, 1, kv_heads, dim, 3, 700, 300, 2, 200};
      kcuda::DeviceCache<TestType> dev(device_config(t));
      CpuTwin<TestType> cpu(t);
      const std::vector<std::size_t> cached{300, 0, 129};  // prefix already in the cache
      const std::vector<std::size_t> fresh{130, 65, 200};  // then this many new tokens each
      std::vector<std::size_t> total(3);
      for (std::size_t s = 0; s < 3; ++s) total[s] = cached[s] + fresh[s];
      fill(dev, cpu, t, rng, total);  // K/V of all tokens, new ones included, are appended
      AttentionOptions opts;
      const kvcache::Rope rope({.pairing = kvcache::RopePairing::neox}, dim);
      if (layout == kcuda::Layout::ring) {
        opts.window = t.window;
        opts.num_sink_tokens = t.sinks;
        if (dim == 128) {  // StreamingLLM positions: the sinks' scores with q turned back
          opts.positions = kvcache::PositionMode::cache_relative;
          opts.rope = &rope;
        }
      }
      std::vector<std::int32_t> offsets{0};
      for (std::size_t s = 0; s < 3; ++s)
        offsets.push_back(offsets.back() + static_cast<std::int32_t>(fresh[s]));
      const std::size_t rows = static_cast<std::size_t>(offsets.back());
      const auto q = kvcache::test::normal_floats(rng, rows * q_heads * dim);
      auto dq = upload(q);
      auto doff = upload(offsets);
      kcuda::DeviceBuffer<float> dout(q.size());
      kcuda::check(cudaMemset(dout.data(), 0xff, dout.bytes()), "poison");
      dev.check_attention(0, fresh, opts);
      const std::size_t ws_bytes =
          kcuda::prefill_workspace_bytes(dev.view(0), static_cast<int>(q_heads), 200, opts);
      REQUIRE((ws_bytes == 0) == (opts.positions == kvcache::PositionMode::absolute));
      kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
      // the launcher, not kvcache::attend, which would build the decode kernels here too
      kcuda::launch_prefill_attention(dev.view(0), dq.data(), dout.data(),
                                      static_cast<int>(q_heads), doff.data(), 200, opts, nullptr,
                                      ws.data(), ws_bytes);
      kcuda::check(cudaDeviceSynchronize(), "prefill");
      const auto got = download(dout.data(), q.size());
      for (std::size_t s = 0; s < 3; ++s) {
        const std::size_t n = fresh[s], first = static_cast<std::size_t>(offsets[s]);
        std::vector<float> expect(n * q_heads * dim);
        cpu.with_view(0, s, [&](const auto& cv) {
          reference::attend(
              {std::span<const float>(q).subspan(first * q_heads * dim, n * q_heads * dim), n,
               q_heads, dim},
              cv, {expect, n, q_heads, dim}, opts);
        });
        INFO("layout " << static_cast<int>(layout) << " dim " << dim << " seq " << s
                       << " cache_relative "
                       << (opts.positions == kvcache::PositionMode::cache_relative));
        kvcache::test::check_close(
            std::span<const float>(got).subspan(first * q_heads * dim, n * q_heads * dim), expect,
            prefill_tolerance<TestType>());
      }
    }
  }
}

TEST_CASE("CUDA cache_relative positions refuse a RoPE of another head_dim and short workspace",
          "[cuda]") {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-cache-relative-errors");
  const Twin t{kcuda::Layout::ring, 1, 1, 64, 2, 400, 32, 2, 64};
  kcuda::DeviceCache<float> dev(device_config(t));  // float: the kernels this file builds anyway
  CpuTwin<float> cpu(t);
  fill(dev, cpu, t, rng, {100, 70});
  const kvcache::Rope wrong({}, 32), right({}, 64);
  AttentionOptions opts{.window = 32,
                        .num_sink_tokens = 2,
                        .positions = kvcache::PositionMode::cache_relative,
                        .rope = &wrong};
  const auto q = kvcache::test::normal_floats(rng, 2 * 2 * 64);
  auto dq = upload(q);
  kcuda::DeviceBuffer<float> dout(q.size());
  const TokenBlock<const float> qb{std::span<const float>(dq.data(), q.size()), 2, 2, 64};
  const TokenBlock<float> ob{std::span<float>(dout.data(), q.size()), 2, 2, 64};
  kcuda::DeviceBuffer<unsigned char> ws(1 << 20);
  using kvcache::test::require_throws;
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(
            qb, dev.view(0), ob, opts,
            kcuda::DeviceAttendArgs{.workspace = ws.data(), .workspace_bytes = 1 << 20});
      },
      "RoPE for head_dim 32", "head_dim 64");
  opts.rope = &right;
  const std::size_t need = kcuda::decode_workspace_bytes(dev.view(0), 2, opts);
  REQUIRE(need >= 2 * 2 * 2 * sizeof(float));  // the sink scores at least
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(
            qb, dev.view(0), ob, opts,
            kcuda::DeviceAttendArgs{.workspace = ws.data(), .workspace_bytes = need - 1});
      },
      "workspace of " + std::to_string(need - 1) + " bytes, needs " + std::to_string(need));
  const std::vector<std::int32_t> offsets{0, 1, 2};
  auto doff = upload(offsets);
  const std::size_t prefill_need = kcuda::prefill_workspace_bytes(dev.view(0), 2, 1, opts);
  REQUIRE(prefill_need > 0);
  require_throws<kvcache::shape_error>(
      [&] {
        kvcache::attend(qb, dev.view(0), ob, opts,
                        kcuda::DeviceAttendArgs{.q_offsets = doff.data(), .max_q_len = 1});
      },
      "CUDA prefill attention: workspace of 0 bytes, needs " + std::to_string(prefill_need));
}

TEST_CASE(
    "The device kvcache::attend runs the decode launcher without q_offsets and the prefill "
    "launcher with them",
    "[cuda]") {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-attend-dispatch");
  constexpr std::size_t kv_heads = 2, q_heads = 4, dim = 64;
  const Twin t{kcuda::Layout::paged, 1, kv_heads, dim, 2, 600, 0, 0, 64};
  kcuda::DeviceCache<float> dev(device_config(t));
  CpuTwin<float> cpu(t);
  fill(dev, cpu, t, rng, {513, 40});  // sequence 0 in several splits of decode
  const auto view = dev.view(0);
  const AttentionOptions opts{.softcap = 20.0f};
  // decode: a query per sequence; prefill: the last 3 and 5 tokens of the sequences
  const std::vector<std::int32_t> offsets{0, 3, 8};
  auto doff = upload(offsets);
  for (const bool prefill : {false, true}) {
    const std::size_t rows = prefill ? 8 : 2;
    const auto q = kvcache::test::normal_floats(rng, rows * q_heads * dim);
    auto dq = upload(q);
    const std::size_t ws_bytes =
        prefill ? kcuda::prefill_workspace_bytes(view, static_cast<int>(q_heads), 5, opts)
                : kcuda::decode_workspace_bytes(view, static_cast<int>(q_heads), opts);
    if (!prefill) REQUIRE(ws_bytes > 0);  // split: the merge runs too
    kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
    kcuda::DeviceBuffer<float> by_attend(q.size()), by_launcher(q.size());
    kvcache::attend(
        TokenBlock<const float>{std::span<const float>(dq.data(), q.size()), rows, q_heads, dim},
        view, TokenBlock<float>{std::span<float>(by_attend.data(), q.size()), rows, q_heads, dim},
        opts,
        kcuda::DeviceAttendArgs{.workspace = ws.data(),
                                .workspace_bytes = ws_bytes,
                                .q_offsets = prefill ? doff.data() : nullptr,
                                .max_q_len = prefill ? 5 : 0});
    if (prefill) {
      kcuda::launch_prefill_attention(view, dq.data(), by_launcher.data(),
                                      static_cast<int>(q_heads), doff.data(), 5, opts, nullptr,
                                      ws.data(), ws_bytes);
    } else {
      kcuda::launch_decode_attention(view, dq.data(), by_launcher.data(), static_cast<int>(q_heads),
                                     opts, ws.data(), ws_bytes, nullptr);
    }
    kcuda::check(cudaDeviceSynchronize(), "attend");
    INFO((prefill ? "prefill" : "decode"));
    const auto got = download(by_attend.data(), q.size());
    const auto expect = download(by_launcher.data(), q.size());
    REQUIRE(std::memcmp(got.data(), expect.data(), q.size() * sizeof(float)) == 0);
    // and they computed attention: row 0 against the reference
    const std::size_t first = prefill ? 3 : 1;  // sequence 0's query tokens
    std::vector<float> ref(first * q_heads * dim);
    cpu.with_view(0, 0, [&](const auto& cv) {
      reference::attend(
          {std::span<const float>(q).first(first * q_heads * dim), first, q_heads, dim}, cv,
          {ref, first, q_heads, dim}, opts);
    });
    kvcache::test::check_close(std::span<const float>(got).first(first * q_heads * dim), ref,
                               prefill_tolerance<float>());
  }
}

// The host-side pieces of the kernels' logic run here, on the CPU, also where no device is.

TEST_CASE("visible_keys lists every present key a validated mask lets the queries see", "[cuda]") {
  auto rng = kvcache::test::make_rng("cuda-visible-keys");
  int checked = 0, evicted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const auto length = static_cast<std::int64_t>(kvcache::test::uniform(rng, 0, 300));
    const auto cache_sinks = static_cast<std::int64_t>(kvcache::test::uniform(rng, 0, 8));
    kcuda::detail::KeyRange present;
    present.length = length;
    present.sink_end = std::min(length, cache_sinks);
    const bool keep_all = kvcache::test::uniform(rng, 0, 2) == 0;  // else a random gap
    present.recent_begin =
        keep_all || length <= cache_sinks
            ? present.sink_end
            : present.sink_end + static_cast<std::int64_t>(kvcache::test::uniform(
                                     rng, 0, static_cast<std::size_t>(length - present.sink_end)));
    if (length == 0) continue;
    const auto n =
        static_cast<position_t>(kvcache::test::uniform(rng, 1, static_cast<std::size_t>(length)));
    AttentionOptions opts;
    opts.causal = kvcache::test::uniform(rng, 0, 9) != 0;
    if (opts.causal && kvcache::test::uniform(rng, 0, 2) != 0) {
      const std::int64_t first = length - n;
      if (present.recent_begin > present.sink_end && first >= present.recent_begin &&
          kvcache::test::uniform(rng, 0, 3) != 0) {
        // a window the evicted gap allows (what a sliding-window cache is used with)
        opts.window = kvcache::test::uniform(
            rng, 1, static_cast<std::size_t>(first - present.recent_begin + 1));
        opts.num_sink_tokens =
            kvcache::test::uniform(rng, 0, static_cast<std::size_t>(present.sink_end));
      } else {
        opts.window = kvcache::test::uniform(rng, 1, 320);
        opts.num_sink_tokens = kvcache::test::uniform(rng, 0, 10);
      }
    }
    try {
      kvcache::detail::check_query_positions(n, std::nullopt, length, present.sink_end,
                                             present.recent_begin, opts);
    } catch (const kvcache::position_error&) {
      continue;  // the launchers' callers check first (DeviceCache::check_attention)
    }
    const kcuda::DeviceMask mask{opts.causal, static_cast<std::int64_t>(opts.window),
                                 static_cast<std::int64_t>(opts.num_sink_tokens)};
    const std::int64_t first = length - n;
    const kcuda::detail::KeyRange list = kcuda::detail::visible_keys(present, mask, first);
    INFO("length " << length << " present [0, " << present.sink_end << ") + ["
                   << present.recent_begin << ", " << length << "), causal " << opts.causal
                   << " window " << opts.window << " sinks " << opts.num_sink_tokens
                   << ", queries from " << first << "; list [0, " << list.sink_end << ") + ["
                   << list.recent_begin << ", " << list.length << ")");
    auto is_present = [&](std::int64_t p) {
      return p >= 0 && p < length && (p < present.sink_end || p >= present.recent_begin);
    };
    std::vector<bool> listed(static_cast<std::size_t>(length), false);
    std::int64_t prev = -1;
    for (std::int64_t i = 0; i < list.count(); ++i) {
      const std::int64_t p = list.pos(i);
      if (!is_present(p) || p <= prev) {  // increasing: kernels stop at the first key past a query
        INFO("listed key " << p << " after " << prev);
        REQUIRE((is_present(p) && p > prev));
      }
      prev = p;
      listed[static_cast<std::size_t>(p)] = true;
    }
    for (std::int64_t qpos = first; qpos < length; ++qpos) {
      for (std::int64_t p = 0; p < length; ++p) {
        if (is_present(p) && mask.visible(qpos, p) && !listed[static_cast<std::size_t>(p)]) {
          INFO("query " << qpos << " sees key " << p);
          REQUIRE(listed[static_cast<std::size_t>(p)]);
        }
      }
    }
    ++checked;
    if (present.recent_begin > present.sink_end && opts.window > 0) ++evicted;
  }
  INFO(checked << " checked, " << evicted << " with a window over an evicted gap");
  REQUIRE(checked > 8000);
  REQUIRE(evicted > 2000);
}

TEMPLATE_TEST_CASE(
    "CUDA prefill: inf or NaN in q, or in a seen key's K or V, makes exactly the rows that see it "
    "NaN; unseen ones change no bit",
    "[cuda][nonfinite]", KVCACHE_TEST_CUDA_FORMATS) {
  if (!have_device()) return;
  using T = TestType;
  using namespace nonfinite;
  auto rng = kvcache::test::make_rng("cuda-nonfinite-prefill");
  for (kcuda::Layout layout : layouts()) {
    // Prefill: sequence 0 holds 70 cached tokens and 60 new ones (positions 70..129), sequence
    // 1 20 new ones; causal, so a value planted at a later token of the chunk touches none of
    // the earlier rows.
    const std::vector<std::int64_t> total{130, 20};
    const std::vector<std::int32_t> offsets{0, 60, 80};
    std::vector<std::vector<float>> pk, pv;
    for (std::int64_t n : total) {
      pk.push_back(exact_tokens(rng, n));
      pv.push_back(exact_tokens(rng, n));
    }
    const auto pq = kvcache::test::normal_floats(rng, 80 * q_heads * dim);
    auto doff = upload(offsets);
    const auto row_pos = [&](std::size_t r, std::size_t& seq) {
      seq = r < 60 ? 0 : 1;
      const std::int64_t first = total[seq] - (offsets[seq + 1] - offsets[seq]);
      return first + static_cast<std::int64_t>(r) - offsets[seq];
    };
    for (const AttentionOptions& opts :
         {AttentionOptions{}, AttentionOptions{.window = 20, .num_sink_tokens = 2},
          AttentionOptions{.scale = 0.2f, .softcap = 5.0f}, AttentionOptions{.causal = false}}) {
      if (kQuickNonfinite && opts.window == 0) continue;
      INFO("prefill, layout " << static_cast<int>(layout) << " window " << opts.window
                              << " softcap " << opts.softcap << " causal " << opts.causal);
      const auto run = [&](const std::vector<float>& qq, const std::vector<std::vector<float>>& kk,
                           const std::vector<std::vector<float>>& vv) {
        const auto hk = hand_kv<T>(layout, kk, vv, total, kv_heads, dim);
        auto dq = upload(qq);
        kcuda::DeviceBuffer<float> dout(qq.size());
        kcuda::launch_prefill_attention(hk->view, dq.data(), dout.data(), static_cast<int>(q_heads),
                                        doff.data(), 60, opts, nullptr);
        kcuda::check(cudaDeviceSynchronize(), "prefill");
        return download(dout.data(), qq.size());
      };
      const auto base = run(pq, pk, pv);
      for (float x : base) REQUIRE(std::isfinite(x));
      for (const auto& [r, h, bad] : {std::tuple{std::size_t{10}, std::size_t{2}, kNan},
                                      std::tuple{std::size_t{65}, std::size_t{7}, kInfinity}}) {
        auto bad_q = pq;
        bad_q[(r * q_heads + h) * dim + 1] = bad;
        INFO("q row " << r << " head " << h << " = " << bad);
        require_nan_rows(run(bad_q, pk, pv), base, 80, q_heads, dim,
                         [&, bad_r = r, bad_h = h](std::size_t rr, std::size_t rh) {
                           return rr == bad_r && rh == bad_h;
                         });
      }
      // a later token of the chunk (100, 129), the cached prefix (5, 1), the first new token,
      // a sink
      const std::vector<Plant> plants{
          {true, 0, 0, 100, 4, kNan},        {false, 0, 1, 100, 4, kInfinity},
          {true, 0, 1, 129, 63, -kInfinity}, {false, 0, 0, 5, 0, -kInfinity},
          {true, 0, 0, 1, 17, kInfinity},    {true, 0, 1, 70, 2, kNan},
          {false, 1, 1, 10, 30, kNan},       {true, 1, 0, 19, 3, kInfinity}};
      for (const Plant& p : plants) {
        INFO((p.value_side ? "V" : "K") << " of seq " << p.seq << " head " << p.kv_head << " pos "
                                        << p.pos << " = " << p.value);
        const auto got =
            run(pq, p.value_side ? pk : planted(pk, p), p.value_side ? planted(pv, p) : pv);
        // V in int8/fp8: a bad V row may move the unseen rows of its tile by rounding
        // (prefill.cuh)
        const float rounding =
            kvcache::scaled_v<kvcache::value_format_t<T>> && p.value_side ? 1e-5f : 0.0f;
        require_nan_rows(
            got, base, 80, q_heads, dim,
            [&](std::size_t r, std::size_t h) {
              std::size_t seq = 0;
              const std::int64_t qpos = row_pos(r, seq);
              return seq == p.seq && h / group == p.kv_head && sees(opts, qpos, p.pos);
            },
            rounding);
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "context_shift, restore and read_rows of a DeviceCache equal the host cache's, every "
    "layout",
    "[cuda]", float, kvcache::qint8, kvcache::fp8_e4m3) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("device_context_shift");
  const kvcache::Rope rope({.base = 10000.0f}, 16);
  for (const kcuda::Layout layout : kLayouts) {
    // layers, heads, dim, batch, capacity, window, sinks, max_append: ring_len 11
    const Twin t{layout, 2, 2, 16, 3, 40, 8, 2, 4};
    INFO("layout " << static_cast<int>(layout));
    kcuda::DeviceCacheConfig config = device_config(t);
    config.num_blocks *= 2;  // paged: room for a shifted sequence's blocks beside its old ones
    kcuda::DeviceCache<TestType> dev(config);
    CpuTwin<TestType> cpu(t);
    fill(dev, cpu, t, rng, {30, 6, 17});
    int shifted = 0, refused = 0;
    for (int round = 0; round < 16; ++round) {
      const std::size_t s = kvcache::test::uniform(rng, 0, t.batch - 1);
      const std::size_t len = dev.seq_length(s);
      // past the end at times; for the ring, mostly n_keep = the sinks (what a window allows)
      const std::size_t keep =
          layout == kcuda::Layout::ring && kvcache::test::uniform(rng, 0, 3) != 0
              ? std::min(t.sinks, len)
              : kvcache::test::uniform(rng, 0, len);
      // round 0: one past the end, refused by both
      const std::size_t discard =
          round == 0 ? len - keep + 1 : kvcache::test::uniform(rng, 0, len - keep + 1);
      INFO("round " << round << ": sequence " << s << " of " << len << ", keep " << keep
                    << ", discard " << discard);
      std::string host_error, dev_error;
      try {
        if (cpu.ring) kvcache::context_shift(*cpu.ring, s, keep, discard, rope);
        if (cpu.flat) kvcache::context_shift(*cpu.flat, s, keep, discard, rope);
      } catch (const kvcache::error& e) {
        host_error = typeid(e).name();
      }
      try {
        kcuda::context_shift(dev, s, keep, discard, rope, nullptr);
      } catch (const kvcache::error& e) {
        dev_error = typeid(e).name();
      }
      REQUIRE(dev_error == host_error);
      (host_error.empty() ? shifted : refused) += 1;
      // the same positions and rows everywhere (read_rows against the host view, packed)
      for (std::size_t l = 0; l < t.layers; ++l) {
        for (std::size_t q = 0; q < t.batch; ++q) {
          cpu.with_view(l, q, [&](const auto& cv) {
            const kvcache::KeyRange r = dev.keys(l, q);
            REQUIRE(r.length == cv.length());
            REQUIRE(r.sink_end == cv.sink_end());
            REQUIRE(r.recent_begin == cv.recent_begin());
            const std::size_t rows = kvcache::view_num_tokens(cv) * t.heads, n = rows * t.dim;
            std::vector<TestType> hk(n), hv(n), dk(n), dv(n);
            // int8/fp8: the rows' scales too, packed as the rows
            const std::size_t scales = kvcache::scaled_v<TestType> ? rows : 0;
            std::vector<kvcache::scale_type> hks(scales), hvs(scales), dks(scales), dvs(scales);
            kvcache::detail::pack_view_rows(cv, hk.data(), hv.data(), hks.data(), hvs.data());
            if constexpr (kvcache::scaled_v<TestType>) {
              dev.read_rows(l, q, dk, dv, dks, dvs, nullptr);
            } else {
              dev.read_rows(l, q, dk, dv, nullptr);
            }
            REQUIRE(dk == hk);
            REQUIRE(dv == hv);
            REQUIRE(dks == hks);
            REQUIRE(dvs == hvs);
          });
        }
      }
      // and appends go on alike
      std::vector<std::size_t> more(t.batch);
      for (std::size_t q = 0; q < t.batch; ++q) {
        more[q] = layout == kcuda::Layout::ring
                      ? 3
                      : std::min<std::size_t>(3, t.capacity - dev.seq_length(q));
      }
      fill(dev, cpu, t, rng, more);
    }
    INFO(shifted << " shifts, " << refused << " refused alike");
    CHECK(shifted >= 3);
    CHECK(refused >= 1);
    std::string first_mismatch;
    CHECK(count_mismatches(dev, cpu, t, first_mismatch) == 0);
    if (layout != kcuda::Layout::paged) {
      const kvcache::SequenceTokens ids[] = {{.seq = 0, .ids = {}}};
      kvcache::test::require_throws<kvcache::shape_error>([&] { dev.restore({}, ids, nullptr); },
                                                          "only the paged layout keeps token ids");
    }
  }
}
