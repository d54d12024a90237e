// SPDX-License-Identifier: Apache-2.0
// Decode launch planning (kvcache/cuda/decode_plan.hpp), plain C++ with no CUDA: head chunks and
// split-KV counts cover every query head and key, splits never shrink as contexts grow (one
// workspace serves the longest), waves fill the device, setups are checked against their use.
#include "kvcache/cuda/decode_plan.hpp"

#include <cstdint>

#include "support/catch.hpp"
#include "support/rng.hpp"
#include "support/throws.hpp"

namespace kcuda = kvcache::cuda;

TEST_CASE("decode plan: head chunks and splits cover every query head and key") {
  // The benchmark's shape on an H200 (132 SMs, 3 blocks each): 256 (sequence, KV head) units.
  // Two splits would be 512 blocks on 396 slots, a second wave 29% full; three fill 97%.
  const auto h200 = kcuda::detail::plan_decode_grid(32, 4, 8, 4096, 132 * 3);
  REQUIRE(h200.splits == 3);
  REQUIRE(h200.num_chunks == 1);
  REQUIRE(h200.chunk_group == 4);
  // One sequence (8 units) at 32k keys: enough splits to fill 90% of the slots.
  const auto single = kcuda::detail::plan_decode_grid(1, 4, 8, 32768, 132 * 3);
  REQUIRE(8 * single.splits >= 0.9 * 132 * 3);

  auto rng = kvcache::test::make_rng("cuda-decode-plan");
  for (int trial = 0; trial < 3000; ++trial) {
    const int seqs = static_cast<int>(kvcache::test::uniform(rng, 1, 64));
    const int group = static_cast<int>(kvcache::test::uniform(rng, 1, 64));
    const int kv_heads = static_cast<int>(kvcache::test::uniform(rng, 1, 8));
    const auto keys = static_cast<std::int64_t>(kvcache::test::uniform(rng, 0, 40000));
    const auto slots = static_cast<std::int64_t>(kvcache::test::uniform(rng, 1, 1200));
    const auto p = kcuda::detail::plan_decode_grid(seqs, group, kv_heads, keys, slots);
    INFO("seqs " << seqs << " group " << group << " kv_heads " << kv_heads << " keys " << keys
                 << " slots " << slots << ": chunks " << p.num_chunks << " x " << p.chunk_group
                 << ", splits " << p.splits << " x " << p.keys_per_split);
    REQUIRE(p.chunk_group >= 1);
    REQUIRE(p.chunk_group <= kcuda::kMaxGroup);
    REQUIRE(p.num_chunks * p.chunk_group >= group);       // every query head served
    REQUIRE((p.num_chunks - 1) * p.chunk_group < group);  // no chunk without heads
    REQUIRE(p.splits >= 1);
    REQUIRE(p.keys_per_split % kcuda::kDecodeTile == 0);
    REQUIRE(p.splits * p.keys_per_split >= keys);  // every key in some split
    REQUIRE((p.splits == 1 || keys > (p.splits - 1) * kcuda::kMinKeysPerSplit));
    // more keys never need fewer splits (so one workspace sized for the longest context serves)
    const auto more = kvcache::test::uniform(rng, 0, 20000);
    REQUIRE(kcuda::detail::plan_decode_grid(seqs, group, kv_heads,
                                            keys + static_cast<std::int64_t>(more), slots)
                .splits >= p.splits);
  }
}

TEST_CASE("decode plan from a setup: the workspace is host arithmetic, setups checked by name") {
  using kvcache::test::require_throws;
  // with a setup the workspace size is host arithmetic: the same plan as plan_decode_grid
  const kcuda::DecodeSetup h200{.dtype = kvcache::DType::f16,
                                .head_dim = 128,
                                .group = 4,
                                .smem_bytes = 1,
                                .blocks_per_sm = 3,
                                .num_sms = 132,
                                .kernel = kcuda::DecodeKernel::tensor_cores};
  const auto plan = kcuda::detail::plan_decode_grid(32, 4, 8, 4096, 132 * 3);
  REQUIRE(kcuda::decode_workspace_bytes<kvcache::half>(h200, 32, 32, 8, 128, 4096) ==
          plan.workspace_bytes(32, 32, 128));
  // a setup names a kernel for its dtype; the per-warp kernel serves at most 8 bf16 heads a block
  // at head_dim 128 (its accumulators are registers), so a group of 16 takes two blocks
  kcuda::DecodeSetup wrong = h200;
  wrong.kernel = kcuda::DecodeKernel::cuda_cores;
  require_throws<kvcache::shape_error>(
      [&] { (void)kcuda::decode_workspace_bytes<kvcache::half>(wrong, 32, 32, 8, 128, 4096); },
      "decode kernel cuda_cores (0) does not serve f16");
  kcuda::DecodeSetup per_warp = h200;
  per_warp.kernel = kcuda::DecodeKernel::tensor_cores_per_warp;
  per_warp.group = 16;
  REQUIRE(kcuda::detail::plan_decode(per_warp, 32, 8, 4096).chunk_group == 16);
  per_warp.dtype = kvcache::DType::bf16;
  const auto bf16_plan = kcuda::detail::plan_decode(per_warp, 32, 8, 4096);
  REQUIRE(bf16_plan.chunk_group == 8);
  REQUIRE(bf16_plan.num_chunks == 2);
  per_warp.head_dim = 256;
  REQUIRE(kcuda::detail::plan_decode(per_warp, 32, 8, 4096).chunk_group == 4);
  require_throws<kvcache::shape_error>(
      [&] { (void)kcuda::decode_workspace_bytes<kvcache::bfloat16>(h200, 32, 32, 8, 128, 4096); },
      "DecodeSetup for f16", "used for bf16");
  // a K/V pair's setup names both formats: int8 keys' setup does not size int8 keys with f16
  // values (their V tiles are twice as large), nor the reverse; pairs take the CUDA-core kernel
  using Int8Half = kvcache::KVFormats<kvcache::qint8, kvcache::half>;
  kcuda::DecodeSetup int8 = h200;
  int8.dtype = kvcache::DType::i8;
  int8.kernel = kcuda::DecodeKernel::cuda_cores;
  require_throws<kvcache::shape_error>(
      [&] { (void)kcuda::decode_workspace_bytes<Int8Half>(int8, 32, 32, 8, 128, 4096); },
      "DecodeSetup for int8", "used for K int8 + V f16");
  kcuda::DecodeSetup pair = int8;
  pair.value_dtype = kvcache::DType::f16;
  REQUIRE(kcuda::decode_workspace_bytes<Int8Half>(pair, 32, 32, 8, 128, 4096) ==
          plan.workspace_bytes(32, 32, 128));
  require_throws<kvcache::shape_error>(
      [&] { (void)kcuda::decode_workspace_bytes<kvcache::qint8>(pair, 32, 32, 8, 128, 4096); },
      "DecodeSetup for K int8 + V f16", "used for int8");
  pair.kernel = kcuda::DecodeKernel::tensor_cores;
  require_throws<kvcache::shape_error>(
      [&] { (void)kcuda::decode_workspace_bytes<Int8Half>(pair, 32, 32, 8, 128, 4096); },
      "does not serve K int8 + V f16");
}
