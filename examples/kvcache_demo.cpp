// SPDX-License-Identifier: Apache-2.0
// kvcache_demo: the example inference engine's command line. Runs a llama2.c checkpoint or an
// embedded synthetic Llama model through four KV-cache scenarios (or plain generation) and prints
// TTFT and decode speed with and without the cache, side by side, measured in the same run.
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#if __has_include(<unistd.h>)
#include <unistd.h>
#define KVCACHE_DEMO_HAS_ISATTY 1
#endif

extern char** environ;  // POSIX: the environment, passed on to the serving process

#include "kvcache/io/snapshot.hpp"
#include "kvcache/kvcache.hpp"
#include "llama/caches.hpp"
#include "llama/forward.hpp"
#include "llama/from_disk.hpp"
#include "llama/generate.hpp"
#include "llama/model.hpp"
#include "llama/sampler.hpp"
#include "llama/scenarios.hpp"
#include "llama/streaming.hpp"
#include "llama/tokenizer.hpp"

#ifndef KVCACHE_SHARED_DIR
#define KVCACHE_SHARED_DIR "../shared"
#endif

namespace {

using llama::token_id;
using llama::usage_error;

constexpr std::string_view kDefaultSpec = "8L-512d-8h-4kv-512ctx";

constexpr std::string_view kUsage = R"(usage: kvcache_demo [command] [options]

commands:
  demo             all four scenarios, one summary table (the default); the system prompt
                   also from disk and, like RAG, also with automatic prefix caching (paged)
  chat             1. multi-turn chat: cached turns append only their new tokens
  system-prompt    2. one system prompt in a StaticCache serving many requests
  system-prompt-disk
                   2b. the system prompt from disk: this process prefills it and saves a
                   snapshot, a second process loads it and serves the requests
  rag              3. many questions over one long cached document
  sliding          4. generation past the model's seq_len in a sliding window with sinks;
                   with stories260K (--stories), how coherent: perplexity four ways, and text
  generate         plain generation from --prompt or --tokens
  help             this text

model:
  --model PATH          llama2.c checkpoint (legacy version-0 .bin)
  --synthetic SPEC      embedded synthetic model (default {spec}); items
                        <n>L <n>d <n>h, optional <n>kv <n>ff <n>v <n>ctx tied,
                        e.g. 8L-1024d-16h-4kv
  --seed N              seed of the synthetic weights (default 1)
  --tokenizer PATH      llama2.c tokenizer (default: {tok} when it exists
                        and its vocabulary matches the model)
  --no-tokenizer        prompts and output as token ids

running:
  --cache KIND          dynamic | static | sliding | paged (default per scenario: chat
                        dynamic, system-prompt static, rag dynamic, generate dynamic).
                        paged: a block pool with automatic prefix caching; every request
                        submits its whole prompt and reuses what any earlier one cached
  --kv-format F          K/V storage of the cached scenarios: f32 (default) | f16 | bf16 |
                        int8 | fp8 (quantized: codes plus a scale per token and head, about
                        half of f16's memory) | f16+int8 (keys f16, values int8); the summary
                        shows each cache's memory. The sliding scenario keeps f32 (it checks
                        bits against an uncached pass)
  --threads N           threads for GEMMs and attention (default: all hardware threads)
  --chunk N             prefill chunk: tokens per batched forward pass (default 256)
  --window N --sinks N  sliding window and attention sinks (default 256 and 4)
  --positions MODE      sliding, generate: absolute (default) or cache-relative: window and
                        sinks at positions within the cache (StreamingLLM), which keeps a
                        model coherent past its training length
  --temperature T       0 = greedy (default); > 0 samples
  --top-p P             nucleus sampling threshold (default 0.9 when sampling)
  --sample-seed N       sampler seed (default 0)
  --verbose             demo: also print each scenario's own table

system-prompt-disk:
  --snapshot PATH       where process 1 saves the snapshot (kept; default: a temporary file,
                        removed at the end)
  --serve-from-snapshot PATH
                        be process 2 only: load PATH (saved with the same model and sizes)
                        and serve the requests

sliding (and the demo's scenario 4):
  --stories DIR         where stories260K.bin and tok512.bin are, for the quality half
                        (default {stories});
                        skipped, saying so, when they are absent

generate:
  --prompt TEXT         text prompt (needs a tokenizer)
  --tokens 1,403,407    prompt as token ids (BOS included if you want it)
  --steps N             tokens to generate, stopping early at BOS as run.c (default 256)

scenario sizes:
  chat:           --turns N (6) --user-tokens N (48) --reply-tokens N (6)
  system-prompt:  --requests N (4) --system-tokens N (384) --suffix-tokens N (32)
  paged:          --block-size N (16)
  ...-disk:       --requests N (3) --system-tokens N (384) --suffix-tokens N (32)
  rag:            --questions N (3) --doc-tokens N (1024) --suffix-tokens N (24)
  sliding:        --prompt-tokens N (64) --generate-tokens N (3 x seq_len) --checkpoints N (6)
  all:            --reply-tokens N
)";

struct Options {
  std::string command = "demo";
  std::optional<std::string> model_path;
  std::string spec = std::string(kDefaultSpec);
  std::uint64_t seed = 1;
  std::optional<std::string> tokenizer_path;
  bool no_tokenizer = false;
  std::optional<llama::CacheKind> cache;
  std::size_t threads = std::max(1u, std::thread::hardware_concurrency());
  std::size_t chunk = 256;
  std::size_t window = 256, sinks = 4;
  std::optional<kvcache::PositionMode> positions;
  std::optional<std::string> stories_dir;
  std::size_t block_size = 16;
  llama::KvFormat kv_format = kvcache::DType::f32;
  llama::SamplerConfig sampler{};
  bool top_p_given = false;
  std::optional<std::string> prompt;
  std::optional<std::vector<token_id>> tokens;
  std::size_t steps = 256;
  bool verbose = false;
  std::optional<std::string> snapshot, serve_from, report;
  /// The arguments after the command, as given (passed on to the serving process).
  std::vector<std::string> args;
  std::optional<std::size_t> turns, user_tokens, reply_tokens, requests, system_tokens,
      suffix_tokens, questions, doc_tokens, prompt_tokens, generate_tokens, checkpoints;
};

std::size_t parse_count(std::string_view flag, std::string_view v, std::size_t lo = 1) {
  std::size_t n = 0;
  bool ok = !v.empty() && v.size() <= 9;
  for (char c : v) {
    ok = ok && c >= '0' && c <= '9';
    n = n * 10 + static_cast<std::size_t>(c - '0');
  }
  if (!ok || n < lo) {
    throw usage_error(fmt::format("{} {}: expected an integer >= {}", flag, v, lo));
  }
  return n;
}

float parse_float(std::string_view flag, const std::string& v) {
  char* end = nullptr;
  const float f = std::strtof(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size()) {
    throw usage_error(fmt::format("{} {}: expected a number", flag, v));
  }
  return f;
}

std::vector<token_id> parse_tokens(const std::string& v) {
  std::vector<token_id> ids;
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t comma = std::min(v.find(',', start), v.size());
    ids.push_back(static_cast<token_id>(
        parse_count("--tokens", std::string_view(v).substr(start, comma - start), 0)));
    start = comma + 1;
  }
  return ids;
}

Options parse_args(int argc, char** argv) {
  Options o;
  int i = 1;
  if (i < argc && argv[i][0] != '-') o.command = argv[i++];
  o.args.assign(argv + i, argv + argc);
  auto value = [&](std::string_view flag) -> std::string {
    if (i + 1 >= argc) throw usage_error(fmt::format("{} needs a value", flag));
    return argv[++i];
  };
  for (; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--model") {
      o.model_path = value(a);
    } else if (a == "--synthetic") {
      o.spec = value(a);
    } else if (a == "--seed") {
      o.seed = parse_count(a, value(a), 0);
    } else if (a == "--tokenizer") {
      o.tokenizer_path = value(a);
    } else if (a == "--no-tokenizer") {
      o.no_tokenizer = true;
    } else if (a == "--cache") {
      o.cache = llama::parse_cache_kind(value(a));
    } else if (a == "--kv-format") {
      o.kv_format = llama::parse_kv_format(value(a));
    } else if (a == "--threads") {
      o.threads = parse_count(a, value(a));
    } else if (a == "--chunk") {
      o.chunk = parse_count(a, value(a));
    } else if (a == "--window") {
      o.window = parse_count(a, value(a));
    } else if (a == "--sinks") {
      o.sinks = parse_count(a, value(a), 0);
    } else if (a == "--positions") {
      const std::string mode = value(a);
      if (mode != "absolute" && mode != "cache-relative") {
        throw usage_error(fmt::format("--positions {}: expected absolute or cache-relative", mode));
      }
      o.positions = mode == "absolute" ? kvcache::PositionMode::absolute
                                       : kvcache::PositionMode::cache_relative;
    } else if (a == "--stories") {
      o.stories_dir = value(a);
    } else if (a == "--block-size") {
      o.block_size = parse_count(a, value(a));
    } else if (a == "--temperature") {
      o.sampler.temperature = parse_float(a, value(a));
    } else if (a == "--top-p") {
      o.sampler.top_p = parse_float(a, value(a));
      o.top_p_given = true;
    } else if (a == "--sample-seed") {
      o.sampler.seed = parse_count(a, value(a), 0);
    } else if (a == "--prompt") {
      o.prompt = value(a);
    } else if (a == "--tokens") {
      o.tokens = parse_tokens(value(a));
    } else if (a == "--steps") {
      o.steps = parse_count(a, value(a));
    } else if (a == "--turns") {
      o.turns = parse_count(a, value(a));
    } else if (a == "--user-tokens") {
      o.user_tokens = parse_count(a, value(a));
    } else if (a == "--reply-tokens") {
      o.reply_tokens = parse_count(a, value(a));
    } else if (a == "--requests") {
      o.requests = parse_count(a, value(a));
    } else if (a == "--system-tokens") {
      o.system_tokens = parse_count(a, value(a));
    } else if (a == "--suffix-tokens") {
      o.suffix_tokens = parse_count(a, value(a));
    } else if (a == "--questions") {
      o.questions = parse_count(a, value(a));
    } else if (a == "--doc-tokens") {
      o.doc_tokens = parse_count(a, value(a));
    } else if (a == "--prompt-tokens") {
      o.prompt_tokens = parse_count(a, value(a));
    } else if (a == "--generate-tokens") {
      o.generate_tokens = parse_count(a, value(a));
    } else if (a == "--checkpoints") {
      o.checkpoints = parse_count(a, value(a));
    } else if (a == "--snapshot") {
      o.snapshot = value(a);
    } else if (a == "--serve-from-snapshot") {
      o.serve_from = value(a);
    } else if (a == "--report") {  // internal: process 2 writes its summary row there
      o.report = value(a);
    } else if (a == "--verbose" || a == "-v") {
      o.verbose = true;
    } else if (a == "--help" || a == "-h") {
      o.command = "help";
    } else {
      throw usage_error(fmt::format("unknown option {} (see kvcache_demo help)", a));
    }
  }
  if (o.sampler.temperature > 0 && !o.top_p_given) o.sampler.top_p = 0.9f;
  return o;
}

/// A status line on stderr, rewritten in place on a terminal.
class ProgressLine {
 public:
  ProgressLine() {
#ifdef KVCACHE_DEMO_HAS_ISATTY
    tty_ = isatty(2) != 0;
#endif
  }
  void show(const std::string& stage, const std::string& what) {
    if (tty_) {
      fmt::print(stderr, "\r\033[K  {} {}", stage, what);
    } else {
      fmt::print(stderr, "  {} {}\n", stage, what);
    }
    std::fflush(stderr);
  }
  void clear() {
    if (tty_) fmt::print(stderr, "\r\033[K");
    std::fflush(stderr);
  }
  llama::Progress for_stage(std::string stage) {
    return [this, stage](const std::string& what) { show(stage, what); };
  }

 private:
  bool tty_ = false;
};

std::string ms(double s) { return fmt::format("{:.1f} ms", s * 1e3); }
std::string tps(double t) { return t > 0 ? fmt::format("{:.1f}", t) : std::string("-"); }
std::string mib(std::size_t b) {
  return fmt::format("{:.2f} MiB", static_cast<double>(b) / 1048576.0);
}

double mean(const std::vector<llama::RequestRow>& rows, double llama::RequestRow::*field) {
  double s = 0;
  for (const auto& r : rows) s += r.*field;
  return rows.empty() ? 0 : s / static_cast<double>(rows.size());
}

struct Context {
  Options opt;
  std::unique_ptr<kvcache::ThreadPool> pool;
  std::unique_ptr<llama::Model> model;
  std::optional<llama::Tokenizer> tokenizer;
  std::unique_ptr<llama::Engine> engine;
  std::string model_name;
  /// What snapshots are keyed by: the weights file's fingerprint or the synthetic spec + seed;
  /// and the id of another model that a snapshot must be refused for (a synthetic model of the
  /// same shape; for a synthetic model, the one with the next seed).
  kvcache::ModelId model_id, other_model_id;
  std::string other_model_name;
  ProgressLine progress;

  [[nodiscard]] const llama::Tokenizer* tok() const { return tokenizer ? &*tokenizer : nullptr; }
  /// The summary's name of a cache: its policy, and its K/V format unless f32.
  [[nodiscard]] std::string cache_label(const std::string& policy) const {
    return opt.kv_format == kvcache::DType::f32 ? policy : policy + "/" + opt.kv_format.name();
  }
  [[nodiscard]] llama::CacheParams cache_params() const {
    return {.format = opt.kv_format,
            .window = opt.window,
            .num_sink_tokens = opt.sinks,
            .max_append_len = std::min<std::size_t>(opt.chunk, 64),
            .block_size = opt.block_size};
  }
  [[nodiscard]] std::string show(std::span<const token_id> ids, std::size_t max_ids = 24) const {
    if (tokenizer) {
      std::string s = llama::Tokenizer::printable(tokenizer->decode(ids, -1));
      for (char& c : s) c = c == '\n' ? ' ' : c;
      return "\"" + s + "\"";
    }
    std::string s;
    for (std::size_t i = 0; i < ids.size() && i < max_ids; ++i) {
      s += (i ? "," : "") + std::to_string(ids[i]);
    }
    return ids.size() > max_ids ? s + ",..." : s;
  }
};

void load(Context& ctx) {
  Options& o = ctx.opt;
  ctx.pool = std::make_unique<kvcache::ThreadPool>(o.threads);
  const double t0 = llama::now_s();
  if (o.model_path) {
    ctx.progress.show("loading", *o.model_path);
    const llama::Checkpoint ckpt = llama::load_llama2c(*o.model_path);
    ctx.model = std::make_unique<llama::Model>(llama::Model::from_checkpoint(ckpt, ctx.pool.get()));
    ctx.model_name = std::filesystem::path(*o.model_path).filename().string();
    ctx.model_id = kvcache::model_id_of_file(*o.model_path);
    ctx.other_model_id = llama::synthetic_model_id(ckpt.config, o.seed);
    ctx.other_model_name = "a synthetic model of the same shape";
  } else {
    const llama::ModelConfig config = llama::parse_synthetic_spec(o.spec);
    ctx.progress.show("building", "synthetic model " + llama::synthetic_spec(config));
    ctx.model =
        std::make_unique<llama::Model>(llama::Model::synthetic(config, o.seed, ctx.pool.get()));
    ctx.model_name =
        "synthetic " + llama::synthetic_spec(config) + " (seed " + std::to_string(o.seed) + ")";
    ctx.model_id = llama::synthetic_model_id(config, o.seed);
    ctx.other_model_id = llama::synthetic_model_id(config, o.seed + 1);
    ctx.other_model_name = "the same synthetic shape with seed " + std::to_string(o.seed + 1);
  }
  const double load_s = llama::now_s() - t0;
  ctx.progress.clear();
  const auto& c = ctx.model->config();
  if (!o.no_tokenizer) {
    const std::filesystem::path path =
        o.tokenizer_path
            ? std::filesystem::path(*o.tokenizer_path)
            : std::filesystem::path(KVCACHE_SHARED_DIR) / "models/stories260K/tok512.bin";
    std::error_code ec;
    if (o.tokenizer_path || std::filesystem::exists(path, ec)) {
      auto tok = llama::Tokenizer::load(path);
      if (tok.vocab_size() == c.vocab_size) {
        ctx.tokenizer = std::move(tok);
      } else if (o.tokenizer_path) {
        throw usage_error(fmt::format("--tokenizer {}: {} tokens but the model has vocab_size {}",
                                      path.string(), tok.vocab_size(), c.vocab_size));
      }
    }
  }
  ctx.engine = std::make_unique<llama::Engine>(*ctx.model, ctx.pool.get(), o.chunk);
  if (o.report) return;  // process 2 of system-prompt-disk: process 1 printed all this
  fmt::print("model      {}\n", ctx.model_name);
  fmt::print(
      "           dim {}, hidden {}, {} layers, {} heads / {} KV heads (head_dim {}), "
      "vocab {}, seq_len {}, {:.1f} MiB of weights, ready in {:.2f} s\n",
      c.dim, c.hidden_dim, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim(), c.vocab_size,
      c.seq_len, static_cast<double>(ctx.model->weight_bytes()) / 1048576.0, load_s);
  fmt::print("tokens     {}\n", ctx.tokenizer ? "text (llama2.c tokenizer, " +
                                                    std::to_string(c.vocab_size) + " tokens)"
                                              : std::string("token ids (no matching tokenizer)"));
  fmt::print("threads    {}, prefill chunk {}, {} sampling\n\n", o.threads, o.chunk,
             o.sampler.temperature == 0
                 ? std::string("greedy")
                 : fmt::format("temperature {} top-p {} seed {}", o.sampler.temperature,
                               o.sampler.top_p, o.sampler.seed));
}

// ------------------------------------------------------------------------------------------
// Scenario runners: each returns its row of the summary table (plus a few lines of notes) and,
// when `details` is set, first prints its own table.

struct SummaryRow {
  std::string scenario, cache;
  std::size_t cache_bytes = 0;  ///< the scenario's cache memory_bytes() at the end (0: none)
  double ttft_cached = 0, ttft_uncached = 0, decode_cached = 0, decode_uncached = 0;
  std::string check;
  bool ok = true;
  std::vector<std::string> notes = {};
  /// False where both ways run the same prefill, so TTFT has no speedup to show ("-").
  bool ttft_speedup = true;
};

std::string series_ms(const std::vector<llama::RequestRow>& rows,
                      double llama::RequestRow::*field) {
  std::string s;
  for (const auto& r : rows) s += fmt::format("{:>7.1f}", r.*field * 1e3);
  return s;
}

/// Hit rate and block sharing of a paged run (RequestsResult::prefix_stats set).
std::string prefix_cache_note(const llama::RequestsResult& r) {
  const kvcache::PrefixCacheStats& st = *r.prefix_stats;
  return fmt::format(
      "hit rate {:.0f}% ({} of {} prompt tokens found cached); {}-token blocks: {} in use "
      "(without sharing {}), {} cached, {} free of {}",
      100 * st.hit_rate(), st.reused_tokens, st.prompt_tokens, st.block_size, st.blocks_used,
      r.blocks_unshared, st.blocks_cached, st.blocks_free, st.blocks_total);
}

void print_requests(const Context& ctx, const char* label, const llama::RequestsResult& r) {
  fmt::print("{:>4} {:>8} {:>9} {:>11} {:>13} {:>9} {:>12} {:>11}  {}\n", label, "prompt",
             "computed", "TTFT cached", "TTFT uncached", "speedup", "tok/s cached", "uncached",
             "same tokens");
  for (std::size_t i = 0; i < r.rows.size(); ++i) {
    const auto& row = r.rows[i];
    fmt::print("{:>4} {:>8} {:>9} {:>11} {:>13} {:>8.1f}x {:>12} {:>11}  {}\n", i + 1,
               row.prompt_tokens, row.cached_computed, ms(row.ttft_cached_s),
               ms(row.ttft_uncached_s), row.ttft_uncached_s / row.ttft_cached_s,
               tps(row.decode_cached_tps), tps(row.decode_uncached_tps),
               row.identical ? "yes" : "NO");
  }
  fmt::print("     first reply: {}\n", ctx.show(r.rows.front().reply));
  if (r.prefix_stats) {
    fmt::print("     prefix cache: {}\n", prefix_cache_note(r));
  }
  fmt::print("     cache memory after the last request: {}\n\n", mib(r.rows.back().cache_bytes));
}

template <class Rows, class Pred>
std::size_t count(const Rows& rows, Pred pred) {
  return static_cast<std::size_t>(std::count_if(rows.begin(), rows.end(), pred));
}

SummaryRow chat(Context& ctx, const std::string& stage, bool details) {
  const Options& o = ctx.opt;
  const llama::ChatOptions co{.turns = o.turns.value_or(6),
                              .user_tokens = o.user_tokens.value_or(48),
                              .reply_tokens = o.reply_tokens.value_or(6),
                              .cache = o.cache.value_or(llama::CacheKind::dynamic),
                              .params = ctx.cache_params(),
                              .sampler = o.sampler};
  llama::PromptSource source(ctx.tok(), ctx.model->config().vocab_size, 11);
  const auto r = llama::run_chat(*ctx.engine, source, co, ctx.progress.for_stage(stage));
  ctx.progress.clear();
  if (details) {
    fmt::print("1. multi-turn chat: {} turns of {} user + {} reply tokens, {} cache\n", co.turns,
               co.user_tokens, co.reply_tokens, r.cache);
    fmt::print(
        "   cached: each turn runs only its new tokens; uncached: the whole history again\n");
    print_requests(ctx, "turn", r);
  }
  const auto& last = r.rows.back();
  SummaryRow row{
      .scenario = fmt::format("1 chat, turn {} of {}", r.rows.size(), r.rows.size()),
      .cache = ctx.cache_label(r.cache),
      .cache_bytes = last.cache_bytes,
      .ttft_cached = last.ttft_cached_s,
      .ttft_uncached = last.ttft_uncached_s,
      .decode_cached = last.decode_cached_tps,
      .decode_uncached = last.decode_uncached_tps,
      .check = fmt::format("{} of {} turns: same tokens",
                           count(r.rows, [](const auto& x) { return x.identical; }), r.rows.size()),
      .ok = r.all_identical(),
      .notes = {fmt::format("chat TTFT per turn, cached   (ms):{}",
                            series_ms(r.rows, &llama::RequestRow::ttft_cached_s)),
                fmt::format("chat TTFT per turn, uncached (ms):{}",
                            series_ms(r.rows, &llama::RequestRow::ttft_uncached_s))}};
  if (r.prefix_stats) row.notes.push_back("chat prefix cache: " + prefix_cache_note(r));
  return row;
}

std::string prefix_note(const char* what, const llama::RequestsResult& r, std::size_t suffix) {
  const bool reused = std::all_of(r.rows.begin(), r.rows.end(),
                                  [&](const auto& row) { return row.cached_computed == suffix; });
  return reused ? fmt::format(
                      "{} of {} tokens prefilled once ({}), never recomputed: each request "
                      "ran only its {} new tokens",
                      what, r.prefix_tokens, ms(r.prefix_s), suffix)
                : fmt::format(
                      "{} of {} tokens prefilled once ({}); the cache could not keep it "
                      "for every request (see the computed column)",
                      what, r.prefix_tokens, ms(r.prefix_s));
}

/// Scenarios 2 and 3 on `cache` (the scenario's default, or --cache). The paged policy serves
/// them by automatic prefix caching: nothing is prefilled up front, every request submits its
/// whole prompt; its row's TTFT is the mean over the requests after the first, which find the
/// shared prefix cached (the first computes it, and its TTFT goes to the notes).
SummaryRow shared_prefix(Context& ctx, const std::string& stage, bool rag, bool details,
                         std::optional<llama::CacheKind> cache = std::nullopt) {
  const Options& o = ctx.opt;
  const llama::SharedPrefixOptions so{
      .prefix_tokens = rag ? o.doc_tokens.value_or(1024) : o.system_tokens.value_or(384),
      .requests = rag ? o.questions.value_or(3) : o.requests.value_or(4),
      .suffix_tokens = o.suffix_tokens.value_or(rag ? 24 : 32),
      .reply_tokens = o.reply_tokens.value_or(6),
      .cache = cache.value_or(
          o.cache.value_or(rag ? llama::CacheKind::dynamic : llama::CacheKind::static_cache)),
      .params = ctx.cache_params(),
      .sampler = o.sampler};
  const bool automatic = so.cache == llama::CacheKind::paged;
  llama::PromptSource source(ctx.tok(), ctx.model->config().vocab_size, rag ? 33 : 22);
  const auto r = llama::run_shared_prefix(*ctx.engine, source, so, ctx.progress.for_stage(stage));
  ctx.progress.clear();
  const char* what = rag ? "answers" : "requests";
  if (details) {
    if (rag) {
      fmt::print(
          "3. long-document RAG: a {}-token document{}, {} questions of {} tokens, {} cache\n",
          r.prefix_tokens, automatic ? "" : " cached once", so.requests, so.suffix_tokens, r.cache);
      fmt::print("   every answer checked against a from-scratch run of document + question\n");
    } else {
      fmt::print("2. fixed system prompt: {} tokens{}, {} requests of {} user tokens, {} cache\n",
                 r.prefix_tokens, automatic ? "" : " cached once", so.requests, so.suffix_tokens,
                 r.cache);
      fmt::print("   {}\n", automatic ? "each request submits its whole prompt; automatic prefix "
                                        "caching finds the system prompt's blocks"
                                      : "each request starts from the system prompt's K/V (the "
                                        "previous request is cropped away)");
    }
    print_requests(ctx, rag ? "q" : "req", r);
  }
  // The paged row averages the requests that found the prefix cached.
  const std::vector<llama::RequestRow> hits =
      automatic && r.rows.size() > 1
          ? std::vector<llama::RequestRow>(r.rows.begin() + 1, r.rows.end())
          : r.rows;
  SummaryRow row{
      .scenario = automatic ? (rag ? "3b RAG, prefix hits, mean" : "2c system, prefix hits, mean")
                            : (rag ? "3 RAG, mean per question" : "2 system prompt, mean/request"),
      .cache = ctx.cache_label(r.cache),
      .cache_bytes = r.rows.back().cache_bytes,
      .ttft_cached = mean(hits, &llama::RequestRow::ttft_cached_s),
      .ttft_uncached = mean(hits, &llama::RequestRow::ttft_uncached_s),
      .decode_cached = mean(hits, &llama::RequestRow::decode_cached_tps),
      .decode_uncached = mean(hits, &llama::RequestRow::decode_uncached_tps),
      .check = fmt::format("{} of {} {} = from scratch",
                           count(r.rows, [](const auto& x) { return x.identical; }), r.rows.size(),
                           what),
      .ok = r.all_identical()};
  if (!automatic) {
    row.notes = {prefix_note(rag ? "document" : "system prompt", r, so.suffix_tokens)};
  } else {
    // A later request finds every full block of the prefix (a partly filled last block holds
    // the first request's own tokens too, so it is computed again).
    const std::size_t bs = r.prefix_stats->block_size;
    const std::size_t shared = r.prefix_tokens / bs * bs;
    const auto& first = r.rows.front();
    const bool hits_ok = std::all_of(hits.begin(), hits.end(), [&](const auto& x) {
      return x.prompt_tokens - x.cached_computed == shared;
    });
    row.check += fmt::format("; hit rate {:.0f}%", 100 * r.prefix_stats->hit_rate());
    row.ok = row.ok && hits_ok;
    row.notes = {
        fmt::format(
            "{} with automatic prefix caching (paged): the 1st request computed its {} "
            "tokens (TTFT {}); {} found the {}-token prefix's {} full blocks cached{}",
            rag ? "RAG" : "system prompt", first.cached_computed, ms(first.ttft_cached_s),
            r.rows.size() > 1 ? "each later one" : "no later one", r.prefix_tokens, shared / bs,
            hits_ok
                ? fmt::format(" and ran only its other {} tokens", r.rows.back().cached_computed)
                : std::string(": NOT every later one")),
        "  " + prefix_cache_note(r)};
  }
  return row;
}

// 2b. The system prompt from disk: process 1 (this one) prefills it and saves the snapshot,
// process 2 (this program again, --serve-from-snapshot) loads it and serves the requests, and
// hands its summary row back in a small report file ("key value" lines).

/// A new directory under the system temp dir (mkdtemp), removed with its contents at the end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string name = (std::filesystem::temp_directory_path() / "kvcache-demo-XXXXXX").string();
    if (::mkdtemp(name.data()) == nullptr) {
      throw kvcache::io_error(fmt::format("mkdtemp '{}'", name), errno);
    }
    path_ = name;
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// The same system prompt as scenario 2 (the prompt stream's seed).
constexpr std::uint64_t kSystemPromptSeed = 22;

llama::DiskPromptOptions disk_options(const Context& ctx) {
  const Options& o = ctx.opt;
  return {.system_tokens = o.system_tokens.value_or(384),
          .requests = o.requests.value_or(3),
          .suffix_tokens = o.suffix_tokens.value_or(32),
          .reply_tokens = o.reply_tokens.value_or(6),
          .cache = o.cache.value_or(llama::CacheKind::static_cache),
          .params = ctx.cache_params(),
          .sampler = o.sampler,
          .other_model = ctx.other_model_id};
}

/// Process 2: loads the snapshot at `path` and serves the requests, each checked against a
/// from-scratch run. Its row: the first request's TTFT (load + suffix prefill) against
/// recomputing system prompt + suffix in a fresh cache.
SummaryRow serve_from_snapshot(Context& ctx, const std::filesystem::path& path, bool details) {
  const llama::DiskPromptOptions o = disk_options(ctx);
  llama::PromptSource source(ctx.tok(), ctx.model->config().vocab_size, kSystemPromptSeed);
  ctx.progress.show("  process 2",
                    fmt::format("loads {}, serves {} requests", path.string(), o.requests));
  const llama::ServeResult r =
      llama::serve_from_snapshot(*ctx.engine, source, o, path, ctx.model_id);
  ctx.progress.clear();
  const auto& first = r.rows.front();
  if (details) {
    fmt::print("   process 2 (pid {}): loaded {} positions ({}, {} cache) in {}{}\n", ::getpid(),
               r.system_tokens, mib(r.file_bytes), r.cache, ms(r.load_s),
               r.holds_system_prompt ? "" : "; it does NOT hold this system prompt");
    fmt::print("{:>4} {:>7} {:>9} {:>15} {:>15} {:>8} {:>11} {:>10}  {}\n", "req", "prompt",
               "computed", "TTFT from disk", "TTFT recompute", "speedup", "tok/s disk", "recompute",
               "same tokens");
    for (std::size_t i = 0; i < r.rows.size(); ++i) {
      const auto& row = r.rows[i];
      const double disk = i == 0 ? r.first_ttft_s() : row.ttft_disk_s;
      fmt::print("{:>4} {:>7} {:>9} {:>15} {:>15} {:>7.1f}x {:>11} {:>10}  {}\n", i + 1,
                 row.prompt_tokens, row.disk_computed, ms(disk), ms(row.ttft_recompute_s),
                 row.ttft_recompute_s / disk, tps(row.decode_disk_tps),
                 tps(row.decode_recompute_tps), row.identical ? "yes" : "NO");
    }
    fmt::print(
        "     request 1 from disk = load {} + prefill of its {} new tokens {}; later requests "
        "reuse the loaded K/V in memory\n",
        ms(r.load_s), first.disk_computed, ms(first.ttft_disk_s));
    fmt::print("     first reply: {}\n", ctx.show(first.reply));
    fmt::print("     a process with another model ({}) is refused: {}\n\n", ctx.other_model_name,
               r.other_model_refused ? r.refusal : std::string("NOT REFUSED"));
  }
  const std::size_t same = count(r.rows, [](const auto& x) { return x.identical; });
  return {.scenario = "2b from disk, 1st request",
          .cache = ctx.cache_label(r.cache),
          .ttft_cached = r.first_ttft_s(),
          .ttft_uncached = first.ttft_recompute_s,
          .decode_cached = first.decode_disk_tps,
          .decode_uncached = first.decode_recompute_tps,
          .check = fmt::format("{} of {} requests = from scratch{}", same, r.rows.size(),
                               r.other_model_refused ? "; other model refused" : ""),
          .ok = r.ok(o),
          .notes = {fmt::format("from disk: process 2 (pid {}) loaded the {}-token system prompt "
                                "({}) in {}; {}",
                                ::getpid(), r.system_tokens, mib(r.file_bytes), ms(r.load_s),
                                r.reused_system_prompt()
                                    ? fmt::format("each request took {} of its tokens from it "
                                                  "and ran only its other {}",
                                                  r.shareable_tokens, first.disk_computed)
                                    : std::string("the cache could not keep it for every request "
                                                  "(see the computed column)")),
                    std::string("  2b's uncached columns: process 2 recomputes system prompt + "
                                "request in a fresh cache (what it does without the snapshot), "
                                "then decodes with that cache"),
                    fmt::format("  a process with {} is refused: {}", ctx.other_model_name,
                                r.other_model_refused ? r.refusal : std::string("NOT REFUSED"))}};
}

void write_report(const std::filesystem::path& path, const SummaryRow& row) {
  std::ofstream out(path);
  out << fmt::format("ttft_cached {:.9g}\nttft_uncached {:.9g}\n", row.ttft_cached,
                     row.ttft_uncached)
      << fmt::format("decode_cached {:.9g}\ndecode_uncached {:.9g}\n", row.decode_cached,
                     row.decode_uncached)
      << "ok " << (row.ok ? 1 : 0) << "\ncache " << row.cache << "\ncheck " << row.check << "\n";
  for (const auto& n : row.notes) out << "note " << n << "\n";
  if (!out.flush())
    throw kvcache::error(fmt::format("cannot write the report '{}'", path.string()));
}

/// The row process 2 wrote; nullopt when it wrote none.
std::optional<SummaryRow> read_report(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  SummaryRow row;
  std::string line;
  bool complete = false;
  while (std::getline(in, line)) {
    const std::size_t space = std::min(line.find(' '), line.size());
    const std::string key = line.substr(0, space);
    const std::string value = space < line.size() ? line.substr(space + 1) : std::string();
    if (key == "ttft_cached") row.ttft_cached = std::strtod(value.c_str(), nullptr);
    if (key == "ttft_uncached") row.ttft_uncached = std::strtod(value.c_str(), nullptr);
    if (key == "decode_cached") row.decode_cached = std::strtod(value.c_str(), nullptr);
    if (key == "decode_uncached") row.decode_uncached = std::strtod(value.c_str(), nullptr);
    if (key == "ok") row.ok = value == "1";
    if (key == "cache") row.cache = value;
    if (key == "check") row.check = value, complete = true;
    if (key == "note") row.notes.push_back(value);
  }
  if (!complete) return std::nullopt;
  return row;
}

/// Runs `args` (args[0] an executable path) as a child process with this environment and waits
/// for it. @return its waitpid status. @throws kvcache::io_error when it cannot be started.
int run_process(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (const int err = ::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ)) {
    throw kvcache::io_error(fmt::format("posix_spawn '{}'", args[0]), err);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw kvcache::io_error("waitpid", errno);
  }
  return status;
}

/// Process 1: prefills the system prompt, saves the snapshot, starts process 2 on it and
/// returns process 2's row (with process 1's figures in its notes).
SummaryRow system_prompt_disk(Context& ctx, const std::string& stage, bool details) {
  const llama::DiskPromptOptions o = disk_options(ctx);
  const ScratchDir dir;
  const std::filesystem::path path =
      ctx.opt.snapshot ? std::filesystem::path(*ctx.opt.snapshot) : dir.path() / "system.kvs";
  llama::PromptSource source(ctx.tok(), ctx.model->config().vocab_size, kSystemPromptSeed);
  ctx.progress.show(stage, "process 1: prefill of the system prompt, save");
  const llama::SavedSystemPrompt saved =
      llama::save_system_prompt(*ctx.engine, source, o, path, ctx.model_id);
  ctx.progress.show(stage, "process 2: load of the snapshot, requests");
  const std::string p1 = fmt::format(
      "from disk: process 1 (pid {}) prefilled the {}-token system prompt in {} and saved it "
      "({}) in {} to {}",
      ::getpid(), saved.tokens, ms(saved.prefill_s), mib(saved.file_bytes), ms(saved.save_s),
      ctx.opt.snapshot ? path.string() : std::string("a temporary file"));
  if (details) {
    ctx.progress.clear();
    fmt::print(
        "2b. system prompt from disk: {} tokens saved by process 1, {} requests of {} user "
        "tokens served by process 2, {} cache\n",
        saved.tokens, o.requests, o.suffix_tokens, llama::cache_kind_name(o.cache));
    fmt::print("   process 1 (pid {}): prefilled the system prompt in {}, saved {} to {} in {}\n",
               ::getpid(), ms(saved.prefill_s), mib(saved.file_bytes), path.string(),
               ms(saved.save_s));
  }
  std::fflush(stdout);

  const std::filesystem::path report = dir.path() / "process-2.report";
  std::vector<std::string> args{std::filesystem::read_symlink("/proc/self/exe").string(),
                                "system-prompt-disk"};
  for (std::size_t i = 0; i < ctx.opt.args.size(); ++i) {
    const std::string& a = ctx.opt.args[i];
    if (a == "--snapshot" || a == "--serve-from-snapshot" || a == "--report") {
      ++i;  // and its value
    } else {
      args.push_back(a);
    }
  }
  if (details) args.emplace_back("--verbose");
  for (const std::string& a : {std::string("--serve-from-snapshot"), path.string(),
                               std::string("--report"), report.string()}) {
    args.push_back(a);
  }
  const int status = run_process(args);
  ctx.progress.clear();
  std::optional<SummaryRow> row = read_report(report);
  if (!row) {
    throw kvcache::error(fmt::format("process 2 ({}) wrote no report; {}", args[0],
                                     WIFEXITED(status)
                                         ? fmt::format("exit status {}", WEXITSTATUS(status))
                                         : fmt::format("signal {}", WTERMSIG(status))));
  }
  row->scenario = "2b from disk, 1st request";
  row->notes.insert(row->notes.begin(), p1);
  row->ok = row->ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return *row;
}

std::string positions_name(kvcache::PositionMode mode) {
  return mode == kvcache::PositionMode::absolute ? "absolute" : "cache-relative";
}

/// Scenario 4's quality half: stories260K (trained on 512 tokens) scores a stream of stories it
/// sampled itself, past its training length, four ways (llama/streaming.hpp), and then starts a
/// new story in the sliding window at absolute and at cache-relative positions. Its lines go to
/// the notes; one line saying why when the model is not in --stories.
std::vector<std::string> sliding_quality(Context& ctx, const std::string& stage) {
  const Options& o = ctx.opt;
  const std::filesystem::path dir =
      std::filesystem::path(o.stories_dir.value_or(KVCACHE_SHARED_DIR "/models/stories260K"))
          .lexically_normal();
  std::error_code ec;
  if (!std::filesystem::exists(dir / "stories260K.bin", ec) ||
      !std::filesystem::exists(dir / "tok512.bin", ec)) {
    return {
        fmt::format("sliding quality: skipped, no stories260K.bin and tok512.bin in {} "
                    "(--stories DIR)",
                    dir.string())};
  }
  const llama::Model model =
      llama::Model::from_checkpoint(llama::load_llama2c(dir / "stories260K.bin"));
  const llama::Tokenizer tok = llama::Tokenizer::load(dir / "tok512.bin");
  // One thread: a model this small decodes fastest without handing work to a pool.
  llama::Engine engine(model);
  const auto progress = ctx.progress.for_stage(stage + " stories260K:");
  constexpr std::size_t kContinuation = 40;  // tokens of text shown per position mode
  const llama::StreamingOptions so{
      .window = o.window, .num_sink_tokens = o.sinks, .continuation_tokens = kContinuation};
  const llama::StreamingResult r = llama::evaluate_streaming(engine, so, progress);
  const auto column = [&](double ppl) {
    return fmt::format("{:.2f} ({:.3f}x)", ppl, ppl / r.in_story);
  };
  const auto text = [&](const std::vector<token_id>& ids) {  // BOS, then the story
    std::string t = llama::Tokenizer::printable(tok.decode(std::span(ids).subspan(1)));
    for (char& ch : t) ch = ch == '\n' ? ' ' : ch;
    return "\"" + t + (ids.size() > kContinuation ? "...\"" : "\"");
  };
  return {
      fmt::format("sliding quality on stories260K (trained on {} tokens): a {}-token stream of {} "
                  "stories it sampled itself",
                  model.config().seq_len, r.stream_tokens, r.num_stories),
      fmt::format("  (seed {}, temperature {}), perplexity at positions {}..{}; window {} + {} "
                  "sinks; ratio to (a):",
                  so.sampler.seed, so.sampler.temperature, r.scored_from, r.stream_tokens - 1,
                  r.window, r.num_sink_tokens),
      fmt::format("  {:>22}  {:>26}  {:>22}  {:>28}", "(a) each story alone",
                  "(b) full cache, absolute", "(c) window, absolute", "(d) window, cache-relative"),
      fmt::format("  {:>22}  {:>26}  {:>22}  {:>28}", fmt::format("{:.2f}", r.in_story),
                  column(r.full_absolute), column(r.window_absolute), column(r.window_relative)),
      fmt::format("  (d) is {} of (a){}. A new story from position {} on, in the window:",
                  r.window_relative <= 1.10 * r.in_story ? "within 10%" : "NOT within 10%",
                  r.window_relative < r.window_absolute ? ", (c) far worse" : "", r.stream_tokens),
      fmt::format("    (c) absolute        {}", text(r.continuation_absolute)),
      fmt::format("    (d) cache-relative  {}", text(r.continuation_relative)),
      fmt::format("  ({:.1f} s on one thread. More text: kvcache_demo sliding --model {} "
                  "--positions cache-relative)",
                  r.seconds, (dir / "stories260K.bin").string())};
}

SummaryRow sliding(Context& ctx, const std::string& stage, bool details) {
  const Options& o = ctx.opt;
  if (o.cache && *o.cache != llama::CacheKind::sliding) {
    throw usage_error("the sliding scenario runs on --cache sliding only");
  }
  const auto& c = ctx.model->config();
  const llama::SlidingOptions so{.prompt_tokens = o.prompt_tokens.value_or(64),
                                 .generate_tokens = o.generate_tokens.value_or(3 * c.seq_len),
                                 .window = o.window,
                                 .num_sink_tokens = o.sinks,
                                 .max_append_len = std::min<std::size_t>(o.chunk, 64),
                                 .checkpoints = o.checkpoints.value_or(6),
                                 .positions = o.positions.value_or(kvcache::PositionMode::absolute),
                                 .sampler = o.sampler};
  llama::PromptSource source(ctx.tok(), c.vocab_size, 44);
  const auto r = llama::run_sliding(*ctx.engine, source, so, ctx.progress.for_stage(stage));
  ctx.progress.clear();
  if (details) {
    fmt::print(
        "4. sliding window: {} tokens generated after a {}-token prompt, model seq_len "
        "{}, window {} + {} sinks, {} positions\n",
        r.generated, so.prompt_tokens, r.seq_len, r.window, r.num_sink_tokens,
        positions_name(r.positions));
    fmt::print("   TTFT cached {}, uncached {}; decode {} tok/s cached\n", ms(r.ttft_cached_s),
               ms(r.ttft_uncached_s), tps(r.decode_cached_tps));
    fmt::print("{:>9} {:>14} {:>16} {:>15} {:>15}  {}\n", "position", "cache memory",
               "full KV would be", "uncached step", "uncached tok/s", "logits = from scratch");
    for (const auto& p : r.points) {
      const std::string same =
          p.identical ? "yes, bit for bit"
                      : fmt::format("NO: max |logit diff| {:.2g}, next token {}", p.max_logit_diff,
                                    p.argmax_match ? "the same" : "differs");
      fmt::print("{:>9} {:>14} {:>16} {:>15} {:>15}  {}\n", p.length, mib(p.memory_bytes),
                 mib(p.full_cache_bytes), ms(p.uncached_step_s), tps(1.0 / p.uncached_step_s),
                 same);
    }
    if (o.model_path) {  // a synthetic model's text is noise
      const std::size_t tail = std::min<std::size_t>(48, r.sequence.size());
      fmt::print("   its last {} tokens: {}\n", tail,
                 ctx.show(std::span(r.sequence).last(tail), tail));
    }
    fmt::print("\n");
  }
  const auto& first = r.points.front();
  const auto& last = r.points.back();
  std::string positions, full;
  for (const auto& p : r.points) {
    positions += fmt::format(" {}", p.length);
    full += fmt::format(" {:.1f}", static_cast<double>(p.full_cache_bytes) / 1048576.0);
  }
  const bool flat = std::all_of(r.points.begin(), r.points.end(), [&](const auto& p) {
    return p.memory_bytes == first.memory_bytes;
  });
  SummaryRow row{
      .scenario = fmt::format("4 sliding, to position {}", last.length),
      .cache = "sliding",
      .cache_bytes = first.memory_bytes,
      .ttft_cached = r.ttft_cached_s,
      .ttft_uncached = r.ttft_uncached_s,
      .decode_cached = r.decode_cached_tps,
      .decode_uncached = 1.0 / last.uncached_step_s,
      .check = fmt::format("{} of {} checkpoints: logits = from scratch; memory {}",
                           count(r.points, [](const auto& p) { return p.identical; }),
                           r.points.size(), flat ? "constant" : "NOT constant"),
      .ok = r.all_identical() && flat,
      .notes = {fmt::format("sliding: window {} + {} sinks, {} positions, model seq_len {}; "
                            "checkpoints at positions{}",
                            r.window, r.num_sink_tokens, positions_name(r.positions), r.seq_len,
                            positions),
                fmt::format("  both ways prefill the same {}-token prompt (TTFT alike, speedup "
                            "-); what the cache buys is decode, {} tok/s at any length against "
                            "{} uncached at position {}",
                            so.prompt_tokens, tps(r.decode_cached_tps),
                            tps(1.0 / last.uncached_step_s), last.length),
                fmt::format("  in constant memory: memory_bytes {} at every checkpoint; a full "
                            "cache would hold{} MiB",
                            mib(first.memory_bytes), full)},
      .ttft_speedup = false};
  const auto quality = sliding_quality(ctx, stage);
  ctx.progress.clear();
  row.notes.insert(row.notes.end(), quality.begin(), quality.end());
  return row;
}

void print_summary(const std::vector<SummaryRow>& rows) {
  std::size_t cache_width = 12;  // "dynamic/f16+int8" is wider
  for (const auto& r : rows) cache_width = std::max(cache_width, r.cache.size());
  fmt::print("{:<30} {:<{}} {:>10} {:>11} {:>13} {:>8} {:>12} {:>10}  {}\n", "scenario", "cache",
             cache_width, "K/V memory", "TTFT cached", "TTFT uncached", "speedup", "tok/s cached",
             "uncached", "check");
  fmt::print("{}\n", std::string(131 + cache_width, '-'));
  for (const auto& r : rows) {
    const std::string speedup =
        r.ttft_speedup ? fmt::format("{:.1f}x", r.ttft_uncached / r.ttft_cached) : std::string("-");
    const std::string memory = r.cache_bytes != 0 ? mib(r.cache_bytes) : std::string("-");
    fmt::print("{:<30} {:<{}} {:>10} {:>11} {:>13} {:>8} {:>12} {:>10}  {}{}\n", r.scenario,
               r.cache, cache_width, memory, ms(r.ttft_cached), ms(r.ttft_uncached), speedup,
               tps(r.decode_cached), tps(r.decode_uncached), r.ok ? "" : "FAILED: ", r.check);
  }
  fmt::print("\n");
  for (const auto& r : rows) {
    for (const auto& n : r.notes) fmt::print("{}\n", n);
  }
  fmt::print(
      "\nuncached = no KV cache: the prompt (or the whole chat history) is prefilled from "
      "scratch, and every decoded\ntoken runs the model over the whole sequence again. "
      "speedup = TTFT uncached / TTFT cached (-: the same\nprefill both ways); tok/s = decode. "
      "K/V memory = the cache's memory_bytes() at the end\n(--kv-format int8 or fp8: about half "
      "of f16's, f16+int8 three quarters; each uncached pass then holds its K/V in that format "
      "too, so the checks stay exact).\n");
}

int generate(Context& ctx) {
  const Options& o = ctx.opt;
  std::vector<token_id> prompt;
  if (o.tokens) {
    prompt = *o.tokens;
  } else if (o.prompt) {
    if (!ctx.tokenizer) {
      throw usage_error("--prompt needs a tokenizer matching the model; give --tokens instead");
    }
    prompt = ctx.tokenizer->encode(*o.prompt, true, false);
  } else {
    prompt = {llama::kBos};
  }
  const auto kind = o.cache.value_or(llama::CacheKind::dynamic);
  ctx.engine->set_positions(o.positions.value_or(kvcache::PositionMode::absolute));
  llama::CacheParams params = ctx.cache_params();
  params.max_seq_len = prompt.size() + o.steps;
  llama::Sampler sampler(o.sampler);
  const token_id stop[] = {llama::kBos};
  const llama::GenerateLimits limits{.max_new = o.steps, .stop = std::span<const token_id>(stop)};
  const auto g = llama::with_cache(kind, *ctx.model, params, [&](auto& raw) {
    if constexpr (kvcache::PrefixCacheConcept<std::remove_cvref_t<decltype(raw)>>) {
      return llama::generate(*ctx.engine, raw, 0, prompt, limits, sampler);
    } else {
      kvcache::TokenTrackedCache tracked(std::move(raw));
      return llama::generate(*ctx.engine, tracked, 0, prompt, limits, sampler);
    }
  });
  if (ctx.tokenizer) {
    std::string text;
    token_id prev = prompt.back();
    if (o.prompt) text = *o.prompt;
    for (token_id t : g.tokens) {
      text += ctx.tokenizer->decode(prev, t);
      prev = t;
    }
    fmt::print("{}\n", llama::Tokenizer::printable(text));
  } else {
    std::string ids;
    for (token_id t : g.tokens) ids += (ids.empty() ? "" : ",") + std::to_string(t);
    fmt::print("{}\n", ids);
  }
  fmt::print(stderr, "\n{} prompt tokens, {} generated ({} cache): TTFT {}, decode {} tok/s\n",
             prompt.size(), g.tokens.size(), llama::cache_kind_name(kind), ms(g.ttft_s),
             tps(g.decode_tokens_per_s()));
  return 0;
}

int run(int argc, char** argv) {
  Context ctx;
  ctx.opt = parse_args(argc, argv);
  const std::string& cmd = ctx.opt.command;
  if (cmd == "help") {
    fmt::print(fmt::runtime(kUsage), fmt::arg("spec", kDefaultSpec),
               fmt::arg("tok", KVCACHE_SHARED_DIR "/models/stories260K/tok512.bin"),
               fmt::arg("stories", KVCACHE_SHARED_DIR "/models/stories260K"));
    return 0;
  }
  if (cmd != "demo" && cmd != "chat" && cmd != "system-prompt" && cmd != "system-prompt-disk" &&
      cmd != "rag" && cmd != "sliding" && cmd != "generate") {
    throw usage_error(fmt::format("unknown command {} (see kvcache_demo help)", cmd));
  }
  if ((ctx.opt.snapshot && cmd != "demo" && cmd != "system-prompt-disk") ||
      ((ctx.opt.serve_from || ctx.opt.report) && cmd != "system-prompt-disk")) {
    throw usage_error("--snapshot and --serve-from-snapshot are options of system-prompt-disk");
  }
  if (ctx.opt.positions && cmd != "sliding" && cmd != "generate") {
    throw usage_error("--positions is an option of sliding and generate");
  }
  if (ctx.opt.stories_dir && cmd != "sliding" && cmd != "demo") {
    throw usage_error("--stories is an option of sliding and demo");
  }
  load(ctx);
  if (cmd == "generate") return generate(ctx);
  std::vector<SummaryRow> rows;
  const double t0 = llama::now_s();
  const bool details = cmd != "demo" || ctx.opt.verbose;
  if (cmd == "demo") {
    if (ctx.opt.cache) throw usage_error("demo picks the cache per scenario; drop --cache");
    fmt::print(stderr,
               "running the four scenarios (the system prompt also from disk, in a second "
               "process; system prompt and RAG also with automatic prefix caching), each cached "
               "and uncached and checked token for token...\n");
    rows.push_back(chat(ctx, "[1/7 chat]", details));
    rows.push_back(shared_prefix(ctx, "[2/7 system prompt]", false, details));
    rows.push_back(system_prompt_disk(ctx, "[3/7 system prompt from disk]", details));
    rows.push_back(shared_prefix(ctx, "[4/7 system prompt, auto-prefix]", false, details,
                                 llama::CacheKind::paged));
    rows.push_back(shared_prefix(ctx, "[5/7 RAG]", true, details));
    rows.push_back(
        shared_prefix(ctx, "[6/7 RAG, auto-prefix]", true, details, llama::CacheKind::paged));
    rows.push_back(sliding(ctx, "[7/7 sliding window]", details));
  } else if (cmd == "chat") {
    rows.push_back(chat(ctx, "[chat]", details));
  } else if (cmd == "system-prompt") {
    rows.push_back(shared_prefix(ctx, "[system prompt]", false, details));
  } else if (cmd == "system-prompt-disk" && ctx.opt.serve_from) {
    const SummaryRow row =
        serve_from_snapshot(ctx, *ctx.opt.serve_from, !ctx.opt.report || ctx.opt.verbose);
    if (ctx.opt.report) {
      write_report(*ctx.opt.report, row);
      return row.ok ? 0 : 1;
    }
    rows.push_back(row);
  } else if (cmd == "system-prompt-disk") {
    rows.push_back(system_prompt_disk(ctx, "[system prompt from disk]", details));
  } else if (cmd == "rag") {
    rows.push_back(shared_prefix(ctx, "[RAG]", true, details));
  } else {
    rows.push_back(sliding(ctx, "[sliding window]", details));
  }
  print_summary(rows);
  fmt::print("total {:.1f} s\n", llama::now_s() - t0);
  return std::all_of(rows.begin(), rows.end(), [](const SummaryRow& r) { return r.ok; }) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Lines on stdout go out as they are printed, so that they keep their order with the progress
  // lines on stderr when both go to one pipe (kvcache_demo 2>&1 | cat).
  std::setvbuf(stdout, nullptr, _IOLBF, BUFSIZ);
  try {
    return run(argc, argv);
  } catch (const usage_error& e) {
    fmt::print(stderr, "kvcache_demo: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "kvcache_demo: error: {}\n", e.what());
    return 1;
  }
}
