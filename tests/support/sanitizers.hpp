// SPDX-License-Identifier: Apache-2.0
// Which sanitizer this test build runs under, for GCC and clang alike: KVCACHE_TEST_ASAN and
// KVCACHE_TEST_TSAN are 1 or 0. GCC 12 says so with __SANITIZE_ADDRESS__/__SANITIZE_THREAD__,
// clang only through __has_feature; a check of the GCC macro alone is silently false under clang.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define KVCACHE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCACHE_TEST_ASAN 1
#endif
#endif
#ifndef KVCACHE_TEST_ASAN
#define KVCACHE_TEST_ASAN 0
#endif

#if defined(__SANITIZE_THREAD__)
#define KVCACHE_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVCACHE_TEST_TSAN 1
#endif
#endif
#ifndef KVCACHE_TEST_TSAN
#define KVCACHE_TEST_TSAN 0
#endif
