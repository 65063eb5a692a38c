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

#define W 8
// 3 x 4 accumulators + 4 weight vectors + 1 x vector fit the 16 registers.
#define MR 3
#define NR 4
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vset1(float s) { return _mm256_set1_ps(s); }
static inline float vhsum(vf v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

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

Kernels avx2_kernels() { return Kernels{avx2::gemv_any, avx2::gemm_any}; }
GemmColsFn avx2_gemm() { return avx2::gemm_cols; }
GemmColsFn avx2_gemm_small() { return avx2::gemm_small; }

}  // namespace emlx
#endif
