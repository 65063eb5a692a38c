
  // Output n's weight rows: row n of the weight, and for SwiGLU its up row
  // n + OUTS.
  decltype(wq) wrow[PER_OUT];
  decltype(scales) srow[PER_OUT];
  decltype(biases) brow[PER_OUT];
#pragma unroll
  for (int p = 0; p < PER_OUT; p++) {
    wrow[p] = wq + (size_t)p * OUTS * WORDS;
    srow[p] = scales + (size_t)p * OUTS * GROUPS;
    brow[p] = biases + (size_t)p * OUTS * GROUPS;
  }
