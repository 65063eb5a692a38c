
  constexpr int WARPS = BLOCK / 32;
  constexpr int GQA = NQ / NKV;
  // Blocks per key head, each taking TILE of its query heads.
  constexpr int QG = GQA / TILE;
  // A lane's values of a key: G lanes hold one key, a warp KW keys at once,
  // the block STREAMS; each stream takes U keys a trip.
  constexpr int E = 8;
  constexpr int G = D / E;
  constexpr int KW = 32 / G;
  constexpr int STREAMS = WARPS * KW;
  constexpr int U = TILE >= 3 ? 2 : 4;
  // Heads a pass of the prologue takes.
  constexpr int RPP = BLOCK / D;
  const int t = threadIdx.x;
  const int lane = t % 32;
  const int w = t / 32;
  const int li = lane % G;
  const int kv = blockIdx.x / QG;
  const int qh0 = kv * GQA + (blockIdx.x % QG) * TILE;
  const int row = blockIdx.y;
  const T* src = qkv + (size_t)row * (NQ + 2 * NKV) * D;
  const int pos = positions[row];
  // A long row's keys are split over up to SPLITS blocks (blockIdx.z) of at
  // least MIN_KEYS keys each, so a one-row step still fills the GPU; the
  // last block of a row's heads to finish combines their partial sums. The
  // split count is a power of two from the row's length alone (SPLITS is
  // too), so a row's sums are the same in any batch or cache size.
  const int begin = starts[row];
  const int keys_n = pos - begin + 1;
  const int splits = min(SPLITS, 1 << (31 - __clz(max(1, keys_n / MIN_KEYS))));
  const int split = blockIdx.z;
  if (split >= splits) return;
  const int first = begin + (int)((long)split * keys_n / splits);
  const int last = begin + (int)((long)(split + 1) * keys_n / splits) - 1;
  const float neg_inf = __int_as_float(0xff800000);

  __shared__ float partial[WARPS];
  __shared__ T normed[TILE + 1][D];
  // The rotated queries (0..TILE) and the new key (TILE).
  __shared__ __align__(16) T qk[TILE + 1][D];
  const T* ks = qk[TILE];
  const T* vnew = src + (NQ + NKV + kv) * D;
  const T* kb = keys + row * keys_strides[0] + kv * keys_strides[1] + li * E;
  const T* vb = values + row * values_strides[0] + kv * values_strides[1] + li * E;
  const long long k2 = keys_strides[2];
  const long long v2 = values_strides[2];

  // A trip: the keys and values j0..j0 + U (clamped to last), every load
  // issued before any use. The new key is read from the cache too (where it
  // may not be written yet), then taken from shared memory: the cache's
  // reads stay global loads.
  auto load = [&](int j0, emlx_row8<T> (&kr)[U], emlx_row8<T> (&vr)[U]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int j = min(j0 + u, last);
      kr[u].load(kb + j * k2);
      vr[u].load(j == pos ? vnew + li * E : vb + j * v2);
    }
  };
  auto new_key = [&](int j0, emlx_row8<T> (&kr)[U]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (min(j0 + u, last) == pos) kr[u].load(ks + li * E);
    }
  };
  // A warp's streams take KW * U keys from jw on, a trip; the warp's first
  // trip is under way while the prologue runs. Whether a warp goes on is
  // the same for its lanes (they exchange values); a stream past `last`
  // reads `last` again and counts nothing.
  const int jw0 = first + w * KW * U;
  const int j00 = jw0 + (lane / G) * U;
  emlx_row8<T> kr0[U];
  emlx_row8<T> vr0[U];
  if (jw0 <= last) load(j00, kr0, vr0);

  // The prologue: the TILE queries and the new key, normalized (Qwen3) and
  // rotated, RPP heads a pass; every read of a pass issued at once.
  const int i = t % D;
  const int partner = TRAD ? (i ^ 1) : (i < D / 2 ? i + D / 2 : i - D / 2);
  const float cs = rope_cos[(size_t)pos * D + i];
  const float sn = rope_sin[(size_t)pos * D + i];
  const float qw = NORM ? static_cast<float>(q_norm[i]) : 1.f;
  const float kw = NORM ? static_cast<float>(k_norm[i]) : 1.f;
  constexpr int PASSES = (TILE + RPP) / RPP;
  float xs[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    const int role = p * RPP + t / D;
    const bool mine = t / D < RPP && role <= TILE;
    xs[p] = mine ? static_cast<float>(src[(role == TILE ? NQ + kv : qh0 + role) * D + i]) : 0.f;
  }
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    const int role = p * RPP + t / D;
    const bool mine = t / D < RPP && role <= TILE;
    const bool key = role == TILE;
    const float x = xs[p];
    float n = 1.f;
    if (NORM) {
      float ss = x * x;
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
      if (lane == 0) partial[w] = ss;
      __syncthreads();
      float total = 0.f;
      if (mine) {
        for (int k = 0; k < D / 32; k++) total += partial[(t / D) * (D / 32) + k];
      }
      n = rsqrtf(total / D + __int_as_float(EPS_BITS));
      __syncthreads();
    }
    if (mine) {
      normed[role][i] =
          NORM ? static_cast<T>((key ? kw : qw) * static_cast<float>(static_cast<T>(x * n))) : static_cast<T>(x);
    }
  }
  __syncthreads();
#pragma unroll
  for (int p = 0; p < PASSES; p++) {
    const int role = p * RPP + t / D;
    if (t / D < RPP && role <= TILE) {
      qk[role][i] = static_cast<T>(static_cast<float>(normed[role][i]) * cs +
                                   static_cast<float>(normed[role][partner]) * sn);
    }
  }
  __syncthreads();
  if (split == 0 && blockIdx.x % QG == 0 && t < D) {
    T* kc = const_cast<T*>(keys) + row * keys_strides[0] + kv * keys_strides[1] + (long)pos * k2;
    T* vc = const_cast<T*>(values) + row * values_strides[0] + kv * values_strides[1] + (long)pos * v2;
    kc[t] = ks[t];
    vc[t] = vnew[t];
  }
  new_key(j00, kr0);

  const float scale = rsqrtf((float)D);
  float q[TILE][E];
#pragma unroll
  for (int h = 0; h < TILE; h++) {
#pragma unroll
    for (int e = 0; e < E; e++) q[h][e] = static_cast<float>(qk[h][li * E + e]) * scale;
  }
