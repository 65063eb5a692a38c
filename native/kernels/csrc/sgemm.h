// Dense f32 matrix product (the BLAS sgemm contract, row-major form).
// Helpers here are static: this header is also compiled under wider targets.
#pragma once

#include <cstdint>

namespace emlx {

// An IEEE half's value (elementwise.cpp).
float half_to_float(uint16_t h);

// C[i, j] = alpha * sum_k a(i, k) b(k, j) + beta * C[i, j], row-major, where
// a(i, k) = trans_a ? A[k * lda + i] : A[i * lda + k], likewise b; B's
// elements are float16 where b16 is set (a float16 KV cache, read without
// a float32 copy), float32 at b otherwise.
struct GemmArgs {
  bool trans_a, trans_b;
  int M, N, K;
  float alpha;
  const float* a;
  int lda;
  const float* b;
  int ldb;
  float beta;
  float* c;
  int ldc;
  const uint16_t* b16 = nullptr;
};

static inline float gemm_a(const GemmArgs& g, int i, int k) {
  return g.trans_a ? g.a[(long)k * g.lda + i] : g.a[(long)i * g.lda + k];
}
static inline float gemm_b(const GemmArgs& g, int k, int j) {
  const long at = g.trans_b ? (long)j * g.ldb + k : (long)k * g.ldb + j;
  return g.b16 ? half_to_float(g.b16[at]) : g.b[at];
}

// Adds alpha * A B to columns n0..n1 of C (beta already applied).
using GemmColsFn = void (*)(const GemmArgs&, int n0, int n1);
void gemm_reference(const GemmArgs& g, int n0, int n1);
#if defined(__x86_64__)
GemmColsFn avx2_gemm();
GemmColsFn avx512_gemm();
// The same product for a few rows, unpacked (see kSmallRows).
GemmColsFn avx2_gemm_small();
GemmColsFn avx512_gemm_small();
#endif

// The whole product on the selected variant, split over the pool.
void sgemm(const GemmArgs& g, int isa, int max_threads);

}  // namespace emlx
