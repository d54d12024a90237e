// SPDX-License-Identifier: Apache-2.0
// AVX2 + FMA + F16C micro-kernels of the fast CPU attention: q.k scores for a tile of keys, the
// p.V accumulation, and a vectorised exp. fp16/bf16 rows are converted in registers. Compiled
// with per-function target attributes and chosen at run time, so no -mavx2 flag is needed.
#pragma once

#include <cstddef>
#include <type_traits>

#include "kvcache/core/dtype.hpp"

namespace kvcache::cpu::detail {

/// What the micro-kernels read a K/V element as: the element's value, an int8 code's value, and an
/// fp8 code's value x 2^-8 (the vector loads turn an e4m3 code into the half whose bits are the
/// code's shifted into place, which is exactly 2^-8 of its value, subnormals included). The sweep
/// multiplies each row's scale by kCodeUnit<T> to make up for it.
template <KVElement T>
inline constexpr float kCodeUnit = std::same_as<T, fp8_e4m3> ? 256.0f : 1.0f;

/// The value the micro-kernels read for element x (see kCodeUnit).
template <KVElement T>
[[nodiscard]] constexpr float code_value(T x) noexcept {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else {
    return static_cast<float>(x) * (1.0f / kCodeUnit<T>);
  }
}

/// Memory a micro-kernel should start fetching while it computes: `bytes` from each of k and v
/// (the K and V rows a few tiles ahead).
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  std::size_t bytes = 0;
};

/// Calls f(std::integral_constant<std::size_t, R>{}) with R = min(rows, 4): the SIMD micro-kernels
/// are instantiated for 1..4 query rows. @pre rows >= 1.
template <class F>
inline void with_rows(std::size_t rows, F&& f) {
  switch (rows) {
    case 1:
      return f(std::integral_constant<std::size_t, 1>{});
    case 2:
      return f(std::integral_constant<std::size_t, 2>{});
    case 3:
      return f(std::integral_constant<std::size_t, 3>{});
    default:
      return f(std::integral_constant<std::size_t, 4>{});
  }
}

}  // namespace kvcache::cpu::detail

#if KVCACHE_X86_DISPATCH

#include <immintrin.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

#define KVCACHE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

// nvcc parses these host-only kernels too and reports GCC's unroll pragmas as unknown (1675).
#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

namespace kvcache::cpu::detail {

/// The 64-byte lines of the K (or V) side of a list of Prefetch ranges, prefetched into L2 in
/// order, a few at a time between a micro-kernel's blocks.
class FetchLines {
 public:
  FetchLines(const Prefetch* ranges, std::size_t n, bool v_side) noexcept
      : ranges_(ranges), left_(n), v_side_(v_side) {
    refill();
  }
  /// How many lines to fetch per slice to spread the lines left evenly over `slices` slices
  /// (0 for none).
  [[nodiscard]] std::size_t per_slice(std::size_t slices) const noexcept {
    if (slices == 0) return 0;
    std::size_t lines = (bytes_ + 63) / 64;
    for (std::size_t i = 0; i < left_; ++i) lines += (ranges_[i].bytes + 63) / 64;
    return (lines + slices) / slices;
  }
  /// Prefetches the next `n` lines, or as many as are left. fetch, fetch_rest and next are always
  /// inlined: one out-of-line call puts the cursor in memory for the whole micro-kernel (measured:
  /// AVX-512 16k-token half decode fell from 0.63-0.66 to 0.53-0.55 of the read bandwidth).
  [[gnu::always_inline]] void fetch(std::size_t n) noexcept {
    for (; n != 0 && bytes_ != 0; --n) _mm_prefetch(next(), _MM_HINT_T1);
  }
  /// Prefetches every line left.
  [[gnu::always_inline]] void fetch_rest() noexcept {
    while (bytes_ != 0) _mm_prefetch(next(), _MM_HINT_T1);
  }

 private:
  // The next line. @pre bytes_ != 0.
  [[nodiscard, gnu::always_inline]] const char* next() noexcept {
    const char* line = cur_;
    if (bytes_ > 64) {
      cur_ += 64;
      bytes_ -= 64;
    } else {
      bytes_ = 0;
      refill();
    }
    return line;
  }

  // Moves to the next non-empty range, if any.
  void refill() noexcept {
    for (; bytes_ == 0 && left_ != 0; ++ranges_, --left_) {
      cur_ = v_side_ ? ranges_->v : ranges_->k;
      bytes_ = ranges_->bytes;
    }
  }

  const Prefetch* ranges_;
  std::size_t left_;  // ranges after the current one
  bool v_side_;
  const char* cur_ = nullptr;
  std::size_t bytes_ = 0;  // left in the current range, from cur_
};

/// The 8 halves exactly 2^-8 of 8 fp8 e4m3 codes (sign-extended to 16 bits): each code's
/// exponent and mantissa shifted under half's, the sign in bit 15 (see kCodeUnit).
KVCACHE_TARGET_AVX2 inline __m128i e4m3_as_half(__m128i codes16) noexcept {
  return _mm_and_si128(_mm_slli_epi16(codes16, 7), _mm_set1_epi16(static_cast<short>(0xbfff)));
}

/// Loads 8 consecutive elements as 8 floats (codes as code_value reads them).
template <KVElement T>
KVCACHE_TARGET_AVX2 inline __m256 load8(const T* p) noexcept {
  if constexpr (std::same_as<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::same_as<T, half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::same_as<T, qint8>) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (std::same_as<T, fp8_e4m3>) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtph_ps(e4m3_as_half(_mm_cvtepi8_epi16(codes)));
  } else {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

/// The sum of the 8 lanes, associated as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)):
/// exactly as hsum4x8, so a dot product rounds the same whichever path computes it and a query's
/// result does not depend on the other queries of the call.
KVCACHE_TARGET_AVX2 inline float hsum(__m256 v) noexcept {
  const __m256 pairs = _mm256_hadd_ps(v, v);          // v0+v1, v2+v3, .. | v4+v5, v6+v7, ..
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);  // (v0+v1)+(v2+v3) | (v4+v5)+(v6+v7)
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

/// exp(x) for 8 lanes with x <= 0; lanes below -87 (including -inf) give exactly 0.
/// Cephes-style range reduction and degree-6 polynomial: relative error below 2e-7.
KVCACHE_TARGET_AVX2 inline __m256 exp8_nonpositive(__m256 x) noexcept {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)), keep);
}

/// Lane r of the result = sum of the 8 lanes of a[r], r < 4, associated as hsum does.
KVCACHE_TARGET_AVX2 inline __m128 hsum4x8(const __m256* a) noexcept {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/// s[r * stride + a] = q_r . k[a] for R query rows (each head_dim floats, rows d apart) and J
/// key rows: R x J accumulators, each q load shared by the J keys.
template <KVElement T, std::size_t R, std::size_t J>
KVCACHE_TARGET_AVX2 inline void qk_block(const float* q, const T* const* k, std::size_t d, float* s,
                                         std::size_t stride) noexcept {
  __m256 acc[J][R];
#pragma GCC unroll 3
  for (std::size_t a = 0; a < J; ++a) {
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) acc[a][r] = _mm256_setzero_ps();
  }
  for (std::size_t x = 0; x < d; x += 8) {
    __m256 kx[J];
#pragma GCC unroll 3
    for (std::size_t a = 0; a < J; ++a) kx[a] = load8(k[a] + x);
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * d + x);
#pragma GCC unroll 3
      for (std::size_t a = 0; a < J; ++a) acc[a][r] = _mm256_fmadd_ps(qv, kx[a], acc[a][r]);
    }
  }
  if constexpr (R == 4) {
#pragma GCC unroll 3
    for (std::size_t a = 0; a < J; ++a) {
      const __m128 sums = hsum4x8(acc[a]);  // lane r: row r
      s[a] = _mm_cvtss_f32(sums);
      s[stride + a] = _mm_cvtss_f32(_mm_movehdup_ps(sums));
      s[2 * stride + a] = _mm_cvtss_f32(_mm_movehl_ps(sums, sums));
      s[3 * stride + a] = _mm_cvtss_f32(_mm_shuffle_ps(sums, sums, 3));
    }
  } else {
#pragma GCC unroll 3
    for (std::size_t a = 0; a < J; ++a) {
#pragma GCC unroll 4
      for (std::size_t r = 0; r < R; ++r) s[r * stride + a] = hsum(acc[a][r]);
    }
  }
}

/// s[r * stride + j] = q_r . k[j] for R query rows (each head_dim floats, rows d apart) and nk
/// key rows (each head_dim elements, anywhere: a tile may span several segments, such as paged
/// blocks, and costs the same as one), three keys at a time: 12 accumulators for 4 rows leave
/// the FMA chains slack that 8 do not (Zen 4, L2-resident half tile: ~10% faster than two keys
/// at a time). The K side of `ahead` is prefetched in even slices over the key loop (pv_rows
/// fetches the V side), into L2 (prefetcht1), not L1: a lead of several tiles of K and V does not
/// fit in L1 beside the working rows, and L1 prefetches tie up its few miss buffers (Zen 4, half
/// K/V, 16k-token decode on one thread: 8.4 GB/s with prefetcht0 two tiles ahead, 13 GB/s with
/// prefetcht1 four tiles ahead; Zen 5 does best with prefetcht1 two tiles ahead, kPrefetchTiles).
template <KVElement T, std::size_t R>
KVCACHE_TARGET_AVX2 void qk_rows(const float* q, const T* const* k, std::size_t nk, std::size_t d,
                                 float* s, std::size_t stride, FetchLines ahead) noexcept {
  // Triples, then pairs: a remainder of one key (its 4 accumulators leave the FMA chains idle)
  // only when nk is 1.
  std::size_t blocks = nk / 3;
  if (nk % 3 == 1 && blocks > 0) --blocks;
  const std::size_t lines_per_block = ahead.per_slice(blocks);
  std::size_t j = 0;
  for (std::size_t b = 0; b < blocks; ++b, j += 3) {
    ahead.fetch(lines_per_block);
    qk_block<T, R, 3>(q, k + j, d, s + j, stride);
  }
  ahead.fetch_rest();  // tiles too short to spread
  for (; j + 2 <= nk; j += 2) qk_block<T, R, 2>(q, k + j, d, s + j, stride);
  if (j < nk) qk_block<T, R, 1>(q, k + j, d, s + j, stride);
}

/// acc_r += sum_j p[r * stride + j] * v[j] for R rows and nk value rows (anywhere, as in
/// qk_rows), 16 (then 8) columns at a time so that the accumulators stay in registers across the
/// whole tile. The V side of `ahead` is prefetched into L2 one line per value row visited: issued
/// in bursts beside K in qk_rows, a tile's worth of prefetches stalls on the miss buffers (float
/// K/V, 16k tokens, one thread: 8.4 GB/s that way, ~20 GB/s spread over this loop).
template <KVElement T, std::size_t R>
KVCACHE_TARGET_AVX2 void pv_rows(const float* p, std::size_t stride, const T* const* v,
                                 std::size_t nk, std::size_t d, float* acc,
                                 FetchLines ahead) noexcept {
  std::size_t x = 0;
  for (; x + 16 <= d; x += 16) {
    __m256 a0[R], a1[R];
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
      a0[r] = _mm256_loadu_ps(acc + r * d + x);
      a1[r] = _mm256_loadu_ps(acc + r * d + x + 8);
    }
    for (std::size_t j = 0; j < nk; ++j) {
      ahead.fetch(1);
      const __m256 v0 = load8(v[j] + x);
      const __m256 v1 = load8(v[j] + x + 8);
#pragma GCC unroll 4
      for (std::size_t r = 0; r < R; ++r) {
        const __m256 pr = _mm256_broadcast_ss(p + r * stride + j);
        a0[r] = _mm256_fmadd_ps(pr, v0, a0[r]);
        a1[r] = _mm256_fmadd_ps(pr, v1, a1[r]);
      }
    }
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * d + x, a0[r]);
      _mm256_storeu_ps(acc + r * d + x + 8, a1[r]);
    }
  }
  if (x < d) {  // d % 16 == 8
    __m256 a0[R];
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) a0[r] = _mm256_loadu_ps(acc + r * d + x);
    for (std::size_t j = 0; j < nk; ++j) {
      const __m256 v0 = load8(v[j] + x);
#pragma GCC unroll 4
      for (std::size_t r = 0; r < R; ++r) {
        a0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * stride + j), v0, a0[r]);
      }
    }
#pragma GCC unroll 4
    for (std::size_t r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * d + x, a0[r]);
  }
  ahead.fetch_rest();  // more lines than rows visited
}

/// The AVX2 operation set of the tile loop (see cpu.hpp). @pre head_dim % 8 == 0.
template <KVElement T>
struct Avx2Ops {
  KVCACHE_TARGET_AVX2 static void qk(const float* q, std::size_t rows, const T* const* k,
                                     std::size_t nk, std::size_t d, float* s, std::size_t stride,
                                     const Prefetch* ahead, std::size_t num_ahead) noexcept {
    const FetchLines lines(ahead, num_ahead, false);
    with_rows(rows, [&](auto r) { qk_rows<T, decltype(r)::value>(q, k, nk, d, s, stride, lines); });
  }
  KVCACHE_TARGET_AVX2 static void pv(const float* p, std::size_t stride, std::size_t rows,
                                     const T* const* v, std::size_t nk, std::size_t d, float* acc,
                                     const Prefetch* ahead, std::size_t num_ahead) noexcept {
    const FetchLines lines(ahead, num_ahead, true);
    with_rows(rows,
              [&](auto r) { pv_rows<T, decltype(r)::value>(p, stride, v, nk, d, acc, lines); });
  }
  /// The largest of x[0..n), n >= 1.
  KVCACHE_TARGET_AVX2 static float max(const float* x, std::size_t n) noexcept {
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; i < n; ++i) best = x[i] > best ? x[i] : best;
    return best;
  }
  /// max(x, n), and sets `found` when some x[i] is inf or NaN: the same pass, the same max.
  KVCACHE_TARGET_AVX2 static float max_nonfinite(const float* x, std::size_t n,
                                                 bool& found) noexcept {
    const __m256i exp_bits = _mm256_set1_epi32(0x7f800000);
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i any = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      m = _mm256_max_ps(m, v);
      const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exp_bits);
      any = _mm256_or_si256(any, _mm256_cmpeq_epi32(e, exp_bits));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    bool bad = _mm256_testz_si256(any, any) == 0;
    for (; i < n; ++i) {
      best = x[i] > best ? x[i] : best;
      bad = bad || (std::bit_cast<std::uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
    }
    found = found || bad;
    return best;
  }
  /// True when some x[i] is inf or NaN (every exponent bit set).
  KVCACHE_TARGET_AVX2 static bool nonfinite(const float* x, std::size_t n) noexcept {
    const __m256i exp_bits = _mm256_set1_epi32(0x7f800000);
    __m256i any = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i e = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i)), exp_bits);
      any = _mm256_or_si256(any, _mm256_cmpeq_epi32(e, exp_bits));
    }
    bool found = _mm256_testz_si256(any, any) == 0;
    for (; i < n; ++i) {
      found = found || (std::bit_cast<std::uint32_t>(x[i]) & 0x7f800000u) == 0x7f800000u;
    }
    return found;
  }
  /// x[i] = exp(x[i] - shift) for x[i] <= shift (-inf gives 0); returns the sum of the results.
  KVCACHE_TARGET_AVX2 static float exp_sum(float* x, std::size_t n, float shift) noexcept {
    const __m256 sv = _mm256_set1_ps(shift);
    __m256 sum = _mm256_setzero_ps();
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), sv));
      _mm256_storeu_ps(x + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {  // the tail, padded with -inf lanes (which give 0)
      alignas(32) float tail[8];
      for (std::size_t t = 0; t < 8; ++t) {
        tail[t] = i + t < n ? x[i + t] : -std::numeric_limits<float>::infinity();
      }
      const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(tail), sv));
      _mm256_store_ps(tail, e);
      for (std::size_t t = 0; i + t < n; ++t) x[i + t] = tail[t];
      sum = _mm256_add_ps(sum, e);
    }
    return hsum(sum);
  }
  KVCACHE_TARGET_AVX2 static void scale(float* x, std::size_t n, float c) noexcept {
    const __m256 cv = _mm256_set1_ps(c);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), cv));
    for (; i < n; ++i) x[i] *= c;
  }
};

}  // namespace kvcache::cpu::detail

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif

#undef KVCACHE_TARGET_AVX2

#endif  // KVCACHE_X86_DISPATCH
