// SPDX-License-Identifier: Apache-2.0
// A batch's block tables in the compressed-sparse-row form that paged attention kernels take
// (FlashInfer's paged_kv_indptr / paged_kv_indices / paged_kv_last_page_len), for engines that
// bring their own kernels but keep kvcache's bookkeeping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "kvcache/core/error.hpp"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache {

/// How many entries export_csr() writes: indptr seqs.size() + 1, indices `indices`, and
/// last_page_len seqs.size().
struct CsrSizes {
  std::size_t indptr = 0;
  std::size_t indices = 0;
  std::size_t last_page_len = 0;
};

/// The sizes of export_csr(manager, layer, seqs, ...): the pages (blocks) holding `layer` of
/// each sequence, ceil(layer_length / block_size) of them. O(seqs).
/// @throws layer_error, batch_error.
template <BlockHasher Hasher>
[[nodiscard]] CsrSizes csr_sizes(const BlockManager<Hasher>& manager, std::size_t layer,
                                 std::span<const std::size_t> seqs) {
  CsrSizes sizes{seqs.size() + 1, 0, seqs.size()};
  for (std::size_t seq : seqs) {
    sizes.indices +=
        (manager.layer_length(layer, seq) + manager.block_size() - 1) / manager.block_size();
  }
  return sizes;
}

/// Writes the block tables of `layer` of seqs[0..n) in CSR form: request i (sequence seqs[i])
/// reads pages indices[indptr[i] .. indptr[i + 1]) in position order, the last holding
/// last_page_len[i] tokens (1 .. block_size; 0 for an empty sequence, which has no pages). With
/// kvcache's storage a page id is a block of the layer's pool: in PagedCache's HostBlocks and
/// DeviceCache alike, layer l's pool is [num_blocks][K, V][num_kv_heads][block_size][head_dim]
/// (FlashInfer's HND layout with K and V in one tensor, page stride 2 * num_kv_heads *
/// block_size * head_dim elements), starting at PagedCache::layer_data(l) or
/// DeviceCache::view(l).k. The arrays are valid until the next operation that changes a listed
/// sequence. O(seqs + indices).
/// @throws layer_error, batch_error, shape_error (a span shorter than csr_sizes() says), and
///         capacity_error when a count exceeds what int32 holds; nothing is written then.
template <BlockHasher Hasher>
void export_csr(const BlockManager<Hasher>& manager, std::size_t layer,
                std::span<const std::size_t> seqs, std::span<std::int32_t> indptr,
                std::span<std::int32_t> indices, std::span<std::int32_t> last_page_len) {
  const CsrSizes need = csr_sizes(manager, layer, seqs);
  if (indptr.size() < need.indptr || indices.size() < need.indices ||
      last_page_len.size() < need.last_page_len) {
    throw shape_error(detail::message(
        manager.name(), ": export_csr of ", seqs.size(), " sequences needs indptr ", need.indptr,
        ", indices ", need.indices, ", last_page_len ", need.last_page_len, " entries, got ",
        indptr.size(), ", ", indices.size(), ", ", last_page_len.size()));
  }
  constexpr auto kMax = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
  if (need.indices > kMax || manager.num_blocks() > kMax + 1) {
    throw capacity_error(detail::message(manager.name(), ": export_csr of ", need.indices,
                                         " pages of a pool of ", manager.num_blocks(),
                                         " blocks: int32 holds at most ", kMax));
  }
  const std::size_t bs = manager.block_size();
  std::size_t at = 0;
  indptr[0] = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const std::size_t len = manager.layer_length(layer, seqs[i]);
    const std::size_t pages = (len + bs - 1) / bs;
    const auto table = manager.block_table(seqs[i]);
    for (std::size_t p = 0; p < pages; ++p) indices[at + p] = static_cast<std::int32_t>(table[p]);
    at += pages;
    indptr[i + 1] = static_cast<std::int32_t>(at);
    last_page_len[i] = static_cast<std::int32_t>(len - (pages == 0 ? 0 : (pages - 1) * bs));
  }
}

}  // namespace kvcache
