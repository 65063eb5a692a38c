#include "elementwise.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "pool.h"
#include "sgemm.h"

namespace emlx {

void softmax_row_scalar(const float* x, float* y, int seen, int S) {
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < seen; ++j) m = std::max(m, x[j]);
  float sum = 0.0f;
  for (int j = 0; j < seen; ++j) {
    y[j] = std::exp(x[j] - m);
    sum += y[j];
  }
  const float inv = 1.0f / sum;
  for (int j = 0; j < seen; ++j) y[j] *= inv;
  for (int j = seen; j < S; ++j) y[j] = 0.0f;
}

void swiglu_row_scalar(const float* gate, const float* up, float* y, int n) {
  for (int i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g * (1.0f / (1.0f + std::exp(-g))) * up[i];
  }
}

void rms_norm_row_scalar(const float* x, const float* w, float* y, int D, float eps) {
  float sum = 0.0f;
  for (int i = 0; i < D; ++i) sum += x[i] * x[i];
  // As MLX: the mean is the sum times 1 / D (computed in double).
  const float mean = sum * (float)(1.0 / D);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int i = 0; i < D; ++i) y[i] = (x[i] * scale) * w[i];
}

void attention_weights(SoftmaxRowFn softmax_row, float* scores, float* out, int G, int n,
                       int hd) {
  for (int g = 0; g < G; ++g) {
    float* row = scores + (long)g * n;
    softmax_row(row, row, n, n);
    float* og = out + (long)g * hd;
    for (int e = 0; e < hd; ++e) og[e] = 0.0f;
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {
    // Subnormal: shift the mantissa up to an implicit leading one.
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

namespace {

// Rows of float32 or float16 values, and of quantized ones: value e of row
// j as float32.
struct F32Rows {
  const float* p;
  int hd;
  float at(long j, int e) const { return p[j * hd + e]; }
};
struct F16Rows {
  const uint16_t* p;
  int hd;
  float at(long j, int e) const { return half_to_float(p[j * hd + e]); }
};
struct QuantRows {
  const uint32_t* w;
  const float* s;
  const float* b;
  int hd, bits, group;
  float at(long j, int e) const {
    const long i = j * hd + e;
    const int per_word = 32 / bits;
    const uint32_t q = (w[i / per_word] >> (bits * (i % per_word))) & ((1u << bits) - 1u);
    return s[i / group] * (float)q + b[i / group];
  }
};

template <typename Rows>
void attend_scalar_t(const float* q, const Rows& k, const Rows& v, float* scores, float* out,
                     int G, int n, int hd) {
  for (int j = 0; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      const float* qg = q + (long)g * hd;
      // Four partial sums, which the compiler keeps in vector registers.
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int e = 0;
      for (; e + 4 <= hd; e += 4)
        for (int u = 0; u < 4; ++u) s[u] += qg[e + u] * k.at(j, e + u);
      for (; e < hd; ++e) s[0] += qg[e] * k.at(j, e);
      scores[(long)g * n + j] = (s[0] + s[1]) + (s[2] + s[3]);
    }
  }
  attention_weights(softmax_row_scalar, scores, out, G, n, hd);
  for (int j = 0; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      const float p = scores[(long)g * n + j];
      float* og = out + (long)g * hd;
      for (int e = 0; e < hd; ++e) og[e] += p * v.at(j, e);
    }
  }
}

}  // namespace

void attend_scalar(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                   int G, int n, int hd) {
  auto quant = [&](const KvRows& r) {
    return QuantRows{static_cast<const uint32_t*>(r.data), r.scales, r.biases, hd, r.bits,
                     r.group};
  };
  switch (k.bits) {
    case 32:
      attend_scalar_t(q, F32Rows{static_cast<const float*>(k.data), hd},
                      F32Rows{static_cast<const float*>(v.data), hd}, scores, out, G, n, hd);
      break;
    case 16:
      attend_scalar_t(q, F16Rows{static_cast<const uint16_t*>(k.data), hd},
                      F16Rows{static_cast<const uint16_t*>(v.data), hd}, scores, out, G, n, hd);
      break;
    default:
      attend_scalar_t(q, quant(k), quant(v), scores, out, G, n, hd);
  }
}

bool attend_takes(int hd, int bits, int group) {
  if (hd <= 0) return false;
  if (bits == 32 || bits == 16) return true;
  // Groups a power of two, as MLX's (32, 64, 128).
  return (bits == 8 || bits == 4) && group > 0 && (group & (group - 1)) == 0 && hd % group == 0 &&
         (hd * bits) % 32 == 0;
}

AttendFn attend_fn(Isa isa, int hd, int bits, int group) {
#if defined(__x86_64__)
  // Quantized rows are read 16 (8) values at a time within one group, and
  // the vector kernels keep at most 32 groups a head.
  const bool plain = bits == 32, quantized = bits < 16;
  if (quantized && hd / group > 32) return attend_scalar;
  if (isa == kAvx512 && (plain || (hd % 16 == 0 && (bits == 16 || group % 16 == 0))))
    return attend_avx512;
  if (isa >= kAvx2 && hd % 8 == 0 && (bits >= 16 || group % 8 == 0)) return attend_avx2;
#endif
  (void)isa;
  (void)hd;
  (void)bits;
  (void)group;
  return attend_scalar;
}

namespace {

// Below this many elements one thread does it all.
constexpr long kMinParallel = 1L << 15;

SoftmaxRowFn row_fn(Isa isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return softmax_row_avx512;
#endif
  (void)isa;
  return softmax_row_scalar;
}

SwigluRowFn swiglu_fn(Isa isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return swiglu_row_avx512;
#endif
  (void)isa;
  return swiglu_row_scalar;
}

RmsNormRowFn rms_norm_fn(Isa isa) {
#if defined(__x86_64__)
  if (isa == kAvx512) return rms_norm_row_avx512;
#endif
  (void)isa;
  return rms_norm_row_scalar;
}

// Runs part(u0, u1) over units 0..units: on the calling thread when the
// `elements` are too few to wake the pool (or there is one unit), else in
// up to `chunks` pieces per thread of the pool (at most `max_threads`, 0 for
// all), taken in turn by whichever thread is free.
template <typename Part>
void split(long units, long elements, int max_threads, long chunks, const Part& part) {
  Pool& pool = Pool::shared();
  int threads = pool.size();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  if (threads == 1 || elements < kMinParallel || units < 2) {
    part(0, units);
    return;
  }
  const int tasks = (int)std::min<long>(units, threads * chunks);
  pool.run(tasks, [&](int t) { part(units * t / tasks, units * (t + 1) / tasks); });
}

}  // namespace

void swiglu(const SwigluArgs& a, Isa isa, int max_threads) {
  if (a.rows <= 0 || a.F <= 0) return;
  const SwigluRowFn fn = swiglu_fn(isa);
  // Split over rows, and a single row (a decode step) over its columns in
  // blocks of 64.
  const long units = a.rows > 1 ? a.rows : (a.F + 63) / 64;
  auto part = [&](long u0, long u1) {
    if (a.rows > 1) {
      for (long r = u0; r < u1; ++r) {
        const float* x = a.x + r * 2L * a.F;
        fn(x, x + a.F, a.y + r * a.F, a.F);
      }
    } else {
      const int c0 = (int)std::min<long>(a.F, u0 * 64), c1 = (int)std::min<long>(a.F, u1 * 64);
      if (c0 < c1) fn(a.x + c0, a.x + a.F + c0, a.y + c0, c1 - c0);
    }
  };
  split(units, a.rows * a.F, max_threads, 4, part);
}

void norm_rope(const NormRopeArgs& a, int max_threads) {
  const long rows = (long)a.B * a.L * a.H;
  const int half = a.hd / 2;
  auto part = [&](long r0, long r1) {
    float n[1024];
    for (long r = r0; r < r1; ++r) {
      const int h = (int)(r % a.H);
      const long bl = r / a.H;
      const int l = (int)(bl % a.L);
      const int t = a.T == 1 ? 0 : (int)(bl / a.L);
      const float* x = a.x + r * a.hd;
      if (a.w) {
        rms_norm_row_scalar(x, a.w + (long)h * a.hd, n, a.hd, a.eps);
      } else {
        for (int i = 0; i < a.hd; ++i) n[i] = x[i];
      }
      const float* c = a.cos + ((long)t * a.L + l) * a.hd;
      const float* s = a.sin + ((long)t * a.L + l) * a.hd;
      float* y = a.y + r * a.hd;
      if (a.traditional) {
        for (int i = 0; i < a.hd; ++i) y[i] = n[i] * c[i] + n[i ^ 1] * s[i];
      } else {
        for (int i = 0; i < half; ++i) y[i] = n[i] * c[i] + n[i + half] * s[i];
        for (int i = half; i < a.hd; ++i) y[i] = n[i] * c[i] + n[i - half] * s[i];
      }
    }
  };
  split(rows, rows * a.hd, max_threads, 4, part);
}

void rms_norm(const RmsNormArgs& a, Isa isa, int max_threads) {
  if (a.rows <= 0 || a.D <= 0 || a.R <= 0) return;
  const RmsNormRowFn fn = rms_norm_fn(isa);
  auto rows = [&](long r0, long r1) {
    for (long r = r0; r < r1; ++r)
      fn(a.x + r * a.D, a.w + (r % a.R) * (long)a.D, a.y + r * a.D, a.D, a.eps);
  };
  split(a.rows, a.rows * a.D, max_threads, 4, rows);
}

namespace {

// A block's scores buffer holds at most this many floats (8 MB), which
// bounds the queries of a block at long contexts. Each thread keeps its
// buffers between calls: fresh ones cost page faults and zeroing.
constexpr long kPromptScores = 1L << 21;
// Queries per block at most: the products' rows are G times as many.
constexpr int kPromptQueries = 128;

}  // namespace

void prompt_attention(const PromptAttentionArgs& a, Isa isa) {
  if (a.B <= 0 || a.nkv <= 0 || a.G <= 0 || a.L <= 0 || a.S < a.L || a.hd <= 0) return;
  const SoftmaxRowFn softmax_row = row_fn(isa);
  const int qb = (int)std::max<long>(
      1, std::min<long>(kPromptQueries, kPromptScores / ((long)a.G * a.S)));
  const int blocks = (a.L + qb - 1) / qb;
  const long rows_per_head = (long)a.G * a.L;
  const size_t elem = a.bits == 16 ? 2 : 4;
  // Unit u: a block of one key head; the later blocks (more keys) first,
  // so that the threads finish together.
  auto unit = [&](int u) {
    const int blk = blocks - 1 - u % blocks, head = u / blocks;
    const int b = head / a.nkv, h = head % a.nkv;
    const int at = blk * qb, lb = std::min(qb, a.L - at), rows = a.G * lb;
    const int end = a.S - a.L + at + lb;  // keys the block's last query sees
    thread_local std::vector<float> qs, scores, os;
    qs.resize((size_t)rows * a.hd);
    scores.resize((size_t)rows * end);
    os.resize((size_t)rows * a.hd);
    const float* q = a.q + (size_t)head * rows_per_head * a.hd;
    for (int g = 0; g < a.G; ++g)
      std::memcpy(qs.data() + (size_t)g * lb * a.hd, q + ((size_t)g * a.L + at) * a.hd,
                  sizeof(float) * lb * a.hd);
    const size_t first = (size_t)b * a.batch_stride + (size_t)h * a.head_stride;
    const void* keys = static_cast<const uint8_t*>(a.keys) + first * elem;
    const void* values = static_cast<const uint8_t*>(a.values) + first * elem;
    auto operand_b = [&](GemmArgs& g, const void* p) {
      if (a.bits == 16)
        g.b16 = static_cast<const uint16_t*>(p);
      else
        g.b = static_cast<const float*>(p);
    };
    GemmArgs s{false, true, rows, end, a.hd, 1.0f, qs.data(), a.hd,
               nullptr, a.hd, 0.0f, scores.data(), end};
    operand_b(s, keys);
    sgemm(s, isa, 1);
    for (int r = 0; r < rows; ++r) {
      float* row = scores.data() + (size_t)r * end;
      softmax_row(row, row, a.S - a.L + at + r % lb + 1, end);
    }
    GemmArgs o{false, false, rows, a.hd, end, 1.0f, scores.data(), end,
               nullptr, a.hd, 0.0f, os.data(), a.hd};
    operand_b(o, values);
    sgemm(o, isa, 1);
    float* out = a.out + (size_t)head * rows_per_head * a.hd;
    for (int g = 0; g < a.G; ++g)
      std::memcpy(out + ((size_t)g * a.L + at) * a.hd, os.data() + (size_t)g * lb * a.hd,
                  sizeof(float) * lb * a.hd);
  };
  const int units = a.B * a.nkv * blocks;
  Pool& pool = Pool::shared();
  if (pool.size() == 1 || units == 1)
    for (int u = 0; u < units; ++u) unit(u);
  else
    pool.run(units, unit);
}

}  // namespace emlx
