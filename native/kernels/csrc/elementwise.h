// Elementwise float32 work of a forward pass that MLX's CPU backend runs on
// one thread with a scalar exp, threaded over rows here: the causal softmax
// of a prompt's attention and the MLP's SwiGLU.
#pragma once

#include "qmm.h"

namespace emlx {

struct SoftmaxArgs {
  const float* x;  // [rows, S]
  float* y;  // [rows, S]
  long rows;
  int S;
  // Causal: row r is query r % L of L, which sees keys 0..S - L + r % L
  // (the prompt's positions follow the S - L cached ones); the keys after
  // it get weight 0. L = 0: every key is seen.
  int L;
};

// Row r: y = exp(x - max) / sum over its seen keys, 0 for the others.
using SoftmaxRowFn = void (*)(const float* x, float* y, int seen, int S);

void softmax_row_scalar(const float* x, float* y, int seen, int S);
#if defined(__x86_64__)
void softmax_row_avx512(const float* x, float* y, int seen, int S);
#endif

void softmax(const SoftmaxArgs& a, Isa isa, int max_threads);

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

}  // namespace emlx
