// SPDX-License-Identifier: Apache-2.0
// PagedTables: the paged layout's bookkeeping for DeviceCache — a BlockManager (the one behind
// PagedCache) and the device copy of its block tables, kept equal by sending only the entries an
// operation changed — plus the one-launch copy-on-write copies of an append batch.
#pragma once

#if !defined(__CUDACC__)
#error "kvcache/cuda/*.cuh are CUDA headers: compile them with nvcc (KVCACHE_ENABLE_CUDA=ON)"
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/cuda/cache_kernels.cuh"
#include "kvcache/cuda/runtime.cuh"
#include "kvcache/manager/block_manager.hpp"

namespace kvcache::cuda {

/// A BlockManager and the device array [max_batch][max_blocks] of block ids that paged
/// views read (DeviceKVView::block_table). Every mutation goes through a member that sends the
/// entries it changed to the device on the caller's stream (kernel parameters, batched), so the
/// device table equals the manager's wherever a sequence holds positions. Not thread-safe.
class PagedTables {
 public:
  /// @throws shape_error (a bad config), capacity_error, cuda_error, std::bad_alloc.
  explicit PagedTables(const BlockManagerConfig& config)
      : manager_(config, DefaultBlockHasher{}, "DeviceCache"),
        max_blocks_((manager_.max_seq_len() + config.block_size - 1) / config.block_size),
        device_(config.max_batch * max_blocks_),
        mirror_(config.max_batch * max_blocks_, 0),
        requests_(config.max_batch),
        plans_(config.max_batch),
        sync_from_(config.max_batch) {
    check(cudaMemset(device_.data(), 0, device_.bytes()), "cudaMemset(block table)");
  }

  [[nodiscard]] BlockManager<>& manager() noexcept { return manager_; }
  [[nodiscard]] const BlockManager<>& manager() const noexcept { return manager_; }
  [[nodiscard]] const block_id* device_table() const noexcept { return device_.data(); }
  [[nodiscard]] std::size_t max_blocks() const noexcept { return max_blocks_; }
  [[nodiscard]] std::size_t device_bytes() const noexcept { return device_.bytes(); }

  /// BlockManager::begin_append() of counts[i] tokens to seqs[i] (ids: sum(counts) ids grouped
  /// like them, or nullptr), then the copy-on-write copies of the whole batch in one launch per
  /// kMaxCopiesPerLaunch and array of `rows` (every layer of each block, whole: rows and scales,
  /// KVRows::for_each_array; `rows` holds num_layers x num_blocks slabs, layer-major), then the
  /// new table entries. The caller writes the rows and calls end_append(). @throws as
  /// BlockManager::begin_append (nothing changed), cuda_error.
  template <KVFormat T>
  std::span<const BlockManager<>::AppendPlan> begin_append(
      std::size_t layer, std::span<const std::size_t> seqs, std::span<const std::size_t> counts,
      const token_id* ids, KVRows<T, DeviceArrays>& rows, cudaStream_t stream) {
    for (std::size_t i = 0, t = 0; i < seqs.size(); t += counts[i++]) {
      requests_[i] = {seqs[i], counts[i], ids == nullptr ? nullptr : ids + t};
    }
    const auto plans = std::span(plans_).first(seqs.size());
    manager_.begin_append(layer, std::span(requests_).first(seqs.size()), plans);
    rows.for_each_array([&](std::byte* array, std::size_t block_bytes) {
      copy_blocks(plans, reinterpret_cast<unsigned char*>(array),
                  manager_.num_blocks() * block_bytes, block_bytes, stream);
    });
    for (const auto& plan : plans) {
      // from the first block written; end_append() may switch committed ones after it
      sync_from_[plan.seq] =
          std::min(plan.position / manager_.block_size(), manager_.committed_blocks(plan.seq));
      sync(plan.seq, sync_from_[plan.seq], stream);
    }
    return plans;
  }

  /// BlockManager::end_append(), then the table entries it changed.
  void end_append(std::span<const BlockManager<>::AppendPlan> plans, cudaStream_t stream) {
    manager_.end_append(plans);
    for (const auto& plan : plans) sync(plan.seq, sync_from_[plan.seq], stream);
  }

  /// Sends the table entries of seq from `first` on that differ from the device's.
  void sync(std::size_t seq, std::size_t first, cudaStream_t stream) {
    detail::BlockBatch batch;
    const auto flush = [&] {
      if (batch.count == 0) return;
      detail::update_blocks_kernel<><<<1, detail::entry_threads(batch.count), 0, stream>>>(
          device_.data(), static_cast<int>(max_blocks_), batch);
      check_launch("kvcache::cuda::update_blocks_kernel");
      batch.count = 0;
    };
    const auto table = manager_.block_table(seq);
    block_id* mirror = mirror_.data() + seq * max_blocks_;
    for (std::size_t i = first; i < table.size(); ++i) {
      const block_id b = table[i];
      if (mirror[i] == b) continue;
      if (batch.count == detail::kMaxBlocksPerLaunch) flush();
      batch.entry[batch.count++] = {static_cast<std::int32_t>(seq), static_cast<std::int32_t>(i),
                                    b};
      mirror[i] = b;
    }
    flush();
  }

  /// "" or the first entry where the device table (downloaded: synchronises the device)
  /// differs from the manager's. For tests.
  [[nodiscard]] std::string check_device() const {
    std::vector<block_id> table(mirror_.size());
    check(cudaMemcpy(table.data(), device_.data(), device_.bytes(), cudaMemcpyDeviceToHost),
          "download block table");
    for (std::size_t q = 0; q < manager_.max_batch(); ++q) {
      const auto blocks = manager_.block_table(q);
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const block_id on_device = table[q * max_blocks_ + i];
        if (on_device != blocks[i]) {
          return kvcache::detail::message("sequence ", q, " entry ", i, " is block ", on_device,
                                          " on the device but ", blocks[i], " in the bookkeeping");
        }
      }
    }
    return {};
  }

 private:
  void copy_blocks(std::span<const BlockManager<>::AppendPlan> plans, unsigned char* array,
                   std::size_t layer_bytes, std::size_t block_bytes, cudaStream_t stream) {
    detail::CopyBatch batch;
    const auto flush = [&] {
      if (batch.count == 0) return;
      const dim3 grid(static_cast<unsigned>(batch.count),
                      static_cast<unsigned>(manager_.num_layers()));
      detail::copy_blocks_kernel<>
          <<<grid, 256, 0, stream>>>(array, static_cast<std::int64_t>(layer_bytes),
                                     static_cast<std::int64_t>(block_bytes), batch);
      check_launch("kvcache::cuda::copy_blocks_kernel");
      batch.count = 0;
    };
    for (const auto& plan : plans) {
      for (const BlockCopy& c : plan.copies) {
        if (batch.count == detail::kMaxCopiesPerLaunch) flush();
        batch.entry[batch.count++] = {static_cast<std::int32_t>(c.from),
                                      static_cast<std::int32_t>(c.to)};
      }
    }
    flush();
  }

  BlockManager<> manager_;
  std::size_t max_blocks_ = 0;
  DeviceBuffer<block_id> device_;
  std::vector<block_id> mirror_;  // what device_ holds
  // append scratch, max_batch each
  std::vector<AppendRequest> requests_;
  std::vector<BlockManager<>::AppendPlan> plans_;
  std::vector<std::size_t> sync_from_;
};

}  // namespace kvcache::cuda
