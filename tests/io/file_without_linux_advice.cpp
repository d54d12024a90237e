// SPDX-License-Identifier: Apache-2.0
// Snapshots build where Linux's read advice is missing (macOS): compiled against the stand-ins in
// tests/support/without_linux_advice, which hide POSIX_FADV_* and MAP_POPULATE. Never run.
#include "kvcache/io/snapshot.hpp"

#if defined(MAP_POPULATE) || defined(POSIX_FADV_WILLNEED)
#error "the stand-ins for <fcntl.h> and <sys/mman.h> did not hide Linux's read advice"
#endif
