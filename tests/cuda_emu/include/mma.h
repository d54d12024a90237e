// SPDX-License-Identifier: Apache-2.0
// kvemu's stand-in for mma.h (nvcuda::wmma): a fragment holds the whole matrix (num_elements =
// rows x cols), products accumulate in float, and the warp's last lane alone loads, computes
// mma_sync and writes store_matrix_sync's tile, so that reading the stored tile before
// __syncwarp() is caught. The other lanes' fragments stay zero (they check the pointers and
// take part in the element-wise loops, but nothing reads their copies): loading the whole
// matrix on all 32 lanes was a third of the emulated prefill's time. Pointer alignment (32
// bytes) and leading dimensions (multiples of 16 bytes) are checked as the hardware requires.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvemu.hpp"

namespace nvcuda::wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}  // namespace precision
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <class T>
struct Storage {
  using type = T;
};
template <>
struct Storage<precision::tf32> {
  using type = float;
};
template <class T>
float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return x;
  }
}
template <class Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};
/// Whether the calling thread is its warp's last lane: the one that loads, computes and stores
/// the tiles (the other lanes' copies are not kept up to date).
inline bool last_lane() {
  const kvemu::Fiber& me = kvemu::fiber();
  return kvemu::lane_of(me) + 1 == kvemu::block().warp_barriers[kvemu::warp_of(me)].expected;
}
inline void check_pointer(const void* p, unsigned ldm, std::size_t element_bytes) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) {
    kvemu::fail("wmma: matrix pointer not 256-bit aligned");
  }
  if (ldm * element_bytes % 16 != 0) kvemu::fail("wmma: ldm not a multiple of 16 bytes");
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  using element_type = typename detail::Storage<T>::type;
  static constexpr int num_rows = detail::Shape<Use, M, N, K>::rows;
  static constexpr int num_cols = detail::Shape<Use, M, N, K>::cols;
  static constexpr int num_elements = num_rows * num_cols;  // logical row-major
  element_type x[num_elements]{};  // zero on the lanes that do not load (see above)
};

inline float __float_to_tf32(float f) {  // 10 mantissa bits, round to nearest even
  std::uint32_t b = std::bit_cast<std::uint32_t>(f);
  if ((b & 0x7f800000u) != 0x7f800000u) b += 0xfffu + ((b >> 13) & 1u);
  return std::bit_cast<float>(b & 0xffffe000u);
}

template <class Use, int M, int N, int K, class T, class Layout, class P>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const P* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  static_assert(std::is_same_v<P, typename F::element_type>);
  detail::check_pointer(p, ldm, sizeof(P));
  if (!detail::last_lane()) return;
  for (int r = 0; r < F::num_rows; ++r) {
    for (int c = 0; c < F::num_cols; ++c) {
      f.x[r * F::num_cols + c] =
          std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
    }
  }
}
template <int M, int N, int K, class T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  detail::check_pointer(p, ldm, sizeof(float));
  if (!detail::last_lane()) return;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}
template <int M, int N, int K, class T>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                       layout_t layout) {
  detail::check_pointer(p, ldm, sizeof(float));
  if (!detail::last_lane()) return;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * N + c];
}
template <class Use, int M, int N, int K, class T, class Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                   typename fragment<Use, M, N, K, T, Layout>::element_type v) {
  for (auto& x : f.x) x = v;
}
template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC>
void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
              const fragment<matrix_b, M, N, K, TB, LB>& b,
              const fragment<accumulator, M, N, K, TC>& c) {
  if (!detail::last_lane()) return;  // only the storing lane's copy of d is ever read
  float fa[M * K], fb[K * N], out[M * N];
  for (int i = 0; i < M * K; ++i) fa[i] = detail::to_float(a.x[i]);
  for (int i = 0; i < K * N; ++i) fb[i] = detail::to_float(b.x[i]);
  for (int r = 0; r < M; ++r) {
    for (int col = 0; col < N; ++col) {
      float s = c.x[r * N + col];
      for (int k = 0; k < K; ++k) s += fa[r * K + k] * fb[k * N + col];
      out[r * N + col] = s;
    }
  }
  std::copy(out, out + M * N, d.x);
}

}  // namespace nvcuda::wmma
