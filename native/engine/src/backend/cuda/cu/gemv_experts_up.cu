  wrow[PER_OUT - 1] = up_wq + expert * OUTS * WORDS;
  srow[PER_OUT - 1] = up_scales + expert * OUTS * GROUPS;
  brow[PER_OUT - 1] = up_biases + expert * OUTS * GROUPS;
