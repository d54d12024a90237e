// SPDX-License-Identifier: Apache-2.0
// Umbrella header: the whole public CPU API of kvcache, portable C++20 only. Not included: CUDA
// (kvcache/cuda/cuda.cuh), {fmt} formatters (kvcache/fmt.hpp) and snapshots on disk, which use
// POSIX file APIs (kvcache/io/snapshot.hpp). KVCACHE_EXTERN_KERNELS and
// KVCACHE_INSTANTIATE_KERNELS compile the CPU attention kernels once per program (see the end
// of kvcache/attention/cpu.hpp).
#pragma once

#include "kvcache/attention/attend.hpp"
#include "kvcache/attention/cpu.hpp"
#include "kvcache/attention/options.hpp"
#include "kvcache/attention/reference.hpp"
#include "kvcache/attention/rope.hpp"
#include "kvcache/core/buffer.hpp"
#include "kvcache/core/cache_concept.hpp"
#include "kvcache/core/config.hpp"
#include "kvcache/core/dtype.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/layout.hpp"
#include "kvcache/core/mask.hpp"
#include "kvcache/core/prefix_cache_concept.hpp"
#include "kvcache/core/restore.hpp"
#include "kvcache/core/tensor.hpp"
#include "kvcache/core/thread_pool.hpp"
#include "kvcache/core/view.hpp"
#include "kvcache/manager/block_manager.hpp"
#include "kvcache/manager/csr.hpp"
#include "kvcache/policy/context_shift.hpp"
#include "kvcache/policy/dynamic_cache.hpp"
#include "kvcache/policy/paged_cache.hpp"
#include "kvcache/policy/sliding_window_cache.hpp"
#include "kvcache/policy/static_cache.hpp"
#include "kvcache/policy/token_tracked_cache.hpp"
#include "kvcache/prefix/block_pool.hpp"
#include "kvcache/prefix/eviction.hpp"
#include "kvcache/prefix/prefix_index.hpp"
#include "kvcache/prefix/types.hpp"
#include "kvcache/storage/host_blocks.hpp"
#include "kvcache/version.hpp"
