
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  if ((t & 31) == 0) partial[t >> 5] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < BLOCK / 32; i++) total += partial[i];
  const float n = rsqrtf(total / D + __int_as_float(EPS_BITS));
