
  constexpr int PER = (E + BLOCK - 1) / BLOCK;
  constexpr int WARPS = BLOCK / 32;
  const int t = threadIdx.x;
  const int row = blockIdx.y;
  const T* xr = logits + (size_t)row * E;
  __shared__ float sv[WARPS];
  __shared__ int si[WARPS];
  __shared__ float picked[TOPK];
  // The block's largest (v, i) of each thread's, ties to the higher index
  // (where MLX's stable ascending sort leaves them last); every thread gets
  // it.
  auto largest = [&](float v, int i, float& bv, int& bi) {
    auto take = [&](float ov, int oi) {
      if (ov > v || (ov == v && oi > i)) {
        v = ov;
        i = oi;
      }
    };
    for (int o = 16; o > 0; o >>= 1) take(__shfl_xor_sync(0xffffffff, v, o), __shfl_xor_sync(0xffffffff, i, o));
    __syncthreads();
    if (t % 32 == 0) {
      sv[t / 32] = v;
      si[t / 32] = i;
    }
    __syncthreads();
    for (int w = 0; w < WARPS; w++) take(sv[w], si[w]);
    bv = v;
    bi = i;
  };
  float v[PER];
  float m = __int_as_float(0xff800000);
#pragma unroll
  for (int k = 0; k < PER; k++) {
    const int i = t + k * BLOCK;
    v[k] = i < E ? static_cast<float>(xr[i]) : __int_as_float(0xff800000);
    m = fmaxf(m, v[k]);
  }
  int unused;
  largest(m, 0, m, unused);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < PER; k++) {
    v[k] = t + k * BLOCK < E ? expf(v[k] - m) : 0.f;
    s += v[k];
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
  __syncthreads();
  if (t % 32 == 0) sv[t / 32] = s;
  __syncthreads();
  s = 0.f;
  for (int w = 0; w < WARPS; w++) s += sv[w];
  // The probabilities as MLX's softmax stores them; -1 marks the padding
  // and the experts taken, which no choice takes.
#pragma unroll
  for (int k = 0; k < PER; k++) {
    v[k] = t + k * BLOCK < E ? static_cast<float>(static_cast<T>(v[k] / s)) : -1.f;
  }
  // The j-th largest goes to place TOPK - 1 - j: the order of the last TOPK
  // of MLX's ascending sort.
  for (int j = 0; j < TOPK; j++) {
    float bv = -1.f;
    int bi = -1;
#pragma unroll
    for (int k = 0; k < PER; k++) {
      const int i = t + k * BLOCK;
      if (v[k] > bv || (v[k] == bv && v[k] >= 0.f && i > bi)) {
        bv = v[k];
        bi = i;
      }
    }
    largest(bv, bi, bv, bi);
#pragma unroll
    for (int k = 0; k < PER; k++) {
      if (t + k * BLOCK == bi) v[k] = -1.f;
    }
    if (t == 0) {
      ids[(size_t)row * TOPK + TOPK - 1 - j] = bi;
      picked[TOPK - 1 - j] = bv;
    }
  }
  __syncthreads();
  if (t < TOPK) {
    float p = picked[t];
    if (NORM) {
      float total = 0.f;
      for (int j = 0; j < TOPK; j++) total += picked[j];
      p = p / static_cast<float>(static_cast<T>(total));
    }
    scores[(size_t)row * TOPK + t] = static_cast<T>(p);
  }
