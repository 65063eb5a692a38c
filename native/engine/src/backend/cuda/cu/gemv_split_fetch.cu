
  // Thread t takes chunk t of every weight row; a trip takes NO outputs
  // (four weight rows), the next trip's rows in flight while this one's are
  // used.
  constexpr int NO = 4 / PER_OUT;
  const bool has = t < CHUNKS;
  const int g = t * CH / GS;
  const int stride = gridDim.x * NO;
  struct Rows {
    uint4 q[NO][PER_OUT];
    float sc[NO][PER_OUT];
    float bi[NO][PER_OUT];
  };
  auto fetch = [&](Rows& rs, int base) {
#pragma unroll
    for (int o = 0; o < NO; o++) {
#pragma unroll
      for (int p = 0; p < PER_OUT; p++) {
        const size_t row = (size_t)(base + o) + (size_t)p * OUTS;
        const bool in = has && base + o < OUTS;
        rs.q[o][p] = in ? reinterpret_cast<const uint4*>(wq + row * WORDS)[t] : make_uint4(0, 0, 0, 0);
        rs.sc[o][p] = in ? static_cast<float>(scales[row * GROUPS + g]) : 0.f;
        rs.bi[o][p] = in ? static_cast<float>(biases[row * GROUPS + g]) : 0.f;
      }
    }
  };
  Rows rows;
  fetch(rows, blockIdx.x * NO);
