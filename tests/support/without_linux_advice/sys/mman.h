// SPDX-License-Identifier: Apache-2.0
// Stand-in for <sys/mman.h> on a POSIX system without Linux's MAP_POPULATE (macOS, the BSDs): the
// real header minus that flag. Used by tests/io/file_without_linux_advice.cpp only.
#pragma once
#include_next <sys/mman.h>
#undef MAP_POPULATE
