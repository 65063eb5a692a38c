  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) out[i] = 0;
