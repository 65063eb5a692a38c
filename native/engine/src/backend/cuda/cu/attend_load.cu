
  constexpr int U = 8;
  auto load = [&](int j0, float (&kf)[U][E], float (&vf)[U][E]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int j = min(j0 + u, last);
      const T* kp = KEY(j);
      const T* vp = VALUE(j);
#pragma unroll
      for (int e = 0; e < E; e++) {
        kf[u][e] = static_cast<float>(kp[e]);
        vf[u][e] = static_cast<float>(vp[e]);
      }
    }
  };
  float kf0[U][E];
  float vf0[U][E];
