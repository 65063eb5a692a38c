
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = D / PER_WORD;
  constexpr int WPT = (WORDS + BLOCK - 1) / BLOCK;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int V = wq_shape[0];
  const int row = blockIdx.y;
  const int t = threadIdx.x;
  long long tok = static_cast<long long>(ids[row * ids_strides[0]]);
  if (tok < 0) tok += V;
  tok = tok < 0 ? 0 : (tok >= V ? V - 1 : tok);
  const uint32_t* wr = wq + (size_t)tok * WORDS;
  const size_t g0 = (size_t)tok * (D / GS);
  __shared__ float partial[BLOCK / 32];
  float v[WPT][PER_WORD];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < WPT; c++) {
    const int i = t + c * BLOCK;
    if (i < WORDS) {
      const uint32_t word = wr[i];
      const size_t g = g0 + i * PER_WORD / GS;
      const float sc = static_cast<float>(static_cast<T>(static_cast<float>(scales[g])));
      const float bi = static_cast<float>(static_cast<T>(static_cast<float>(biases[g])));
#pragma unroll
      for (int j = 0; j < PER_WORD; j++) {
        const float q = static_cast<float>((word >> (BITS * j)) & MASK);
        const T e = static_cast<T>(fmaf(sc, q, bi));
        h[(size_t)row * D + i * PER_WORD + j] = e;
        v[c][j] = static_cast<float>(e);
        ss += v[c][j] * v[c][j];
      }
    }
  }
