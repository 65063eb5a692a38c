// Int8-activation product with AVX512-VNNI (vpdpbusd), selected at run time.
// Its own file: the float32 AVX-512 variant must not require VNNI.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
// GCC 12 flags its own intrinsics headers (self-initialized placeholders).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

#include "qmm_int8.h"

namespace emlx {
namespace int8_avx512 {

// 32 weight rows per packed block: two vectors of 16 lanes.
#define NB 32
// 4 x 2 integer sums + 4 x 2 block sums + 4 x 2 accumulators + 2 weight
// vectors fit the 32 registers.
#define IMR(BITS) 4

// A full block of NB rows by gathers: one 4-byte gather over 16 rows gives
// a quad of 8-bit weights, or for 4-bit weights two quads (low nibbles: the
// block's even elements, high nibbles: the odd ones).
template <int BITS>
static inline bool pack_weights_fast(const emlx::QmmArgs& a, int n, int rows, int c0, int c1,
                                     uint8_t* pw) {
  const long row_bytes = (long)a.K * BITS / 8;
  if (rows != NB || 16 * row_bytes > 0x7FFFFFFFL) return false;
  const int block_bytes = emlx::kXBlock * BITS / 8;
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32((int)row_bytes));
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < NB / 16; ++h) {
    const uint8_t* base = (const uint8_t*)a.w + (long)(n + h * 16) * row_bytes;
    for (int c = c0; c < c1; ++c) {
      const uint8_t* src = base + (long)c * block_bytes;
      uint8_t* dst = pw + ((long)(c - c0) * 8 * NB + h * 16) * 4;
      for (int j = 0; j < block_bytes / 4; ++j) {
        const __m512i v = _mm512_i32gather_epi32(index, (const void*)(src + j * 4), 1);
        if (BITS == 4) {
          _mm512_store_si512((void*)(dst + (long)j * NB * 4), _mm512_and_si512(v, mask));
          _mm512_store_si512((void*)(dst + (long)(j + 4) * NB * 4),
                             _mm512_and_si512(_mm512_srli_epi32(v, 4), mask));
        } else {
          _mm512_store_si512((void*)(dst + (long)j * NB * 4), v);
        }
      }
    }
  }
  return true;
}

static inline int load4(const int8_t* p) {
  int v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

template <int R, int BITS>
static void micro_int8(const emlx::Int8MicroArgs& m) {
  const int c0 = m.cols < 16 ? m.cols : 16;
  const __mmask16 k0 = (__mmask16)((1u << c0) - 1);
  const __mmask16 k1 = (__mmask16)((1u << (m.cols - c0)) - 1);
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) {
    if (m.g0 == 0) {
      acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    } else {
      acc[i][0] = _mm512_maskz_loadu_ps(k0, m.y + (long)i * m.ldy);
      acc[i][1] = _mm512_maskz_loadu_ps(k1, m.y + (long)i * m.ldy + 16);
    }
  }
  const long first = (long)m.g0 * m.per_group;
  for (int g = m.g0; g < m.g1; ++g) {
    __m512 t[R][2];
    for (int i = 0; i < R; ++i) t[i][0] = t[i][1] = _mm512_setzero_ps();
    for (int c = g * m.per_group; c < (g + 1) * m.per_group; ++c) {
      __m512i s[R][2];
      for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = _mm512_setzero_si512();
      const uint8_t* wq = m.pw + (c - first) * 8 * NB * 4;
      const int8_t* xc = m.xq + c * emlx::kXBlock;
      for (int j = 0; j < 8; ++j) {
        const __m512i w0 = _mm512_load_si512((const void*)(wq + j * NB * 4));
        const __m512i w1 = _mm512_load_si512((const void*)(wq + j * NB * 4 + 64));
        for (int i = 0; i < R; ++i) {
          const __m512i xb = _mm512_set1_epi32(load4(xc + (long)i * m.K + j * 4));
          s[i][0] = _mm512_dpbusd_epi32(s[i][0], w0, xb);
          s[i][1] = _mm512_dpbusd_epi32(s[i][1], w1, xb);
        }
      }
      for (int i = 0; i < R; ++i) {
        const __m512 sx = _mm512_set1_ps(m.xs[(long)i * m.blocks + c]);
        t[i][0] = _mm512_fmadd_ps(sx, _mm512_cvtepi32_ps(s[i][0]), t[i][0]);
        t[i][1] = _mm512_fmadd_ps(sx, _mm512_cvtepi32_ps(s[i][1]), t[i][1]);
      }
    }
    const __m512 s0 = _mm512_load_ps(m.ps + (long)g * NB);
    const __m512 s1 = _mm512_load_ps(m.ps + (long)g * NB + 16);
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm512_fmadd_ps(s0, t[i][0], acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(s1, t[i][1], acc[i][1]);
    }
  }
  if (m.g1 == m.groups) {
    __m512 bacc[R][2];
    for (int i = 0; i < R; ++i) bacc[i][0] = bacc[i][1] = _mm512_setzero_ps();
    for (int g = 0; g < m.groups; ++g) {
      const __m512 b0 = _mm512_load_ps(m.pb + (long)g * NB);
      const __m512 b1 = _mm512_load_ps(m.pb + (long)g * NB + 16);
      for (int i = 0; i < R; ++i) {
        const __m512 xs = _mm512_set1_ps(m.xsum[(long)i * m.groups + g]);
        bacc[i][0] = _mm512_fmadd_ps(b0, xs, bacc[i][0]);
        bacc[i][1] = _mm512_fmadd_ps(b1, xs, bacc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i) {
      acc[i][0] = _mm512_add_ps(acc[i][0], bacc[i][0]);
      acc[i][1] = _mm512_add_ps(acc[i][1], bacc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    float* y = m.y + (long)i * m.ldy;
    _mm512_mask_storeu_ps(y, k0, acc[i][0]);
    _mm512_mask_storeu_ps(y + 16, k1, acc[i][1]);
  }
}

#include "qmm_int8_simd.inc"
#include "rows_avx512.inc"

// 128-bit lane K of v in every lane.
template <int K>
static inline __m512 lane(__m512 v) {
  return _mm512_shuffle_f32x4(v, v, K * 0x55);
}

// Parameters (scales or biases) of 4 weight rows, from their first groups
// p + first[j], as out[g * 4 + j] for all `groups` groups (rounded up to 16).
static void params_by_group(const void* p, const long* first, int groups, bool bf16, float* out) {
  for (int g = 0; g < groups; g += 16) {
    const int c = groups - g < 16 ? groups - g : 16;
    const __mmask16 mk = (__mmask16)(c == 16 ? 0xFFFFu : (1u << c) - 1);
    __m512 r[4];
    for (int j = 0; j < 4; ++j) r[j] = params16(p, first[j] + g, mk, bf16);
    // In each 128-bit lane i (groups g + 4i ..): 4 x 4 transposes, then the
    // lanes put in group order.
    const __m512 a0 = _mm512_unpacklo_ps(r[0], r[1]), a1 = _mm512_unpackhi_ps(r[0], r[1]);
    const __m512 b0 = _mm512_unpacklo_ps(r[2], r[3]), b1 = _mm512_unpackhi_ps(r[2], r[3]);
    const __m512 v[4] = {
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a0), _mm512_castps_pd(b0))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a0), _mm512_castps_pd(b0))),
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a1), _mm512_castps_pd(b1))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a1), _mm512_castps_pd(b1)))};
    const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
    const __m512 t2 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
    _mm512_store_ps(out + g * 4, _mm512_shuffle_f32x4(t0, t1, 0x88));
    _mm512_store_ps(out + g * 4 + 16, _mm512_shuffle_f32x4(t0, t1, 0xDD));
    _mm512_store_ps(out + g * 4 + 32, _mm512_shuffle_f32x4(t2, t3, 0x88));
    _mm512_store_ps(out + g * 4 + 48, _mm512_shuffle_f32x4(t2, t3, 0xDD));
  }
}

// The matrix-vector form, for one row of x and 4-bit weights, read as
// stored (no repacking): a 64-byte load of a weight row is 4 blocks, its
// low nibbles pairing with the blocks' even activations and its high ones
// with the odd (x is laid out once per call so that one load holds each),
// and vpdpbusd leaves 4 partial sums a block. Four rows' are added and
// interleaved into one vector, a 128-bit lane a block, a lane in it a row;
// the float steps then repeat the scalar order on those 4 lanes.
static void gemv_int8_4bit(const emlx::QmmArgs& a, const emlx::Int8Activations& xa, int n0,
                           int n1) {
  const int K = a.K;
  const int groups = K / a.group;
  const int per_group = a.group / emlx::kXBlock;
  const long row_bytes = K / 2;
  const size_t param_bytes = (size_t)(groups + 15) / 16 * 16 * 4 * sizeof(float);
  int8_t* xeo = (int8_t*)aligned_alloc(64, (size_t)K);
  float* sw = (float*)aligned_alloc(64, 2 * param_bytes);
  if (!xeo || !sw) {
    // Without its buffers, the portable kernel, which needs none.
    free(xeo);
    free(sw);
    return emlx::scalar_int8_kernels().gemm(a, xa, n0, n1);
  }
  float* sb = sw + param_bytes / sizeof(float);
  int8_t* xe = xeo;
  int8_t* xo = xeo + K / 2;
  for (int c = 0; c < K / emlx::kXBlock; ++c) {
    __builtin_memcpy(xe + c * 16, xa.q + c * 32, 16);
    __builtin_memcpy(xo + c * 16, xa.q + c * 32 + 16, 16);
  }
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int n = n0; n < n1; n += 4) {
    const int rows = n1 - n < 4 ? n1 - n : 4;
    emlx::prefetch_params(a, n, 4);
    RowLines w[4];
    long params[4];
    for (int j = 0; j < 4; ++j) {
      const long row = n + (j < rows ? j : rows - 1);
      w[j] = row_lines(a.w + row * (row_bytes / 4));
      params[j] = row * groups;
    }
    params_by_group(a.scales, params, groups, a.bf16_params, sw);
    params_by_group(a.biases, params, groups, a.bf16_params, sb);
    __m512 acc = _mm512_setzero_ps();
    __m512 t = _mm512_setzero_ps();
    for (int b = 0; b < K / 128; ++b) {
      const __m512i e = _mm512_load_si512((const void*)(xe + b * 64));
      const __m512i o = _mm512_load_si512((const void*)(xo + b * 64));
      __m512i d[4];
      for (int j = 0; j < 4; ++j) emlx::prefetch_weights(w[j].row + b * 16);
      for (int j = 0; j < 4; ++j) {
        const __m512i v = row_load(w[j], b);
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        d[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, e), hi, o);
      }
      const __m512i d01 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]),
                                           _mm512_unpackhi_epi32(d[0], d[1]));
      const __m512i d23 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]),
                                           _mm512_unpackhi_epi32(d[2], d[3]));
      const __m512 f = _mm512_cvtepi32_ps(
          _mm512_add_epi32(_mm512_unpacklo_epi64(d01, d23), _mm512_unpackhi_epi64(d01, d23)));
      const __m512 fk[4] = {lane<0>(f), lane<1>(f), lane<2>(f), lane<3>(f)};
      for (int k = 0; k < 4; ++k) {
        const int c = b * 4 + k;
        const __m512 from = c % per_group == 0 ? _mm512_setzero_ps() : t;
        t = _mm512_fmadd_ps(_mm512_set1_ps(xa.scale[c]), fk[k], from);
        if (c % per_group == per_group - 1) {
          const __m512 s = _mm512_castps128_ps512(_mm_load_ps(sw + (c / per_group) * 4));
          acc = _mm512_fmadd_ps(s, t, acc);
        }
      }
    }
    __m512 bacc = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g)
      bacc = _mm512_fmadd_ps(_mm512_castps128_ps512(_mm_load_ps(sb + g * 4)),
                             _mm512_set1_ps(xa.sum[g]), bacc);
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_add_ps(acc, bacc));
    for (int j = 0; j < rows; ++j) a.y[n + j] = out[j];
  }
  free(xeo);
  free(sw);
}

}  // namespace int8_avx512

Int8Kernels avx512_int8_kernels() {
  // The AVX2 quantizer: 32 elements are one AVX2 step already.
  return Int8Kernels{quantize_activations_avx2, int8_avx512::gemm_int8_any, NB,
                     int8_avx512::gemv_int8_4bit};
}

}  // namespace emlx
#endif
