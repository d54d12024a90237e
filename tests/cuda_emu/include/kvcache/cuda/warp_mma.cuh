// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for kvcache/cuda/warp_mma.cuh: ldmatrix and mma.m16n8k16 computed from the
// whole warp's operands (kvemu::warp_gather) with the register layouts that header documents
// (the PTX ISA's), so that a kernel misreading them computes wrong results here too. Row
// addresses must be 16-byte aligned and inside shared memory, as on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvcache/core/dtype.hpp"
#include "kvemu.hpp"

namespace kvcache::cuda::detail {

namespace emu {
inline const unsigned char* checked_row(const void* row) {
  const auto p = reinterpret_cast<std::uintptr_t>(row);
  const auto base = reinterpret_cast<std::uintptr_t>(smem);
  if (p % 16 != 0) kvemu::fail("ldmatrix: row address not 16-byte aligned");
  if (p < base || p + 16 > base + kvemu::kSharedBytes) {
    kvemu::fail("ldmatrix: row address outside shared memory");
  }
  return static_cast<const unsigned char*>(row);
}
inline std::uint16_t element(const unsigned char* row, int i) {
  std::uint16_t x;
  std::memcpy(&x, row + 2 * i, 2);
  return x;
}
template <class S>
float to_float(std::uint32_t reg, int half) {
  const auto bits = static_cast<std::uint16_t>(reg >> (16 * half));
  if constexpr (std::is_same_v<S, __half>) {
    return kvcache::half::to_float(bits);
  } else {
    static_assert(std::is_same_v<S, __nv_bfloat16>);
    return kvcache::bfloat16::to_float(bits);
  }
}
}  // namespace emu

inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
  const auto rows = kvemu::warp_gather(emu::checked_row(row));
  const unsigned lane = kvemu::lane_of(kvemu::fiber()), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) std::memcpy(&r[i], rows[8 * i + g] + 4 * t, 4);
}

inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
  const auto rows = kvemu::warp_gather(emu::checked_row(row));
  const unsigned lane = kvemu::lane_of(kvemu::fiber()), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    r[i] = emu::element(rows[8 * i + 2 * t], static_cast<int>(g)) |
           static_cast<std::uint32_t>(emu::element(rows[8 * i + 2 * t + 1], static_cast<int>(g)))
               << 16;
  }
}

template <class S>
void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  struct Operands {
    std::uint32_t a[4], b[2];
  };
  Operands mine{};
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  const auto all = kvemu::warp_gather(mine);
  // this lane's outputs need rows g and g + 8 of A and columns 2t, 2t + 1 of B: lane 4g + t'
  // holds A's row g (and g + 8) at columns 2t', 2t' + 1 (+ 8), lane 4n + t' B's column n at rows
  // 2t', 2t' + 1 (+ 8)
  const int lane = static_cast<int>(kvemu::lane_of(kvemu::fiber())), g = lane / 4, t = lane % 4;
  float fa[2][16], fb[2][16];
  for (int tt = 0; tt < 4; ++tt) {
    const Operands& ar = all[4 * g + tt];
    for (int half = 0; half < 2; ++half) {
      fa[0][2 * tt + half] = emu::to_float<S>(ar.a[0], half);
      fa[1][2 * tt + half] = emu::to_float<S>(ar.a[1], half);
      fa[0][2 * tt + 8 + half] = emu::to_float<S>(ar.a[2], half);
      fa[1][2 * tt + 8 + half] = emu::to_float<S>(ar.a[3], half);
      for (int col = 0; col < 2; ++col) {
        const Operands& br = all[4 * (2 * t + col) + tt];
        fb[col][2 * tt + half] = emu::to_float<S>(br.b[0], half);
        fb[col][2 * tt + 8 + half] = emu::to_float<S>(br.b[1], half);
      }
    }
  }
  for (int i = 0; i < 4; ++i) {
    float s = c[i];
    for (int k = 0; k < 16; ++k) s += fa[i / 2][k] * fb[i % 2][k];
    c[i] = s;
  }
}

}  // namespace kvcache::cuda::detail
