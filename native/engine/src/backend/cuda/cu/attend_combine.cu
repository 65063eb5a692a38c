
  __shared__ float sm[WARPS];
  __shared__ float sl[WARPS];
  __shared__ float so[WARPS][D];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
  for (int e = 0; e < E; e++) so[w][lane * E + e] = acc[e];
  __syncthreads();
  const size_t at = (size_t)row * gridDim.x + head;
  // This block's (max, sum, D unnormalized outputs), split by split.
  float* sums = part + (at * SPLITS + split) * (D + 2);
  if (threadIdx.x < D) {
    const int d = threadIdx.x;
    float big = neg_inf;
    for (int i = 0; i < WARPS; i++) big = fmaxf(big, sm[i]);
    float total = 0.f;
    float o = 0.f;
    for (int i = 0; i < WARPS; i++) {
      const float f = sm[i] == neg_inf ? 0.f : expf(sm[i] - big);
      total += sl[i] * f;
      o += so[i][d] * f;
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
  if (threadIdx.x == 0) {
    int* count = const_cast<int*>(counts) + at;
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
  if (threadIdx.x < D) {
    const int d = threadIdx.x;
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
  if (threadIdx.x == 0) const_cast<int*>(counts)[at] = 0;
