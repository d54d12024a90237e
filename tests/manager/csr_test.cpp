// SPDX-License-Identifier: Apache-2.0
// export_csr(): a batch's block tables as FlashInfer-style CSR arrays. Checked against the
// tables and lengths, and by reading every row through the arrays and PagedCache::layer_data()
// (the layout the header promises) and comparing with the cache's own views.
#include <cstdint>
#include <vector>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"
#include "support/prefix_helpers.hpp"

using namespace kvcache;
using kvcache::test::iota_ids;

namespace {

constexpr std::size_t kLayers = 2, kHeads = 2, kDim = 4, kBlock = 4;
const kvcache::test::SyntheticModel kSynth{kLayers, kHeads, kDim};

}  // namespace

TEST_CASE("export_csr lists each sequence's pages, and the pages hold its rows") {
  PagedCache<float> cache({.num_layers = kLayers,
                           .num_kv_heads = kHeads,
                           .head_dim = kDim,
                           .num_blocks = 32,
                           .block_size = kBlock,
                           .max_batch = 5,
                           .max_seq_len = 40});
  (void)kSynth.run_prompt(cache, 0, iota_ids(13, 1));  // 4 pages, the last holding 1
  cache.fork(0, 1);                                    // shares sequence 0's pages
  (void)kSynth.run_prompt(cache, 2, iota_ids(8, 50));  // 2 full pages
  // sequence 3 empty; sequence 4: layer 0 longer than layer 1
  const auto ids = iota_ids(6, 90);
  cache.add_tokens(4, ids);
  kSynth.prefill(cache, 4, ids, 0, 5);
  const auto kv = kSynth.kv(0, ids, 5, 1);
  cache.append(0, 4, kv.k_block(0, 1), kv.v_block(0, 1));

  const std::vector<std::size_t> seqs{2, 0, 3, 4, 1};
  for (std::size_t layer = 0; layer < kLayers; ++layer) {
    INFO("layer " << layer);
    const CsrSizes sizes = csr_sizes(cache.manager(), layer, seqs);
    std::vector<std::int32_t> indptr(sizes.indptr), indices(sizes.indices),
        last(sizes.last_page_len);
    export_csr(cache.manager(), layer, seqs, indptr, indices, last);
    REQUIRE(indptr.front() == 0);
    REQUIRE(static_cast<std::size_t>(indptr.back()) == indices.size());
    const std::size_t page_elems = 2 * kHeads * kBlock * kDim;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const std::size_t len = cache.layer_length(layer, seqs[i]);
      const std::size_t pages = static_cast<std::size_t>(indptr[i + 1] - indptr[i]);
      REQUIRE(pages == (len + kBlock - 1) / kBlock);
      REQUIRE(static_cast<std::size_t>(last[i]) == (len == 0 ? 0 : len - (pages - 1) * kBlock));
      // every row, through the CSR arrays and the layer's pool, as the view has it
      const auto view = cache.view(layer, seqs[i]);
      for (std::size_t p = 0; p < pages; ++p) {
        const auto page =
            static_cast<std::size_t>(indices[static_cast<std::size_t>(indptr[i]) + p]);
        REQUIRE(page == cache.block_table(seqs[i])[p]);
        const float* k = cache.layer_data(layer) + page * page_elems;
        const float* v = k + kHeads * kBlock * kDim;
        const auto seg = view.segment(p);
        for (std::size_t h = 0; h < kHeads; ++h) {
          for (std::size_t e = 0; e < seg.len * kDim; ++e) {
            REQUIRE(k[h * kBlock * kDim + e] == seg.k[h * seg.head_stride + e]);
            REQUIRE(v[h * kBlock * kDim + e] == seg.v[h * seg.head_stride + e]);
          }
        }
      }
    }
    // shared pages are listed for each holder
    REQUIRE(std::equal(indices.begin() + indptr[1], indices.begin() + indptr[2],
                       indices.begin() + indptr[4]));
  }
  CHECK(cache.layer_length(0, 4) == 6);
  CHECK(cache.layer_length(1, 4) == 5);

  // arrays too short: refused, nothing written
  std::vector<std::int32_t> indptr(seqs.size() + 1, -7), indices(3, -7), last(seqs.size(), -7);
  REQUIRE_THROWS_AS(export_csr(cache.manager(), 0, seqs, indptr, indices, last), shape_error);
  CHECK(indptr == std::vector<std::int32_t>(seqs.size() + 1, -7));
  CHECK(indices == std::vector<std::int32_t>(3, -7));
  REQUIRE_THROWS_AS(csr_sizes(cache.manager(), 2, seqs), layer_error);
  const std::vector<std::size_t> bad{9};
  REQUIRE_THROWS_AS(csr_sizes(cache.manager(), 0, bad), batch_error);
}
