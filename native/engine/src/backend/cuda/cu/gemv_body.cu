
  constexpr unsigned MASK = (1u << BITS) - 1u;
  constexpr int LOADS = CH * (int)sizeof(XT) / 16;
  // Each chunk's input sum, as float bits in the first bytes of its
  // padding, for the products' `bias * sum(x)` and `- sum(x)` terms.
  for (int c = t; c < BT * CHUNKS; c += BLOCK) {
    XT* p = &xs[c / CHUNKS][c % CHUNKS * (CH + PAD)];
    const uint4* pv = reinterpret_cast<const uint4*>(p);
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < LOADS; q++) {
      const uint4 raw = pv[q];
      const XT* v = reinterpret_cast<const XT*>(&raw);
#pragma unroll
      for (int e = 0; e < 16 / (int)sizeof(XT); e++) s += static_cast<float>(v[e]);
    }
    *reinterpret_cast<float*>(p + CH) = s;
  }
  __syncthreads();
  // The tile's products with window `win` of one weight row, added to
  // this lane's sums (its scales already times 2^BITS, see `fetch`).
  auto dot = [&](const Row& row, int win, float (&acc)[BT]) {
#pragma unroll
    for (int it = 0; it < WIN; it++) {
      const int i = (win * WIN + it) * 32 + lane;
      if (i >= CHUNKS) break;
      const uint32_t ws[4] = {row.words[it].x, row.words[it].y, row.words[it].z, row.words[it].w};
      float wv[CH];
#pragma unroll
      for (int v = 0; v < 4; v++) {
#pragma unroll
        for (int j = 0; j < PER_WORD; j++) {
          constexpr int TOP = 23 - BITS;
          const int sh = TOP - BITS * j;
          const uint32_t m = sh >= 0 ? ws[v] << sh : ws[v] >> -sh;
          wv[v * PER_WORD + j] = __uint_as_float((m & (MASK << TOP)) | 0x3f800000u);
        }
      }
#pragma unroll
      for (int b = 0; b < BT; b++) {
        const uint4* xp = reinterpret_cast<const uint4*>(&xs[b][i * (CH + PAD)]);
        uint4 raw[LOADS + 1];
#pragma unroll
        for (int q = 0; q <= LOADS; q++) raw[q] = xp[q];
        const XT* xv = reinterpret_cast<const XT*>(raw);
        const float xsum = __uint_as_float(raw[LOADS].x);
        float a = -xsum;
#pragma unroll
        for (int e = 0; e < CH; e++) a += wv[e] * static_cast<float>(xv[e]);
        acc[b] += row.sc[it] * a + row.bi[it] * xsum;
      }
    }
  };
  // The lanes' sums, summed over the warp.
  auto reduce = [&](float (&acc)[BT]) {
#pragma unroll
    for (int b = 0; b < BT; b++) {
      for (int o = 16; o > 0; o >>= 1) acc[b] += __shfl_xor_sync(0xffffffff, acc[b], o);
    }
  };
  // With LOOP, a warp takes outputs a grid's width apart until they run
  // out. The next window (of these rows, or of the next outputs) is
  // fetched while the warp works on this one.
  const int stride = gridDim.x * WARPS * R;
  float sums[R][PER_OUT][BT];
#pragma unroll
  for (int rr = 0; rr < R; rr++) {
#pragma unroll
    for (int p = 0; p < PER_OUT; p++) {
#pragma unroll
      for (int b = 0; b < BT; b++) sums[rr][p][b] = 0.f;
    }
  }
  for (int base = n0, win_ = 0;;) {
    // A constant where rows are one window.
    const int win = NWIN == 1 ? 0 : win_;
    const int next_win = win + 1 == NWIN ? 0 : win + 1;
    const int next_base = next_win == 0 ? base + stride : base;
    const bool more = (NWIN > 1 && next_win != 0) || (LOOP && next_base < OUTS);
    Row next[R][PER_OUT];
    if (more) fetch(next, next_base, next_win);
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
      const int n = base + rr;
      if (n >= OUTS) break;
#pragma unroll
      for (int p = 0; p < PER_OUT; p++) dot(rows[rr][p], win, sums[rr][p]);
      if (win != NWIN - 1) continue;
      float acc[BT];
#pragma unroll
      for (int b = 0; b < BT; b++) {
        acc[b] = sums[rr][0][b];
        sums[rr][0][b] = 0.f;
      }
      reduce(acc);
      if constexpr (PER_OUT == 1) {
#pragma unroll
        for (int b = 0; b < BT; b++) {
          if (lane == 0 && b < nb) y[(size_t)(b0 + b) * OUTS + n] = static_cast<T>(acc[b]);
        }
      } else {
        // `silu(gate) * up` of the products rounded as MLX's product rounds.
        float up[BT];
#pragma unroll
        for (int b = 0; b < BT; b++) {
          up[b] = sums[rr][1][b];
          sums[rr][1][b] = 0.f;
        }
        reduce(up);
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
    base = next_base;
    win_ = next_win;
  }
