// SPDX-License-Identifier: Apache-2.0
// stories260K (../shared/models/stories260K, or $KVCACHE_SHARED_DIR at configure time): where the
// example engine's tests find the checkpoint and its tokenizer, and the check that says clearly
// when they are missing.
#pragma once

#include <filesystem>
#include <initializer_list>

#include "support/catch.hpp"

namespace kvcache::test {

/// The folder holding stories260K.bin and tok512.bin.
inline const std::filesystem::path kStoriesDir =
    std::filesystem::path(KVCACHE_SHARED_DIR) / "models/stories260K";

/// True when every file of `names` is in kStoriesDir; otherwise a WARN naming the first missing
/// one ("SKIPPED: ... not found"), and false: the caller's test then returns without checking.
inline bool have_stories(std::initializer_list<const char*> names = {"stories260K.bin",
                                                                     "tok512.bin"}) {
  for (const char* name : names) {
    const std::filesystem::path path = kStoriesDir / name;
    if (!std::filesystem::exists(path)) {
      WARN("SKIPPED: " << path.string() << " not found (set KVCACHE_SHARED_DIR)");
      return false;
    }
  }
  return true;
}

}  // namespace kvcache::test
