// AVX-512 rows of the elementwise kernels, selected at run time.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <vector>

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
};
struct F16Rows {
  const uint16_t* p;
  int hd;
  __m512 load16(long j, int e, __mmask16) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * hd + e)));
  }
};
// Quantized rows: 16 values inside one group as the float32 of their
// integers (16 bytes at 8 bits; the nibbles of 8 bytes, low nibble first,
// at 4 bits), and each group's scale and bias.
template <int BITS>
struct QuantRows {
  const uint8_t* p;
  const float* s;
  const float* b;
  int hd, shift;  // the group's log2
  __m512 ints16(long j, int e) const {
    const long i = j * hd + e;
    __m128i bytes;
    if constexpr (BITS == 8) {
      bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    } else {
      const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i / 2));
      const __m128i low = _mm_set1_epi8(0x0f);
      bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  }
};

// Attention over quantized rows, a group at a time: each 16 integers
// converted once for the G query heads; a key's score is the sum over its
// groups of scale * (q . ints) + bias * (the sum of q over the group), and
// each value group adds (p * scale) * ints to a head's output, its
// p * bias summed apart and added once at the end.
template <int G, int BITS>
void attend_quant_avx512(const float* q, const QuantRows<BITS>& k, const QuantRows<BITS>& v,
                         float* scores, float* out, int n, int hd) {
  const int group = 1 << k.shift, groups = hd >> k.shift;
  std::vector<float> qsum((size_t)G * groups), bsum((size_t)G * groups, 0.0f);
  for (int g = 0; g < G; ++g)
    for (int gi = 0; gi < groups; ++gi) {
      float t = 0.0f;
      for (int e = 0; e < group; ++e) t += q[(long)g * hd + gi * group + e];
      qsum[g * groups + gi] = t;
    }
  for (int j = 0; j < n; ++j) {
    __m512 total[G];
    float bias[G];
    for (int g = 0; g < G; ++g) {
      total[g] = _mm512_setzero_ps();
      bias[g] = 0.0f;
    }
    for (int gi = 0; gi < groups; ++gi) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int e = gi * group; e < (gi + 1) * group; e += 16) {
        const __m512 x = k.ints16(j, e);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (long)g * hd + e), x, acc[g]);
      }
      const long at = (long)j * groups + gi;
      const __m512 scale = _mm512_set1_ps(k.s[at]);
      for (int g = 0; g < G; ++g) {
        total[g] = _mm512_fmadd_ps(scale, acc[g], total[g]);
        bias[g] += k.b[at] * qsum[g * groups + gi];
      }
    }
    for (int g = 0; g < G; ++g) scores[(long)g * n + j] = _mm512_reduce_add_ps(total[g]) + bias[g];
  }
  attention_weights(softmax_row_avx512, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    for (int gi = 0; gi < groups; ++gi) {
      const long at = (long)j * groups + gi;
      __m512 w[G];
      for (int g = 0; g < G; ++g) {
        const float p = scores[(long)g * n + j];
        w[g] = _mm512_set1_ps(p * v.s[at]);
        bsum[g * groups + gi] += p * v.b[at];
      }
      for (int e = gi * group; e < (gi + 1) * group; e += 16) {
        const __m512 x = v.ints16(j, e);
        for (int g = 0; g < G; ++g) {
          float* o = out + (long)g * hd + e;
          _mm512_storeu_ps(o, _mm512_fmadd_ps(w[g], x, _mm512_loadu_ps(o)));
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int gi = 0; gi < groups; ++gi) {
      const __m512 b = _mm512_set1_ps(bsum[g * groups + gi]);
      for (int e = gi * group; e < (gi + 1) * group; e += 16) {
        float* o = out + (long)g * hd + e;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), b));
      }
    }
}

template <int BITS, int G = 1>
void attend_quant_g(const float* q, const QuantRows<BITS>& k, const QuantRows<BITS>& v,
                    float* scores, float* out, int g, int n, int hd) {
  if constexpr (G < 8) {
    if (g != G) return attend_quant_g<BITS, G + 1>(q, k, v, scores, out, g, n, hd);
  }
  attend_quant_avx512<G, BITS>(q, k, v, scores, out, n, hd);
}

template <typename Rows>
void attend_avx512_t(const float* q, const Rows& k, const Rows& v, float* scores, float* out,
                     int G, int n, int hd) {
  for (int j = 0; j < n; ++j) {
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

template <int BITS>
QuantRows<BITS> quant_rows(const KvRows& r, int hd) {
  return {static_cast<const uint8_t*>(r.data), r.scales, r.biases, hd, __builtin_ctz(r.group)};
}

// Query heads per key head the quantized kernel unrolls (up to 8; more go
// through it in parts of 8).
template <int BITS>
void attend_quant(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                  int G, int n, int hd) {
  const auto keys = quant_rows<BITS>(k, hd), values = quant_rows<BITS>(v, hd);
  for (int g0 = 0; g0 < G; g0 += 8) {
    const int g = G - g0 < 8 ? G - g0 : 8;
    attend_quant_g<BITS>(q + (long)g0 * hd, keys, values, scores + (long)g0 * n,
                         out + (long)g0 * hd, g, n, hd);
  }
}

}  // namespace

void attend_avx512(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                   int G, int n, int hd) {
  switch (k.bits) {
    case 32:
      attend_avx512_t(q, F32Rows{static_cast<const float*>(k.data), hd},
                      F32Rows{static_cast<const float*>(v.data), hd}, scores, out, G, n, hd);
      break;
    case 16:
      attend_avx512_t(q, F16Rows{static_cast<const uint16_t*>(k.data), hd},
                      F16Rows{static_cast<const uint16_t*>(v.data), hd}, scores, out, G, n, hd);
      break;
    case 8:
      attend_quant<8>(q, k, v, scores, out, G, n, hd);
      break;
    default:
      attend_quant<4>(q, k, v, scores, out, G, n, hd);
  }
}

}  // namespace emlx
#endif
