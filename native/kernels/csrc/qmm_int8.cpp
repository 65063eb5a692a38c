// Int8-activation affine-quantized product: the activation quantizer, the
// portable (reference) kernel, variant selection and the threaded split.
//
// The algebra. MLX's affine layout dequantizes weight element (n, k) of group
// g = k / G as w[n, k] = s_w[n, g] * q_w[n, k] + b_w[n, g], q_w unsigned
// (0..15 for 4 bits, 0..255 for 8). So, exactly,
//
//   y[m, n] = sum_g s_w[n, g] * sum_{k in g} q_w[n, k] x[m, k]
//           + sum_g b_w[n, g] * X[m, g],        X[m, g] = sum_{k in g} x[m, k].
//
// Each block c of 32 elements of a row of x (a group holds G / 32 of them) is
// replaced by x'[m, k] = s_x[m, c] * q_x[m, k], with
//
//   s_x[m, c] = max_{k in c} |x[m, k]| / 127,
//   q_x[m, k] = round_to_nearest_even(x[m, k] * (1 / s_x[m, c])), in -127..127
//
// (symmetric, no zero point, so q_w * q_x needs no correction term). Then
//
//   sum_{k in g} q_w x' = sum_{c in g} s_x[m, c] * I[m, n, c],
//   I[m, n, c] = sum_{k in c} q_w[n, k] q_x[m, k]   (an exact integer:
//                |I| <= 32 * 255 * 127 < 2^24, so it is also exact in float),
//
// and the group sums are those of x' too, X'[m, g] = sum_{c in g} s_x[m, c] *
// Q[m, c] with Q[m, c] = sum_{k in c} q_x[m, k] (exact). The product is then
// exactly x' times the dequantized weights, so each output moves by
//
//   |sum_k (x' - x) w| <= sum_c (s_x[m, c] / 2) * sum_{k in c} |w[n, k]|,
//
// and, the rounding errors being independent and w centred, typically by
// sqrt(sum_k (x' - x)^2 w^2). Taking X from the unquantized x instead would
// look more exact but is worse: the error becomes sum_k (x' - x) * s_w * q_w,
// and s_w * q_w = w - b_w is not centred (b_w is about the group's minimum),
// so the errors no longer cancel (about 3x larger on random weights).
//
// The kernels then compute, per output, in this order and with these
// roundings (fma = one rounding), which every variant repeats lane by lane:
//
//   acc = 0, bacc = 0
//   for g: t = 0
//          for c in g: t = fma(s_x[m, c], float(I[m, n, c]), t)
//          acc = fma(s_w[n, g], t, acc)
//   for g: bacc = fma(b_w[n, g], X'[m, g], bacc)
//   y = acc + bacc
//
// The SIMD variants get I from integer dot products (VNNI vpdpbusd, or
// pmaddubsw + pmaddwd; q_w is the unsigned operand, q_x the signed one), and
// integer sums do not depend on their order, so all variants agree exactly.
#include "qmm_int8.h"

#include <math.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "pool.h"

namespace emlx {

Activations selected_activations() {
  static const Activations act = [] {
    const char* env = std::getenv("EMLX_AXON_CPU_ACTIVATIONS");
    return env && std::strcmp(env, "int8") == 0 ? kActivationsInt8 : kActivationsF32;
  }();
  return act;
}

#if defined(__x86_64__)
bool vnni_supported() {
  __builtin_cpu_init();
  return isa_supported(kAvx512) && __builtin_cpu_supports("avx512vnni");
}
#endif

namespace {

// round_to_nearest_even(v) (the rounding mode's rounding, as the SIMD
// quantizer's) clamped to -127..127. rintf rather than a faster trick: the
// compiler may not fuse x * id into anything (an FMA would round once).
inline int8_t quantize_one(float v) {
  float r = rintf(v);
  r = r > 127.0f ? 127.0f : r;
  r = r < -127.0f ? -127.0f : r;
  // Only a NaN or an infinity of x gets here out of range; it reaches y
  // through its block's scale instead (see quantize_activations).
  return r == r ? (int8_t)r : 0;
}

}  // namespace

void quantize_activations(const QmmArgs& a, int m0, int m1, int8_t* q, float* scale, float* sum) {
  const int K = a.K;
  const int blocks = K / kXBlock;
  const int groups = K / a.group;
  std::vector<int> qsums(blocks);
  for (int m = m0; m < m1; ++m) {
    const float* x = a.x + (long)m * K;
    for (int c = 0; c < blocks; ++c) {
      const float* xb = x + c * kXBlock;
      float amax = 0.0f;
      bool nan = false;
      for (int i = 0; i < kXBlock; ++i) {
        amax = fmaxf(amax, fabsf(xb[i]));
        nan |= xb[i] != xb[i];
      }
      // A NaN makes the block's scale NaN, and so every output it feeds, as
      // in the float32 path (an infinity makes it infinite, and the products NaN).
      const float d = nan ? NAN : amax / 127.0f;
      // A scale that is not finite (NaN, infinity) gives q = 0 throughout.
      const float id = d > 0.0f ? 1.0f / d : 0.0f;
      scale[(long)m * blocks + c] = d;
      int8_t* qb = q + (long)m * K + c * kXBlock;
      int qsum = 0;
      for (int i = 0; i < kXBlock; ++i) {
        const int pos = a.bits == 4 ? (i & 1) * (kXBlock / 2) + (i >> 1) : i;
        qb[pos] = quantize_one(xb[i] * id);
        qsum += qb[pos];
      }
      qsums[c] = qsum;
    }
    // X' (see above), in block order.
    const int per_group = a.group / kXBlock;
    for (int g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int c = g * per_group; c < (g + 1) * per_group; ++c)
        s = fmaf(scale[(long)m * blocks + c], (float)qsums[c], s);
      sum[(long)m * groups + g] = s;
    }
  }
}

namespace {

// I for one block: 32 weights (16 or 32 bytes) against 32 int8 activations
// in the block order of Int8Activations.
template <int BITS>
int block_dot(const uint8_t* w, const int8_t* xq) {
  int s = 0;
  if (BITS == 4) {
    for (int j = 0; j < kXBlock / 2; ++j)
      s += (w[j] & 0x0F) * xq[j] + (w[j] >> 4) * xq[kXBlock / 2 + j];
  } else {
    for (int j = 0; j < kXBlock; ++j) s += w[j] * xq[j];
  }
  return s;
}

template <int BITS>
void rows(const QmmArgs& a, const Int8Activations& xa, int n0, int n1) {
  const int K = a.K;
  const int blocks = K / kXBlock;
  const int groups = K / a.group;
  const int per_group = a.group / kXBlock;
  const long row_bytes = (long)K * BITS / 8;
  for (int m = 0; m < a.M; ++m) {
    const int8_t* xq = xa.q + (long)m * K;
    const float* xs = xa.scale + (long)m * blocks;
    const float* xsum = xa.sum + (long)m * groups;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = (const uint8_t*)a.w + n * row_bytes;
      const long p = (long)n * groups;
      float acc = 0.0f;
      for (int g = 0; g < groups; ++g) {
        float t = 0.0f;
        for (int c = g * per_group; c < (g + 1) * per_group; ++c) {
          const int dot = block_dot<BITS>(row + (long)c * kXBlock * BITS / 8, xq + c * kXBlock);
          t = fmaf(xs[c], (float)dot, t);
        }
        acc = fmaf(qmm_param(a.scales, p + g, a.bf16_params), t, acc);
      }
      float bacc = 0.0f;
      for (int g = 0; g < groups; ++g)
        bacc = fmaf(qmm_param(a.biases, p + g, a.bf16_params), xsum[g], bacc);
      a.y[(long)m * a.N + n] = acc + bacc;
    }
  }
}

void rows_any(const QmmArgs& a, const Int8Activations& xa, int n0, int n1) {
  if (a.bits == 8)
    rows<8>(a, xa, n0, n1);
  else
    rows<4>(a, xa, n0, n1);
}

Int8Kernels int8_kernels_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == kAvx512 && vnni_supported()) return avx512_int8_kernels();
  if (isa >= kAvx2 && isa_supported(kAvx2)) return avx2_int8_kernels();
#endif
  (void)isa;
  return scalar_int8_kernels();
}

constexpr long kMinParallelWork = 1L << 17;
constexpr long kMinParallelQuantize = 1L << 15;
constexpr int kChunksPerThread = 8;

}  // namespace

Int8Kernels scalar_int8_kernels() { return Int8Kernels{quantize_activations, rows_any, 1, nullptr}; }

namespace {

bool gemv_takes(const Int8Kernels& k, const QmmArgs& a) {
  return k.gemv && a.M == 1 && a.bits == 4 && a.K % 128 == 0;
}

}  // namespace

bool int8_takes(const QmmArgs& a) {
  // Asked for every product the primitive and the layer nodes run.
  static const Int8Kernels selected = int8_kernels_for(selected_isa());
  return a.M >= kInt8MinRows || gemv_takes(selected, a);
}

bool int8_for(const QmmArgs& a) { return selected_activations() == kActivationsInt8 && int8_takes(a); }

void qmm_selected(const QmmArgs& a, Isa isa, int max_threads) {
  if (int8_for(a))
    qmm_int8(a, isa, max_threads);
  else
    qmm(a, isa, max_threads);
}

void qmm_int8(const QmmArgs& a, Isa isa, int max_threads) {
  const Int8Kernels k = int8_kernels_for(isa);
  const int blocks = a.K / kXBlock;
  const int groups = a.K / a.group;
  std::vector<int8_t> q((size_t)a.M * a.K);
  std::vector<float> scale((size_t)a.M * blocks);
  std::vector<float> sum((size_t)a.M * groups);

  Pool& pool = Pool::shared();
  int threads = pool.size();
  if (max_threads > 0) threads = std::min(threads, max_threads);

  // Quantize x, split over its rows (each row's result does not depend on the split).
  const long elems = (long)a.M * a.K;
  const int qtasks = elems < kMinParallelQuantize ? 1 : std::min(a.M, threads);
  auto quantize = [&](int t) {
    const int m0 = (int)((long)a.M * t / qtasks);
    const int m1 = (int)((long)a.M * (t + 1) / qtasks);
    k.quantize(a, m0, m1, q.data(), scale.data(), sum.data());
  };
  if (qtasks == 1)
    quantize(0);
  else
    pool.run(qtasks, quantize);
  const Int8Activations xa{q.data(), scale.data(), sum.data()};

  const long work = (long)a.M * a.N * a.K;
  if (work < kMinParallelWork) threads = 1;
  const bool gemv = gemv_takes(k, a);
  const int align = gemv ? 4 : k.gemm_rows;
  const int units = (a.N + align - 1) / align;
  threads = std::max(1, std::min(threads, units));
  // The matrix-vector form streams the weights once: a chunk per thread
  // (as the float32 one), where the matrix product takes several.
  const int tasks =
      threads == 1 ? 1 : std::min(units, threads * (gemv ? 1 : kChunksPerThread));
  auto task = [&](int t) {
    const int n0 = std::min(a.N, (int)((long)units * t / tasks) * align);
    const int n1 = std::min(a.N, (int)((long)units * (t + 1) / tasks) * align);
    if (n0 >= n1) return;
    (gemv ? k.gemv : k.gemm)(a, xa, n0, n1);
  };
  if (threads == 1)
    task(0);
  else
    pool.run(tasks, task);
}

}  // namespace emlx
