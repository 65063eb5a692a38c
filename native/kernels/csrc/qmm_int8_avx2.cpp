// Int8-activation product with AVX2 (pmaddubsw + pmaddwd), selected at run time.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "qmm_int8.h"

namespace emlx {
namespace int8_avx2 {

// pmaddubsw saturates its pairs of u8 * s8 products to int16: 2 * 15 * 127
// fits, 2 * 255 * 127 does not, so 8-bit weights go in as two nibbles,
// w = lo + 16 * hi, each product then bounded like a 4-bit one.
static inline __m256i dot_nibbles(__m256i w, __m256i xv) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

template <int BITS>
static inline __m256i block_weights(const uint8_t* w) {
  if (BITS == 4) {
    // Low nibbles pair with the block's even activations, high with the odd.
    const __m128i b = _mm_loadu_si128((const __m128i*)w);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
  }
  return _mm256_loadu_si256((const __m256i*)w);
}

template <int BITS>
static inline __m256i block_dot(__m256i wv, __m256i xv) {
  if (BITS == 4) return dot_nibbles(wv, xv);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(wv, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
  return _mm256_add_epi32(dot_nibbles(lo, xv), _mm256_slli_epi32(dot_nibbles(hi, xv), 4));
}

// 8 weight rows per packed block: one vector of 8 lanes.
#define NB 8
// 4-bit: 4 int16 sums + 4 block sums + 4 accumulators + weights, x and a
// constant fit the 16 registers; 8-bit needs two int16 sums per row.
#define IMR(BITS) ((BITS) == 4 ? 4 : 2)

template <int BITS>
static inline bool pack_weights_fast(const emlx::QmmArgs&, int, int, uint8_t*) {
  return false;
}

static inline int load4(const int8_t* p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

template <int R, int BITS>
static void micro_int8(const emlx::Int8MicroArgs& m) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int g = 0; g < m.groups; ++g) {
    __m256 t[R];
    for (int i = 0; i < R; ++i) t[i] = _mm256_setzero_ps();
    for (int c = g * m.per_group; c < (g + 1) * m.per_group; ++c) {
      // int16 sums of 8 pmaddubsw results: at most 8 * 2 * 15 * 127 = 30480.
      __m256i lo[R], hi[R];
      for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
      const uint8_t* wq = m.pw + (long)c * 8 * NB * 4;
      const int8_t* xc = m.xq + c * emlx::kXBlock;
      for (int j = 0; j < 8; ++j) {
        const __m256i w = _mm256_load_si256((const __m256i*)(wq + j * NB * 4));
        const __m256i wl = BITS == 4 ? w : _mm256_and_si256(w, mask);
        const __m256i wh = BITS == 4 ? w : _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
        for (int i = 0; i < R; ++i) {
          const __m256i xb = _mm256_set1_epi32(load4(xc + (long)i * m.K + j * 4));
          lo[i] = _mm256_add_epi16(lo[i], _mm256_maddubs_epi16(wl, xb));
          if (BITS == 8) hi[i] = _mm256_add_epi16(hi[i], _mm256_maddubs_epi16(wh, xb));
        }
      }
      for (int i = 0; i < R; ++i) {
        __m256i s = _mm256_madd_epi16(lo[i], ones);
        if (BITS == 8) s = _mm256_add_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(hi[i], ones), 4));
        const __m256 sx = _mm256_set1_ps(m.xs[(long)i * m.blocks + c]);
        t[i] = _mm256_fmadd_ps(sx, _mm256_cvtepi32_ps(s), t[i]);
      }
    }
    const __m256 sw = _mm256_load_ps(m.ps + (long)g * NB);
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(sw, t[i], acc[i]);
  }
  __m256 bacc[R];
  for (int i = 0; i < R; ++i) bacc[i] = _mm256_setzero_ps();
  for (int g = 0; g < m.groups; ++g) {
    const __m256 bw = _mm256_load_ps(m.pb + (long)g * NB);
    for (int i = 0; i < R; ++i)
      bacc[i] = _mm256_fmadd_ps(bw, _mm256_set1_ps(m.xsum[(long)i * m.groups + g]), bacc[i]);
  }
  for (int i = 0; i < R; ++i) {
    float* y = m.y + (long)i * m.ldy;
    const __m256 v = _mm256_add_ps(acc[i], bacc[i]);
    if (m.cols == NB) {
      _mm256_storeu_ps(y, v);
    } else {
      float out[NB];
      _mm256_storeu_ps(out, v);
      for (int j = 0; j < m.cols; ++j) y[j] = out[j];
    }
  }
}

#include "qmm_int8_simd.inc"

}  // namespace int8_avx2

Int8Kernels avx2_int8_kernels() {
  return Int8Kernels{int8_avx2::gemv_int8_any, int8_avx2::gemm_int8_any, NB};
}

}  // namespace emlx
#endif
