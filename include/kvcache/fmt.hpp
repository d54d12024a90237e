// SPDX-License-Identifier: Apache-2.0
// Optional {fmt} formatters for kvcache types: include this only where fmt is available.
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"

/// Formats a DType as its short name: f32, f16, bf16.
template <>
struct fmt::formatter<kvcache::DType> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(kvcache::DType d, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(kvcache::dtype_name(d), ctx);
  }
};

/// Formats a CacheShape as "5 layers x 4 kv heads x head_dim 8, f16", or with keys and values in
/// different formats "..., K f16 + V int8".
template <>
struct fmt::formatter<kvcache::CacheShape> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const kvcache::CacheShape& s, Ctx& ctx) const {
    auto out = fmt::format_to(ctx.out(), "{} layers x {} kv heads x head_dim {}, ", s.num_layers,
                              s.num_kv_heads, s.head_dim);
    return fmt::format_to(out, "{}", kvcache::format_name(s.dtype, s.value_dtype));
  }
};

/// Formats PrefixCacheStats as "blocks 64 x 16 tokens: 10 used, 20 cached, 34 free; prefix hit
/// rate 75.0% (3072 of 4096 prompt tokens reused, 8 prompts); 2 evictions, 1 copy-on-write".
template <>
struct fmt::formatter<kvcache::PrefixCacheStats> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const kvcache::PrefixCacheStats& s, Ctx& ctx) const {
    return fmt::format_to(ctx.out(),
                          "blocks {} x {} tokens: {} used, {} cached, {} free; prefix hit rate "
                          "{:.1f}% ({} of {} prompt tokens reused, {} prompts); {} evictions, {} "
                          "copy-on-write",
                          s.blocks_total, s.block_size, s.blocks_used, s.blocks_cached,
                          s.blocks_free, 100.0 * s.hit_rate(), s.reused_tokens, s.prompt_tokens,
                          s.prompts, s.evictions, s.cow_copies);
  }
};
