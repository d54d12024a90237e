// SPDX-License-Identifier: Apache-2.0
// The system-prompt scenario "from disk": one process prefills the system prompt and saves its
// K/V as a snapshot (kvcache/io); another loads it and serves requests, prefilling only each
// user suffix. Also the model identities snapshots are keyed by (weights file, synthetic spec).
// With the paged policy the loaded system prompt becomes cached prefix blocks: every request
// submits its whole prompt and automatic prefix caching finds the system prompt there.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/io/error.hpp"
#include "kvcache/io/model_id.hpp"
#include "kvcache/io/snapshot.hpp"
#include "kvcache/io/xxhash64.hpp"
#include "kvcache/policy/token_tracked_cache.hpp"
#include "llama/caches.hpp"
#include "llama/forward.hpp"
#include "llama/generate.hpp"
#include "llama/model.hpp"
#include "llama/sampler.hpp"
#include "llama/scenarios.hpp"

namespace llama {

/// The identity of the synthetic model Model::synthetic(c, seed): 8 bytes, XXH64 of
/// "kvcache-llama synthetic v1 <synthetic_spec(c)> seed <seed>" (v1 names the weight generator,
/// synthetic_weight). Two synthetic models share it exactly when they have the same weights.
/// It never equals a checkpoint's id (model_id_of_file ids are 16 bytes).
[[nodiscard]] inline kvcache::ModelId synthetic_model_id(const ModelConfig& c, std::uint64_t seed) {
  const std::string text =
      "kvcache-llama synthetic v1 " + synthetic_spec(c) + " seed " + std::to_string(seed);
  return kvcache::ModelId::from_u64(kvcache::xxhash64(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()), text.size())));
}

/// Sizes of the from-disk scenario. Both processes must be given the same options (and the same
/// model): the serving process re-derives the system prompt to check that the snapshot holds
/// it, and takes the requests from the same prompt stream.
struct DiskPromptOptions {
  std::size_t system_tokens = 384;
  std::size_t requests = 3;
  std::size_t suffix_tokens = 32;
  std::size_t reply_tokens = 6;
  CacheKind cache = CacheKind::static_cache;
  CacheParams params = {};  ///< max_seq_len is set to system + suffix + reply tokens
  SamplerConfig sampler = {};
  /// The id of a model the snapshot must be refused for: serve_from_snapshot() tries to load
  /// the snapshot under it into the serving cache and records the refusal.
  std::optional<kvcache::ModelId> other_model = std::nullopt;

  [[nodiscard]] CacheParams cache_params() const noexcept {
    CacheParams p = params;
    p.max_seq_len = std::max<std::size_t>(1, system_tokens) + suffix_tokens + reply_tokens;
    return p;
  }
};

/// BOS followed by the next n - 1 tokens of `source` (n >= 1): the system prompt.
[[nodiscard]] inline std::vector<token_id> take_system_prompt(PromptSource& source, std::size_t n) {
  std::vector<token_id> prompt{kBos};
  const auto body = source.take(n > 1 ? n - 1 : 0);
  prompt.insert(prompt.end(), body.begin(), body.end());
  return prompt;
}

/// What the first process did.
struct SavedSystemPrompt {
  std::size_t tokens = 0;        ///< system prompt tokens prefilled and saved
  double prefill_s = 0;          ///< their prefill
  double save_s = 0;             ///< save_snapshot (atomic, fsynced)
  std::uint64_t file_bytes = 0;  ///< the snapshot's size
};

namespace detail {

/// Calls f(cache) with the cache the from-disk scenario keeps for `raw`: raw itself where it is
/// a prefix cache (it tracks token ids itself), else a TokenTrackedCache around it.
template <class Raw, class F>
decltype(auto) with_snapshot_cache(Raw& raw, F&& f) {
  if constexpr (kvcache::PrefixCacheConcept<Raw>) {
    return f(raw);
  } else {
    kvcache::TokenTrackedCache tracked(std::move(raw));
    return f(tracked);
  }
}

/// Runs `tokens` on sequence `seq` of a cache kept by with_snapshot_cache and records their ids
/// (a prefix cache registers them itself when admitting them).
template <class C>
void prefill_and_record(Engine& engine, C& cache, std::size_t seq,
                        std::span<const token_id> tokens) {
  if constexpr (kvcache::PrefixCacheConcept<C>) {
    const std::size_t reused = cache.admit(seq, tokens);
    engine.forward(cache, seq, tokens.subspan(reused));
  } else {
    engine.forward(cache, seq, tokens);
    cache.commit(seq, tokens);
  }
}

}  // namespace detail

/// Process 1: prefills the system prompt (from `source`, see take_system_prompt) into sequence 0
/// of a cache of policy o.cache (a TokenTrackedCache around it, except for the paged policy,
/// which tracks ids itself) and saves it to `path` with `model_id`.
/// O(system_tokens x model) + O(snapshot bytes) written.
/// @throws as Engine::forward and save_snapshot (io_error...).
inline SavedSystemPrompt save_system_prompt(Engine& engine, PromptSource& source,
                                            const DiskPromptOptions& o,
                                            const std::filesystem::path& path,
                                            const kvcache::ModelId& model_id) {
  const std::vector<token_id> system = take_system_prompt(source, o.system_tokens);
  return with_cache(o.cache, engine.model(), o.cache_params(), [&](auto& raw) {
    return detail::with_snapshot_cache(raw, [&](auto& cache) {
      SavedSystemPrompt out{.tokens = system.size()};
      const double t0 = now_s();
      detail::prefill_and_record(engine, cache, 0, system);
      out.prefill_s = now_s() - t0;
      const std::size_t seq0[] = {0};
      const double t1 = now_s();
      kvcache::save_snapshot(path, cache, model_id, seq0);
      out.save_s = now_s() - t1;
      out.file_bytes = std::filesystem::file_size(path);
      return out;
    });
  });
}

/// One request of process 2, served from the loaded snapshot and recomputed from scratch.
struct DiskRequestRow {
  std::size_t prompt_tokens = 0;  ///< system prompt + suffix
  std::size_t disk_computed = 0;  ///< prompt tokens the from-disk path ran (the rest loaded)
  double ttft_disk_s = 0;         ///< prefill of those tokens up to the first token
  double ttft_recompute_s = 0;    ///< the whole prompt prefilled into a fresh cache
  double decode_disk_tps = 0, decode_recompute_tps = 0;
  bool identical = false;            ///< the same tokens both ways
  std::vector<token_id> reply = {};  ///< what the from-disk path generated
};

/// What process 2 did.
struct ServeResult {
  std::string cache = {};         ///< policy name
  std::size_t system_tokens = 0;  ///< positions the snapshot restored
  std::uint64_t file_bytes = 0;
  double load_s = 0;  ///< load_snapshot() before the first request
  /// The snapshot held exactly the system prompt's token ids (re-derived from the stream).
  bool holds_system_prompt = false;
  /// System prompt tokens a request can take from the loaded state: all of them, except with
  /// the paged policy, which shares whole blocks (a partly filled last block is recomputed).
  std::size_t shareable_tokens = 0;
  std::vector<DiskRequestRow> rows = {};
  /// DiskPromptOptions::other_model given: its load was refused with snapshot_mismatch_error
  /// and left the serving sequence's length and token ids as they were.
  bool other_model_refused = false;
  std::string refusal = {};  ///< that error's message

  /// TTFT of the first request: the load plus its suffix prefill.
  [[nodiscard]] double first_ttft_s() const noexcept {
    return rows.empty() ? 0 : load_s + rows.front().ttft_disk_s;
  }
  /// The snapshot held the system prompt, every request matched its from-scratch run, and
  /// (when asked) another model's load was refused. (Whether the loaded system prompt served
  /// every request: reused_system_prompt.)
  [[nodiscard]] bool ok(const DiskPromptOptions& o) const noexcept {
    bool all = holds_system_prompt && !rows.empty() && (!o.other_model || other_model_refused);
    for (const DiskRequestRow& r : rows) all = all && r.identical;
    return all;
  }
  /// Every request's from-disk path took shareable_tokens of its prompt from the loaded state
  /// and ran only the rest (false where the policy had to reset, e.g. a window that evicted it).
  [[nodiscard]] bool reused_system_prompt() const noexcept {
    bool all = !rows.empty();
    for (const DiskRequestRow& r : rows) {
      all = all && r.prompt_tokens - r.disk_computed == shareable_tokens;
    }
    return all;
  }
};

/// Process 2: loads the snapshot at `path` (saved by save_system_prompt with the same options
/// and model) into a fresh cache, then serves o.requests requests of system prompt +
/// o.suffix_tokens tokens from `source` (a stream identical to process 1's: the system prompt is
/// taken from it first). Each request runs on the loaded state and again from scratch in a fresh
/// cache (the whole prompt prefilled), and the two replies are compared token for token. On the
/// loaded state: a TokenTrackedCache keeps the system prompt and crops the previous request
/// (reuse_prefix); the paged policy releases the loaded sequence, whose full blocks stay in its
/// prefix index, and each request's admit() finds them. The first request is served from disk
/// before anything is recomputed, so it pays what a fresh process pays.
/// O(requests x (system + suffix + reply) x model).
/// @throws as load_snapshot (snapshot_mismatch_error for another model or shape, io_error,
///         snapshot_format_error...) and Engine::forward.
inline ServeResult serve_from_snapshot(Engine& engine, PromptSource& source,
                                       const DiskPromptOptions& o,
                                       const std::filesystem::path& path,
                                       const kvcache::ModelId& model_id) {
  const std::vector<token_id> system = take_system_prompt(source, o.system_tokens);
  const CacheParams params = o.cache_params();
  return with_cache(o.cache, engine.model(), params, [&](auto& raw) {
    return detail::with_snapshot_cache(raw, [&](auto& cache) {
      constexpr bool kPrefixCache =
          kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(cache)>>;
      ServeResult result{.cache = std::string(cache_kind_name(o.cache))};
      const GenerateLimits limits{.max_new = o.reply_tokens};
      for (std::size_t r = 0; r < o.requests; ++r) {
        std::vector<token_id> prompt = system;
        const auto suffix = source.take(o.suffix_tokens);
        prompt.insert(prompt.end(), suffix.begin(), suffix.end());
        if (r == 0) {
          const double t0 = now_s();
          const kvcache::SnapshotInfo info = kvcache::load_snapshot(path, cache, model_id);
          result.load_s = now_s() - t0;
          result.file_bytes = info.file_bytes;
          result.system_tokens = cache.seq_length(0);
          const auto held = cache.tokens(0);
          result.holds_system_prompt =
              std::equal(held.begin(), held.end(), system.begin(), system.end());
          result.shareable_tokens = system.size();
          if constexpr (kPrefixCache) {
            const std::size_t bs = cache.stats().block_size;
            result.shareable_tokens = system.size() / bs * bs;
          }
        }
        if constexpr (kPrefixCache) cache.release(0);  // the previous request (or the load)
        Sampler disk_sampler(o.sampler), scratch_sampler(o.sampler);
        const Generation d = generate(engine, cache, 0, prompt, limits, disk_sampler);
        using Format = typename std::remove_cvref_t<decltype(raw)>::value_type;
        const Generation s =
            with_cache_as<Format>(o.cache, engine.model(), params, [&](auto& fresh_raw) {
              if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(fresh_raw)>>) {
                return generate(engine, fresh_raw, 0, prompt, limits, scratch_sampler);
              } else {
                kvcache::TokenTrackedCache fresh(std::move(fresh_raw));
                return generate(engine, fresh, 0, prompt, limits, scratch_sampler);
              }
            });
        result.rows.push_back({.prompt_tokens = prompt.size(),
                               .disk_computed = d.prompt_computed,
                               .ttft_disk_s = d.ttft_s,
                               .ttft_recompute_s = s.ttft_s,
                               .decode_disk_tps = d.decode_tokens_per_s(),
                               .decode_recompute_tps = s.decode_tokens_per_s(),
                               .identical = d.tokens == s.tokens,
                               .reply = d.tokens});
      }
      if (o.other_model) {
        const auto before = cache.tokens(0);
        const std::vector<token_id> ids(before.begin(), before.end());
        const std::size_t length = cache.seq_length(0);
        try {
          (void)kvcache::load_snapshot(path, cache, *o.other_model);
        } catch (const kvcache::snapshot_mismatch_error& e) {
          const auto after = cache.tokens(0);
          result.other_model_refused =
              cache.seq_length(0) == length &&
              std::equal(after.begin(), after.end(), ids.begin(), ids.end());
          result.refusal = e.what();
        }
      }
      return result;
    });
  });
}

}  // namespace llama
