// AVX-512 rows of the elementwise kernels, selected at run time.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "elementwise.h"

namespace emlx {
namespace {

// exp(x) to about 1 ulp: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial for e^r (the Cephes expf coefficients), then 2^n exactly.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.37626f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail(int left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

}  // namespace

void softmax_row_avx512(const float* x, float* y, int seen, int S) {
  __m512 mv = _mm512_set1_ps(-__builtin_inff());
  for (int j = 0; j < seen; j += 16)
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail(seen - j), x + j));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sv = _mm512_setzero_ps();
  for (int j = 0; j < seen; j += 16) {
    const __mmask16 k = tail(seen - j);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), m)));
    _mm512_mask_storeu_ps(y + j, k, e);
    sv = _mm512_add_ps(sv, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
  for (int j = 0; j < seen; j += 16) {
    const __mmask16 k = tail(seen - j);
    _mm512_mask_storeu_ps(y + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, y + j), inv));
  }
  for (int j = seen; j < S; ++j) y[j] = 0.0f;
}

void swiglu_row_avx512(const float* gate, const float* up, float* y, int n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = tail(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(k, gate + i);
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_mul_ps(g, s), _mm512_maskz_loadu_ps(k, up + i)));
  }
}

void rms_norm_row_avx512(const float* x, const float* w, float* y, int D, float eps) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= D; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    s0 = _mm512_fmadd_ps(a, a, s0);
    s1 = _mm512_fmadd_ps(b, b, s1);
  }
  for (; i < D; i += 16) {
    const __m512 a = _mm512_maskz_loadu_ps(tail(D - i), x + i);
    s0 = _mm512_fmadd_ps(a, a, s0);
  }
  const float mean = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * (float)(1.0 / D);
  const __m512 scale = _mm512_set1_ps(1.0f / __builtin_sqrtf(mean + eps));
  for (i = 0; i < D; i += 16) {
    const __mmask16 k = tail(D - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), scale);
    _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(k, w + i)));
  }
}

namespace {

// Rows of keys or values (see KvRows): 16 values of row j from e as
// float32, under mask `m` for float32 rows (float16 and quantized rows come
// in whole 16s, the mask full).
struct F32Rows {
  const float* p;
  int hd;
  __m512 load16(long j, int e, __mmask16 m) const {
    return _mm512_maskz_loadu_ps(m, p + j * hd + e);
  }
  void ahead(long) const {}
};
struct F16Rows {
  const uint16_t* p;
  int hd;
  __m512 load16(long j, int e, __mmask16) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * hd + e)));
  }
  // Row j's cache lines (see kAhead).
  void ahead(long j) const { prefetch_lines(p + j * hd, hd * 2L); }
};

template <typename Rows>
void attend_avx512_t(const float* q, const Rows& k, const Rows& v, float* scores, float* out,
                     int G, int n, int hd) {
  for (int j = 0; j < n; ++j) {
    if (j + kAhead < n) k.ahead(j + kAhead);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (long)g * hd;
      __m512 acc = _mm512_setzero_ps();
      for (int e = 0; e < hd; e += 16) {
        const __mmask16 m = tail(hd - e);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qg + e), k.load16(j, e, m), acc);
      }
      scores[(long)g * n + j] = _mm512_reduce_add_ps(acc);
    }
  }
  attention_weights(softmax_row_avx512, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    if (j + kAhead < n) v.ahead(j + kAhead);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[(long)g * n + j]);
      float* og = out + (long)g * hd;
      for (int e = 0; e < hd; e += 16) {
        const __mmask16 m = tail(hd - e);
        _mm512_mask_storeu_ps(og + e, m,
                              _mm512_fmadd_ps(p, v.load16(j, e, m), _mm512_maskz_loadu_ps(m, og + e)));
      }
    }
  }
}

// What attend_quant_simd.inc needs: 16 lanes, and 16 integers as float32
// from 16 bytes (8 bits) or from the nibbles of 8 bytes (4 bits).
#include "vec_avx512.inc"
#define SOFTMAX_ROW softmax_row_avx512
template <int BITS>
static inline vf ints_w(const uint8_t* p) {
  __m128i bytes;
  if constexpr (BITS == 8) {
    bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i low = _mm_set1_epi8(0x0f);
    bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

#define ATTEND_PLAIN attend_avx512_t
#include "attend_quant_simd.inc"

}  // namespace

void attend_avx512(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                   int G, int n, int hd) {
  attend_rows(q, k, v, scores, out, G, n, hd);
}

}  // namespace emlx
#endif
