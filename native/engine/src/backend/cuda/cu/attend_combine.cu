
  __shared__ float sm[TILE][STREAMS];
  __shared__ float sl[TILE][STREAMS];
  __shared__ float so[TILE][STREAMS][D];
  {
    const int s = w * KW + lane / G;
#pragma unroll
    for (int h = 0; h < TILE; h++) {
      if (li == 0) {
        sm[h][s] = m[h];
        sl[h][s] = l[h];
      }
#pragma unroll
      for (int e = 0; e < E; e++) so[h][s][li * E + e] = acc[h][e];
    }
  }
  __syncthreads();
  const size_t at0 = (size_t)row * NQ + qh0;
  for (int x = t; x < TILE * D; x += BLOCK) {
    const int h = x / D;
    const int d = x % D;
    const size_t at = at0 + h;
    // This block's (max, sum, D unnormalized outputs), split by split.
    float* sums = part + (at * SPLITS + split) * (D + 2);
    float big = neg_inf;
    for (int i = 0; i < STREAMS; i++) big = fmaxf(big, sm[h][i]);
    float total = 0.f;
    float o = 0.f;
    for (int i = 0; i < STREAMS; i++) {
      const float f = sm[h][i] == neg_inf ? 0.f : expf(sm[h][i] - big);
      total += sl[h][i] * f;
      o += so[h][i][d] * f;
    }
    if (splits == 1) {
      out[at * D + d] = static_cast<T>(o / total);
    } else {
      sums[2 + d] = o;
      if (d == 0) {
        sums[0] = big;
        sums[1] = total;
      }
    }
  }
  if (splits == 1) return;
  // The classic last-block reduction: each block's sums are visible before
  // its count is; the block that counts last combines every split in a
  // fixed order (the result does not depend on which block that is) and
  // puts the count back to zero for the next layer.
  __threadfence();
  __syncthreads();
  __shared__ bool combines;
  const size_t counted = (size_t)row * gridDim.x + blockIdx.x;
  if (t == 0) {
    int* count = const_cast<int*>(counts) + counted;
    combines = atomicAdd(count, 1) == splits - 1;
  }
  __syncthreads();
  if (!combines) return;
  __threadfence();
  // Other blocks' sums, read from L2 (the L1 of this multiprocessor is not
  // kept coherent with other multiprocessors' writes).
  auto read = [](const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
  };
  for (int x = t; x < TILE * D; x += BLOCK) {
    const int h = x / D;
    const int d = x % D;
    const size_t at = at0 + h;
    const float* all = part + at * SPLITS * (D + 2);
    float big = neg_inf;
    for (int i = 0; i < splits; i++) big = fmaxf(big, read(all + i * (D + 2)));
    float total = 0.f;
    float o = 0.f;
    for (int i = 0; i < splits; i++) {
      const float* p = all + i * (D + 2);
      const float f = expf(read(p) - big);
      total += read(p + 1) * f;
      o += read(p + 2 + d) * f;
    }
    out[at * D + d] = static_cast<T>(o / total);
  }
  if (t == 0) const_cast<int*>(counts)[counted] = 0;
