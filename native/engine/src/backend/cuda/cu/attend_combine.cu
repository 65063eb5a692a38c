
  __shared__ float sm[WARPS];
  __shared__ float sl[WARPS];
  __shared__ float so[WARPS][D];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
  for (int e = 0; e < E; e++) so[w][lane * E + e] = acc[e];
  __syncthreads();
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
    out[((size_t)row * gridDim.x + head) * D + d] = static_cast<T>(o / total);
  }
