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

// 8 weight rows per packed block: one vector of 8 lanes.
#define NB 8
// 4-bit: 4 int16 sums + 4 block sums + 4 accumulators + weights, x and a
// constant fit the 16 registers; 8-bit needs two int16 sums per row.
#define IMR(BITS) ((BITS) == 4 ? 4 : 2)

template <int BITS>
static inline bool pack_weights_fast(const emlx::QmmArgs&, int, int, int, int, uint8_t*) {
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
  for (int i = 0; i < R; ++i) {
    if (m.g0 == 0) {
      acc[i] = _mm256_setzero_ps();
    } else {
      float in[NB] = {0};
      for (int j = 0; j < m.cols; ++j) in[j] = m.y[(long)i * m.ldy + j];
      acc[i] = _mm256_loadu_ps(in);
    }
  }
  const long first = (long)m.g0 * m.per_group;
  for (int g = m.g0; g < m.g1; ++g) {
    __m256 t[R];
    for (int i = 0; i < R; ++i) t[i] = _mm256_setzero_ps();
    for (int c = g * m.per_group; c < (g + 1) * m.per_group; ++c) {
      // int16 sums of 8 pmaddubsw results: at most 8 * 2 * 15 * 127 = 30480.
      __m256i lo[R], hi[R];
      for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_si256();
      const uint8_t* wq = m.pw + (c - first) * 8 * NB * 4;
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
  if (m.g1 == m.groups) {
    __m256 bacc[R];
    for (int i = 0; i < R; ++i) bacc[i] = _mm256_setzero_ps();
    for (int g = 0; g < m.groups; ++g) {
      const __m256 bw = _mm256_load_ps(m.pb + (long)g * NB);
      for (int i = 0; i < R; ++i)
        bacc[i] = _mm256_fmadd_ps(bw, _mm256_set1_ps(m.xsum[(long)i * m.groups + g]), bacc[i]);
    }
    for (int i = 0; i < R; ++i) acc[i] = _mm256_add_ps(acc[i], bacc[i]);
  }
  for (int i = 0; i < R; ++i) {
    float* y = m.y + (long)i * m.ldy;
    if (m.cols == NB) {
      _mm256_storeu_ps(y, acc[i]);
    } else {
      float out[NB];
      _mm256_storeu_ps(out, acc[i]);
      for (int j = 0; j < m.cols; ++j) y[j] = out[j];
    }
  }
}

#include "qmm_int8_simd.inc"

}  // namespace int8_avx2

// The portable quantizer's results (qmm_int8.cpp), 32 elements at a time:
// the maximum is exact in any order, x * id is the same one multiply, and
// roundps rounds like the portable code's rintf (both follow the rounding
// mode, round-to-nearest-even by default).
void quantize_activations_avx2(const QmmArgs& a, int m0, int m1, int8_t* q, float* scale,
                               float* sum) {
  const int K = a.K;
  const int blocks = K / kXBlock;
  const int groups = K / a.group;
  const int per_group = a.group / kXBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // Per 128-bit lane: the even bytes, then the odd ones.
  const __m256i even_odd = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                            4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int m = m0; m < m1; ++m) {
    const float* x = a.x + (long)m * K;
    float* scales = scale + (long)m * blocks;
    int qsums[4];
    for (int g = 0; g < groups; ++g) {
      for (int j = 0; j < per_group; ++j) {
        const int c = g * per_group + j;
        const float* xb = x + c * kXBlock;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        int nan = 0;
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + i * 8);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
          nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float d = nan ? __builtin_nanf("") : _mm_cvtss_f32(h) / 127.0f;
        scales[c] = d;
        int8_t* qb = q + (long)m * K + c * kXBlock;
        if (!(d > 0.0f) || d - d != 0.0f) {
          // Zero, NaN or infinite: q = 0, as the portable code gives.
          _mm256_storeu_si256((__m256i*)qb, _mm256_setzero_si256());
          qsums[j] = 0;
          continue;
        }
        const __m256 id = _mm256_set1_ps(1.0f / d);
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) {
          // Rounded as the portable code rounds, then clamped as it clamps
          // (min/max keep a NaN, which becomes 0): exact also when 1 / d
          // overflows for a subnormal d.
          __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_CUR_DIRECTION);
          r = _mm256_max_ps(_mm256_set1_ps(-127.0f), _mm256_min_ps(_mm256_set1_ps(127.0f), r));
          r = _mm256_andnot_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q), r);
          i32[i] = _mm256_cvtps_epi32(r);
        }
        // Integers in -127..127: the packs never saturate.
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                             _mm256_packs_epi32(i32[2], i32[3]));
        __m256i out = _mm256_permutevar8x32_epi32(b, natural);
        if (a.bits == 4)
          out = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(out, even_odd), 0xD8);
        _mm256_storeu_si256((__m256i*)qb, out);
        const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                            _mm256_add_epi32(i32[2], i32[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        qsums[j] = _mm_cvtsi128_si32(s);
      }
      float total = 0.0f;
      for (int j = 0; j < per_group; ++j)
        total = __builtin_fmaf(scales[g * per_group + j], (float)qsums[j], total);
      sum[(long)m * groups + g] = total;
    }
  }
}

Int8Kernels avx2_int8_kernels() {
  return Int8Kernels{quantize_activations_avx2, int8_avx2::gemm_int8_any, NB, nullptr};
}

}  // namespace emlx
#endif
