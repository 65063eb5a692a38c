
  constexpr int SLOTS = VEC ? KC / 32 : 1;
  __shared__ float partial[BT][SLOTS > WARPS ? SLOTS : WARPS];
  const float eps = __int_as_float(EPS_BITS);
  const bool dense = VEC && h_strides[2] == 1 && r_strides[2] == 1 && h_strides[0] % PV == 0 &&
                     r_strides[0] % PV == 0 && reinterpret_cast<size_t>(h) % 16 == 0 &&
                     reinterpret_cast<size_t>(r) % 16 == 0 && reinterpret_cast<size_t>(nw) % 16 == 0;
  if (dense) {
    // Each warp's sum of squares is one of its row's SLOTS parts.
    each_piece([&](int b, int k, int q) {
      const size_t row = b0 + b;
      const uint4 hv = *reinterpret_cast<const uint4*>(h + row * h_strides[0] + k);
      const uint4 rv = *reinterpret_cast<const uint4*>(r + row * r_strides[0] + k);
      const T* he = reinterpret_cast<const T*>(&hv);
      const T* re = reinterpret_cast<const T*>(&rv);
      uint4 sv;
      T* se = reinterpret_cast<T*>(&sv);
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < PV; e++) {
        se[e] = static_cast<T>(static_cast<float>(he[e]) + static_cast<float>(re[e]));
        const float f = static_cast<float>(se[e]);
        ss += f * f;
      }
      if (blockIdx.x == 0) *reinterpret_cast<uint4*>(sum + row * K + k) = sv;
      tile_put(b, k, se);
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
      if (lane == 0) partial[b][q % KC / 32] = ss;
    });
    __syncthreads();
    each_piece([&](int b, int k, int) {
      float total = 0.f;
      for (int i = 0; i < SLOTS; i++) total += partial[b][i];
      const float n = rsqrtf(total / K + eps);
      float xf[PV];
      tile_get(b, k, xf);
      const uint4 wv = *reinterpret_cast<const uint4*>(nw + k);
      const T* we = reinterpret_cast<const T*>(&wv);
      uint4 ov;
      T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
      for (int e = 0; e < PV; e++) {
        oe[e] = static_cast<T>(static_cast<float>(we[e]) * static_cast<float>(static_cast<T>(xf[e] * n)));
      }
      tile_put(b, k, oe);
    });
  } else {
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
        const size_t row = b0 + b;
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) {
            const T s = static_cast<T>(static_cast<float>(h[row * h_strides[0] + k * h_strides[2]]) +
                                       static_cast<float>(r[row * r_strides[0] + k * r_strides[2]]));
            if (blockIdx.x == 0) sum[row * K + k] = s;
            xs[b][XI(k)] = static_cast<XT>(static_cast<float>(s));
            const float f = static_cast<float>(s);
            ss += f * f;
          }
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
        if (lane == 0) partial[b][w] = ss;
      }
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
        float total = 0.f;
        for (int i = 0; i < WARPS; i++) total += partial[b][i];
        const float n = rsqrtf(total / K + eps);
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) {
            const float f = static_cast<float>(xs[b][XI(k)]);
            xs[b][XI(k)] = static_cast<XT>(static_cast<float>(
                static_cast<T>(static_cast<float>(nw[k]) * static_cast<float>(static_cast<T>(f * n)))));
          }
        }
      }
    }
  }
  __syncthreads();
