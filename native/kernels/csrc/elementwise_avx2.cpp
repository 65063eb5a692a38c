// AVX2 rows of the one-token attention (float32, float16 and quantized
// keys and values), selected at run time; the softmax stays the portable one.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "elementwise.h"

namespace emlx {
namespace {

// Rows of keys or values (see KvRows): 8 values of row j from e as float32.
struct F32Rows {
  const float* p;
  int hd;
  __m256 load8(long j, int e) const { return _mm256_loadu_ps(p + j * hd + e); }
};
struct F16Rows {
  const uint16_t* p;
  int hd;
  __m256 load8(long j, int e) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * hd + e)));
  }
};
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hd a multiple of 8.
template <typename Rows>
void attend_avx2_t(const float* q, const Rows& k, const Rows& v, float* scores, float* out, int G,
                   int n, int hd) {
  for (int j = 0; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (long)g * hd;
      __m256 acc = _mm256_setzero_ps();
      for (int e = 0; e < hd; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + e), k.load8(j, e), acc);
      scores[(long)g * n + j] = sum8(acc);
    }
  }
  attention_weights(softmax_row_scalar, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(scores[(long)g * n + j]);
      float* og = out + (long)g * hd;
      for (int e = 0; e < hd; e += 8)
        _mm256_storeu_ps(og + e, _mm256_fmadd_ps(p, v.load8(j, e), _mm256_loadu_ps(og + e)));
    }
  }
}

// What attend_quant_simd.inc needs: 8 lanes, and 8 integers as float32
// from 8 bytes (8 bits) or from the nibbles of 4 bytes (4 bits).
#include "vec_avx2.inc"
#define SOFTMAX_ROW softmax_row_scalar
template <int BITS>
static inline vf ints_w(const uint8_t* p) {
  __m128i bytes;
  if constexpr (BITS == 8) {
    bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {
    int word;
    __builtin_memcpy(&word, p, sizeof word);
    const __m128i x = _mm_cvtsi32_si128(word);
    const __m128i low = _mm_set1_epi8(0x0f);
    bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

#define ATTEND_PLAIN attend_avx2_t
#include "attend_quant_simd.inc"

}  // namespace

void attend_avx2(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                 int G, int n, int hd) {
  attend_rows(q, k, v, scores, out, G, n, hd);
}

}  // namespace emlx
#endif
