// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels against the CPU, decode half (cuda_prefill_test.cu is the other half of the
// executable, test.cuda.cuda_kernels_test): appends must store bit-identical rows (every dtype,
// layout, block boundary); decode attention, every kernel, must equal kvcache::reference over the
// same cached tokens (random data, odd sizes, GQA groups, windows, sinks, soft-caps, splits) and
// give NaN exactly to the rows that see an inf or NaN; the launchers refuse bad input with the
// numbers. Every test skips with a message when no CUDA device is present.
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

TEMPLATE_TEST_CASE("CUDA append stores exactly what the CPU cache stores", "[cuda]",
                   KVCACHE_TEST_CUDA_FORMATS) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-append");
  for (kcuda::Layout layout : kLayouts) {
    // ring wraps; paged crosses blocks
    check_append<TestType>({layout, 2, 3, 64, 4, 100, 40, 3, 17}, {100, 1, 37, 64}, rng);
  }
}

TEST_CASE("CUDA append of a batch wider than one launch stores every sequence", "[cuda]") {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-append-wide");
  const std::size_t batch = kcuda::kMaxSeqsPerLaunch + 88;  // two append launches per round
  for (kcuda::Layout layout : kLayouts) {
    std::vector<std::size_t> lengths(batch);
    for (auto& n : lengths) n = kvcache::test::uniform(rng, 1, 40);
    check_append<kvcache::half>({layout, 1, 2, 64, batch, 40, 8, 2, 5}, lengths, rng);
  }
}

TEMPLATE_TEST_CASE("CUDA decode attention equals the CPU reference", "[cuda][decode]",
                   KVCACHE_TEST_CUDA_FORMATS) {
  if (!have_device()) return;
  auto rng = kvcache::test::make_rng("cuda-decode");
  struct Case {
    std::size_t dim, group, kv_heads;
    AttentionOptions opts;
  };
  // group 32 and 20: more query heads than one block serves (head chunks of 16 and 10)
  const std::vector<Case> all_cases{{64, 1, 2, {}},
                                    {256, 2, 1, {.softcap = 30.0f}},
                                    {128, 8, 1, {.scale = 0.05f}},
                                    {128, 20, 2, {}},
                                    {128, 4, 2, {}},
                                    {64, 16, 1, {}},
                                    {128, 3, 2, {}},
                                    {64, 32, 1, {}}};
  // Under AddressSanitizer (kernels emulated on the CPU, 5x slower) cases 0, 1 and 3: every
  // head_dim, chunked and unchunked groups, both position modes on the ring, every layout and
  // length; the memory errors it looks for do not depend on the other groups' arithmetic, which
  // the plain build checks.
  // int8, fp8 and the pairs run on the fp32 kernel (its other cases check its arithmetic); these
  // cases add the reading of codes, scales and sides at every head_dim, group chunking and
  // position mode.
#if KVCACHE_TEST_ASAN
  const std::vector<std::size_t> picked{0, 1, 3};
#else
  std::vector<std::size_t> picked(all_cases.size());
  for (std::size_t i = 0; i < picked.size(); ++i) picked[i] = i;
  if constexpr (kQuantizedOrPair<TestType>) picked = {0, 1, 3};
#endif
  // long: several splits (and sequences with no keys in most of them), 1 and odd lengths, a
  // block boundary; short: one split, the output written without the merge kernel
  const std::vector<std::size_t> long_lengths{3000, 1, 17, 513, 2049};
  const std::vector<std::size_t> short_lengths{200, 1, 64, 17, 129};
  // every kernel that serves TestType; the default one sized by a DecodeSetup made once (not
  // queried) every other launch, the others always (a setup is how they are chosen)
  std::vector<kcuda::DecodeKernel> kernels{kcuda::default_decode_kernel<TestType>};
  if constexpr (!kcuda::kCudaCoreDecode<TestType>) {
    kernels.push_back(kcuda::DecodeKernel::tensor_cores_per_warp);
  }
  bool with_setup = false;
  for (kcuda::Layout layout : kLayouts) {
    for (const std::size_t case_index : picked) {
      const Case& c = all_cases[case_index];
      for (const auto* lengths_ptr : {&long_lengths, &short_lengths}) {
        const std::vector<std::size_t>& lengths = *lengths_ptr;
        const Twin t{layout, 1, c.kv_heads, c.dim, 5, 3000, 500, 4, 300};
        kcuda::DeviceCache<TestType> dev(device_config(t));
        CpuTwin<TestType> cpu(t);
        fill(dev, cpu, t, rng, lengths);
        AttentionOptions opts = c.opts;
        const kvcache::Rope rope({}, c.dim);
        if (layout == kcuda::Layout::ring) {
          opts.window = t.window;
          opts.num_sink_tokens = t.sinks;
          if (case_index % 2 == 1) {  // every other case: StreamingLLM positions
            opts.positions = kvcache::PositionMode::cache_relative;
            opts.rope = &rope;
          }
        }
        const bool relative = opts.positions == kvcache::PositionMode::cache_relative;
        const std::size_t q_heads = c.kv_heads * c.group;
        const auto view = dev.view(0);
        dev.check_attention(0, std::vector<std::size_t>(t.batch, 1), opts);
        for (const kcuda::DecodeKernel kernel : kernels) {
          const auto q = kvcache::test::normal_floats(rng, t.batch * q_heads * c.dim);
          auto dq = upload(q);
          kcuda::DeviceBuffer<float> dout(q.size());
          kcuda::check(cudaMemset(dout.data(), 0xff, dout.bytes()), "poison");  // NaN everywhere
          const bool default_kernel = kernel == kcuda::default_decode_kernel<TestType>;
          if (default_kernel) with_setup = !with_setup;
          std::optional<kcuda::DecodeSetup> setup;
          if (with_setup || !default_kernel) {
            setup = kcuda::make_decode_setup<TestType>(static_cast<int>(q_heads),
                                                       static_cast<int>(c.kv_heads),
                                                       static_cast<int>(c.dim), kernel);
          }
          const kcuda::DecodeSetup* setup_ptr = setup ? &*setup : nullptr;
          const std::size_t ws_bytes =
              kcuda::decode_workspace_bytes(view, static_cast<int>(q_heads), opts, setup_ptr);
          if (default_kernel) {
            REQUIRE(ws_bytes ==
                    kcuda::decode_workspace_bytes(view, static_cast<int>(q_heads), opts));
          }
          // one split: nothing to merge (but cache_relative's sink scores)
          if (lengths_ptr == &short_lengths) REQUIRE((ws_bytes == 0) == !relative);
          if (lengths_ptr == &long_lengths) REQUIRE(ws_bytes > 0);
          kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
          // the launcher, not kvcache::attend, which would build the prefill kernels here too
          // (cuda_prefill_test.cu checks that attend runs this launcher)
          kcuda::launch_decode_attention(view, dq.data(), dout.data(), static_cast<int>(q_heads),
                                         opts, ws.data(), ws_bytes, nullptr, setup_ptr);
          kcuda::check(cudaDeviceSynchronize(), "decode");
          const auto got = download(dout.data(), q.size());
          for (std::size_t s = 0; s < t.batch; ++s) {
            std::vector<float> expect(q_heads * c.dim);
            cpu.with_view(0, s, [&](const auto& cv) {
              reference::attend(
                  {std::span<const float>(q).subspan(s * q_heads * c.dim, q_heads * c.dim), 1,
                   q_heads, c.dim},
                  cv, {expect, 1, q_heads, c.dim}, opts);
            });
            INFO("layout " << static_cast<int>(layout) << " dim " << c.dim << " group " << c.group
                           << " seq " << s << " length " << lengths[s] << " kernel "
                           << static_cast<int>(kernel) << " setup " << setup.has_value()
                           << " cache_relative " << relative);
            kvcache::test::check_close(
                std::span<const float>(got).subspan(s * q_heads * c.dim, q_heads * c.dim), expect,
                decode_tolerance<TestType>());
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("CUDA decode on tensor cores keeps q's low bits", "[cuda]", kvcache::half,
                   bfloat16) {
  if (!have_device()) return;
  // Every score rests on q's bits below 2^-16: q = (1 + 2^-9 + 2^-17, -(1 + 2^-9), 0, ...) 2^h
  // for head h, K row j = (c, c, 0, ...) with c = 2^11 (j % 16), so q.k = 2^h j / 64 exactly,
  // and is 0 for every key once q is cut to 16 bits (two bf16 parts, or one fp16 part). The
  // expected output is the softmax-weighted V in double.
  constexpr std::size_t kDim = 64, kKeys = 40, kHeads = 4;
  std::vector<TestType> k(kKeys * kDim, TestType(0.0f)), v(kKeys * kDim);
  for (std::size_t j = 0; j < kKeys; ++j) {
    k[j * kDim] = k[j * kDim + 1] = TestType(2048.0f * static_cast<float>(j % 16));
    for (std::size_t d = 0; d < kDim; ++d) {
      v[j * kDim + d] = TestType(static_cast<float>((7 * j + 3 * d) % 13) / 13.0f - 0.5f);
    }
  }
  std::vector<float> q(kHeads * kDim, 0.0f), expect(kHeads * kDim, 0.0f);
  for (std::size_t h = 0; h < kHeads; ++h) {
    const float pow2 = static_cast<float>(1u << h);
    q[h * kDim] = (1.0f + 0x1p-9f + 0x1p-17f) * pow2;
    q[h * kDim + 1] = -(1.0f + 0x1p-9f) * pow2;
    double sum = 0.0;
    std::vector<double> acc(kDim, 0.0);
    for (std::size_t j = 0; j < kKeys; ++j) {
      const double w = std::exp(static_cast<double>(pow2) * static_cast<double>(j % 16) / 64.0);
      sum += w;
      for (std::size_t d = 0; d < kDim; ++d) {
        acc[d] += w * static_cast<double>(kvcache::to_float(v[j * kDim + d]));
      }
    }
    for (std::size_t d = 0; d < kDim; ++d) {
      expect[h * kDim + d] = static_cast<float>(acc[d] / sum);
    }
  }
  auto dk = upload(k), dv = upload(v);
  auto dq = upload(q);
  auto dlen = upload(std::vector<std::int64_t>{static_cast<std::int64_t>(kKeys)});
  const kcuda::DeviceKVView<TestType> view{.k = dk.data(),
                                           .v = dv.data(),
                                           .num_seqs = 1,
                                           .num_kv_heads = 1,
                                           .head_dim = static_cast<int>(kDim),
                                           .seq_stride = static_cast<std::int64_t>(kKeys * kDim),
                                           .head_stride = static_cast<std::int64_t>(kKeys * kDim),
                                           .length = dlen.data(),
                                           .max_keys = static_cast<std::int64_t>(kKeys)};
  const AttentionOptions opts{.scale = 1.0f};
  for (const kcuda::DecodeKernel kernel :
       {kcuda::DecodeKernel::tensor_cores, kcuda::DecodeKernel::tensor_cores_per_warp}) {
    const auto setup = kcuda::make_decode_setup<TestType>(kHeads, 1, kDim, kernel);
    const std::size_t ws_bytes =
        kcuda::decode_workspace_bytes(view, static_cast<int>(kHeads), opts, &setup);
    kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
    kcuda::DeviceBuffer<float> dout(q.size());
    kcuda::launch_decode_attention(view, dq.data(), dout.data(), static_cast<int>(kHeads), opts,
                                   ws.data(), ws_bytes, nullptr, &setup);
    kcuda::check(cudaDeviceSynchronize(), "decode");
    INFO("kernel " << kcuda::decode_kernel_name(kernel));
    kvcache::test::check_close(download(dout.data(), q.size()), expect,
                               decode_tolerance<TestType>());
  }
}

TEST_CASE("CUDA launchers and DeviceCache reject bad input with the numbers", "[cuda]") {
  if (!have_device()) return;
  using kvcache::test::require_throws;
  kcuda::DeviceCache<kvcache::half> dev({.layout = kcuda::Layout::paged,
                                         .num_layers = 1,
                                         .num_kv_heads = 1,
                                         .head_dim = 64,
                                         .max_batch = 2,
                                         .max_seq_len = 64,
                                         .block_size = 16,
                                         .num_blocks = 3});
  kcuda::DeviceBuffer<float> kv(64 * 64);
  const std::vector<std::size_t> seq0{0}, seq1{1}, n40{40}, n20{20}, n70{70};
  dev.append(0, seq0, n40, kv.data(), kv.data(), nullptr);  // 3 blocks: pool now empty
  require_throws<kvcache::capacity_error>(
      [&] { dev.append(0, seq1, n20, kv.data(), kv.data(), nullptr); }, "needs 2 blocks",
      "has 0 free");
  require_throws<kvcache::capacity_error>(
      [&] { dev.append(0, seq0, n70, kv.data(), kv.data(), nullptr); }, "max_seq_len 64",
      "holds 40");
  require_throws<kvcache::batch_error>(
      [&] { dev.append(0, std::vector<std::size_t>{2}, n20, kv.data(), kv.data(), nullptr); },
      "sequence 2");
  REQUIRE(dev.seq_length(0) == 40);
  dev.crop(0, 16, nullptr);
  REQUIRE(dev.free_blocks() == 2);
  dev.reset(0, nullptr);
  REQUIRE(dev.free_blocks() == 3);
  kcuda::DeviceCache<kvcache::half> odd(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = 96, .max_seq_len = 8});
  dev.append(0, seq0, std::vector<std::size_t>{1}, kv.data(), kv.data(), nullptr);
  odd.append(0, seq0, std::vector<std::size_t>{1}, kv.data(), kv.data(), nullptr);
  kcuda::DeviceBuffer<float> q(96), out(96);
  require_throws<kvcache::shape_error>(
      [&] {
        kcuda::launch_decode_attention(odd.view(0), q.data(), out.data(), 1, AttentionOptions{},
                                       nullptr, 0, nullptr);
      },
      "head_dim 96", "64, 128, 256");
  // a DecodeSetup serves only the dtype, head_dim, group and device it was made for
  const auto setup = kcuda::make_decode_setup<kvcache::half>(2, 1, 64);
  kcuda::DeviceBuffer<float> q2(2 * 2 * 64), out2(2 * 2 * 64);  // 2 sequences x up to 2 heads
  kcuda::check(cudaMemset(q2.data(), 0, q2.bytes()), "zero q");
  const auto decode = [&](int q_heads, const kcuda::DecodeSetup& s) {
    kcuda::launch_decode_attention(dev.view(0), q2.data(), out2.data(), q_heads, AttentionOptions{},
                                   nullptr, 0, nullptr, &s);
  };
  decode(2, setup);
  require_throws<kvcache::shape_error>([&] { decode(1, setup); }, "group 2", "used for f16",
                                       "group 1");
  require_throws<kvcache::shape_error>(
      [&] { decode(1, kcuda::make_decode_setup<kvcache::bfloat16>(1, 1, 64)); }, "for bf16",
      "used for f16");
  require_throws<kvcache::shape_error>(
      [&] { decode(1, kcuda::make_decode_setup<kvcache::half>(1, 1, 128)); }, "head_dim 128",
      "used for f16, head_dim 64");
  require_throws<kvcache::shape_error>([&] { decode(1, kcuda::DecodeSetup{}); }, "0 SMs");
  auto elsewhere = setup;
  elsewhere.device += 7;
  require_throws<kvcache::shape_error>([&] { decode(2, elsewhere); }, "DecodeSetup of device",
                                       "used on device");
  // int8 and fp8 decode on CUDA cores only
  require_throws<kvcache::shape_error>(
      [&] {
        (void)kcuda::make_decode_setup<kvcache::qint8>(2, 1, 64, kcuda::DecodeKernel::tensor_cores);
      },
      "tensor_cores", "does not serve int8");
  kcuda::check(cudaDeviceSynchronize(), "errors");
}

// The host-side pieces of the kernels' logic run here, on the CPU, also where no device is.

TEST_CASE("CUDA launchers reject bad shapes before touching the device", "[cuda]") {
  using kvcache::test::require_throws;
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::decode_workspace_bytes<kvcache::half>(4, 6, 4, 128, 1000); },
      "num_q_heads 6", "num_kv_heads 4");
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::decode_workspace_bytes<kvcache::half>(4, 8, 4, 96, 1000); }, "head_dim 96",
      "64, 128, 256");
  require_throws<kvcache::shape_error>(
      [] { (void)kcuda::make_decode_setup<kvcache::half>(6, 4, 128); }, "num_q_heads 6");
  require_throws<kvcache::shape_error>([] { (void)kcuda::make_decode_setup<float>(8, 4, 80); },
                                       "head_dim 80", "64, 128, 256");
  require_throws<kvcache::shape_error>(
      [] {
        (void)kcuda::make_decode_setup<float>(8, 4, 128,
                                              kcuda::DecodeKernel::tensor_cores_per_warp);
      },
      "decode kernel tensor_cores_per_warp (2) does not serve f32");
}

TEMPLATE_TEST_CASE(
    "CUDA decode: inf or NaN in q, or in a seen key's K or V, makes exactly the rows that see it "
    "NaN; unseen ones change no bit",
    "[cuda][nonfinite]", KVCACHE_TEST_CUDA_FORMATS) {
  if (!have_device()) return;
  using T = TestType;
  using namespace nonfinite;
  auto rng = kvcache::test::make_rng("cuda-nonfinite-decode");
  for (kcuda::Layout layout : layouts()) {
    // Decode: 600 keys (split-K: the merge sees the NaN partial), an empty sequence whose q is
    // NaN (zeros: it sees no key), 77 keys (keys in the first split only).
    const std::vector<std::int64_t> lengths{600, 0, 77};
    std::vector<std::vector<float>> keys, values;
    for (std::int64_t n : lengths) {
      keys.push_back(exact_tokens(rng, n));
      values.push_back(exact_tokens(rng, n));
    }
    auto q = kvcache::test::normal_floats(rng, lengths.size() * q_heads * dim);
    std::fill(q.begin() + q_heads * dim, q.begin() + 2 * q_heads * dim, kNan);
    std::vector<kcuda::DecodeKernel> kernels{kcuda::default_decode_kernel<T>};
    if constexpr (!kcuda::kCudaCoreDecode<T>) {
      kernels.push_back(kcuda::DecodeKernel::tensor_cores_per_warp);
    }
    for (const AttentionOptions& opts :
         {AttentionOptions{}, AttentionOptions{.window = 100, .num_sink_tokens = 4},
          AttentionOptions{.scale = 0.2f, .softcap = 5.0f}}) {
      if (kQuickNonfinite && (opts.window != 0 || opts.softcap != 0.0f)) continue;
      for (const kcuda::DecodeKernel kernel : kernels) {
        INFO("decode, layout " << static_cast<int>(layout) << " kernel "
                               << kcuda::decode_kernel_name(kernel) << " window " << opts.window
                               << " softcap " << opts.softcap);
        const auto setup = kcuda::make_decode_setup<T>(q_heads, kv_heads, dim, kernel);
        const auto run = [&](const std::vector<float>& qq,
                             const std::vector<std::vector<float>>& kk,
                             const std::vector<std::vector<float>>& vv, std::size_t* ws_out) {
          const auto hk = hand_kv<T>(layout, kk, vv, lengths, kv_heads, dim);
          const std::size_t ws_bytes =
              kcuda::decode_workspace_bytes(hk->view, static_cast<int>(q_heads), opts, &setup);
          if (ws_out != nullptr) *ws_out = ws_bytes;
          kcuda::DeviceBuffer<unsigned char> ws(ws_bytes);
          auto dq = upload(qq);
          kcuda::DeviceBuffer<float> dout(qq.size());
          kcuda::launch_decode_attention(hk->view, dq.data(), dout.data(),
                                         static_cast<int>(q_heads), opts, ws.data(), ws_bytes,
                                         nullptr, &setup);
          kcuda::check(cudaDeviceSynchronize(), "decode");
          return download(dout.data(), qq.size());
        };
        std::size_t ws_bytes = 0;
        const auto base = run(q, keys, values, &ws_bytes);
        if (opts.window == 0) REQUIRE(ws_bytes > 0);  // split-K, merged by decode_merge_kernel
        for (std::size_t i = 0; i < base.size(); ++i) {
          if (i / (q_heads * dim) == 1) {
            REQUIRE(base[i] == 0.0f);  // the empty sequence, NaN q
          } else {
            REQUIRE(std::isfinite(base[i]));
          }
        }
        // q: that head only
        for (const auto& [s, h, bad] : {std::tuple{std::size_t{0}, std::size_t{5}, kInfinity},
                                        std::tuple{std::size_t{2}, std::size_t{0}, kNan},
                                        std::tuple{std::size_t{0}, std::size_t{2}, -kInfinity}}) {
          auto bad_q = q;
          bad_q[(s * q_heads + h) * dim + 7] = bad;
          INFO("q[" << s << "][" << h << "] = " << bad);
          require_nan_rows(run(bad_q, keys, values, nullptr), base, lengths.size(), q_heads, dim,
                           [&, bad_s = s, bad_h = h](std::size_t r, std::size_t rh) {
                             return r == bad_s && rh == bad_h;
                           });
        }
        // K and V: seen keys (the first, the last, one mid-split, a sink), keys outside the
        // window
        const std::vector<Plant> plants{
            {false, 0, 0, 0, 3, kInfinity},     {true, 0, 1, 0, 60, kNan},
            {false, 0, 1, 250, 5, kNan},        {true, 0, 0, 300, 0, -kInfinity},
            {false, 0, 0, 599, 63, -kInfinity}, {true, 0, 1, 599, 1, kInfinity},
            {true, 0, 0, 2, 9, kInfinity},      {false, 2, 1, 40, 2, kNan},
            {true, 2, 0, 76, 8, kNan}};
        for (const Plant& p : plants) {
          INFO((p.value_side ? "V" : "K") << " of seq " << p.seq << " head " << p.kv_head << " pos "
                                          << p.pos << " = " << p.value);
          const auto got = run(q, p.value_side ? keys : planted(keys, p),
                               p.value_side ? planted(values, p) : values, nullptr);
          require_nan_rows(got, base, lengths.size(), q_heads, dim,
                           [&](std::size_t r, std::size_t h) {
                             return r == p.seq && h / group == p.kv_head &&
                                    sees(opts, lengths[p.seq] - 1, p.pos);
                           });
        }
      }
    }
  }
}
