// SPDX-License-Identifier: Apache-2.0
// Stand-in for <fcntl.h> on a POSIX system without posix_fadvise's advice (macOS): the real header
// minus POSIX_FADV_*. Used by tests/io/file_without_linux_advice.cpp only.
#pragma once
#include_next <fcntl.h>
#undef POSIX_FADV_NORMAL
#undef POSIX_FADV_RANDOM
#undef POSIX_FADV_SEQUENTIAL
#undef POSIX_FADV_WILLNEED
#undef POSIX_FADV_DONTNEED
#undef POSIX_FADV_NOREUSE
