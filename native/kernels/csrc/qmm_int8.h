// The int8-activation form of the affine-quantized product (opt-in: it
// rounds the activations). The algebra is spelled out in qmm_int8.cpp.
#pragma once

#include <stdint.h>

#include "qmm.h"

namespace emlx {

// Activations are quantized in blocks of this many consecutive elements of a
// row; every supported group size (32, 64, 128) is a multiple of it.
constexpr int kXBlock = 32;

// x quantized once per product, shared by every thread.
struct Int8Activations {
  // [M, K]. Within each block of 32, the order of the weights' bytes: for
  // 4-bit weights the even elements of the block first, then the odd ones
  // (byte j holds elements 2j and 2j + 1 in its low and high nibble), for
  // 8-bit weights the natural order.
  const int8_t* q;
  const float* scale;  // [M, K / 32]: x ~= scale * q within a block
  const float* sum;  // [M, K / group]: group sums of the quantized x, X' in qmm_int8.cpp
};

// Rows n0..n1 of y, for every m. As in qmm.h, results do not depend on the
// split, and every variant rounds its float steps in the same order as the
// scalar one, so all variants give identical results.
using Int8RowsFn = void (*)(const QmmArgs&, const Int8Activations&, int n0, int n1);

// Fills q, scale and sum of rows m0..m1 of x (see Int8Activations); every
// variant's quantizer gives identical results.
using QuantizeFn = void (*)(const QmmArgs&, int m0, int m1, int8_t* q, float* scale, float* sum);

struct Int8Kernels {
  QuantizeFn quantize;
  Int8RowsFn gemm;  // repacks blocks of weight rows, reused over the rows of x
  int gemm_rows;  // n0 of a gemm call is a multiple of this
  // One row of x, 4-bit weights as stored, K a multiple of 128; null where
  // the variant has none. n0 of a call is a multiple of 4.
  Int8RowsFn gemv;
};

// One micro-tile of the SIMD matrix product: rows of x from xq (row i at
// xq + i * K, its block scales at xs + i * blocks, its group sums at
// xsum + i * groups) against groups g0..g1 of one packed block of weight
// rows (see qmm_int8_simd.inc), into y (row stride ldy, `cols` columns
// stored). y holds the running sums between slices: read unless g0 is 0,
// final (biases added) when g1 is the last group.
struct Int8MicroArgs {
  const int8_t* xq;
  int K;
  const float* xs;
  int blocks;
  const float* xsum;
  int groups;
  int per_group;
  int g0, g1;
  const uint8_t* pw;
  const float* ps;
  const float* pb;
  float* y;
  long ldy;
  int cols;
};

Int8Kernels scalar_int8_kernels();
#if defined(__x86_64__)
Int8Kernels avx2_int8_kernels();
Int8Kernels avx512_int8_kernels();  // needs AVX512-VNNI on top of the AVX-512 variant's set
bool vnni_supported();
void quantize_activations_avx2(const QmmArgs& a, int m0, int m1, int8_t* q, float* scale,
                               float* sum);
#endif

enum Activations { kActivationsF32 = 0, kActivationsInt8 = 1 };

// EMLX_AXON_CPU_ACTIVATIONS=int8 selects the int8 form for products built by
// the primitive; anything else (or unset) keeps float32. Read once.
Activations selected_activations();

// Rows of x from which a product takes int8 activations where they are
// selected, through the matrix product.
constexpr int kInt8MinRows = 8;

// Whether a product of this shape takes int8 activations where they are
// selected: kInt8MinRows rows or more, or one row that the selected
// variant's matrix-vector form takes (other shapes keep float32, which reads
// the weights faster than the matrix product there).
bool int8_takes(const QmmArgs& a);

// Whether a product runs with int8 activations: selected, and int8_takes.
bool int8_for(const QmmArgs& a);

// The product with the activations selected for it (int8_for): qmm_int8 or
// qmm, on at most `max_threads` of the pool's threads (0 for all).
void qmm_selected(const QmmArgs& a, Isa isa, int max_threads);

// Whole product on `isa` with int8 activations, split over the shared pool's
// threads (at most `max_threads`, 0 for all). The AVX-512 variant uses VNNI;
// on an AVX-512 CPU without it, the AVX2 int8 kernels run.
void qmm_int8(const QmmArgs& args, Isa isa, int max_threads);

// The portable quantizer (the reference the others match).
void quantize_activations(const QmmArgs& a, int m0, int m1, int8_t* q, float* scale, float* sum);

}  // namespace emlx
