
  constexpr int WARPS = BLOCK / 32;
  constexpr int PER_WORD = 32 / BITS;
  constexpr int CH = 4 * PER_WORD;
  constexpr int PAD = 16 / (int)sizeof(XT);
  constexpr int KP = K + K / CH * PAD;
  constexpr int WORDS = K / PER_WORD;
  constexpr int CHUNKS = WORDS / 4;
  constexpr int GROUPS = K / GS;
  constexpr int PER = (K + BLOCK - 1) / BLOCK;
  // Inputs move 16 bytes (PV values) at a time where rows allow it (VEC):
  // KC such pieces a row, each inside one lane chunk of the tile, a warp's
  // 32 within one row.
  constexpr int PV = 16 / (int)sizeof(T);
  constexpr int KC = K / PV;
  constexpr bool VEC = K % (32 * PV) == 0 && CH % PV == 0;
  constexpr int VITERS = (BT * KC + BLOCK - 1) / BLOCK;
  const int t = threadIdx.x;
  const int lane = t % 32;
  const int w = t / 32;
  const int b0 = blockIdx.y * BT;
  const int nb = min(BT, ROWS - b0);
  __shared__ __align__(16) XT xs[BT][KP];
#define XI(k) ((k) + (k) / CH * PAD)
  // PV values (16 bytes of T) into tile row b at column k, a multiple of
  // PV, and out as floats.
  auto tile_put = [&](int b, int k, const T* v) {
    if constexpr (sizeof(XT) == sizeof(T)) {
      *reinterpret_cast<uint4*>(&xs[b][XI(k)]) = *reinterpret_cast<const uint4*>(v);
    } else {
#pragma unroll
      for (int q = 0; q < PV / 4; q++) {
        float4 f;
        f.x = static_cast<float>(v[4 * q]);
        f.y = static_cast<float>(v[4 * q + 1]);
        f.z = static_cast<float>(v[4 * q + 2]);
        f.w = static_cast<float>(v[4 * q + 3]);
        *reinterpret_cast<float4*>(&xs[b][XI(k) + 4 * q]) = f;
      }
    }
  };
  auto tile_get = [&](int b, int k, float* f) {
#pragma unroll
    for (int q = 0; q < PV; q++) f[q] = static_cast<float>(xs[b][XI(k) + q]);
  };
  // The thread's 16-byte pieces of the tile (VEC): `f(b, k, q)` for each in
  // a row of this tile, at column k, piece q of the tile's.
  auto each_piece = [&](auto f) {
#pragma unroll
    for (int c = 0; c < VITERS; c++) {
      const int q = t + c * BLOCK;
      const int b = q / KC;
      if (b < nb) f(b, q % KC * PV, q);
    }
  };
