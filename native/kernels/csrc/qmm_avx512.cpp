// AVX-512 variant (F + BW + VL), selected at run time.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 flags its own intrinsics headers (self-initialized placeholders).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "qmm.h"
#include "sgemm.h"

namespace emlx {
namespace avx512 {

// 12 x 2 accumulators, the panel's two vectors and a broadcast fit the
// 32 registers.
#define GR 12
// The dot-product tile for a few rows of x: 4 x 4 accumulators.
#define MR 4
#define NR 4
#include "vec_avx512.inc"

struct F16 {
  vf v[16 / W];
};
static inline F16 cvt16(__m128i b) {
  F16 r;
  r.v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  return r;
}

#include "qmm_simd.inc"
#include "rows_avx512.inc"

// Matrix-vector form without byte shuffles. A 512-bit load of a row holds
// 16 uint32 words; lane i's word packs 32 / BITS consecutive values, so the
// s-th value of every lane is one shift and mask away, converted in place.
// x is reordered once per call to match: for each block of 16 words,
// xr[s * 16 + i] = x[i * (32 / BITS) + s]. Unlike unpacking bytes in order
// this spends no shuffle-port work on the weights, the bound of the other
// form: 1.9x its rate on cache-resident weights (a 1024 x 3072 4-bit
// product on one thread of an AMD EPYC: 0.073 ms against 0.138); weights
// streamed from memory are bound by bandwidth either way.

// R weight rows against MB rows of x at a time: a row's unpacked values
// serve every x row, so a decode batch or a short prompt reads and unpacks
// the weights once. Each output sums exactly as with MB = 1 (the same
// products in the same order), so a batch row gets its single row's bits.
template <int BITS, int R, int MB>
static void gemv_lanes(const emlx::QmmArgs& a, const float* xsum, int n0, int n1) {
  constexpr int VPL = 32 / BITS;  // values per lane
  constexpr int BV = 16 * VPL;  // values per 512-bit load
  const int K = a.K;
  const int G = a.group;
  const int groups = K / G;
  const int blocks = K / BV;
  // Groups one load spans, and each lane's group among them.
  const int span = BV >= G ? BV / G : 1;
  alignas(64) int lane_group[16];
  for (int i = 0; i < 16; ++i) lane_group[i] = (i * VPL) / G;
  const __m512i gidx = _mm512_load_si512(lane_group);
  const __mmask16 span_mask = (__mmask16)((1u << span) - 1);
  const __m512i vmask = _mm512_set1_epi32((1 << BITS) - 1);
  const __m512 nibbles = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  float* xr = (float*)aligned_alloc(64, ((size_t)a.M * K * sizeof(float) + 63) / 64 * 64);
  // Without its buffer, the portable kernel, which needs none.
  if (!xr) return emlx::scalar_kernels().gemv(a, xsum, n0, n1);
  for (int m = 0; m < a.M; ++m) {
    const float* x = a.x + (long)m * K;
    float* xm = xr + (long)m * K;
    for (int b = 0; b < blocks; ++b)
      for (int s = 0; s < VPL; ++s)
        for (int i = 0; i < 16; ++i) xm[b * BV + s * 16 + i] = x[b * BV + i * VPL + s];
  }
  for (int n = n0; n < n1; n += R) {
    // R rows at once: each x vector serves them all, and their loads
    // overlap.
    const int rows = n1 - n < R ? n1 - n : R;
    emlx::prefetch_params(a, n, R);
    RowLines wrow[R];
    long params[R];
    for (int r = 0; r < R; ++r) {
      const long row = n + (r < rows ? r : rows - 1);
      wrow[r] = row_lines(a.w + row * (K / VPL));
      params[r] = row * groups;
    }
    // The x rows in passes of MB (the last pass repeats its last row); the
    // R weight rows stay in L1 between passes.
    for (int m0 = 0; m0 < a.M; m0 += MB) {
      const int xrows = a.M - m0 < MB ? a.M - m0 : MB;
      const float* xm[MB];
      for (int j = 0; j < MB; ++j) xm[j] = xr + (long)(m0 + (j < xrows ? j : xrows - 1)) * K;
      __m512 tot[R][MB];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < MB; ++j) tot[r][j] = _mm512_setzero_ps();
      for (int b = 0; b < blocks; ++b) {
        __m512i v[R];
        for (int r = 0; r < R; ++r) emlx::prefetch_weights(wrow[r].row + b * 16);
        for (int r = 0; r < R; ++r) v[r] = row_load(wrow[r], b);
        __m512 acc[R][MB][2];
        // Fully unrolled (as are the loops below), so that every
        // accumulator is a register.
#pragma GCC unroll 8
        for (int s = 0; s < VPL; ++s) {
          __m512 qf[R];
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            __m512i q = s == 0 ? v[r] : _mm512_srli_epi32(v[r], s * BITS);
            if (BITS == 4) {
              // A 4-bit value is its own index into a table of 0..15 as
              // floats: the permute reads only each lane's low 4 bits, so
              // one instruction masks and converts.
              qf[r] = _mm512_permutexvar_ps(q, nibbles);
            } else {
              if (s != VPL - 1) q = _mm512_and_si512(q, vmask);
              qf[r] = _mm512_cvtepi32_ps(q);
            }
          }
#pragma GCC unroll 8
          for (int j = 0; j < MB; ++j) {
            const __m512 xv = _mm512_load_ps(xm[j] + b * BV + s * 16);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
              acc[r][j][s % 2] =
                  s < 2 ? _mm512_mul_ps(qf[r], xv) : _mm512_fmadd_ps(qf[r], xv, acc[r][j][s % 2]);
          }
        }
        const long gb = (long)b * BV / G;
        for (int r = 0; r < R; ++r) {
          const __m512 sv = _mm512_permutexvar_ps(
              gidx, params16(a.scales, params[r] + gb, span_mask, a.bf16_params));
          for (int j = 0; j < MB; ++j)
            tot[r][j] = _mm512_fmadd_ps(_mm512_add_ps(acc[r][j][0], acc[r][j][1]), sv, tot[r][j]);
        }
      }
      // Constant bounds here too: tot is indexed by them.
      for (int j = 0; j < MB; ++j) {
        if (j >= xrows) break;
        const float* xs = xsum + (long)(m0 + j) * groups;
        float* y = a.y + (long)(m0 + j) * a.N;
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
          // Bias terms: sum over groups of bias * (sum of x over the group).
          __m512 bt = _mm512_setzero_ps();
          for (int g = 0; g < groups; g += 16) {
            const int c = groups - g < 16 ? groups - g : 16;
            const __mmask16 mk = (__mmask16)(c == 16 ? 0xFFFFu : (1u << c) - 1);
            bt = _mm512_fmadd_ps(params16(a.biases, params[r] + g, mk, a.bf16_params),
                                 _mm512_maskz_loadu_ps(mk, xs + g), bt);
          }
          y[n + r] = _mm512_reduce_add_ps(tot[r][j]) + _mm512_reduce_add_ps(bt);
        }
      }
    }
  }
  free(xr);
}

// Rows per pass of the lane form: 8 spill registers, 2 leave the weight
// stream latency-bound. With several x rows, 2 weight rows against 4 x
// rows keep the accumulators in registers.
#define LANE_ROWS 4
template <int BITS>
static void gemv_lanes_for(const emlx::QmmArgs& a, const float* xsum, int n0, int n1) {
  if (a.M == 1)
    gemv_lanes<BITS, LANE_ROWS, 1>(a, xsum, n0, n1);
  else
    gemv_lanes<BITS, 2, 4>(a, xsum, n0, n1);
}

static void gemv_best(const emlx::QmmArgs& a, const float* xsum, int n0, int n1) {
  if (a.bits == 4 && a.K % 128 == 0)
    gemv_lanes_for<4>(a, xsum, n0, n1);
  else if (a.bits == 8 && a.K % 64 == 0)
    gemv_lanes_for<8>(a, xsum, n0, n1);
  else
    gemv_any(a, xsum, n0, n1);
}

// 12 x 2 accumulators + the B vectors + a broadcast fit the registers.
#define SMR 12
#define SNR 32
#include "sgemm_simd.inc"

}  // namespace avx512

Kernels avx512_kernels() { return Kernels{avx512::gemv_best, avx512::gemm_any, 8, 32}; }
GemmColsFn avx512_gemm() { return avx512::gemm_cols; }
GemmColsFn avx512_gemm_small() { return avx512::gemm_small; }

}  // namespace emlx
#endif
