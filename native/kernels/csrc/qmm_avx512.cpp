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

#define W 16
#define MR 4
#define NR 4
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vset1(float s) { return _mm512_set1_ps(s); }
static inline float vhsum(vf v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

struct F16 {
  vf v[16 / W];
};
static inline F16 cvt16(__m128i b) {
  F16 r;
  r.v[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  return r;
}

#include "qmm_simd.inc"

// 6 x 2 accumulators + the B vectors + a broadcast fit the registers.
#define SMR 6
#define SNR 32
#include "sgemm_simd.inc"

}  // namespace avx512

Kernels avx512_kernels() { return Kernels{avx512::gemv_any, avx512::gemm_any}; }
GemmColsFn avx512_gemm() { return avx512::gemm_cols; }
GemmColsFn avx512_gemm_small() { return avx512::gemm_small; }

}  // namespace emlx
#endif
