// SPDX-License-Identifier: Apache-2.0
// The engine's fp32 matrix multiply: weights repacked once into panels of 16 output columns, a
// 6x16 register-blocked micro-kernel (AVX2+FMA where the CPU has it, chosen at run time), K blocked
// for L1, and (column panel x row block) tasks spread over a caller-owned kvcache::ThreadPool.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>

#include "kvcache/core/buffer.hpp"
#include "kvcache/core/error.hpp"
#include "kvcache/core/thread_pool.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LLAMA_GEMM_X86 1
#define LLAMA_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define LLAMA_GEMM_X86 0
#endif

namespace llama {

/// Output columns per packed panel (the micro-kernel's width).
inline constexpr std::size_t kPanelCols = 16;
/// Rows of A per micro-kernel call.
inline constexpr std::size_t kKernelRows = 6;
/// Depth of one K block: a panel slice of kDepthBlock x kPanelCols floats (16 KiB) stays in L1
/// while every row tile of a task streams past it.
inline constexpr std::size_t kDepthBlock = 256;
/// Rows of A per task (a multiple of kKernelRows): its K block stays in L2 across the panels.
inline constexpr std::size_t kRowBlock = 96;
/// Panels per task.
inline constexpr std::size_t kPanelsPerTask = 4;

/// A weight matrix W [rows][cols] of y = W x, repacked for matmul(): panel p holds rows
/// [16p, 16p + 16) of W column by column ([cols][16] floats, zero past `rows`), 64-byte aligned.
/// Packing is O(rows x cols); the packed matrix takes ceil(rows / 16) * 16 * cols floats.
class PackedMatrix {
 public:
  PackedMatrix() = default;

  /// Packs rows x cols values given by `at(row, col)` (W's elements).
  /// @throws kvcache::shape_error for a zero dimension, kvcache::capacity_error, std::bad_alloc.
  PackedMatrix(std::size_t rows, std::size_t cols,
               const std::function<float(std::size_t, std::size_t)>& at,
               kvcache::ThreadPool* pool = nullptr)
      : rows_(rows), cols_(cols) {
    if (rows == 0 || cols == 0) {
      throw kvcache::shape_error(kvcache::detail::message("PackedMatrix: shape [", rows, "][", cols,
                                                          "] has a zero dimension"));
    }
    const std::size_t panels = num_panels();
    data_ = kvcache::AlignedBuffer<float>(kvcache::detail::checked_mul(
        kvcache::detail::checked_mul(panels, kPanelCols, "PackedMatrix"), cols, "PackedMatrix"));
    auto pack_panel = [&](std::size_t p) {
      float* dst = data_.data() + p * kPanelCols * cols_;
      for (std::size_t j = 0; j < kPanelCols; ++j) {
        const std::size_t r = p * kPanelCols + j;
        for (std::size_t k = 0; k < cols_; ++k) dst[k * kPanelCols + j] = r < rows_ ? at(r, k) : 0;
      }
    };
    if (pool != nullptr) {
      pool->parallel_for(panels, pack_panel);
    } else {
      for (std::size_t p = 0; p < panels; ++p) pack_panel(p);
    }
  }

  /// Packs a row-major [rows][cols] matrix.
  PackedMatrix(std::span<const float> w, std::size_t rows, std::size_t cols,
               kvcache::ThreadPool* pool = nullptr)
      : PackedMatrix(
            checked_rows(w, rows, cols), cols,
            [w, cols](std::size_t r, std::size_t c) { return w[r * cols + c]; }, pool) {}

  /// Rows of W: the output width of matmul().
  [[nodiscard]] std::size_t rows() const noexcept { return rows_; }
  /// Columns of W: the input width (the K of the product).
  [[nodiscard]] std::size_t cols() const noexcept { return cols_; }
  [[nodiscard]] std::size_t num_panels() const noexcept {
    return (rows_ + kPanelCols - 1) / kPanelCols;
  }
  /// Panel p: [cols][16] floats.
  [[nodiscard]] const float* panel(std::size_t p) const noexcept {
    return data_.data() + p * kPanelCols * cols_;
  }
  /// Bytes of packed storage.
  [[nodiscard]] std::size_t bytes() const noexcept { return data_.bytes(); }

 private:
  static std::size_t checked_rows(std::span<const float> w, std::size_t rows, std::size_t cols) {
    if (w.size() != rows * cols) {
      throw kvcache::shape_error(kvcache::detail::message(
          "PackedMatrix: ", w.size(), " values for a [", rows, "][", cols, "] matrix"));
    }
    return rows;
  }

  kvcache::AlignedBuffer<float> data_;
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
};

namespace detail {

/// Arguments of one micro-kernel call: c[r][j] (+)= sum_k a[r][k] * b[k][j] for r < MR rows,
/// j < 16 (only the first `width` columns of c exist), k over one K block.
struct Tile {
  const float* a;
  std::size_t lda;
  const float* b;  // [depth][16]
  std::size_t depth;
  float* c;
  std::size_t ldc;
  std::size_t width;  // valid columns of c (<= 16)
  bool load_c;        // continue accumulating into c (else start from zero)
};

/// Plain C++ micro-kernel. Every element sums its products in k order, one multiply-add at a
/// time, whatever MR is: a row's result never depends on the rows computed with it.
template <std::size_t MR>
void tile_portable(const Tile& t) noexcept {
  float acc[MR][kPanelCols];
  for (std::size_t r = 0; r < MR; ++r) {
    for (std::size_t j = 0; j < kPanelCols; ++j) {
      acc[r][j] = t.load_c && j < t.width ? t.c[r * t.ldc + j] : 0.0f;
    }
  }
  for (std::size_t k = 0; k < t.depth; ++k) {
    const float* b = t.b + k * kPanelCols;
    for (std::size_t r = 0; r < MR; ++r) {
      const float a = t.a[r * t.lda + k];
      for (std::size_t j = 0; j < kPanelCols; ++j) acc[r][j] += a * b[j];
    }
  }
  for (std::size_t r = 0; r < MR; ++r) {
    for (std::size_t j = 0; j < t.width; ++j) t.c[r * t.ldc + j] = acc[r][j];
  }
}

#if LLAMA_GEMM_X86
/// AVX2+FMA micro-kernel: MR x 16 accumulators in registers (12 of the 16 ymm for MR = 6), one
/// fused multiply-add per element per k, in k order (bit-identical for any MR).
template <std::size_t MR>
LLAMA_TARGET_AVX2 void tile_avx2(const Tile& t) noexcept {
  alignas(32) float edge[MR][kPanelCols];  // staging for a partial panel (width < 16)
  const bool full = t.width == kPanelCols;
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (std::size_t r = 0; r < MR; ++r) {
    if (!t.load_c) {
      acc0[r] = _mm256_setzero_ps();
      acc1[r] = _mm256_setzero_ps();
    } else if (full) {
      acc0[r] = _mm256_loadu_ps(t.c + r * t.ldc);
      acc1[r] = _mm256_loadu_ps(t.c + r * t.ldc + 8);
    } else {
      for (std::size_t j = 0; j < kPanelCols; ++j) {
        edge[r][j] = j < t.width ? t.c[r * t.ldc + j] : 0.0f;
      }
      acc0[r] = _mm256_load_ps(edge[r]);
      acc1[r] = _mm256_load_ps(edge[r] + 8);
    }
  }
  const float* b = t.b;
  const float* a = t.a;
  for (std::size_t k = 0; k < t.depth; ++k, b += kPanelCols, ++a) {
    const __m256 b0 = _mm256_load_ps(b);
    const __m256 b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 6
    for (std::size_t r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * t.lda);
      acc0[r] = _mm256_fmadd_ps(ar, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(ar, b1, acc1[r]);
    }
  }
#pragma GCC unroll 6
  for (std::size_t r = 0; r < MR; ++r) {
    if (full) {
      _mm256_storeu_ps(t.c + r * t.ldc, acc0[r]);
      _mm256_storeu_ps(t.c + r * t.ldc + 8, acc1[r]);
    } else {
      _mm256_store_ps(edge[r], acc0[r]);
      _mm256_store_ps(edge[r] + 8, acc1[r]);
      for (std::size_t j = 0; j < t.width; ++j) t.c[r * t.ldc + j] = edge[r][j];
    }
  }
}

inline bool cpu_has_avx2_fma() noexcept {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

using TileFn = void (*)(const Tile&) noexcept;

/// The micro-kernels for 1..6 rows of the selected instruction set.
struct Kernels {
  TileFn by_rows[kKernelRows + 1];
};

[[nodiscard]] inline const Kernels& kernels(bool portable) noexcept {
  static const Kernels portable_set{{nullptr, &tile_portable<1>, &tile_portable<2>,
                                     &tile_portable<3>, &tile_portable<4>, &tile_portable<5>,
                                     &tile_portable<6>}};
#if LLAMA_GEMM_X86
  static const Kernels avx2_set{{nullptr, &tile_avx2<1>, &tile_avx2<2>, &tile_avx2<3>,
                                 &tile_avx2<4>, &tile_avx2<5>, &tile_avx2<6>}};
  if (!portable && cpu_has_avx2_fma()) return avx2_set;
#endif
  return portable_set;
}

}  // namespace detail

/// Which micro-kernels matmul() runs.
enum class GemmKernel {
  automatic,  ///< AVX2+FMA where the CPU has both, else portable
  portable,   ///< plain C++ loops (any CPU)
};

/// c[i][j] = sum_k a[i][k] * W[j][k] (or c[i][j] += ... when `accumulate`) for i < m, j < W.rows().
///
/// a is [m][W.cols()] with row stride lda; c is [m][W.rows()] with row stride ldc. Each element
/// is accumulated in k order with one rounding per multiply-add, so a row's result is the same
/// bits whatever m is and whatever rows it is computed with (prefill and decode agree exactly).
/// Work is split into (4 panels x 96 rows) tasks run on `pool` when it is given and the product
/// is large enough. O(m x rows x cols).
/// @pre lda >= W.cols(), ldc >= W.rows(), a and c do not overlap.
inline void matmul(const float* a, std::size_t m, std::size_t lda, const PackedMatrix& w, float* c,
                   std::size_t ldc, bool accumulate, kvcache::ThreadPool* pool,
                   GemmKernel kernel = GemmKernel::automatic) noexcept {
  if (m == 0) return;
  const detail::Kernels& kern = detail::kernels(kernel == GemmKernel::portable);
  const std::size_t k_total = w.cols();
  const std::size_t panels = w.num_panels();
  const std::size_t panel_tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const std::size_t row_tasks = (m + kRowBlock - 1) / kRowBlock;
  auto task = [&](std::size_t t) noexcept {
    const std::size_t p_begin = (t % panel_tasks) * kPanelsPerTask;
    const std::size_t p_end = std::min(panels, p_begin + kPanelsPerTask);
    const std::size_t r_begin = (t / panel_tasks) * kRowBlock;
    const std::size_t r_end = std::min(m, r_begin + kRowBlock);
    for (std::size_t k0 = 0; k0 < k_total; k0 += kDepthBlock) {
      const std::size_t depth = std::min(kDepthBlock, k_total - k0);
      for (std::size_t p = p_begin; p < p_end; ++p) {
        const std::size_t col = p * kPanelCols;
        const std::size_t width = std::min(kPanelCols, w.rows() - col);
        const float* b = w.panel(p) + k0 * kPanelCols;
        for (std::size_t r = r_begin; r < r_end; r += kKernelRows) {
          const std::size_t rows = std::min(kKernelRows, r_end - r);
          const detail::Tile tile{a + r * lda + k0,  lda, b,     depth,
                                  c + r * ldc + col, ldc, width, accumulate || k0 != 0};
          kern.by_rows[rows](tile);
        }
      }
    }
  };
  const std::size_t tasks = panel_tasks * row_tasks;
  constexpr std::size_t kMinParallelFlops = std::size_t{1} << 18;
  if (pool != nullptr && tasks > 1 && m * w.rows() * k_total >= kMinParallelFlops) {
    pool->parallel_for(tasks, task);
  } else {
    for (std::size_t t = 0; t < tasks; ++t) task(t);
  }
}

}  // namespace llama

#undef LLAMA_TARGET_AVX2
#undef LLAMA_GEMM_X86
