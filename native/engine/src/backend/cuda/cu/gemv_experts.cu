
  // This block's (row, choice) pair takes the weights of the expert it was
  // routed to, `wq` `[experts, OUTS, WORDS]` (gate's, then for SwiGLU
  // up's): ids past the stack are clamped to it.
  const size_t expert = (size_t)min(max(experts[blockIdx.y], 0), wq_shape[0] - 1);
  decltype(wq) wrow[PER_OUT];
  decltype(scales) srow[PER_OUT];
  decltype(biases) brow[PER_OUT];
  wrow[0] = wq + expert * OUTS * WORDS;
  srow[0] = scales + expert * OUTS * GROUPS;
  brow[0] = biases + expert * OUTS * GROUPS;
