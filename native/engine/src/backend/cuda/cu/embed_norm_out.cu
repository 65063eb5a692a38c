
#pragma unroll
  for (int c = 0; c < WPT; c++) {
    const int i = t + c * BLOCK;
    if (i < WORDS) {
#pragma unroll
      for (int j = 0; j < PER_WORD; j++) {
        const int k = i * PER_WORD + j;
        normed[(size_t)row * D + k] =
            static_cast<T>(static_cast<float>(nw[k]) * static_cast<float>(static_cast<T>(v[c][j] * n)));
      }
    }
  }
