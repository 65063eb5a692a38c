
  constexpr int WARPS = BLOCK / 32;
  constexpr int PV = 16 / (int)sizeof(T);
  const int V = x_shape[1];
  const int row = blockIdx.x;
  const int t = threadIdx.x;
  const T* p = x + (size_t)row * x_strides[0];
  float best = __int_as_float(0xff800000);
  int at = V;
  auto take = [&](float v, int i) {
    if (v > best || (v == best && i < at)) {
      best = v;
      at = i;
    }
  };
  int done = 0;
  if (x_strides[1] == 1 && reinterpret_cast<size_t>(p) % 16 == 0) {
    const uint4* pv = reinterpret_cast<const uint4*>(p);
    const int chunks = V / PV;
#pragma unroll 4
    for (int c = t; c < chunks; c += BLOCK) {
      // PV divides 32: a chunk's ids are in one mask word.
      const unsigned bits = allowed_bits(row, c * PV / 32) >> (c * PV % 32);
      if (MASKED && (bits & ((1u << PV) - 1u)) == 0u) continue;
      const uint4 raw = pv[c];
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < PV; e++)
        if (!MASKED || ((bits >> e) & 1u)) take(static_cast<float>(vals[e]), c * PV + e);
    }
    done = chunks * PV;
  }
  for (int i = done + t; i < V; i += BLOCK)
    if (!MASKED || ((allowed_bits(row, i / 32) >> (i % 32)) & 1u))
      take(static_cast<float>(p[(size_t)i * x_strides[1]]), i);
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffff, best, o);
    const int oa = __shfl_xor_sync(0xffffffff, at, o);
    take(ob, oa);
  }
  __shared__ float sb[WARPS];
  __shared__ int sa[WARPS];
  if (t % 32 == 0) {
    sb[t / 32] = best;
    sa[t / 32] = at;
  }
  __syncthreads();
  if (t == 0) {
    for (int i = 0; i < WARPS; i++) take(sb[i], sa[i]);
    out[row] = at < V ? (uint32_t)at : 0u;
  }
