// AVX2 rows of the one-token attention (float32 and float16 keys and
// values), selected at run time; the softmax stays the portable one.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "elementwise.h"

namespace emlx {
namespace {

// 8 keys' or values' elements as float32: float16 converted (F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hd a multiple of 8.
template <typename KV>
void attend_avx2_t(const float* q, const KV* k, const KV* v, float* scores, float* out, int G,
                   int n, int hd) {
  for (int j = 0; j < n; ++j) {
    const KV* kj = k + (long)j * hd;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (long)g * hd;
      __m256 acc = _mm256_setzero_ps();
      for (int e = 0; e < hd; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + e), load8(kj + e), acc);
      scores[(long)g * n + j] = sum8(acc);
    }
  }
  attention_weights(softmax_row_scalar, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    const KV* vj = v + (long)j * hd;
    for (int g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(scores[(long)g * n + j]);
      float* og = out + (long)g * hd;
      for (int e = 0; e < hd; e += 8)
        _mm256_storeu_ps(og + e, _mm256_fmadd_ps(p, load8(vj + e), _mm256_loadu_ps(og + e)));
    }
  }
}

}  // namespace

void attend_avx2(const float* q, const float* k, const float* v, float* scores, float* out,
                 int G, int n, int hd) {
  attend_avx2_t(q, k, v, scores, out, G, n, hd);
}

void attend_f16_avx2(const float* q, const uint16_t* k, const uint16_t* v, float* scores,
                     float* out, int G, int n, int hd) {
  attend_avx2_t(q, k, v, scores, out, G, n, hd);
}

}  // namespace emlx
#endif
