
  for (int k = 0; k < PER; k++) {
    const int i = t + k * BLOCK;
    if (i < D) {
      normed[(size_t)row * D + i] =
          static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(v[k] * n)));
    }
  }
