
  float m = neg_inf;
  float l = 0.f;
  float acc[E];
  for (int e = 0; e < E; e++) acc[e] = 0.f;
  auto update = [&](int j0, const float (&kf)[U][E], const float (&vf)[U][E]) {
    float s[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      s[u] = 0.f;
#pragma unroll
      for (int e = 0; e < E; e++) s[u] += qv[e] * kf[u][e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < U; u++) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (j0 + u <= last) mn = fmaxf(mn, s[u]);
    }
    const float c = expf(m - mn);
    l *= c;
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] *= c;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (j0 + u <= last) {
        const float p = expf(s[u] - mn);
        l += p;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] += p * vf[u][e];
      }
    }
    m = mn;
  };
  int j0 = first + w * U;
  if (j0 <= last) {
    if (!FIRST_LOADED) load(j0, kf0, vf0);
    update(j0, kf0, vf0);
    for (j0 += WARPS * U; j0 <= last; j0 += WARPS * U) {
      float kf[U][E];
      float vf[U][E];
      load(j0, kf, vf);
      update(j0, kf, vf);
    }
  }
