// SPDX-License-Identifier: Apache-2.0
// BlockManager's member functions that are defined in files of their own: appends, fork and
// reorder, restores, the consistency check. manager/block_manager.hpp includes this file where
// they are to be compiled (core/compiled_once.hpp). In a program built with
// KVCACHE_EXTERN_KERNELS they are compiled once, for DefaultBlockHasher, in its
// KVCACHE_INSTANTIATE_KERNELS file; a translation unit of such a program whose BlockManager or
// PagedCache has a hasher of its own includes this header after the others, so that the members
// compile there for that hasher (without it the program does not link).
#pragma once

#include "kvcache/core/compiled_once.hpp"
#include "kvcache/manager/append.hpp"  // IWYU pragma: export
#include "kvcache/manager/block_manager.hpp"
#include "kvcache/manager/consistency.hpp"  // IWYU pragma: export
#include "kvcache/manager/fork.hpp"         // IWYU pragma: export
#include "kvcache/manager/restore.hpp"      // IWYU pragma: export

#if defined(KVCACHE_INSTANTIATE_KERNELS)
namespace kvcache {
template class BlockManager<DefaultBlockHasher>;
}  // namespace kvcache
#endif
