
  // One block a row. Values are ranked by orderable keys (the order of
  // Rust's `f32::total_cmp`), the lower id first among equal keys.
  constexpr int WARPS = BLOCK / 32;
  static_assert(2 * WARPS >= 64, "the bound below the K-th largest needs 32 warps");
  constexpr int PV = 16 / (int)sizeof(T);
  constexpr unsigned FULL = 0xffffffffu;
  const int V = x_shape[1];
  const int row = blockIdx.x;
  const int t = threadIdx.x;
  const int lane = t % 32, warp = t / 32;
  const T* p = x + (size_t)row * x_strides[0];
  const long long xs = x_strides[1];
  auto key_of = [](float v) -> unsigned {
    const unsigned b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  };
  auto value_of = [](unsigned k) -> float {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
  };
  const bool wide = xs == 1 && reinterpret_cast<size_t>(p) % 16 == 0;
  // Masked rows: how many tokens the mask allows. A row it allows none of
  // (one whose grammar has ended, whose token is not used) draws unmasked.
  __shared__ int s_allowed;
  bool masked = false;
  if (MASKED) {
    int mine_allowed = 0;
    for (int w = t; w * 32 < V; w += BLOCK) {
      const int bits_here = V - w * 32 < 32 ? V - w * 32 : 32;
      const unsigned b = allowed_bits(row, w);
      mine_allowed += __popc(bits_here == 32 ? b : b & ((1u << bits_here) - 1u));
    }
    mine_allowed = __reduce_add_sync(FULL, mine_allowed);
    if (t == 0) s_allowed = 0;
    __syncthreads();
    if (lane == 0) atomicAdd(&s_allowed, mine_allowed);
    __syncthreads();
    masked = s_allowed > 0;
  }
  auto allowed = [&](int i) -> bool {
    return !masked || ((allowed_bits(row, i / 32) >> (i % 32)) & 1u);
  };
  // Calls `f(value, id)` for every value this thread owns (each value has
  // exactly one owner) that the mask allows, 16 bytes at a time where the
  // row allows it.
  auto each = [&](auto&& f) {
    int done = 0;
    if (wide) {
      const uint4* pv = reinterpret_cast<const uint4*>(p);
      const int chunks = V / PV;
#pragma unroll 2
      for (int c = t; c < chunks; c += BLOCK) {
        // PV divides 32: a chunk's ids are in one mask word.
        const unsigned bits = masked ? allowed_bits(row, c * PV / 32) >> (c * PV % 32) : ~0u;
        if (masked && (bits & ((1u << PV) - 1u)) == 0u) continue;
        const uint4 raw = pv[c];
        const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int e = 0; e < PV; e++)
          if ((bits >> e) & 1u) f(static_cast<float>(vals[e]), c * PV + e);
      }
      done = chunks * PV;
    }
    for (int i = done + t; i < V; i += BLOCK)
      if (allowed(i)) f(static_cast<float>(p[(size_t)i * xs]), i);
  };
  const float* prm = params;
  const float top_p = prm[0], min_p = prm[1], ln_min_p = prm[2];
  const int min_keep = (int)prm[3];
  const float temperature = prm[4];
  int K = (int)prm[5];
  K = K < 1 ? 1 : (K > 64 ? 64 : K);
  K = K < V ? K : V;
  if (masked) K = K < s_allowed ? K : s_allowed;

  __shared__ unsigned ck[CAP];
  __shared__ int ci[CAP];
  __shared__ unsigned s_top[WARPS], s_second[WARPS];
  __shared__ double s_sum[WARPS];
  __shared__ int s_count, s_digit, s_need;
  __shared__ double s_prob[64];
  __shared__ int s_id[64];

  // Pass 1: the largest key, and a bound below the K-th largest: each
  // warp's two largest per-thread maxima are distinct values, so the
  // smallest of all warps' second ones has at least 2 * WARPS >= 64 values
  // at or above it.
  // (A thread the mask leaves no value keeps 0, below every key: the bound
  // is then 0, and every allowed value, at least K, is gathered.)
  unsigned mine = 0;
  each([&](float v, int) { mine = max(mine, key_of(v)); });
  const unsigned w1 = __reduce_max_sync(FULL, mine);
  const int first = __ffs(__ballot_sync(FULL, mine == w1)) - 1;
  const unsigned w2 = __reduce_max_sync(FULL, lane == first ? 0u : mine);
  if (lane == 0) {
    s_top[warp] = w1;
    s_second[warp] = w2;
  }
  if (t == 0) s_count = 0;
  __syncthreads();
  unsigned kmax = 0, bound = 0xffffffffu;
  for (int w = 0; w < WARPS; w++) {
    kmax = max(kmax, s_top[w]);
    bound = min(bound, s_second[w]);
  }
  const float M = value_of(kmax);

  // Pass 2: the sum for the log-sum-exp, and every value at or above the
  // bound into shared memory (usually a few hundred).
  float sum = 0.f;
  each([&](float v, int i) {
    sum += expf(v - M);
    const unsigned k = key_of(v);
    if (k >= bound) {
      const int at = atomicAdd(&s_count, 1);
      if (at < CAP) {
        ck[at] = k;
        ci[at] = i;
      }
    }
  });
  double dsum = (double)sum;
  for (int o = 16; o > 0; o >>= 1) dsum += __shfl_xor_sync(FULL, dsum, o);
  if (lane == 0) s_sum[warp] = dsum;
  __syncthreads();
  int n = s_count;

  if (n > CAP) {
    // Too many values tie near the top: the K-th largest key by radix
    // selection among those at or above the bound, then every larger one
    // (fewer than K) and the lowest ids of those equal to it.
    __shared__ int hist[256];
    unsigned prefix = 0, high = 0;
    int need = K;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int d = t; d < 256; d += BLOCK) hist[d] = 0;
      __syncthreads();
      each([&](float v, int) {
        const unsigned k = key_of(v);
        if (k >= bound && (k & high) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1);
      });
      __syncthreads();
      if (t == 0) {
        int above = 0, d = 255;
        for (; d > 0; d--) {
          if (above + hist[d] >= need) break;
          above += hist[d];
        }
        s_digit = d;
        s_need = need - above;
      }
      __syncthreads();
      prefix |= (unsigned)s_digit << shift;
      high |= 255u << shift;
      need = s_need;
      __syncthreads();
    }
    const unsigned kth = prefix;
    if (t == 0) s_count = 0;
    __syncthreads();
    each([&](float v, int i) {
      const unsigned k = key_of(v);
      if (k > kth) {
        const int at = atomicAdd(&s_count, 1);
        ck[at] = k;
        ci[at] = i;
      }
    });
    __syncthreads();
    const int greater = s_count;
    __shared__ int s_warp_n[WARPS];
    int taken = 0;
    for (int base = 0; base < V && taken < need; base += BLOCK) {
      const int i = base + t;
      const bool tie = i < V && allowed(i) && key_of(static_cast<float>(p[(size_t)i * xs])) == kth;
      const unsigned b = __ballot_sync(FULL, tie);
      if (lane == 0) s_warp_n[warp] = __popc(b);
      __syncthreads();
      int before = __popc(b & ((1u << lane) - 1u)), total = 0;
      for (int w = 0; w < WARPS; w++) {
        if (w < warp) before += s_warp_n[w];
        total += s_warp_n[w];
      }
      if (tie && taken + before < need) {
        ck[greater + taken + before] = kth;
        ci[greater + taken + before] = i;
      }
      taken += total;
      __syncthreads();
    }
    n = K;
  }

  // The gathered values in rank order: a bitonic sort of the next power of
  // two, the padding last.
  int P = 32;
  while (P < n) P <<= 1;
  for (int i = n + t; i < P; i += BLOCK) {
    ck[i] = 0u;
    ci[i] = 0x7fffffff;
  }
  __syncthreads();
  for (int k2 = 2; k2 <= P; k2 <<= 1) {
    for (int j = k2 >> 1; j > 0; j >>= 1) {
      for (int i = t; i < P; i += BLOCK) {
        const int o = i ^ j;
        if (o > i) {
          const unsigned ka = ck[i], kb = ck[o];
          const int ia = ci[i], ib = ci[o];
          const bool b_first = kb > ka || (kb == ka && ib < ia);
          const bool a_first = ka > kb || (ka == kb && ia < ib);
          if ((i & k2) == 0 ? b_first : a_first) {
            ck[i] = kb;
            ck[o] = ka;
            ci[i] = ib;
            ci[o] = ia;
          }
        }
      }
      __syncthreads();
    }
  }

  // The filters on the K most likely, then the draw: one warp, candidate
  // `j` and `j + 32` on lane `j`.
  if (warp != 0) return;
  double S = 0.0;
  for (int w = 0; w < WARPS; w++) S += s_sum[w];
  const float L = M + logf((float)S);
  // The whole row's mass as the terms `exp(x - L)` add up.
  const double total = S * exp((double)M - (double)L);
  const float NEG_INF = __int_as_float(0xff800000);
  float lp[2];
  double mass[2];
  int id[2];
#pragma unroll
  for (int s = 0; s < 2; s++) {
    const int j = lane + 32 * s;
    lp[s] = j < K ? value_of(ck[j]) - L : NEG_INF;
    mass[s] = j < K ? (double)expf(lp[s]) : 0.0;
    id[s] = j < K ? ci[j] : 0x7fffffff;
  }
  auto lp_at = [&](int j) -> float {
    return j < 32 ? __shfl_sync(FULL, lp[0], j) : __shfl_sync(FULL, lp[1], j - 32);
  };
  // The first candidate meeting its lane's conditions (`c0` for `lane`,
  // `c1` for `lane + 32`), else `none`.
  auto first_where = [&](bool c0, bool c1, int none) -> int {
    const unsigned b0 = __ballot_sync(FULL, c0), b1 = __ballot_sync(FULL, c1);
    return b0 ? __ffs(b0) - 1 : (b1 ? 31 + __ffs(b1) : none);
  };
  int end = K;
  if (top_p > 0.f && top_p < 1.f) {
    // A candidate goes once those above it hold `top_p` of the mass; ties
    // with the last kept stay.
    double a0 = mass[0], a1 = mass[1];
    for (int o = 1; o < 32; o <<= 1) {
      const double u0 = __shfl_up_sync(FULL, a0, o), u1 = __shfl_up_sync(FULL, a1, o);
      if (lane >= o) {
        a0 += u0;
        a1 += u1;
      }
    }
    const double carry = __shfl_sync(FULL, a0, 31);
    a1 += carry;
    const double e0 = __shfl_up_sync(FULL, a0, 1), e1 = __shfl_up_sync(FULL, a1, 1);
    const double above0 = lane == 0 ? 0.0 : e0, above1 = lane == 0 ? carry : e1;
    const double limit = (double)top_p * total;
    const int cut = first_where(lane >= 1 && lane < K && above0 >= limit,
                                lane + 32 < K && above1 >= limit, K);
    if (cut < K) {
      const float threshold = lp_at(cut - 1);
      end = first_where(lane >= cut && lane < K && lp[0] < threshold,
                        lane + 32 >= cut && lane + 32 < K && lp[1] < threshold, K);
    }
  }
  if (min_p > 0.f) {
    const float floor = lp_at(0) + ln_min_p;
    const int keep = min_keep < end ? min_keep : end;
    const int above_floor = first_where(lane < end && lp[0] < floor,
                                        lane + 32 < end && lp[1] < floor, end);
    end = above_floor > keep ? above_floor : keep;
  }
  // Softmax of the kept, tempered, in float64.
  float top = NEG_INF;
#pragma unroll
  for (int s = 0; s < 2; s++)
    if (lane + 32 * s < end) top = fmaxf(top, lp[s]);
  for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(FULL, top, o));
  const double scale = 1.0 / (double)temperature;
  double q[2];
  double qsum = 0.0;
#pragma unroll
  for (int s = 0; s < 2; s++) {
    q[s] = lane + 32 * s < end ? exp(((double)lp[s] - (double)top) * scale) : 0.0;
    qsum += q[s];
  }
  for (int o = 16; o > 0; o >>= 1) qsum += __shfl_xor_sync(FULL, qsum, o);
  // The kept in ascending ids: each one's place among them.
#pragma unroll
  for (int s = 0; s < 2; s++) {
    int place = 0;
    for (int j = 0; j < end; j++) {
      const int other = j < 32 ? __shfl_sync(FULL, id[0], j) : __shfl_sync(FULL, id[1], j - 32);
      place += other < id[s];
    }
    if (lane + 32 * s < end) {
      s_prob[place] = q[s] / qsum;
      s_id[place] = id[s];
    }
  }
  __syncwarp();
  // The draw: the first kept token whose cumulative probability exceeds u,
  // u from the row's seed and position alone.
  unsigned long long z =
      seeds[row] ^ ((unsigned long long)(unsigned)positions[row] * 0x9E3779B97F4A7C15ull);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = (double)(z >> 11) * (1.0 / 9007199254740992.0);
  double c[2];
  bool live[2];
#pragma unroll
  for (int s = 0; s < 2; s++) {
    const int j = lane + 32 * s;
    c[s] = j < end ? s_prob[j] : 0.0;
    live[s] = j < end && c[s] > 0.0;
  }
  for (int o = 1; o < 32; o <<= 1) {
    const double u0 = __shfl_up_sync(FULL, c[0], o), u1 = __shfl_up_sync(FULL, c[1], o);
    if (lane >= o) {
      c[0] += u0;
      c[1] += u1;
    }
  }
  c[1] += __shfl_sync(FULL, c[0], 31);
  int pick = first_where(live[0] && c[0] > u, live[1] && c[1] > u, -1);
  if (pick < 0) {
    // Rounding left u above the last sum: the last kept token that can be
    // drawn, as the host's draw.
    const unsigned b0 = __ballot_sync(FULL, live[0]), b1 = __ballot_sync(FULL, live[1]);
    pick = b1 ? 63 - __clz(b1) : (b0 ? 31 - __clz(b0) : -1);
  }
  if (lane == 0) out[row] = (uint32_t)(pick >= 0 ? s_id[pick] : ci[0]);
