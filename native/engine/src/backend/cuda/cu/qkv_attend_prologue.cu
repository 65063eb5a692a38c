
  constexpr bool FIRST_LOADED = true;
  const int j00 = first + w * U;
  if (j00 <= last) load(j00, kf0, vf0);

  const int role = t / D;
  const bool mine = role < 2;
  const int i = t % D;
  const int partner = TRAD ? (i ^ 1) : (i < D / 2 ? i + D / 2 : i - D / 2);
  const float x = mine ? static_cast<float>(src[(role == 0 ? head : NQ + kv) * D + i]) : 0.f;
  const float wn = NORM && mine ? static_cast<float>(role == 0 ? q_norm[i] : k_norm[i]) : 1.f;
  const T vn = vnew[i];
  const float cs = rope_cos[(size_t)pos * D + i];
  const float sn = rope_sin[(size_t)pos * D + i];
  float n = 1.f;
  if (NORM) {
    float ss = x * x;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (lane == 0) partial[w] = ss;
    __syncthreads();
    float total = 0.f;
    if (mine) {
      for (int k = 0; k < D / 32; k++) total += partial[role * (D / 32) + k];
    }
    n = rsqrtf(total / D + __int_as_float(EPS_BITS));
  }
  if (mine) normed[role][i] = NORM ? static_cast<T>(wn * static_cast<float>(static_cast<T>(x * n))) : static_cast<T>(x);
  __syncthreads();
  if (mine) {
    qk[role][i] = static_cast<T>(static_cast<float>(normed[role][i]) * cs +
                                 static_cast<float>(normed[role][partner]) * sn);
  }
  __syncthreads();
  if (split == 0 && head % GQA == 0 && role == 1) {
    T* kc = const_cast<T*>(keys) + row * keys_strides[0] + kv * keys_strides[1] + (long)pos * keys_strides[2];
    T* vc = const_cast<T*>(values) + row * values_strides[0] + kv * values_strides[1] +
            (long)pos * values_strides[2];
    kc[i] = ks[i];
    vc[i] = vn;
  }
  // The new key, read early from shared memory not yet written, where the
  // first trip took it.
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (min(j00 + u, last) == pos) {
#pragma unroll
      for (int e = 0; e < E; e++) kf0[u][e] = static_cast<float>(ks[lane * E + e]);
    }
  }

  const float scale = rsqrtf((float)D);
  float qv[E];
  for (int e = 0; e < E; e++) qv[e] = static_cast<float>(qk[0][lane * E + e]) * scale;
