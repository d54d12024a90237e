// SPDX-License-Identifier: Apache-2.0
// AlignedBuffer: alignment, ownership on move, and the huge-page advice for large buffers.
// KVRows: where each side's rows and scales of a slab live, for one format and for a pair.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>
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

namespace {

// Writes a distinct value into every row and scale of every slab through k()/v()/k_scale()/
// v_scale(), then reads them back: no two rows or scales share memory, each side's rows are where
// bases() says (slab i at i * slab_stride(), V at the K row's offset from bases().v).
template <KVFormat F>
void check_kv_rows(std::size_t num_slabs, std::size_t slab_rows, std::size_t d) {
  using K = key_format_t<F>;
  using V = value_format_t<F>;
  KVRows<F> rows(num_slabs, slab_rows, d);
  const KVBases<F> base = rows.bases(0);
  REQUIRE(base.slab_stride == static_cast<std::int64_t>(rows.slab_stride()));
  std::size_t bytes_per_row = d * (sizeof(K) + sizeof(V));
  if constexpr (scaled_v<K>) bytes_per_row += sizeof(scale_type);
  if constexpr (scaled_v<V>) bytes_per_row += sizeof(scale_type);
  CHECK(rows.bytes() == num_slabs * slab_rows * bytes_per_row);
  CHECK((base.k_scale != nullptr) == scaled_v<K>);
  CHECK((base.v_scale != nullptr) == scaled_v<V>);
  // 1..15 on the K side, -1..-15 on the V side: exact in every format, fp8 included.
  const auto value = [&](std::size_t slab, std::size_t r, std::size_t x, int side) {
    return static_cast<float>(1 + ((slab * slab_rows + r) * d + x) % 15) *
           (side == 0 ? 1.0f : -1.0f);
  };
  const auto make = [](auto element, float x) {
    using T = decltype(element);
    if constexpr (std::is_same_v<T, qint8>) {
      return qint8(static_cast<std::int8_t>(x));
    } else {
      return T(x);
    }
  };
  for (std::size_t i = 0; i < num_slabs; ++i) {
    for (std::size_t r = 0; r < slab_rows; ++r) {
      const std::size_t at = i * rows.slab_stride() + r * d;
      for (std::size_t x = 0; x < d; ++x) {
        rows.k(at)[x] = make(K{}, value(i, r, x, 0));
        rows.v(at)[x] = make(V{}, value(i, r, x, 1));
      }
      if constexpr (scaled_v<K>) *rows.k_scale(at) = scale_type(static_cast<float>(i * 7 + r));
      if constexpr (scaled_v<V>) *rows.v_scale(at) = scale_type(-static_cast<float>(i * 7 + r));
    }
  }
  for (std::size_t i = 0; i < num_slabs; ++i) {
    for (std::size_t r = 0; r < slab_rows; ++r) {
      const std::size_t at = i * rows.slab_stride() + r * d;
      CHECK(base.k + at == rows.k(at));
      CHECK(base.v + at == rows.v(at));
      for (std::size_t x = 0; x < d; ++x) {
        REQUIRE(static_cast<float>(base.k[at + x]) == value(i, r, x, 0));
        REQUIRE(static_cast<float>(base.v[at + x]) == value(i, r, x, 1));
      }
      if constexpr (scaled_v<K>) {
        REQUIRE(static_cast<float>(base.k_scale[at / d]) == static_cast<float>(i * 7 + r));
      }
      if constexpr (scaled_v<V>) {
        REQUIRE(static_cast<float>(base.v_scale[at / d]) == -static_cast<float>(i * 7 + r));
      }
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("KVRows keeps each slab's K and V rows and scales apart, one format or a pair",
                   "[buffer]", float, half, qint8, fp8_e4m3, (KVFormats<half, qint8>),
                   (KVFormats<fp8_e4m3, bfloat16>), (KVFormats<qint8, fp8_e4m3>)) {
  check_kv_rows<TestType>(3, 5, 4);
  check_kv_rows<TestType>(1, 1, 1);
}

TEST_CASE("KVRows of one format interleaves each slab's K and V; a pair keeps two allocations") {
  const KVRows<half> one(3, 4, 8);
  CHECK(one.slab_stride() == 2 * 4 * 8);
  CHECK(one.v(0) == one.k(0) + 4 * 8);  // [K, V] per slab: PagedCache::layer_data()'s layout
  CHECK(one.k(64) == one.k(0) + 64);    // slab 1 follows slab 0's V rows
  const KVRows<qint8> quantized(2, 3, 8);
  CHECK(quantized.v_scale(0) == quantized.k_scale(0) + 3);
  const KVRows<KVFormats<half, qint8>> pair(3, 4, 8);
  CHECK(pair.slab_stride() == 4 * 8);
  CHECK(pair.k_scale(0) == nullptr);
  CHECK(pair.v_scale(0) != nullptr);
  CHECK(KVRows<float>().bytes() == 0);
}
