// SPDX-License-Identifier: Apache-2.0
// memory_bytes() of each cache policy against the tokens it holds, as JSON on stdout (for
// scripts/figures.sh): 4 sequences of a Llama-3-8B-shaped fp16 cache grow in step to 4096 tokens
// each, their first 1024 tokens a prompt they share. No timing: every figure is the cache's own.
#include <cstdio>
#include <span>
#include <type_traits>
#include <vector>

#include "kvcache/kvcache.hpp"

namespace {

using kvcache::half;

constexpr std::size_t kLayers = 32, kKvHeads = 8, kHeadDim = 128;
constexpr std::size_t kSeqs = 4, kMaxTokens = 4096, kShared = 1024, kStep = 64;
constexpr std::size_t kChunkLen = 256, kWindow = 1024, kSinks = 4, kBlockSize = 16;

// The id of the token at `pos` of `seq`: the shared prompt's below kShared, the sequence's own
// from there on.
kvcache::token_id token_at(std::size_t seq, std::size_t pos) {
  const std::size_t salt = pos < kShared ? 0 : seq + 1;
  return static_cast<kvcache::token_id>(1 + (pos * 7919 + salt * 104729) % 32000);
}

struct Curve {
  const char* policy;
  const char* label;
  std::vector<std::size_t> bytes;  // after 0, kStep, 2 kStep, ... tokens per sequence
};

// Grows every sequence by kStep tokens per step, in every layer (a PagedCache with the tokens'
// ids, so that it can share the blocks of the common prompt), and records bytes(cache) before
// the first step and after each.
template <class Cache, class Bytes>
Curve measure(const char* policy, const char* label, Cache& cache, Bytes bytes) {
  const std::vector<float> kv(kStep * kKvHeads * kHeadDim, 0.25f);
  const kvcache::TokenBlock<const float> block{kv, kStep, kKvHeads, kHeadDim};
  std::vector<kvcache::token_id> ids(kStep);
  Curve curve{policy, label, {bytes(cache)}};
  for (std::size_t len = 0; len < kMaxTokens; len += kStep) {
    for (std::size_t seq = 0; seq < kSeqs; ++seq) {
      for (std::size_t i = 0; i < kStep; ++i) ids[i] = token_at(seq, len + i);
      for (std::size_t layer = 0; layer < kLayers; ++layer) {
        if constexpr (std::is_same_v<Cache, kvcache::PagedCache<half>>) {
          cache.append(layer, seq, std::span<const kvcache::token_id>(ids), block, block);
        } else {
          cache.append(layer, seq, block, block);
        }
      }
    }
    curve.bytes.push_back(bytes(cache));
  }
  return curve;
}

const auto memory_bytes = [](const auto& cache) { return cache.memory_bytes(); };

// A PagedCache's memory_bytes() is its whole pool, fixed at construction; what its sequences
// take of it is the blocks they hold, each memory_bytes() / num_blocks().
const auto blocks_in_use_bytes = [](const kvcache::PagedCache<half>& cache) {
  return cache.stats().blocks_used * (cache.memory_bytes() / cache.num_blocks());
};

kvcache::PagedCache<half> paged(bool prefix_caching) {
  return kvcache::PagedCache<half>({.num_layers = kLayers,
                                    .num_kv_heads = kKvHeads,
                                    .head_dim = kHeadDim,
                                    .num_blocks = kSeqs * kMaxTokens / kBlockSize,
                                    .block_size = kBlockSize,
                                    .max_batch = kSeqs,
                                    .max_seq_len = kMaxTokens,
                                    .enable_prefix_caching = prefix_caching});
}

}  // namespace

int main() {
  std::vector<Curve> curves;
  std::size_t pool_bytes = 0;
  {
    kvcache::StaticCache<half> cache({.num_layers = kLayers,
                                      .num_kv_heads = kKvHeads,
                                      .head_dim = kHeadDim,
                                      .max_batch = kSeqs,
                                      .max_seq_len = kMaxTokens});
    curves.push_back(measure("static", "StaticCache (max_seq_len 4096)", cache, memory_bytes));
  }
  {
    kvcache::DynamicCache<half> cache({.num_layers = kLayers,
                                       .num_kv_heads = kKvHeads,
                                       .head_dim = kHeadDim,
                                       .max_batch = kSeqs,
                                       .chunk_len = kChunkLen});
    curves.push_back(measure("dynamic", "DynamicCache (chunks of 256)", cache, memory_bytes));
  }
  {
    kvcache::SlidingWindowCache<half> cache({.num_layers = kLayers,
                                             .num_kv_heads = kKvHeads,
                                             .head_dim = kHeadDim,
                                             .max_batch = kSeqs,
                                             .window = kWindow,
                                             .num_sink_tokens = kSinks,
                                             .max_append_len = kStep});
    curves.push_back(
        measure("sliding", "SlidingWindowCache (window 1024 + 4 sinks)", cache, memory_bytes));
  }
  {
    auto cache = paged(false);
    pool_bytes = cache.memory_bytes();
    curves.push_back(measure("paged", "PagedCache, blocks in use (no prefix caching)", cache,
                             blocks_in_use_bytes));
  }
  {
    auto cache = paged(true);
    curves.push_back(measure("paged_shared",
                             "PagedCache, blocks in use (prefix caching: the prompt held once)",
                             cache, blocks_in_use_bytes));
  }

  std::printf("{\n  \"shape\": {\"num_layers\": %zu, \"num_kv_heads\": %zu, \"head_dim\": %zu, ",
              kLayers, kKvHeads, kHeadDim);
  std::printf("\"dtype\": \"half\", \"sequences\": %zu, \"shared_prompt\": %zu, ", kSeqs, kShared);
  std::printf("\"block_size\": %zu, \"paged_pool_bytes\": %zu},\n  \"curves\": [\n", kBlockSize,
              pool_bytes);
  for (std::size_t c = 0; c < curves.size(); ++c) {
    std::printf("    {\"policy\": \"%s\", \"label\": \"%s\", \"points\": [", curves[c].policy,
                curves[c].label);
    for (std::size_t i = 0; i < curves[c].bytes.size(); ++i) {
      std::printf("%s[%zu, %zu]", i == 0 ? "" : ", ", i * kStep, curves[c].bytes[i]);
    }
    std::printf("]}%s\n", c + 1 < curves.size() ? "," : "");
  }
  std::printf("  ]\n}\n");
}
