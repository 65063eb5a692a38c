// A transformer layer of a one-token decode step, on raw buffers, in two
// parts around the cache write: what the DecodeQkv and DecodeLayerRest
// primitives run (see decode_layer.cpp).
#pragma once

#include <stdint.h>

#include "elementwise.h"
#include "qmm.h"

namespace emlx {

// An affine-quantized weight [N, K] in MLX's layout (see qmm.h).
struct QuantWeight {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  bool bf16_params;
  int bits, group;
};

// The layer up to its new keys: input RMSNorm, the stacked q/k/v product
// (and bias), per-head RMSNorm of queries and keys (optional) and RoPE.
struct DecodeQkvArgs {
  int B, D, nq, nkv, hd;  // rows, hidden width, query heads, key heads, head width
  const float* h;  // [B, D] the residual stream
  const float* w_in;  // [D]
  float eps_in;
  QuantWeight qkv;  // [(nq + 2 nkv) hd, D]
  const float* qkv_bias;  // [(nq + 2 nkv) hd] or null
  const float* w_qk;  // [nq + nkv, hd] or null
  float eps_qk;
  const float* cos;  // [T, hd] (T = 1 or B)
  const float* sin;
  int T;
  bool traditional;
  float* q;  // [B, nq, hd]
  float* k;  // [B, nkv, hd]
  float* v;  // [B, nkv, hd]
};

void decode_qkv(const DecodeQkvArgs& a, Isa isa);

// Routed experts in place of the dense MLP (Qwen3-MoE): the router's
// softmax picks each row's k most probable experts, whose SwiGLU MLPs'
// outputs are summed, weighted by those probabilities (renormalized over
// the k when asked), as mlx-lm's qwen3_moe computes it.
struct DecodeExperts {
  int E = 0, k = 0;  // experts, experts a row; k == 0: the dense MLP
  bool norm_topk = false;
  QuantWeight router;  // [E, D]
  QuantWeight gate, up;  // [E, F, D] each
  QuantWeight down;  // [E, D, F]
};

// The rest, once the cache holds the new keys: attention of each row over
// its keys starts[b]..=positions[b], the output product and residual,
// RMSNorm, the SwiGLU MLP (or routed experts) and residual.
struct DecodeRestArgs {
  int B, D, F, nq, nkv, hd;
  int cap;  // positions per row of the cache buffers
  const int* positions;  // [B]
  const int* starts;  // [B]
  const float* h;  // [B, D]
  const float* q;  // [B, nq, hd]
  float scale;  // the softmax scale
  // The whole cache buffers, [>= B, nkv, cap, hd] values each (see
  // KvRows: float32, float16 or quantized).
  KvRows keys, values;
  QuantWeight o;  // [D, nq hd]
  const float* w_post;  // [D]
  float eps_post;
  QuantWeight gate_up;  // [2F, D], gate rows then up rows
  QuantWeight down;  // [D, F]
  DecodeExperts experts;  // with experts.k > 0, in place of gate_up and down
  float* out;  // [B, D]
};

void decode_rest(const DecodeRestArgs& a, Isa isa);

}  // namespace emlx
