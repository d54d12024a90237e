// SPDX-License-Identifier: Apache-2.0
// The translation unit that owns the tests' precompiled header (tests/CMakeLists.txt,
// kvcache_test_pch): the header is all it compiles.
