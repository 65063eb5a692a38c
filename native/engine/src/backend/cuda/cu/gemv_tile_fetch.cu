
  constexpr int ITERS = (CHUNKS + 31) / 32;
  // A lane holds at most WIN of its chunks of a weight row at once (64
  // bytes): wider rows are taken in NWIN windows, the next one fetched
  // while this one is used, so that registers do not grow with K.
  constexpr int WIN = ITERS <= 4 ? ITERS : 2;
  constexpr int NWIN = (ITERS + WIN - 1) / WIN;
  const int n0 = (blockIdx.x * WARPS + w) * R;
  struct Row {
    uint4 words[WIN];
    float sc[WIN];
    float bi[WIN];
  };
  // Window `win` of the weight rows of outputs base..base + R (and of
  // their up rows).
  auto fetch = [&](Row (&rs)[R][PER_OUT], int base, int win) {
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
#pragma unroll
      for (int p = 0; p < PER_OUT; p++) {
        const int n = ROW_OF(base + rr, p);
        const uint4* wr = reinterpret_cast<const uint4*>(W_ROWS(p) + (size_t)n * WORDS);
#pragma unroll
        for (int it = 0; it < WIN; it++) {
          const int i = (win * WIN + it) * 32 + lane;
          if (base + rr < OUTS && i < CHUNKS) {
            rs[rr][p].words[it] = wr[i];
            const size_t g = (size_t)n * GROUPS + i * CH / GS;
            rs[rr][p].sc[it] = static_cast<float>(S_ROWS(p)[g]) * (float)(1 << BITS);
            rs[rr][p].bi[it] = static_cast<float>(B_ROWS(p)[g]);
          }
        }
      }
    }
  };
  Row rows[R][PER_OUT];
  fetch(rows, n0, 0);
