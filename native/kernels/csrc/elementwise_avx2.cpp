// AVX2 rows of the one-token attention (float32, float16 and quantized
// keys and values), selected at run time; the softmax stays the portable one.
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <vector>

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
// Quantized rows: 8 values inside one group as the float32 of their
// integers (8 bytes at 8 bits; the nibbles of 4 bytes, low nibble first, at
// 4 bits), and each group's scale and bias.
template <int BITS>
struct QuantRows {
  const uint8_t* p;
  const float* s;
  const float* b;
  int hd, shift;  // the group's log2
  __m256 ints8(long j, int e) const {
    const long i = j * hd + e;
    __m128i bytes;
    if constexpr (BITS == 8) {
      bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + i));
    } else {
      int word;
      __builtin_memcpy(&word, p + i / 2, sizeof word);
      const __m128i x = _mm_cvtsi32_si128(word);
      const __m128i low = _mm_set1_epi8(0x0f);
      bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low), _mm_and_si128(_mm_srli_epi16(x, 4), low));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
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

// Attention over quantized rows a group at a time, as the AVX-512
// variant's (see there): each 8 integers converted once for the G query
// heads, scales applied to partial sums, biases to sums of queries.
template <int G, int BITS>
void attend_quant_avx2(const float* q, const QuantRows<BITS>& k, const QuantRows<BITS>& v,
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
    __m256 total[G];
    float bias[G];
    for (int g = 0; g < G; ++g) {
      total[g] = _mm256_setzero_ps();
      bias[g] = 0.0f;
    }
    for (int gi = 0; gi < groups; ++gi) {
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int e = gi * group; e < (gi + 1) * group; e += 8) {
        const __m256 x = k.ints8(j, e);
        for (int g = 0; g < G; ++g)
          acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (long)g * hd + e), x, acc[g]);
      }
      const long at = (long)j * groups + gi;
      const __m256 scale = _mm256_set1_ps(k.s[at]);
      for (int g = 0; g < G; ++g) {
        total[g] = _mm256_fmadd_ps(scale, acc[g], total[g]);
        bias[g] += k.b[at] * qsum[g * groups + gi];
      }
    }
    for (int g = 0; g < G; ++g) scores[(long)g * n + j] = sum8(total[g]) + bias[g];
  }
  attention_weights(softmax_row_scalar, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    for (int gi = 0; gi < groups; ++gi) {
      const long at = (long)j * groups + gi;
      __m256 w[G];
      for (int g = 0; g < G; ++g) {
        const float p = scores[(long)g * n + j];
        w[g] = _mm256_set1_ps(p * v.s[at]);
        bsum[g * groups + gi] += p * v.b[at];
      }
      for (int e = gi * group; e < (gi + 1) * group; e += 8) {
        const __m256 x = v.ints8(j, e);
        for (int g = 0; g < G; ++g) {
          float* o = out + (long)g * hd + e;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(w[g], x, _mm256_loadu_ps(o)));
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int gi = 0; gi < groups; ++gi) {
      const __m256 b = _mm256_set1_ps(bsum[g * groups + gi]);
      for (int e = gi * group; e < (gi + 1) * group; e += 8) {
        float* o = out + (long)g * hd + e;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), b));
      }
    }
}

template <int BITS, int G = 1>
void attend_quant_g(const float* q, const QuantRows<BITS>& k, const QuantRows<BITS>& v,
                    float* scores, float* out, int g, int n, int hd) {
  if constexpr (G < 8) {
    if (g != G) return attend_quant_g<BITS, G + 1>(q, k, v, scores, out, g, n, hd);
  }
  attend_quant_avx2<G, BITS>(q, k, v, scores, out, n, hd);
}

template <int BITS>
QuantRows<BITS> quant_rows(const KvRows& r, int hd) {
  return {static_cast<const uint8_t*>(r.data), r.scales, r.biases, hd, __builtin_ctz(r.group)};
}

// Query heads in parts of up to 8, each unrolled.
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

void attend_avx2(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                 int G, int n, int hd) {
  switch (k.bits) {
    case 32:
      attend_avx2_t(q, F32Rows{static_cast<const float*>(k.data), hd},
                    F32Rows{static_cast<const float*>(v.data), hd}, scores, out, G, n, hd);
      break;
    case 16:
      attend_avx2_t(q, F16Rows{static_cast<const uint16_t*>(k.data), hd},
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
