// SPDX-License-Identifier: Apache-2.0
// AlignedBuffer: alignment, ownership on move, and the huge-page advice for large buffers.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "kvcache/kvcache.hpp"
#include "support/catch.hpp"

using namespace kvcache;

namespace {

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

#if defined(__linux__)
// The VmFlags line of the /proc/self/smaps mapping that holds p ("" if none was found).
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= address(p) && address(p) < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}
#endif

}  // namespace

TEST_CASE("small buffers are 64-byte aligned, large ones 2 MiB aligned") {
  const AlignedBuffer<half> small(3);
  CHECK(address(small.data()) % kStorageAlignment == 0);
  CHECK(small.bytes() == 6);
  const AlignedBuffer<float> below(kHugePageAdviceBytes / sizeof(float) - 1);
  CHECK(address(below.data()) % kStorageAlignment == 0);
  const AlignedBuffer<float> large(kHugePageAdviceBytes / sizeof(float) + 5);
  CHECK(address(large.data()) % kHugePageBytes == 0);
  const AlignedBuffer<float> none;
  CHECK(none.data() == nullptr);
  CHECK(none.size() == 0);
}

TEST_CASE("a moved buffer hands over its storage and its deallocation") {
  AlignedBuffer<float> large(kHugePageAdviceBytes / sizeof(float));
  float* const p = large.data();
  p[0] = 1.0f;
  p[large.size() - 1] = 2.0f;
  AlignedBuffer<float> moved(std::move(large));
  CHECK(moved.data() == p);
  CHECK(large.size() == 0);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  AlignedBuffer<float> small(16);
  small = std::move(moved);  // frees the 64-byte-aligned block, takes the 2 MiB-aligned one
  CHECK(small.data() == p);
  CHECK(small.data()[small.size() - 1] == 2.0f);
  moved = AlignedBuffer<float>(8);  // and the other way round
  CHECK(address(moved.data()) % kStorageAlignment == 0);
}

#if defined(__linux__)
TEST_CASE("large buffers are advised as huge-page candidates, small ones are not") {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) {
    WARN("this kernel has no transparent huge pages: the madvise check does not apply");
    return;
  }
  const AlignedBuffer<std::byte> large(2 * kHugePageAdviceBytes);
  const std::string flags = vm_flags_of(large.data());
  if (flags.empty()) {
    WARN("/proc/self/smaps has no VmFlags for the buffer: the madvise check is not possible here");
    return;
  }
  INFO(flags);
  CHECK(flags.find(" hg") != std::string::npos);  // MADV_HUGEPAGE
  const AlignedBuffer<std::byte> small(4096);
  CHECK(vm_flags_of(small.data()).find(" hg") == std::string::npos);
}
#endif
