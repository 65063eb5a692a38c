// Portable variant: any CPU, and the reference the SIMD variants are tested against.
#include <math.h>
#include <stdint.h>

#include "qmm.h"

namespace emlx {
namespace {

inline float qval(const uint8_t* row, int k, int bits) {
  if (bits == 8) return (float)row[k];
  return (float)((row[k >> 1] >> ((k & 1) * 4)) & 0x0F);
}

void gemv(const QmmArgs& a, const float* xsum, int n0, int n1) {
  const long row_bytes = (long)a.K * a.bits / 8;
  const int groups = a.K / a.group;
  for (int m = 0; m < a.M; ++m) {
    const float* x = a.x + (long)m * a.K;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = (const uint8_t*)a.w + n * row_bytes;
      float total = 0.0f;
      float bias_term = 0.0f;
      for (int g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int k = g * a.group; k < (g + 1) * a.group; ++k) dot += qval(row, k, a.bits) * x[k];
        const long p = (long)n * groups + g;
        total += qmm_param(a.scales, p, a.bf16_params) * dot;
        bias_term += qmm_param(a.biases, p, a.bf16_params) * xsum[(long)m * groups + g];
      }
      a.y[(long)m * a.N + n] = total + bias_term;
    }
  }
}

void gemm(const QmmArgs& a, const float* /*xp: not packed*/, int n0, int n1) {
  const long row_bytes = (long)a.K * a.bits / 8;
  const int groups = a.K / a.group;
  for (int m = 0; m < a.M; ++m) {
    const float* x = a.x + (long)m * a.K;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = (const uint8_t*)a.w + n * row_bytes;
      float acc = 0.0f;
      for (int k = 0; k < a.K; ++k) {
        const long g = (long)n * groups + k / a.group;
        const float s = qmm_param(a.scales, g, a.bf16_params);
        acc += x[k] * fmaf(s, qval(row, k, a.bits), qmm_param(a.biases, g, a.bf16_params));
      }
      a.y[(long)m * a.N + n] = acc;
    }
  }
}

}  // namespace

Kernels scalar_kernels() { return Kernels{gemv, gemm}; }

}  // namespace emlx
