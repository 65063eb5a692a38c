// Int8-activation product with AVX512-VNNI (vpdpbusd), selected at run time.
// Its own file: the float32 AVX-512 variant must not require VNNI.
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")
// GCC 12 flags its own intrinsics headers (self-initialized placeholders).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <stdint.h>
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

}  // namespace int8_avx512

Int8Kernels avx512_int8_kernels() {
  // The AVX2 quantizer: 32 elements are one AVX2 step already.
  return Int8Kernels{quantize_activations_avx2, int8_avx512::gemm_int8_any, NB};
}

}  // namespace emlx
#endif
