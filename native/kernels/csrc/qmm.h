// Affine-quantized matrix products in MLX's layout, on raw buffers.
//
// y[m, n] = sum_k x[m, k] * (scales[n, k / group] * q[n, k] + biases[n, k / group])
// where q[n, k] is packed along k into uint32 words, low bits first
// (8 x 4-bit or 4 x 8-bit per word). All pointers are row-major and dense.
#pragma once

#include <stdint.h>

namespace emlx {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct QmmArgs {
  const float* x;  // [M, K]
  const uint32_t* w;  // [N, K * bits / 32]
  const void* scales;  // [N, K / group], float32 or bfloat16
  const void* biases;  // [N, K / group], same dtype
  float* y;  // [M, N]
  int M, N, K, bits, group;
  // Checkpoints store scales and biases in bfloat16; reading them as such
  // (widening is exact) saves memory and bandwidth over a float32 copy.
  bool bf16_params = false;
};

// Scale or bias i as float32. Static: this header is compiled under several
// targets and must not give the linker one copy to share.
static inline float qmm_param(const void* p, long i, bool bf16) {
  if (bf16) {
    const uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
  }
  return ((const float*)p)[i];
}

// Decode reads every weight once per token, straight from memory, in
// products of 1-4 MB with other work between them: the hardware prefetcher
// alone leaves them well short of the bandwidth. Asking for each line this
// far ahead, into L2 (the lines are used once), made decode on 2 cores of an
// AMD EPYC 15-20% faster; prefetching the line about to be read gained
// nothing, so the distance is what counts. The hint never faults.
constexpr long kPrefetchBytes = 8192;
static inline void prefetch_weights(const void* p) {
  __builtin_prefetch((const char*)p + kPrefetchBytes, 0, 2);
}

// The scales and biases are two more streams, a few bytes per row, which
// the hardware prefetcher did not keep ahead either: their cache misses
// stalled the products. Asking for them 16 rows ahead (8 to 64 measured
// alike) took a decode step's layer products on 2 cores of an AMD EPYC
// from 28 to 36-40 GB/s, the output head from 28-36 to 48, and decode from
// 68-75 to 83-98 tok/s. Called once per group of `rows` rows from `row`.
// (GCC drops a loop whose body is only __builtin_prefetch, as it does a loop
// without effects, hence the volatile asm on x86-64.)
constexpr int kParamRowsAhead = 16;
static inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}
static inline void prefetch_params(const QmmArgs& a, long row, int rows) {
  const long item = a.bf16_params ? 2 : 4;
  const long groups = a.K / a.group;
  const long from = (row + kParamRowsAhead) * groups * item;
  const long to = from + rows * groups * item;
  for (long o = from & ~63L; o < to; o += 64) {
    prefetch_line((const char*)a.scales + o);
    prefetch_line((const char*)a.biases + o);
  }
}

// Rows n0..n1 of y, for every m. Each variant computes every output with a
// fixed summation order that does not depend on n0/n1, so splitting rows
// across threads never changes a result. `xp` is x packed in panels of
// `Kernels::panel` rows (see `pack_panels`), or null where `qmm` did not
// pack it (no panels, or fewer rows of x than one).
using RowsFn = void (*)(const QmmArgs&, const float* xp, int n0, int n1);

// Matrix-vector form: per row, per group, s * sum(q * x) + b * sum(x).
// `xsum` holds the group sums of x, [M, K / group].
using GemvFn = void (*)(const QmmArgs&, const float* xsum, int n0, int n1);

struct Kernels {
  GemvFn gemv;
  RowsFn gemm;
  // Up to this many rows of x take the matrix-vector form: the AVX-512 one
  // unpacks each weight once for several rows (decode batches, short
  // prompts); the others would unpack it again for every row.
  int gemv_rows = 2;
  // Rows of x per panel of the matrix product's packed x (from this many
  // rows of x on); 0: x as given.
  int panel = 0;
};

Kernels scalar_kernels();
#if defined(__x86_64__)
Kernels avx2_kernels();
Kernels avx512_kernels();
#endif

// Whole product on `isa`, split over the shared pool's threads (at most
// `max_threads`, 0 for all).
void qmm(const QmmArgs& args, Isa isa, int max_threads);

// The best variant this CPU runs, unless EMLX_AXON_KERNELS names another.
Isa selected_isa();
bool isa_supported(Isa isa);

// Whether the kernels should replace MLX's: a SIMD variant runs here, or
// EMLX_AXON_KERNELS=scalar asks for the portable one. (Elsewhere, e.g. on
// aarch64 where there is no NEON variant yet, MLX's own kernels are kept.)
bool kernels_preferred();

}  // namespace emlx
