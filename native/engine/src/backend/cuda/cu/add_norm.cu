
  constexpr int PER = (D + BLOCK - 1) / BLOCK;
  const int t = threadIdx.x;
  const int row = blockIdx.y;
  const int b = row / h_shape[1];
  const int l = row % h_shape[1];
  const T* hr = h + (size_t)b * h_strides[0] + (size_t)l * h_strides[1];
  const T* rr = r + (size_t)b * r_strides[0] + (size_t)l * r_strides[1];
  __shared__ float partial[BLOCK / 32];
  float v[PER];
  float ss = 0.f;
  for (int k = 0; k < PER; k++) {
    const int i = t + k * BLOCK;
    v[k] = 0.f;
    if (i < D) {
      const T s = static_cast<T>(
          static_cast<float>(hr[i * h_strides[2]]) + static_cast<float>(rr[i * r_strides[2]]));
      sum[(size_t)row * D + i] = s;
      v[k] = static_cast<float>(s);
      ss += v[k] * v[k];
    }
  }
