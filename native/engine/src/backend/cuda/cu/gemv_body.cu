
  constexpr unsigned MASK = (1u << BITS) - 1u;
  constexpr int LOADS = CH * (int)sizeof(XT) / 16;
  // The tile's products with one weight row, summed over the warp.
  auto dot = [&](const Row& row, float (&acc)[BT]) {
#pragma unroll
    for (int b = 0; b < BT; b++) acc[b] = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
      const int i = it * 32 + lane;
      if (i >= CHUNKS) break;
      const uint32_t ws[4] = {row.words[it].x, row.words[it].y, row.words[it].z, row.words[it].w};
      float wv[CH];
#pragma unroll
      for (int v = 0; v < 4; v++) {
#pragma unroll
        for (int j = 0; j < PER_WORD; j++) {
          wv[v * PER_WORD + j] = row.sc[it] * static_cast<float>((ws[v] >> (BITS * j)) & MASK) + row.bi[it];
        }
      }
#pragma unroll
      for (int b = 0; b < BT; b++) {
        const uint4* xp = reinterpret_cast<const uint4*>(&xs[b][i * (CH + PAD)]);
        uint4 raw[LOADS];
#pragma unroll
        for (int q = 0; q < LOADS; q++) raw[q] = xp[q];
        const XT* xv = reinterpret_cast<const XT*>(raw);
        float a = acc[b];
#pragma unroll
        for (int e = 0; e < CH; e++) a += wv[e] * static_cast<float>(xv[e]);
        acc[b] = a;
      }
    }
#pragma unroll
    for (int b = 0; b < BT; b++) {
      for (int o = 16; o > 0; o >>= 1) acc[b] += __shfl_xor_sync(0xffffffff, acc[b], o);
    }
  };
  // With LOOP, a warp takes outputs a grid's width apart until they run
  // out, fetching the next rows while it works on these.
  const int stride = gridDim.x * WARPS * R;
  for (int base = n0;; base += stride) {
    Row next[R][PER_OUT];
    const bool more = LOOP && base + stride < OUTS;
    if (more) fetch(next, base + stride);
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
      const int n = base + rr;
      if (n >= OUTS) break;
      float acc[BT];
      dot(rows[rr][0], acc);
      if constexpr (PER_OUT == 1) {
#pragma unroll
        for (int b = 0; b < BT; b++) {
          if (lane == 0 && b < nb) y[(size_t)(b0 + b) * OUTS + n] = static_cast<T>(acc[b]);
        }
      } else {
        // `silu(gate) * up` of the products rounded as MLX's product rounds.
        float up[BT];
        dot(rows[rr][1], up);
#pragma unroll
        for (int b = 0; b < BT; b++) {
          if (lane == 0 && b < nb) {
            y[(size_t)(b0 + b) * OUTS + n] = swiglu(static_cast<float>(static_cast<T>(acc[b])),
                                                    static_cast<float>(static_cast<T>(up[b])));
          }
        }
      }
    }
    if (!more) break;
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
#pragma unroll
      for (int p = 0; p < PER_OUT; p++) rows[rr][p] = next[rr][p];
    }
  }
