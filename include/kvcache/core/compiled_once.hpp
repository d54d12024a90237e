// SPDX-License-Identifier: Apache-2.0
// Where the bodies of kvcache's heavier functions are compiled: the one switch that ThreadPool
// (core/thread_pool_impl.hpp), detail::Mutex (core/mutex_impl.hpp), SequenceTable
// (manager/sequence_table_impl.hpp), Rope (attention/rope_impl.hpp) and BlockManager's members
// defined outside its class (manager/block_manager_impl.hpp, for DefaultBlockHasher) share with
// the attention kernels (the end of attention/cpu.hpp). By default each header includes its
// bodies, inline, so any number of translation units may compile them. In a program built with
// KVCACHE_EXTERN_KERNELS they are compiled once, out of line, in the program's one
// KVCACHE_INSTANTIATE_KERNELS file (README, "Compile time"), and its other translation units
// parse only the declarations (and none of the standard headers the bodies need).
#pragma once

/// 1 where this translation unit compiles the bodies (every unit, unless the program compiles them
/// once and this is not its instantiating file).
#if defined(KVCACHE_EXTERN_KERNELS) && !defined(KVCACHE_INSTANTIATE_KERNELS)
#define KVCACHE_DETAIL_DEFINES_BODIES 0
#else
#define KVCACHE_DETAIL_DEFINES_BODIES 1
#endif

/// What each of those bodies is declared with: `inline` where every translation unit compiles
/// them, nothing in the instantiating file, whose definitions the others link to.
#if defined(KVCACHE_INSTANTIATE_KERNELS)
#define KVCACHE_DETAIL_BODY_INLINE
#else
#define KVCACHE_DETAIL_BODY_INLINE inline
#endif
