// SPDX-License-Identifier: Apache-2.0
// kvcache's version, for code that includes kvcache by plain -I as much as for CMake: this header
// is its one source (CMakeLists.txt reads project(VERSION) from these lines).
#pragma once

#define KVCACHE_VERSION_MAJOR 0
#define KVCACHE_VERSION_MINOR 1
#define KVCACHE_VERSION_PATCH 0
#define KVCACHE_VERSION_STRING "0.1.0"
