// Variant selection and the threaded split of a product over output rows.
#include "qmm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "pool.h"

namespace emlx {

bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
#else
  return isa == kScalar;
#endif
}

Isa selected_isa() {
  static const Isa isa = [] {
    Isa wanted = kAvx512;
    if (const char* env = std::getenv("EMLX_AXON_KERNELS")) {
      if (std::strcmp(env, "scalar") == 0) wanted = kScalar;
      if (std::strcmp(env, "avx2") == 0) wanted = kAvx2;
    }
    for (int i = wanted; i > kScalar; --i)
      if (isa_supported((Isa)i)) return (Isa)i;
    return kScalar;
  }();
  return isa;
}

bool kernels_preferred() {
  static const bool preferred = [] {
    const char* env = std::getenv("EMLX_AXON_KERNELS");
    return selected_isa() != kScalar || (env && std::strcmp(env, "scalar") == 0);
  }();
  return preferred;
}

namespace {

Kernels kernels_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return avx512_kernels();
  if (isa == kAvx2) return avx2_kernels();
#endif
  (void)isa;
  return scalar_kernels();
}

// Below this many multiply-adds a product runs on one thread: waking the
// pool would cost more than it saves.
constexpr long kMinParallelWork = 1L << 17;
// Rows per unit of the split: the SIMD products dequantize 4 rows at a time.
constexpr int kRowAlign = 4;
constexpr int kChunksPerThread = 8;
// Matrix-vector chunks stream weights from memory, and each starts cold
// before its prefetching runs ahead: one per thread decodes 2-3% faster on
// 2 cores than two, despite the uneven finish when MLX preempts a thread.
constexpr int kGemvChunksPerThread = 1;

// x as the SIMD matrix products read it: panels of `p` rows, each k-major
// (xp[(q * K + k) * p + j] = x[q * p + j, k]), zeros past the last row.
void pack_panels(const QmmArgs& a, int p, int q0, int q1, float* xp) {
  for (int q = q0; q < q1; ++q) {
    float* out = xp + (long)q * a.K * p;
    const int rows = std::min(p, a.M - q * p);
    for (int k = 0; k < a.K; ++k) {
      const float* x = a.x + (long)q * p * a.K + k;
      for (int j = 0; j < rows; ++j) out[(long)k * p + j] = x[(long)j * a.K];
      for (int j = rows; j < p; ++j) out[(long)k * p + j] = 0.0f;
    }
  }
}

}  // namespace

void qmm(const QmmArgs& a, Isa isa, int max_threads) {
  const Kernels k = kernels_for(isa);
  // Decode-sized inputs use the fused matrix-vector form; larger ones a
  // matrix product (over packed panels of x from a panel's rows on).
  const bool gemv = a.M <= k.gemv_rows;
  std::vector<float> xsum;
  if (gemv) {
    const int groups = a.K / a.group;
    xsum.assign((size_t)a.M * groups, 0.0f);
    for (int m = 0; m < a.M; ++m)
      for (int g = 0; g < groups; ++g) {
        const float* x = a.x + (long)m * a.K + (long)g * a.group;
        float s = 0.0f;
        for (int i = 0; i < a.group; ++i) s += x[i];
        xsum[(size_t)m * groups + g] = s;
      }
  }

  Pool& pool = Pool::shared();
  int threads = pool.size();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  const long work = (long)a.M * a.N * a.K;
  if (work < kMinParallelWork) threads = 1;
  const int units = (a.N + kRowAlign - 1) / kRowAlign;
  threads = std::max(1, std::min(threads, units));

  // Several chunks per thread, taken in turn by whichever thread is free:
  // on a machine this small, MLX's own threads preempt ours, and a fixed
  // half per thread would leave one waiting for the other.
  const int tasks =
      threads == 1 ? 1 : std::min(units, threads * (gemv ? kGemvChunksPerThread : kChunksPerThread));
  // Packed once for every thread: each reads all of x. Fewer rows than a
  // panel would leave most of it padding: the dot-product form takes them.
  // Not zeroed first: packing writes every element, padding included.
  std::unique_ptr<float[]> panels;
  if (!gemv && k.panel > 0 && a.M >= k.panel) {
    const int count = (a.M + k.panel - 1) / k.panel;
    panels.reset(new float[(size_t)count * k.panel * a.K]);
    const int packers = std::min(threads, count);
    auto pack = [&](int t) {
      pack_panels(a, k.panel, count * t / packers, count * (t + 1) / packers, panels.get());
    };
    if (packers == 1)
      pack(0);
    else
      pool.run(packers, pack);
  }
  const float* xp = panels.get();
  const float* xs = xsum.data();
  auto task = [&](int t) {
    const int n0 = std::min(a.N, (int)((long)units * t / tasks) * kRowAlign);
    const int n1 = std::min(a.N, (int)((long)units * (t + 1) / tasks) * kRowAlign);
    if (n0 >= n1) return;
    if (gemv)
      k.gemv(a, xs, n0, n1);
    else
      k.gemm(a, xp, n0, n1);
  };
  if (threads == 1) {
    task(0);
  } else {
    pool.run(tasks, task);
  }
}

}  // namespace emlx
