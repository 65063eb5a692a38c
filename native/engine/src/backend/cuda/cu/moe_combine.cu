
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = blockIdx.y;
  if (i >= D) return;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < TOPK; j++) {
    const size_t pair = (size_t)row * TOPK + j;
    const float y = static_cast<float>(ys[pair * D + i]);
    acc += static_cast<float>(static_cast<T>(y * static_cast<float>(scores[pair])));
  }
  out[(size_t)row * D + i] = static_cast<T>(acc);
