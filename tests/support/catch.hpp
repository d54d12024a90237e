// SPDX-License-Identifier: Apache-2.0
// Catch2 v2/v3 compatibility: include this instead of Catch2's own headers. The build names the
// major version of the Catch2 it links (KVCACHE_CATCH2_MAJOR, tests/CMakeLists.txt), because a
// machine may have the other version's headers on its include path; without it, whichever
// headers are found decide.
#pragma once

#if defined(KVCACHE_CATCH2_MAJOR)
#define KVCACHE_TEST_CATCH2_V3 (KVCACHE_CATCH2_MAJOR >= 3)
#elif __has_include(<catch2/catch_test_macros.hpp>)
#define KVCACHE_TEST_CATCH2_V3 1
#else
#define KVCACHE_TEST_CATCH2_V3 0
#endif

#if KVCACHE_TEST_CATCH2_V3
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#else
#include <catch2/catch.hpp>
#endif
