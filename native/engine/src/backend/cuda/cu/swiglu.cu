
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = blockIdx.y;
  if (i < I) {
    const T* p = gu + (size_t)row * 2 * I;
    act[(size_t)row * I + i] = swiglu(static_cast<float>(p[i]), static_cast<float>(p[I + i]));
  }
