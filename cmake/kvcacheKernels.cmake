# SPDX-License-Identifier: Apache-2.0
# kvcache::kernels, defined the same way by kvcache's own CMakeLists.txt and by the installed
# package (kvcacheConfig.cmake): kvcache::kvcache with its CPU attention kernels and the bodies
# core/compiled_once.hpp lists compiled once, in a static library of the consumer's own build
# (its compiler, its flags), instead of in every translation unit that uses them. The targets
# that link it are built with KVCACHE_EXTERN_KERNELS (README, "Compile time"). Built only where a
# target links it.
function(kvcache_add_kernels_target source)
  add_library(kvcache_kernels STATIC EXCLUDE_FROM_ALL "${source}")
  add_library(kvcache::kernels ALIAS kvcache_kernels)
  target_link_libraries(kvcache_kernels PUBLIC kvcache::kvcache)
  target_compile_definitions(kvcache_kernels INTERFACE KVCACHE_EXTERN_KERNELS)
endfunction()
