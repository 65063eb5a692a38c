
  if (VEC && reinterpret_cast<size_t>(x) % 16 == 0) {
    each_piece([&](int b, int k, int) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + (size_t)((b0 + b) / X_EVERY) * K + k);
      tile_put(b, k, reinterpret_cast<const T*>(&raw));
    });
  } else {
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) xs[b][XI(k)] = static_cast<XT>(static_cast<float>(x[(size_t)((b0 + b) / X_EVERY) * K + k]));
        }
      }
    }
  }
  __syncthreads();
