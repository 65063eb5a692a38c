
  float m[TILE];
  float l[TILE];
  float acc[TILE][E];
#pragma unroll
  for (int h = 0; h < TILE; h++) {
    m[h] = neg_inf;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < E; e++) acc[h][e] = 0.f;
  }
  auto update = [&](int j0, const emlx_row8<T> (&kr)[U], const emlx_row8<T> (&vr)[U]) {
    float s[U][TILE];
#pragma unroll
    for (int u = 0; u < U; u++) {
      float kf[E];
      kr[u].unpack(kf);
#pragma unroll
      for (int h = 0; h < TILE; h++) {
        s[u][h] = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) s[u][h] += q[h][e] * kf[e];
      }
    }
    // Each key's G lanes sum their parts (G is a power of two and the
    // lanes of a key are aligned, so the exchanges stay among them).
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < U; u++) {
#pragma unroll
        for (int h = 0; h < TILE; h++) s[u][h] += __shfl_xor_sync(0xffffffff, s[u][h], o);
      }
    }
#pragma unroll
    for (int h = 0; h < TILE; h++) {
      float mn = m[h];
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (j0 + u <= last) mn = fmaxf(mn, s[u][h]);
      }
      // No key yet (a stream past `last`): nothing to rescale.
      const float c = mn == neg_inf ? 1.f : expf(m[h] - mn);
      l[h] *= c;
#pragma unroll
      for (int e = 0; e < E; e++) acc[h][e] *= c;
      m[h] = mn;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (j0 + u <= last) {
        float vf[E];
        vr[u].unpack(vf);
#pragma unroll
        for (int h = 0; h < TILE; h++) {
          const float p = expf(s[u][h] - m[h]);
          l[h] += p;
#pragma unroll
          for (int e = 0; e < E; e++) acc[h][e] += p * vf[e];
        }
      }
    }
  };
  if (jw0 <= last) {
    update(j00, kr0, vr0);
    for (int jw = jw0 + STREAMS * U; jw <= last; jw += STREAMS * U) {
      const int j0 = jw + (lane / G) * U;
      emlx_row8<T> kr[U];
      emlx_row8<T> vr[U];
      load(j0, kr, vr);
      new_key(j0, kr);
      update(j0, kr, vr);
    }
  }
