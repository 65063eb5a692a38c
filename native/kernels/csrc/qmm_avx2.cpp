// AVX2 + FMA variant, selected at run time.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "qmm.h"
#include "sgemm.h"

namespace emlx {
namespace avx2 {

// 6 x 2 accumulators, the panel's two vectors and a broadcast fit the 16
// registers.
#define GR 6
// The dot-product tile for a few rows of x: 3 x 4 accumulators, 4 weight
// vectors and 1 x vector fit the 16 registers.
#define MR 3
#define NR 4
#include "vec_avx2.inc"

struct F16 {
  vf v[16 / W];
};
static inline F16 cvt16(__m128i b) {
  F16 r;
  r.v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  r.v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b)));
  return r;
}

#include "qmm_simd.inc"

// 6 x 2 accumulators + the B vectors + a broadcast fit the registers.
#define SMR 6
#define SNR 16
#include "sgemm_simd.inc"

}  // namespace avx2

Kernels avx2_kernels() { return Kernels{avx2::gemv_any, avx2::gemm_any, 2, 16}; }
GemmColsFn avx2_gemm() { return avx2::gemm_cols; }
GemmColsFn avx2_gemm_small() { return avx2::gemm_small; }

}  // namespace emlx
#endif
