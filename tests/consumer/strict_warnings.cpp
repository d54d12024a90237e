// SPDX-License-Identifier: Apache-2.0
// Compiled by the add_subdirectory consumer with a strict engine's flags
// (-Wconversion -Wsign-conversion -Wshadow -Wdouble-promotion -Wold-style-cast ... -Werror),
// where kvcache's headers are plain -I includes: it instantiates the public templates (every
// policy and storage format, K/V format pairs too, every CPU kernel, snapshots, prefix caching,
// RoPE, cache-relative positions) so that their bodies are checked too. Never run.
#include <kvcache/cuda/decode_plan.hpp>
#include <kvcache/io/snapshot.hpp>
#include <kvcache/kvcache.hpp>
#include <vector>

namespace {

using namespace kvcache;

template <KVFormat T>
void policies() {
  constexpr std::size_t d = 16;
  std::vector<float> kv(d), q(d), out(d);
  const TokenBlock<const float> one{kv, 1, 1, d};
  StaticCache<T> fixed({.num_layers = 1, .num_kv_heads = 1, .head_dim = d, .max_seq_len = 8});
  DynamicCache<T> growing({.num_layers = 1, .num_kv_heads = 1, .head_dim = d});
  SlidingWindowCache<T> sliding(
      {.num_layers = 1, .num_kv_heads = 1, .head_dim = d, .window = 2, .num_sink_tokens = 1});
  PagedCache<T> paged({.num_layers = 1, .num_kv_heads = 1, .head_dim = d, .num_blocks = 4});
  fixed.append(0, 0, one, one);
  growing.append(0, 0, one, one);
  sliding.append(0, 0, one, one);
  const token_id id = 1;
  paged.append(0, 0, std::span<const token_id>(&id, 1), one, one);
  (void)paged.evict_cached(1);
  (void)paged.check_consistency();
  const Rope rope({.scaling = RopeScaling::yarn, .factor = 4, .original_max_position = 64}, d);
  const AttentionOptions streaming{
      .window = 2, .num_sink_tokens = 1, .positions = PositionMode::cache_relative, .rope = &rope};
  attend({q, 1, 1, d}, fixed.view(0, 0), {out, 1, 1, d});
  attend({q, 1, 1, d}, growing.view(0, 0), {out, 1, 1, d});
  attend({q, 1, 1, d}, sliding.view(0, 0), {out, 1, 1, d}, streaming);
  attend({q, 1, 1, d}, paged.view(0, 0), {out, 1, 1, d});
  std::vector<half> q_half(d);
  std::vector<bfloat16> out_bf16(d);
  ThreadPool pool(2);
  attend(TokenBlock<const half>{q_half, 1, 1, d}, growing.view(0, 0),
         TokenBlock<bfloat16>{out_bf16, 1, 1, d}, {.pool = &pool});
  reference::attend({q, 1, 1, d}, sliding.view(0, 0), {out, 1, 1, d}, streaming);
  TokenTrackedCache<StaticCache<T>> tracked(
      StaticCache<T>({.num_layers = 1, .num_kv_heads = 1, .head_dim = d, .max_seq_len = 8}));
  const ModelId model = ModelId::from_u64(1);
  load_snapshot_bytes(snapshot_to_bytes(fixed, model), fixed, model);
  load_snapshot_bytes(snapshot_to_bytes(tracked, model), tracked, model);
  load_snapshot_bytes(snapshot_to_bytes(paged, model), paged, model);
  context_shift(growing, 0, 0, 1, rope);
  context_shift(sliding, 0, 0, 1, rope);
  context_shift(paged, 0, 0, 1, rope);
  context_shift(tracked, 0, 0, 0, rope);
  if constexpr (Element<T>) {  // the device kernels read f32/f16/bf16 K/V
    const cuda::DecodeSetup setup{.dtype = dtype_of<T>,
                                  .head_dim = 128,
                                  .group = 4,
                                  .blocks_per_sm = 1,
                                  .num_sms = 1,
                                  .kernel = cuda::default_decode_kernel<T>};
    (void)cuda::decode_workspace_bytes<T>(setup, 1, 8, 2, 128, 4096);
  }
}

}  // namespace

void kvcache_strict_warnings() {
  policies<KVFormats<half, qint8>>();  // keys and values in different formats
  policies<KVFormats<fp8_e4m3, bfloat16>>();
  policies<float>();
  policies<half>();
  policies<bfloat16>();
  policies<qint8>();
  policies<fp8_e4m3>();
}
