// SPDX-License-Identifier: Apache-2.0
// The CPU attention kernels (and the bodies core/compiled_once.hpp lists: ThreadPool, the paged
// caches' mutex, Rope, SequenceTable, BlockManager's out-of-class members), compiled once for
// every test, benchmark and example of this tree: they are built with KVCACHE_EXTERN_KERNELS
// defined (target kvcache_kernels, in the top-level CMakeLists.txt) and link this file's
// instantiations instead of compiling the kernels in each translation unit. An engine does the
// same with these two lines in one of its .cpp files (see "Compile time" in README.md).
#define KVCACHE_INSTANTIATE_KERNELS
#include <kvcache/kvcache.hpp>
