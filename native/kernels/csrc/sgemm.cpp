// Dense f32 products for MLX's CPU matmul, which the wheel sends to a
// reference BLAS (`cblas_sgemm` from its bundled libblas, one scalar loop).
// libmlx resolves `cblas_sgemm` at load time, and the dynamic linker takes
// the first definition in lookup order: our binary (or the NIF library,
// first in its load group) exports one, so MLX's matmul, attention included,
// runs here. EMLX_AXON_KERNELS=mlx hands every call to the next definition
// (the wheel's BLAS) instead.
#include "sgemm.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "pool.h"
#include "qmm.h"

namespace emlx {

void gemm_reference(const GemmArgs& g, int n0, int n1) {
  for (int i = 0; i < g.M; ++i)
    for (int j = n0; j < n1; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < g.K; ++k) acc += gemm_a(g, i, k) * gemm_b(g, k, j);
      g.c[(long)i * g.ldc + j] += g.alpha * acc;
    }
}

namespace {

// Up to this many rows a product skips packing: attention at decode time
// (a head group's queries against the cache) would spend more on the packing
// buffers and copies than on the multiply-adds.
constexpr int kSmallRows = 4;

// The scalar reference is unpacked already, so it serves every shape.
GemmColsFn gemm_for(int isa, bool small) {
#if defined(__x86_64__)
  if (isa == kAvx512) return small ? avx512_gemm_small() : avx512_gemm();
  if (isa == kAvx2) return small ? avx2_gemm_small() : avx2_gemm();
#endif
  (void)small;
  return gemm_reference;
}

// Columns per unit of the thread split (the widest register tile).
constexpr int kColAlign = 32;
// Below this many multiply-adds a product stays on one thread.
constexpr long kMinParallelWork = 1L << 16;
// The unpacked few-row product streams B once, bound by memory: a second
// thread paid only on products of millions of multiply-adds, and only
// where each thread keeps whole cache lines of B's rows (wide column chunks).
constexpr long kMinParallelSmall = 1L << 21;
constexpr int kSmallColAlign = 256;
// Rows per unit of a split by rows (a multiple of every variant's tile).
constexpr int kRowAlign = 12;

}  // namespace

void sgemm(const GemmArgs& g, int isa, int max_threads) {
  if (g.M <= 0 || g.N <= 0) return;
  const bool small = g.M <= kSmallRows;
  // The unpacked few-row kernels read float32 B only.
  const GemmColsFn fn = g.b16 && small ? gemm_reference : gemm_for(isa, small);
  // beta applied by each part to its own block of C, not in a pass over all
  // of C on one thread first (BLAS: C is not read when beta is 0).
  auto scale_c = [&g](int i0, int i1, int n0, int n1) {
    for (int i = i0; i < i1; ++i) {
      float* c = g.c + (long)i * g.ldc;
      if (g.beta == 0.0f)
        std::fill(c + n0, c + n1, 0.0f);
      else if (g.beta != 1.0f)
        for (int j = n0; j < n1; ++j) c[j] *= g.beta;
    }
  };
  const bool product = g.K > 0 && g.alpha != 0.0f;
  Pool& pool = Pool::shared();
  int threads = pool.size();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  if (!product || (long)g.M * g.N * g.K < (small ? kMinParallelSmall : kMinParallelWork))
    threads = 1;
  // Each part of a split packs the whole of the operand it shares, so a
  // packed product is split along the longer side: a prompt's weighted
  // values (many rows, 128 columns) by rows, its scores by columns.
  const bool by_rows = !small && g.M > g.N;
  const int align = by_rows ? kRowAlign : small ? kSmallColAlign : kColAlign;
  const int units = ((by_rows ? g.M : g.N) + align - 1) / align;
  threads = std::max(1, std::min(threads, units));
  // Chunks taken in turn by whichever thread is free (see qmm); a split by
  // rows, whose parts each pack all of B, one part per thread.
  const int tasks = threads == 1 || by_rows ? threads : std::min(units, threads * 4);
  auto task = [&](int t) {
    const int extent = by_rows ? g.M : g.N;
    const int p0 = std::min(extent, (int)((long)units * t / tasks) * align);
    const int p1 = std::min(extent, (int)((long)units * (t + 1) / tasks) * align);
    if (p0 >= p1) return;
    if (!by_rows) {
      scale_c(0, g.M, p0, p1);
      if (product) fn(g, p0, p1);
      return;
    }
    scale_c(p0, p1, 0, g.N);
    GemmArgs part = g;
    part.M = p1 - p0;
    part.a = g.trans_a ? g.a + p0 : g.a + (long)p0 * g.lda;
    part.c = g.c + (long)p0 * g.ldc;
    if (product) fn(part, 0, g.N);
  };
  if (tasks == 1)
    task(0);
  else
    pool.run(tasks, task);
}

}  // namespace emlx

namespace {

enum { kRowMajor = 101, kColMajor = 102, kNoTrans = 111, kTrans = 112, kConjTrans = 113 };

using CblasSgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                            int, float, float*, int);

bool use_wheel_blas() {
  static const bool wheel = [] {
    const char* env = std::getenv("EMLX_AXON_KERNELS");
    return env && std::strcmp(env, "mlx") == 0;
  }();
  return wheel;
}

CblasSgemm wheel_sgemm() {
  static const CblasSgemm next = (CblasSgemm)dlsym(RTLD_NEXT, "cblas_sgemm");
  return next;
}

}  // namespace

extern "C" {

// The CBLAS contract (column- or row-major, transposes as flags).
void emlx_kernels_cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                              float alpha, const float* a, int lda, const float* b, int ldb,
                              float beta, float* c, int ldc) {
  const bool valid = (order == kRowMajor || order == kColMajor) &&
                     (trans_a >= kNoTrans && trans_a <= kConjTrans) &&
                     (trans_b >= kNoTrans && trans_b <= kConjTrans) && m >= 0 && n >= 0 && k >= 0;
  if (!valid || use_wheel_blas() || !emlx::kernels_preferred()) {
    if (CblasSgemm next = wheel_sgemm())
      next(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  emlx::GemmArgs g;
  // Column-major C is row-major C^T = op(B)^T op(A)^T: swap the operands.
  const bool col = order == kColMajor;
  g.trans_a = (col ? trans_b : trans_a) != kNoTrans;
  g.trans_b = (col ? trans_a : trans_b) != kNoTrans;
  g.M = col ? n : m;
  g.N = col ? m : n;
  g.K = k;
  g.alpha = alpha;
  g.a = col ? b : a;
  g.lda = col ? ldb : lda;
  g.b = col ? a : b;
  g.ldb = col ? lda : ldb;
  g.beta = beta;
  g.c = c;
  g.ldc = ldc;
  emlx::sgemm(g, emlx::selected_isa(), 0);
}

// Row-major product with a chosen variant, for tests and benchmarks.
int emlx_kernels_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                       int lda, const float* b, int ldb, float beta, float* c, int ldc, int isa,
                       int threads) {
  if (isa < emlx::kScalar || isa > emlx::kAvx512 || !emlx::isa_supported((emlx::Isa)isa))
    return -1;
  emlx::GemmArgs g{trans_a != 0, trans_b != 0, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc};
  emlx::sgemm(g, isa, threads);
  return 0;
}
}
