// SPDX-License-Identifier: Apache-2.0
// Catch2 v2/v3 compatibility: include this instead of Catch2's own headers.
#pragma once

#if __has_include(<catch2/catch_test_macros.hpp>)
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#else
#include <catch2/catch.hpp>
#endif
