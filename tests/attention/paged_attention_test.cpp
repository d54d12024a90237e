// SPDX-License-Identifier: Apache-2.0
// Attention over paged views (and dynamic caches of short chunks): the kernel sweeps the KV heads
// of short-segment views in lockstep (tile i of every head, then tile i + 1), so that it reads
// each block whole. Whatever the width of that lockstep (block size, head count, group size,
// queries, threads, batch), every query's output must be the same bits as over the same tokens
// stored contiguously, and match the reference. So must attention over a view type of the
// caller's own, of irregular segments.
#include <algorithm>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/cache_helpers.hpp"
#include "support/catch.hpp"
#include "support/kernels.hpp"
#include "support/rng.hpp"
#include "support/tolerance.hpp"

using namespace kvcache;

namespace {

struct Shape {
  std::size_t kv_heads, group, dim;
};

// One KV head; a head count not a multiple of anything; a typical GQA layer; more heads than one
// lockstep item sweeps (16), with and without groups.
constexpr Shape kShapes[] = {{1, 4, 64}, {3, 2, 24}, {8, 4, 128}, {20, 1, 64}, {17, 2, 16}};
// Lengths of the sequences of one batch: a partial last block, a single token, a whole number of
// 16-token blocks.
constexpr std::size_t kLengths[] = {203, 1, 96};

// A view type of the caller's own (attend() takes any KVView): segments of 1, 2, 5, 16 and 3
// tokens, over and over, stored back to front in one buffer.
template <Element T>
class IrregularView {
 public:
  using value_type = T;

  explicit IrregularView(const kvcache::test::TokenKV& kv)
      : heads_(kv.heads), dim_(kv.dim), length_(kv.tokens) {
    constexpr std::size_t kPattern[] = {1, 2, 5, 16, 3};
    for (std::size_t pos = 0, i = 0; pos < kv.tokens; ++i) {
      segments_.push_back({pos, std::min(kPattern[i % std::size(kPattern)], kv.tokens - pos), 0});
      pos += segments_.back().len;
    }
    const std::size_t row = heads_ * dim_;
    data_.resize(2 * kv.tokens * row);
    std::size_t at = 0;
    for (auto s = segments_.rbegin(); s != segments_.rend(); ++s) {
      s->offset = at;
      for (std::size_t h = 0; h < heads_; ++h) {
        for (std::size_t j = 0; j < s->len; ++j) {
          for (std::size_t x = 0; x < dim_; ++x) {
            const std::size_t from = ((s->first + j) * heads_ + h) * dim_ + x;
            const std::size_t to = at + (h * s->len + j) * dim_ + x;
            data_[to] = from_float<T>(kv.k[from]);
            data_[to + s->len * row] = from_float<T>(kv.v[from]);
          }
        }
      }
      at += 2 * s->len * row;
    }
  }

  [[nodiscard]] std::size_t num_kv_heads() const noexcept { return heads_; }
  [[nodiscard]] std::size_t head_dim() const noexcept { return dim_; }
  [[nodiscard]] position_t length() const noexcept { return static_cast<position_t>(length_); }
  [[nodiscard]] position_t sink_end() const noexcept { return 0; }
  [[nodiscard]] position_t recent_begin() const noexcept { return 0; }
  [[nodiscard]] std::size_t num_segments() const noexcept { return segments_.size(); }
  [[nodiscard]] KVSegment<T> segment(std::size_t i) const noexcept {
    const Segment& s = segments_[i];
    const T* k = data_.data() + s.offset;
    return {k, k + s.len * heads_ * dim_, s.len * dim_, static_cast<position_t>(s.first), s.len};
  }

 private:
  struct Segment {
    std::size_t first, len, offset;
  };
  std::size_t heads_, dim_, length_;
  std::vector<Segment> segments_;
  std::vector<T> data_;
};

}  // namespace

TEMPLATE_TEST_CASE(
    "attention over a paged view equals, bit for bit, attention over the same tokens stored "
    "contiguously, with or without threads and batching",
    "", float, half, bfloat16) {
  auto rng = kvcache::test::make_rng("paged-lockstep");
  ThreadPool pool(3);
  constexpr std::size_t kBatch = std::size(kLengths), kMaxLen = 203;
  for (const Shape& shape : kShapes) {
    const std::size_t q_heads = shape.kv_heads * shape.group, dim = shape.dim;
    StaticCache<TestType> contiguous({.num_layers = 1,
                                      .num_kv_heads = shape.kv_heads,
                                      .head_dim = dim,
                                      .max_batch = kBatch,
                                      .max_seq_len = kMaxLen});
    std::vector<kvcache::test::TokenKV> kv;
    for (std::size_t s = 0; s < kBatch; ++s) {
      kv.push_back(kvcache::test::random_kv(rng, kLengths[s], shape.kv_heads, dim));
      kvcache::test::append_in_chunks(contiguous, 0, s, kv[s], 0, kLengths[s], {64});
    }
    // 5-token blocks: 7 runs in a tile; 16: 2 runs of whole blocks; 32: one block per tile.
    for (std::size_t block : {std::size_t{5}, std::size_t{16}, std::size_t{32}}) {
      PagedCache<TestType> paged({.num_layers = 1,
                                  .num_kv_heads = shape.kv_heads,
                                  .head_dim = dim,
                                  .num_blocks = kBatch * ((kMaxLen + block - 1) / block),
                                  .block_size = block,
                                  .max_batch = kBatch});
      for (std::size_t s = 0; s < kBatch; ++s) {
        kvcache::test::append_in_chunks(paged, 0, s, kv[s], 0, kLengths[s], {1, 7, 64, 3});
      }
      REQUIRE(paged.view(0, 0).num_segments() == (kMaxLen + block - 1) / block);
      // A dynamic cache of block-long chunks: the same short segments, another layout.
      DynamicCache<TestType> chunked({.num_layers = 1,
                                      .num_kv_heads = shape.kv_heads,
                                      .head_dim = dim,
                                      .max_seq_len = kMaxLen,
                                      .chunk_len = block});
      kvcache::test::append_in_chunks(chunked, 0, 0, kv[0], 0, kLengths[0], {13});
      for (const AttentionOptions& mask :
           {AttentionOptions{}, AttentionOptions{.window = 40, .num_sink_tokens = 3},
            AttentionOptions{.window = 17}, AttentionOptions{.softcap = 5.0f},
            AttentionOptions{.causal = false}}) {
        // 1 and 3 query tokens fit one row block per KV head (lockstep); 9 x group 2 does not.
        for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{9}}) {
          // One query and one reference for every kernel (the reference is most of this test's
          // time under the sanitizers).
          const auto q = kvcache::test::normal_floats(rng, n * q_heads * dim);
          const TokenBlock<const float> qb{q, n, q_heads, dim};
          AttentionOptions opts = mask;
          opts.query_pos = static_cast<position_t>(kLengths[0] - n);  // sequence 0's last n
          std::vector<float> expect(q.size());
          reference::attend(qb, paged.view(0, 0), {expect, n, q_heads, dim}, opts);
          for (cpu::Kernel kernel : kvcache::test::cpu_kernels(dim)) {
            INFO("kv_heads " << shape.kv_heads << " group " << shape.group << " dim " << dim
                             << " block " << block << " queries " << n << " window " << mask.window
                             << " sinks " << mask.num_sink_tokens << " softcap " << mask.softcap
                             << " causal " << mask.causal << " kernel "
                             << kvcache::test::kernel_name(kernel));
            AttentionOptions call = opts;  // its pool set below
            std::vector<float> flat(q.size());
            cpu::attend(qb, contiguous.view(0, 0), {flat, n, q_heads, dim}, call, kernel);
            for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
              INFO("threads " << (p == nullptr ? 1 : p->num_threads()));
              call.pool = p;
              std::vector<float> got(q.size(), -1.0f);
              cpu::attend(qb, paged.view(0, 0), {got, n, q_heads, dim}, call, kernel);
              REQUIRE(kvcache::test::same_bits(got, flat));
              std::fill(got.begin(), got.end(), -1.0f);
              cpu::attend(qb, chunked.view(0, 0), {got, n, q_heads, dim}, call, kernel);
              REQUIRE(kvcache::test::same_bits(got, flat));
            }
            // Same stored K/V on both sides: only fp32 vs double accumulation differs.
            kvcache::test::require_close(flat, expect, {2e-5, 2e-5});
          }
        }
      }
      // One decode step for the whole batch at once, threaded: the lockstep width then depends
      // on the batch, the bits must not.
      using PagedView = typename PagedCache<TestType>::view_type;
      std::vector<std::vector<float>> qs, outs;
      std::vector<AttentionTask<PagedView>> tasks;
      for (std::size_t s = 0; s < kBatch; ++s) {
        qs.push_back(kvcache::test::normal_floats(rng, q_heads * dim));
        outs.emplace_back(q_heads * dim, -1.0f);
      }
      for (std::size_t s = 0; s < kBatch; ++s) {
        tasks.push_back(
            {{qs[s], 1, q_heads, dim}, paged.view(0, s), {outs[s], 1, q_heads, dim}, {}});
      }
      attend_batch(std::span<const AttentionTask<PagedView>>(tasks), {.pool = &pool});
      for (std::size_t s = 0; s < kBatch; ++s) {
        INFO("batch of " << kBatch << ", sequence " << s << ", block " << block << ", kv_heads "
                         << shape.kv_heads);
        std::vector<float> alone(q_heads * dim);
        attend({qs[s], 1, q_heads, dim}, contiguous.view(0, s), {alone, 1, q_heads, dim});
        REQUIRE(kvcache::test::same_bits(outs[s], alone));
      }
    }
  }
}

TEMPLATE_TEST_CASE(
    "attention over a view type of the caller's own, of irregular segments out of order in "
    "memory, equals attention over a static cache bit for bit",
    "", float, half, bfloat16) {
  auto rng = kvcache::test::make_rng("irregular-view");
  ThreadPool pool(2);
  for (const Shape& shape : {Shape{1, 4, 64}, Shape{3, 2, 24}, Shape{8, 4, 128}}) {
    const std::size_t q_heads = shape.kv_heads * shape.group, dim = shape.dim;
    for (std::size_t len : {std::size_t{1}, std::size_t{27}, std::size_t{203}}) {
      const auto kv = kvcache::test::random_kv(rng, len, shape.kv_heads, dim);
      StaticCache<TestType> contiguous(
          {.num_layers = 1, .num_kv_heads = shape.kv_heads, .head_dim = dim, .max_seq_len = len});
      kvcache::test::append_in_chunks(contiguous, 0, 0, kv, 0, len, {64});
      const IrregularView<TestType> view(kv);
      REQUIRE(kvcache::test::check_view_invariants(view).size() == len);
      for (const AttentionOptions& mask :
           {AttentionOptions{}, AttentionOptions{.window = 40, .num_sink_tokens = 3},
            AttentionOptions{.window = 150, .num_sink_tokens = 20}, AttentionOptions{.window = 9},
            AttentionOptions{.causal = false}}) {
        for (std::size_t n : {std::size_t{1}, std::min<std::size_t>(len, 9)}) {
          for (cpu::Kernel kernel : kvcache::test::cpu_kernels(dim)) {
            INFO("kv_heads " << shape.kv_heads << " group " << shape.group << " dim " << dim
                             << " length " << len << " queries " << n << " window " << mask.window
                             << " sinks " << mask.num_sink_tokens << " causal " << mask.causal
                             << " kernel " << kvcache::test::kernel_name(kernel));
            const auto q = kvcache::test::normal_floats(rng, n * q_heads * dim);
            const TokenBlock<const float> qb{q, n, q_heads, dim};
            std::vector<float> expect(q.size()), flat(q.size());
            reference::attend(qb, view, {expect, n, q_heads, dim}, mask);
            cpu::attend(qb, contiguous.view(0, 0), {flat, n, q_heads, dim}, mask, kernel);
            kvcache::test::require_close(flat, expect, {2e-5, 2e-5});
            for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
              INFO("threads " << (p == nullptr ? 1 : p->num_threads()));
              AttentionOptions opts = mask;
              opts.pool = p;
              std::vector<float> got(q.size(), -1.0f);
              cpu::attend(qb, view, {got, n, q_heads, dim}, opts, kernel);
              REQUIRE(kvcache::test::same_bits(got, flat));
            }
          }
        }
      }
    }
  }
}
