// Elementwise float32 work of a forward pass that MLX's CPU backend runs on
// one thread with a scalar exp, threaded over rows here: the MLP's SwiGLU
// and RMSNorm (which MLX's CPU backend expands into seven nodes); and the
// attention built on the softmax rows, one token's and a prompt chunk's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qmm.h"

namespace emlx {

// Row r: y = exp(x - max) / sum over its seen keys, 0 for the others.
using SoftmaxRowFn = void (*)(const float* x, float* y, int seen, int S);

void softmax_row_scalar(const float* x, float* y, int seen, int S);
#if defined(__x86_64__)
void softmax_row_avx512(const float* x, float* y, int seen, int S);
#endif

// y[r, i] = silu(x[r, i]) * x[r, F + i] for x [rows, 2F] (the gate and up
// projections side by side), silu(g) = g * sigmoid(g), in MLX's order.
struct SwigluArgs {
  const float* x;  // [rows, 2F]
  float* y;  // [rows, F]
  long rows;
  int F;
};

using SwigluRowFn = void (*)(const float* gate, const float* up, float* y, int n);

void swiglu_row_scalar(const float* gate, const float* up, float* y, int n);
#if defined(__x86_64__)
void swiglu_row_avx512(const float* gate, const float* up, float* y, int n);
#endif

void swiglu(const SwigluArgs& a, Isa isa, int max_threads);

// RMSNorm over the last axis: y = x * rsqrt(mean(x^2) + eps) * w, in MLX's
// order of float32 operations; row r takes weight row r % R of w [R, D].
struct RmsNormArgs {
  const float* x;  // [rows, D]
  const float* w;  // [R, D]
  float* y;  // [rows, D]
  long rows;
  int D;
  int R;
  float eps;
};

using RmsNormRowFn = void (*)(const float* x, const float* w, float* y, int D, float eps);

void rms_norm_row_scalar(const float* x, const float* w, float* y, int D, float eps);
#if defined(__x86_64__)
void rms_norm_row_avx512(const float* x, const float* w, float* y, int D, float eps);
#endif

void rms_norm(const RmsNormArgs& a, Isa isa, int max_threads);

// Queries' and keys' per-head RMSNorm (optional) and rotary embedding from
// a table: for x [B, L, H, hd], n = rms_norm(x) * w[h] (or x), then
// y = n * cos + swapped(n) * signed_sin, where the tables are
// [T, L, hd] (T = 1 or B) and swapped exchanges the two halves of a head
// (or each pair's two elements, `traditional`).
struct NormRopeArgs {
  const float* x;  // [B, L, H, hd]
  const float* w;  // [H, hd] or null
  const float* cos;  // [T, L, hd]
  const float* sin;
  float* y;
  int B, L, H, hd, T;
  float eps;
  bool traditional;
};

void norm_rope(const NormRopeArgs& a, int max_threads);

// One key head's keys or values as a one-token step's attention reads
// them: row j holds position j's hd values, float32 (bits 32), float16 as
// IEEE half bits (16, a kv_dtype float16 cache), or MLX's affine
// quantization (8 or 4: values packed little-end first into uint32 words,
// a float32 scale and bias per `group` values, read as scale * q + bias).
struct KvRows {
  const void* data;
  const float* scales;  // quantized only
  const float* biases;
  int bits;
  int group;  // quantized only
};

// One token's attention for the G query heads q [G, hd] (already scaled)
// that share one key head, over its n keys and values: out[g] =
// softmax(q[g] . k) @ v, with scores [G, n] as scratch.
using AttendFn = void (*)(const float* q, const KvRows& k, const KvRows& v, float* scores,
                          float* out, int G, int n, int hd);

void attend_scalar(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                   int G, int n, int hd);
#if defined(__x86_64__)
// hd a multiple of 8 (float16 and quantized rows; groups too).
void attend_avx2(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                 int G, int n, int hd);
// hd a multiple of 16 (float16 and quantized rows; groups too).
void attend_avx512(const float* q, const KvRows& k, const KvRows& v, float* scores, float* out,
                   int G, int n, int hd);
#endif

// The variant for `isa` and rows of `bits` (groups of `group`) of heads of
// `hd` values: the widest the shapes allow.
AttendFn attend_fn(Isa isa, int hd, int bits, int group);

// Whether the kernels read rows of `bits` bits in groups of `group` (heads
// of `hd` values).
bool attend_takes(int hd, int bits, int group);

// How many rows ahead of the one it reads the one-token attention prefetches
// quantized rows (AVX-512 and AVX2) and float16 rows (AVX-512): the
// prefetcher alone leaves those loops waiting on memory. Float32 rows, and
// the AVX2 variant's float16 rows, did not gain.
constexpr int kAhead = 8;

// Asks for the cache lines of `bytes` bytes from `p` (a row kAhead ahead).
static inline void prefetch_lines(const void* p, long bytes) {
  const char* r = static_cast<const char*>(p);
  for (long b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 3);
}

// A prompt chunk's causal attention, per key head: its G query heads' L
// positions (the last L of S) against the S cached keys and values, in
// blocks of queries whose scores stay in a per-thread buffer (no graph
// node's fresh allocation, no float32 copy of a float16 cache). Each block
// is two sgemm products and the softmax of each row over the keys it sees.
struct PromptAttentionArgs {
  const float* q;  // [B, nkv, G * L, hd], scaled; head g's L positions in turn
  const void* keys;  // rows of hd float32 or float16 (bits), element strides:
  const void* values;  // batch, head (a row's hd values contiguous)
  long batch_stride, head_stride;
  int bits;  // 32 or 16
  int B, nkv, G, L, S, hd;
  float* out;  // [B, nkv, G * L, hd]
};

void prompt_attention(const PromptAttentionArgs& a, Isa isa);

// The attention variants' middle step: each of the G rows of scores [G, n]
// softmaxed in place, and out [G, hd] zeroed for the weighted values.
void attention_weights(SoftmaxRowFn softmax_row, float* scores, float* out, int G, int n,
                       int hd);

// An IEEE half's value.
float half_to_float(uint16_t h);

}  // namespace emlx
