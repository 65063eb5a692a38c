//! The CUDA kernels of a one-token step's layer (see the module above), each
//! one node, with the roundings of the MLX ops it replaces: every value an
//! MLX op would store in the compute dtype is rounded to it here too, and
//! sums are taken in float32.

use mlx_rs::{Array, Dtype};
use once_cell::sync::Lazy;

use emlx_axon_kernels::QuantWeight;

use crate::cuda_kernel::{CudaKernel, Template};
use crate::decode_attention::{ATTEND_COMBINE, ATTEND_KEYS, ATTEND_LOAD};
use crate::error::Result;

/// A layer's attention for one query per row from the q/k/v product: q and
/// k RMSNorm (Qwen3), RoPE from a float32 table of positions, the new key and value
/// written into the cache at the row's position, and attention over the
/// row's keys `starts..=position` (online softmax in float32, the block's
/// warps taking turns by a few keys, then combined). One block per
/// (query head, row), of at least `2 * D` threads: the query and the new
/// key are normalized and rotated at once, while each warp's first trip
/// for keys is already under way. Every block of a key head computes that
/// head's new key itself and reads it from shared memory, so no block waits
/// for another's cache write; the first query head of each group writes
/// it. The cache buffers are inputs that the kernel writes in place:
/// nothing else reads them within the step's layer, and the next layer's
/// caches are other buffers.
const QKV_ATTEND_HEAD: &str = r#"
  constexpr int WARPS = BLOCK / 32;
  constexpr int E = D / 32;
  constexpr int GQA = NQ / NKV;
  const int t = threadIdx.x;
  const int lane = t % 32;
  const int w = t / 32;
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int kv = head / GQA;
  const T* src = qkv + (size_t)row * (NQ + 2 * NKV) * D;
  const int pos = positions[row];
  const int first = starts[row];
  const int last = pos;
  const float neg_inf = __int_as_float(0xff800000);

  __shared__ float partial[WARPS];
  __shared__ T normed[2][D];
  // The rotated query (0) and new key (1).
  __shared__ __align__(16) T qk[2][D];
  const T* ks = qk[1];
  const T* vnew = src + (NQ + NKV + kv) * D;
  const T* kb = keys + row * keys_strides[0] + kv * keys_strides[1] + lane * E;
  const T* vb = values + row * values_strides[0] + kv * values_strides[1] + lane * E;
#define KEY(j) ((j) == pos ? ks + lane * E : kb + (long)(j) * keys_strides[2])
#define VALUE(j) ((j) == pos ? vnew + lane * E : vb + (long)(j) * values_strides[2])
"#;

/// After [`ATTEND_LOAD`]: the warp's first trip issued, then the prologue,
/// every read of it issued at once (in a chain of trips to memory they cost
/// most of the time), threads `0..D` on the query and `D..2D` on the key.
const QKV_ATTEND_PROLOGUE: &str = r#"
  constexpr bool FIRST_LOADED = true;
  const int j00 = first + w * U;
  if (j00 <= last) load(j00, kf0, vf0);

  const int role = t / D;
  const bool mine = role < 2;
  const int i = t % D;
  const int partner = TRAD ? (i ^ 1) : (i < D / 2 ? i + D / 2 : i - D / 2);
  const float x = mine ? static_cast<float>(src[(role == 0 ? head : NQ + kv) * D + i]) : 0.f;
  const float wn = NORM && mine ? static_cast<float>(role == 0 ? q_norm[i] : k_norm[i]) : 1.f;
  const T vn = vnew[i];
  const float cs = rope_cos[(size_t)pos * D + i];
  const float sn = rope_sin[(size_t)pos * D + i];
  float n = 1.f;
  if (NORM) {
    float ss = x * x;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (lane == 0) partial[w] = ss;
    __syncthreads();
    float total = 0.f;
    if (mine) {
      for (int k = 0; k < D / 32; k++) total += partial[role * (D / 32) + k];
    }
    n = rsqrtf(total / D + __int_as_float(EPS_BITS));
  }
  if (mine) normed[role][i] = NORM ? static_cast<T>(wn * static_cast<float>(static_cast<T>(x * n))) : static_cast<T>(x);
  __syncthreads();
  if (mine) {
    qk[role][i] = static_cast<T>(static_cast<float>(normed[role][i]) * cs +
                                 static_cast<float>(normed[role][partner]) * sn);
  }
  __syncthreads();
  if (head % GQA == 0 && role == 1) {
    T* kc = const_cast<T*>(keys) + row * keys_strides[0] + kv * keys_strides[1] + (long)pos * keys_strides[2];
    T* vc = const_cast<T*>(values) + row * values_strides[0] + kv * values_strides[1] +
            (long)pos * values_strides[2];
    kc[i] = ks[i];
    vc[i] = vn;
  }
  // The new key, read early from shared memory not yet written, where the
  // first trip took it.
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (min(j00 + u, last) == pos) {
#pragma unroll
      for (int e = 0; e < E; e++) kf0[u][e] = static_cast<float>(ks[lane * E + e]);
    }
  }

  const float scale = rsqrtf((float)D);
  float qv[E];
  for (int e = 0; e < E; e++) qv[e] = static_cast<float>(qk[0][lane * E + e]) * scale;
"#;

/// A prompt's q/k norms (Qwen3), RoPE and cache write for all its tokens,
/// one block of `D` threads per (query or key head, token, row) of the
/// q/k/v product `[B, L, (NQ + 2 * NKV) * D]`: query heads go to `q` `[B,
/// NQ, L, D]` as attention reads them, each key head (rotated) and its value
/// head into the cache buffers in place at `offset + l`. The same arithmetic, rounding for
/// rounding, as the step kernel's prologue above; it replaces about
/// fifteen MLX nodes a layer (slices, norms, transposes, rotations, the
/// cache's update and its reshapes).
const QK_ROPE_WRITE: &str = r#"
  const int i = threadIdx.x;
  const int head = blockIdx.x;
  const int l = blockIdx.y;
  const int b = blockIdx.z;
  const int L = qkv_shape[1];
  const int pos = offset[0] + l;
  const T* src = qkv + ((size_t)b * L + l) * (NQ + 2 * NKV) * D;
  __shared__ float partial[D / 32];
  __shared__ T normed[D];
  const bool is_q = head < NQ;
  const float x = static_cast<float>(src[head * D + i]);
  float n = 1.f;
  if (NORM) {
    float ss = x * x;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (i % 32 == 0) partial[i / 32] = ss;
    __syncthreads();
    float total = 0.f;
    for (int k = 0; k < D / 32; k++) total += partial[k];
    n = rsqrtf(total / D + __int_as_float(EPS_BITS));
  }
  const float wn = NORM ? static_cast<float>(is_q ? q_norm[i] : k_norm[i]) : 1.f;
  normed[i] = NORM ? static_cast<T>(wn * static_cast<float>(static_cast<T>(x * n))) : static_cast<T>(x);
  __syncthreads();
  const int partner = TRAD ? (i ^ 1) : (i < D / 2 ? i + D / 2 : i - D / 2);
  const float cs = rope_cos[(size_t)pos * D + i];
  const float sn = rope_sin[(size_t)pos * D + i];
  const T y = static_cast<T>(static_cast<float>(normed[i]) * cs +
                             static_cast<float>(normed[partner]) * sn);
  if (is_q) {
    q[(((size_t)b * NQ + head) * L + l) * D + i] = y;
  } else {
    const int kv = head - NQ;
    T* kc = const_cast<T*>(keys) + (size_t)b * keys_strides[0] + (size_t)kv * keys_strides[1] +
            (size_t)pos * keys_strides[2];
    T* vc = const_cast<T*>(values) + (size_t)b * values_strides[0] +
            (size_t)kv * values_strides[1] + (size_t)pos * values_strides[2];
    kc[i] = y;
    vc[i] = src[(NQ + NKV + kv) * D + i];
  }
"#;

/// A block's RMSNorm factor `n` over `D` values, from each thread's sum of
/// squares `ss` (threads `t`, a `partial` slot per warp).
const BLOCK_NORM: &str = r#"
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  if ((t & 31) == 0) partial[t >> 5] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < BLOCK / 32; i++) total += partial[i];
  const float n = rsqrtf(total / D + __int_as_float(EPS_BITS));
"#;

/// The residual add and the RMSNorm after it: `h + r`, then (with
/// [`BLOCK_NORM`] and [`ADD_NORM_OUT`]) its norm; a block per row of `[B,
/// L, D]` inputs.
const ADD_NORM: &str = r#"
  constexpr int PER = (D + BLOCK - 1) / BLOCK;
  const int t = threadIdx.x;
  const int row = blockIdx.y;
  const int b = row / h_shape[1];
  const int l = row % h_shape[1];
  const T* hr = h + (size_t)b * h_strides[0] + (size_t)l * h_strides[1];
  const T* rr = r + (size_t)b * r_strides[0] + (size_t)l * r_strides[1];
  __shared__ float partial[BLOCK / 32];
  float v[PER];
  float ss = 0.f;
  for (int k = 0; k < PER; k++) {
    const int i = t + k * BLOCK;
    v[k] = 0.f;
    if (i < D) {
      const T s = static_cast<T>(
          static_cast<float>(hr[i * h_strides[2]]) + static_cast<float>(rr[i * r_strides[2]]));
      sum[(size_t)row * D + i] = s;
      v[k] = static_cast<float>(s);
      ss += v[k] * v[k];
    }
  }
"#;

/// The rest of [`ADD_NORM`]: the normalized sum.
const ADD_NORM_OUT: &str = r#"
  for (int k = 0; k < PER; k++) {
    const int i = t + k * BLOCK;
    if (i < D) {
      normed[(size_t)row * D + i] =
          static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(v[k] * n)));
    }
  }
"#;

/// A step's embeddings and the first layer's RMSNorm of them, one block a
/// row: the row's token's row of a quantized embedding table (MLX's affine
/// layout, as the products read it) dequantized as MLX's `dequantize`
/// computes it (`scale * q + bias` rounded once to the compute dtype: on an
/// NVIDIA H200 every value of MLX's bfloat16, float16 and float32 results
/// matched this and about half differed from rounding the product first),
/// then normalized with weight `nw`. Token ids below zero count from the
/// end, as MLX's `take`; ids past the table are clamped to it. Followed by
/// [`BLOCK_NORM`] and [`EMBED_NORM_OUT`].
const EMBED_NORM: &str = r#"
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = D / PER_WORD;
  constexpr int WPT = (WORDS + BLOCK - 1) / BLOCK;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int V = wq_shape[0];
  const int row = blockIdx.y;
  const int t = threadIdx.x;
  long long tok = static_cast<long long>(ids[row * ids_strides[0]]);
  if (tok < 0) tok += V;
  tok = tok < 0 ? 0 : (tok >= V ? V - 1 : tok);
  const uint32_t* wr = wq + (size_t)tok * WORDS;
  const size_t g0 = (size_t)tok * (D / GS);
  __shared__ float partial[BLOCK / 32];
  float v[WPT][PER_WORD];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < WPT; c++) {
    const int i = t + c * BLOCK;
    if (i < WORDS) {
      const uint32_t word = wr[i];
      const size_t g = g0 + i * PER_WORD / GS;
      const float sc = static_cast<float>(static_cast<T>(static_cast<float>(scales[g])));
      const float bi = static_cast<float>(static_cast<T>(static_cast<float>(biases[g])));
#pragma unroll
      for (int j = 0; j < PER_WORD; j++) {
        const float q = static_cast<float>((word >> (BITS * j)) & MASK);
        const T e = static_cast<T>(fmaf(sc, q, bi));
        h[(size_t)row * D + i * PER_WORD + j] = e;
        v[c][j] = static_cast<float>(e);
        ss += v[c][j] * v[c][j];
      }
    }
  }
"#;

/// The rest of [`EMBED_NORM`]: the normalized embeddings.
const EMBED_NORM_OUT: &str = r#"
#pragma unroll
  for (int c = 0; c < WPT; c++) {
    const int i = t + c * BLOCK;
    if (i < WORDS) {
#pragma unroll
      for (int j = 0; j < PER_WORD; j++) {
        const int k = i * PER_WORD + j;
        normed[(size_t)row * D + k] =
            static_cast<T>(static_cast<float>(nw[k]) * static_cast<float>(static_cast<T>(v[c][j] * n)));
      }
    }
  }
"#;

/// `silu(g) * u` of values in the compute dtype, rounded where MLX's
/// `sigmoid`, `multiply` and `multiply` round.
const SWIGLU_OF: &str = r#"
  auto swiglu = [](float g, float u) -> T {
    const T s = static_cast<T>(1.f / (1.f + expf(-g)));
    const T a = static_cast<T>(g * static_cast<float>(s));
    return static_cast<T>(static_cast<float>(a) * u);
  };
"#;

/// `silu(gate) * up` from the stacked gate/up product `[rows, 2 * I]`
/// (contiguous, any leading shape).
const SWIGLU: &str = r#"
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = blockIdx.y;
  if (i < I) {
    const T* p = gu + (size_t)row * 2 * I;
    act[(size_t)row * I + i] = swiglu(static_cast<float>(p[i]), static_cast<float>(p[I + i]));
  }
"#;

/// Each row's greedy token: the index of its largest value, the first of
/// equal ones (as MLX's argmax), over `x` `[rows, V]`, one block a row.
/// 16-byte loads where the row allows them: MLX's own kernel took 21 µs
/// for a 151,936-wide row on an NVIDIA H200, its loads one value each.
const ARGMAX: &str = r#"
  constexpr int WARPS = BLOCK / 32;
  constexpr int PV = 16 / (int)sizeof(T);
  const int V = x_shape[1];
  const int row = blockIdx.x;
  const int t = threadIdx.x;
  const T* p = x + (size_t)row * x_strides[0];
  float best = __int_as_float(0xff800000);
  int at = V;
  auto take = [&](float v, int i) {
    if (v > best || (v == best && i < at)) {
      best = v;
      at = i;
    }
  };
  int done = 0;
  if (x_strides[1] == 1 && reinterpret_cast<size_t>(p) % 16 == 0) {
    const uint4* pv = reinterpret_cast<const uint4*>(p);
    const int chunks = V / PV;
#pragma unroll 4
    for (int c = t; c < chunks; c += BLOCK) {
      const uint4 raw = pv[c];
      const T* vals = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < PV; e++) take(static_cast<float>(vals[e]), c * PV + e);
    }
    done = chunks * PV;
  }
  for (int i = done + t; i < V; i += BLOCK) take(static_cast<float>(p[(size_t)i * x_strides[1]]), i);
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffff, best, o);
    const int oa = __shfl_xor_sync(0xffffffff, at, o);
    take(ob, oa);
  }
  __shared__ float sb[WARPS];
  __shared__ int sa[WARPS];
  if (t % 32 == 0) {
    sb[t / 32] = best;
    sa[t / 32] = at;
  }
  __syncthreads();
  if (t == 0) {
    for (int i = 0; i < WARPS; i++) take(sb[i], sa[i]);
    out[row] = at < V ? (uint32_t)at : 0u;
  }
"#;

/// The product of one quantized weight (MLX's affine layout: `BITS`-bit
/// values packed little-end first into `uint32` words, a scale and a bias per
/// `GS` values of a row) with a tile of `BT` input rows, after one of the
/// prologues below has put the tile's inputs into shared memory. Each warp
/// takes `R` outputs, each from `PER_OUT` weight rows (two for SwiGLU: the
/// gate row and the up row `OUTS` further on), all fetched before the
/// prologue (`GEMV_START`) so that their trips to memory overlap its
/// (with `LOOP`, further outputs a grid apart, see `LOOP_OUTPUTS`). A
/// lane takes chunks of four words (16 bytes, in one group), and every
/// weight value `scale * q + bias` (float32) is used for all rows of the
/// tile. A lane reads its chunk's inputs with 16-byte loads, and the
/// padding after each chunk's inputs (see `GEMV_START`) puts the lanes of
/// a load on different banks.
const GEMV_BODY: &str = r#"
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
"#;

/// What every prologue starts with (after naming its first input's rows
/// `ROWS`): the block's place and its input tile, in the compute dtype
/// (what MLX's ops would store), each lane chunk's `CH` inputs followed by
/// 16 bytes of padding; then the warp's weight rows fetched into
/// registers. Sizes that need not be constants are read from the shapes,
/// so that fewer variants are compiled.
const GEMV_START: &str = r#"
  const int OUTS = wq_shape[0] / PER_OUT;
  constexpr int WARPS = BLOCK / 32;
  constexpr int PER_WORD = 32 / BITS;
  constexpr int CH = 4 * PER_WORD;
  constexpr int PAD = 16 / (int)sizeof(XT);
  constexpr int KP = K + K / CH * PAD;
  constexpr int WORDS = K / PER_WORD;
  constexpr int CHUNKS = WORDS / 4;
  constexpr int GROUPS = K / GS;
  constexpr int ITERS = (CHUNKS + 31) / 32;
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
  const int n0 = (blockIdx.x * WARPS + w) * R;
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
  struct Row {
    uint4 words[ITERS];
    float sc[ITERS];
    float bi[ITERS];
  };
  // The weight rows of outputs base..base + R (and their up rows).
  auto fetch = [&](Row (&rs)[R][PER_OUT], int base) {
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
#pragma unroll
      for (int p = 0; p < PER_OUT; p++) {
        const int n = base + rr + p * OUTS;
        const uint4* wr = reinterpret_cast<const uint4*>(wq + (size_t)n * WORDS);
#pragma unroll
        for (int it = 0; it < ITERS; it++) {
          const int i = it * 32 + lane;
          if (base + rr < OUTS && i < CHUNKS) {
            rs[rr][p].words[it] = wr[i];
            const size_t g = (size_t)n * GROUPS + i * CH / GS;
            rs[rr][p].sc[it] = static_cast<float>(scales[g]);
            rs[rr][p].bi[it] = static_cast<float>(biases[g]);
          }
        }
      }
    }
  };
  Row rows[R][PER_OUT];
  fetch(rows, n0);
"#;

/// Plain input `x` `[ROWS, 1, K]`, contiguous. The prologues' loops have
/// constant trip counts and are unrolled, so that all their reads are in
/// flight at once.
const GEMV_PLAIN: &str = r#"
  if (VEC && reinterpret_cast<size_t>(x) % 16 == 0) {
    each_piece([&](int b, int k, int) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + (size_t)(b0 + b) * K + k);
      tile_put(b, k, reinterpret_cast<const T*>(&raw));
    });
  } else {
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) xs[b][XI(k)] = static_cast<XT>(static_cast<float>(x[(size_t)(b0 + b) * K + k]));
        }
      }
    }
  }
  __syncthreads();
"#;

/// The residual add `h + r` (the first block of each tile also writes it out
/// as `sum`) and its RMSNorm with weight `nw`: 16 bytes at a time where the
/// rows are contiguous and aligned, as a step's are, else a value at a time.
const GEMV_ADD_NORM: &str = r#"
  constexpr int SLOTS = VEC ? KC / 32 : 1;
  __shared__ float partial[BT][SLOTS > WARPS ? SLOTS : WARPS];
  const float eps = __int_as_float(EPS_BITS);
  const bool dense = VEC && h_strides[2] == 1 && r_strides[2] == 1 && h_strides[0] % PV == 0 &&
                     r_strides[0] % PV == 0 && reinterpret_cast<size_t>(h) % 16 == 0 &&
                     reinterpret_cast<size_t>(r) % 16 == 0 && reinterpret_cast<size_t>(nw) % 16 == 0;
  if (dense) {
    // Each warp's sum of squares is one of its row's SLOTS parts.
    each_piece([&](int b, int k, int q) {
      const size_t row = b0 + b;
      const uint4 hv = *reinterpret_cast<const uint4*>(h + row * h_strides[0] + k);
      const uint4 rv = *reinterpret_cast<const uint4*>(r + row * r_strides[0] + k);
      const T* he = reinterpret_cast<const T*>(&hv);
      const T* re = reinterpret_cast<const T*>(&rv);
      uint4 sv;
      T* se = reinterpret_cast<T*>(&sv);
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < PV; e++) {
        se[e] = static_cast<T>(static_cast<float>(he[e]) + static_cast<float>(re[e]));
        const float f = static_cast<float>(se[e]);
        ss += f * f;
      }
      if (blockIdx.x == 0) *reinterpret_cast<uint4*>(sum + row * K + k) = sv;
      tile_put(b, k, se);
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
      if (lane == 0) partial[b][q % KC / 32] = ss;
    });
    __syncthreads();
    each_piece([&](int b, int k, int) {
      float total = 0.f;
      for (int i = 0; i < SLOTS; i++) total += partial[b][i];
      const float n = rsqrtf(total / K + eps);
      float xf[PV];
      tile_get(b, k, xf);
      const uint4 wv = *reinterpret_cast<const uint4*>(nw + k);
      const T* we = reinterpret_cast<const T*>(&wv);
      uint4 ov;
      T* oe = reinterpret_cast<T*>(&ov);
#pragma unroll
      for (int e = 0; e < PV; e++) {
        oe[e] = static_cast<T>(static_cast<float>(we[e]) * static_cast<float>(static_cast<T>(xf[e] * n)));
      }
      tile_put(b, k, oe);
    });
  } else {
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
        const size_t row = b0 + b;
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) {
            const T s = static_cast<T>(static_cast<float>(h[row * h_strides[0] + k * h_strides[2]]) +
                                       static_cast<float>(r[row * r_strides[0] + k * r_strides[2]]));
            if (blockIdx.x == 0) sum[row * K + k] = s;
            xs[b][XI(k)] = static_cast<XT>(static_cast<float>(s));
            const float f = static_cast<float>(s);
            ss += f * f;
          }
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
        if (lane == 0) partial[b][w] = ss;
      }
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < BT; b++) {
      if (b < nb) {
        float total = 0.f;
        for (int i = 0; i < WARPS; i++) total += partial[b][i];
        const float n = rsqrtf(total / K + eps);
#pragma unroll
        for (int c = 0; c < PER; c++) {
          const int k = t + c * BLOCK;
          if (k < K) {
            const float f = static_cast<float>(xs[b][XI(k)]);
            xs[b][XI(k)] = static_cast<XT>(static_cast<float>(
                static_cast<T>(static_cast<float>(nw[k]) * static_cast<float>(static_cast<T>(f * n)))));
          }
        }
      }
    }
  }
  __syncthreads();
"#;

/// Shared memory for a tile's inputs, at most: room for the kernels' other
/// arrays within the 48 KiB a block may have without asking.
const TILE_BYTES: i32 = 40 * 1024;

/// A tile of one row, at most: the 48 KiB less the other arrays' largest.
const ROW_BYTES: i32 = 46 * 1024;

/// Bytes of one input row in a product's tile (`KP` of `GEMV_START`): each
/// chunk of `128 / bits` inputs in the tile's dtype, then 16 bytes.
fn tile_row_bytes(k_dim: i32, bits: i32, dtype: Dtype) -> i32 {
    let size = if dtype == Dtype::Float32 { 4 } else { 2 };
    k_dim * size + k_dim / (128 / bits) * 16
}

/// Rows of a product's input tile and the tile's dtype (`XT`): float32,
/// which spares the product a conversion per input value and row, where
/// all rows fit one tile; else the compute dtype, as many rows as fit (up
/// to 8), spread evenly over the fewest tiles.
fn tile(rows: i32, k_dim: i32, bits: i32, dtype: Dtype) -> (i32, Dtype) {
    let rows = rows.max(1);
    if rows <= 8 && rows * tile_row_bytes(k_dim, bits, Dtype::Float32) <= TILE_BYTES {
        return (rows, Dtype::Float32);
    }
    let most = (TILE_BYTES / tile_row_bytes(k_dim, bits, dtype)).clamp(1, 8);
    let tiles = (rows + most - 1) / most;
    ((rows + tiles - 1) / tiles, dtype)
}

/// Bit widths the product kernels unpack (values never straddle a word) and
/// that their check covers, groups of whole 16-byte chunks, rows that are
/// whole chunks, and a row of inputs that fits a tile in `dtype`.
pub(crate) fn gemv_takes(bits: i32, group_size: i32, in_dim: i32, dtype: Dtype) -> bool {
    matches!(bits, 4 | 8)
        && group_size % (128 / bits) == 0
        && in_dim % group_size == 0
        && (in_dim * bits) % 128 == 0
        && tile_row_bytes(in_dim, bits, dtype) <= ROW_BYTES
}

/// Threads of every kernel's blocks but the argmax's: 8 warps.
const BLOCK: i32 = 256;

/// The argmax's threads: one block reads a whole row.
const ARGMAX_BLOCK: i32 = 1024;

pub(crate) struct Kernels {
    qkv_attend: CudaKernel,
    add_norm: CudaKernel,
    swiglu: CudaKernel,
    qk_rope_write: CudaKernel,
    /// By input (plain, add + norm) and output (product, SwiGLU of its
    /// halves): `products[input][output]`.
    products: [[CudaKernel; 2]; 2],
    argmax: CudaKernel,
    embed_norm: CudaKernel,
}

/// How a product's input tile is made.
pub(crate) enum GemvInput<'a> {
    Plain(&'a Array),
    /// `h + r` normalized with `weight` and `eps`; the sum is a second output.
    AddNorm {
        h: &'a Array,
        r: &'a Array,
        weight: &'a Array,
        eps: f32,
    },
}

/// What a product gives.
#[derive(Clone, Copy)]
pub(crate) enum GemvOutput {
    Product,
    /// `silu(gate) * up` of the product's halves (a stacked gate/up weight),
    /// half as wide.
    Swiglu,
}

/// A layer's q/k/v product and what the q/k kernels rotate it with and
/// write its keys and values into.
pub(crate) struct QkvHeads<'a> {
    /// The q/k/v product `[rows, L, (heads + 2 * kv_heads) * head_dim]`,
    /// contiguous (a step's L is 1).
    pub qkv: &'a Array,
    /// Qwen3's q and k norm weights (`[head_dim]` each) and eps.
    pub qk_norm: Option<(&'a Array, &'a Array, f32)>,
    /// `[positions, head_dim]` float32, a [`crate::rope::PositionTable`]'s
    /// rows, read at each token's position.
    pub cos: &'a Array,
    pub signed_sin: &'a Array,
    pub traditional: bool,
    /// The cache's buffers `[rows, kv_heads, capacity, head_dim]`, written
    /// in place.
    pub keys: &'a Array,
    pub values: &'a Array,
    pub heads: i32,
    pub kv_heads: i32,
}

impl<'a> QkvHeads<'a> {
    /// The kernel's inputs: the product, the norm weights (the cosines
    /// stand in without norms) and the tables, then `rest`, then the cache.
    fn inputs(&self, rest: &[&'a Array]) -> Vec<&'a Array> {
        let (q_norm, k_norm) = match self.qk_norm {
            Some((q, k, _)) => (q, k),
            None => (self.cos, self.cos),
        };
        let lead = [self.qkv, q_norm, k_norm, self.cos, self.signed_sin];
        [&lead[..], rest, &[self.keys, self.values]].concat()
    }

    /// Both kernels' constants.
    fn templates(&self) -> Vec<(&'static str, Template)> {
        vec![
            ("T", Template::Dtype(self.qkv.dtype())),
            ("D", Template::Int(self.cos.dim(-1))),
            ("NQ", Template::Int(self.heads)),
            ("NKV", Template::Int(self.kv_heads)),
            ("NORM", Template::Bool(self.qk_norm.is_some())),
            ("TRAD", Template::Bool(self.traditional)),
            (
                "EPS_BITS",
                eps_bits(self.qk_norm.map_or(0.0, |(_, _, eps)| eps)),
            ),
        ]
    }
}

/// What [`Kernels::qkv_attend`] reads besides the heads (one token a row).
pub(crate) struct QkvAttend<'a> {
    pub heads: QkvHeads<'a>,
    /// `[rows]` int32: where each row's key goes, its last attended key.
    pub positions: &'a Array,
    /// `[rows]` int32: each row's first attended key.
    pub starts: &'a Array,
}

fn eps_bits(eps: f32) -> Template {
    Template::Int(eps.to_bits() as i32)
}

impl Kernels {
    pub(crate) fn new() -> Result<Self> {
        Ok(Kernels {
            qkv_attend: CudaKernel::new(
                "emlx_axon_qkv_attend",
                &[
                    "qkv",
                    "q_norm",
                    "k_norm",
                    "rope_cos",
                    "rope_sin",
                    "positions",
                    "starts",
                    "keys",
                    "values",
                ],
                &["out"],
                &[
                    QKV_ATTEND_HEAD,
                    ATTEND_LOAD,
                    QKV_ATTEND_PROLOGUE,
                    ATTEND_KEYS,
                    ATTEND_COMBINE,
                ]
                .concat(),
            )?,
            add_norm: CudaKernel::new(
                "emlx_axon_add_norm",
                &["h", "r", "w"],
                &["sum", "normed"],
                &[ADD_NORM, BLOCK_NORM, ADD_NORM_OUT].concat(),
            )?,
            swiglu: CudaKernel::new(
                "emlx_axon_swiglu",
                &["gu"],
                &["act"],
                &[SWIGLU_OF, SWIGLU].concat(),
            )?,
            qk_rope_write: CudaKernel::new(
                "emlx_axon_qk_rope_write",
                &[
                    "qkv", "q_norm", "k_norm", "rope_cos", "rope_sin", "offset", "keys", "values",
                ],
                &["q"],
                QK_ROPE_WRITE,
            )?,
            products: [
                [product_kernel(false, 1)?, product_kernel(false, 2)?],
                [product_kernel(true, 1)?, product_kernel(true, 2)?],
            ],
            argmax: CudaKernel::new("emlx_axon_argmax", &["x"], &["out"], ARGMAX)?,
            embed_norm: CudaKernel::new(
                "emlx_axon_embed_norm",
                &["ids", "wq", "scales", "biases", "nw"],
                &["h", "normed"],
                &[EMBED_NORM, BLOCK_NORM, EMBED_NORM_OUT].concat(),
            )?,
        })
    }

    /// `(h, rms_norm(h) * w)` for `h` the rows of the quantized table
    /// `table` at `ids` (`[rows, 1]`, any integer type), `[rows, 1, hidden]`
    /// in `dtype`, as MLX's `take`, `dequantize` and `rms_norm` compute them.
    pub(crate) fn embed_norm(
        &self,
        ids: &Array,
        table: &QuantWeight,
        w: &Array,
        eps: f32,
        dtype: Dtype,
    ) -> Result<(Array, Array)> {
        let (rows, d) = (ids.dim(0), w.dim(-1));
        let shape = [rows, 1, d];
        let out = self.embed_norm.apply(
            &[ids, table.w, table.scales, table.biases, w],
            &[(&shape, dtype), (&shape, dtype)],
            (BLOCK, rows, 1),
            (BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(dtype)),
                ("D", Template::Int(d)),
                ("BITS", Template::Int(table.bits)),
                ("GS", Template::Int(table.group_size)),
                ("BLOCK", Template::Int(BLOCK)),
                ("EPS_BITS", eps_bits(eps)),
            ],
        )?;
        Ok(pair(out))
    }

    /// Attention's output `[rows, 1, heads * head_dim]`; the new keys and
    /// values go into the cache.
    pub(crate) fn qkv_attend(&self, p: &QkvAttend) -> Result<Array> {
        let h = &p.heads;
        let (rows, hd) = (h.qkv.dim(0), h.cos.dim(-1));
        // Threads for the query and the key at once.
        let threads = BLOCK.max(2 * hd);
        let mut templates = h.templates();
        templates.push(("BLOCK", Template::Int(threads)));
        let mut out = self.qkv_attend.apply(
            &h.inputs(&[p.positions, p.starts]),
            &[(&[rows, 1, h.heads * hd], h.qkv.dtype())],
            (h.heads * threads, rows, 1),
            (threads, 1, 1),
            &templates,
        )?;
        Ok(out.remove(0))
    }

    /// A prompt's queries `[B, heads, L, head_dim]`, normalized and
    /// rotated; its keys and values go into the cache at `offset` (`[1]`
    /// int32, the first token's position) on.
    pub(crate) fn qk_rope_write(&self, h: &QkvHeads, offset: &Array) -> Result<Array> {
        let (b, l, hd) = (h.qkv.dim(0), h.qkv.dim(1), h.cos.dim(-1));
        let mut out = self.qk_rope_write.apply(
            &h.inputs(&[offset]),
            &[(&[b, h.heads, l, hd], h.qkv.dtype())],
            ((h.heads + h.kv_heads) * hd, l, b),
            (hd, 1, 1),
            &h.templates(),
        )?;
        Ok(out.remove(0))
    }

    /// `(h + r, rms_norm(h + r) * w)` for `[B, L, hidden]` arrays (a step's
    /// `[rows, 1, hidden]`).
    pub(crate) fn add_norm(
        &self,
        h: &Array,
        r: &Array,
        w: &Array,
        eps: f32,
    ) -> Result<(Array, Array)> {
        let shape = h.shape();
        let (rows, d) = (h.dim(0) * h.dim(1), h.dim(-1));
        let dtype = h.dtype();
        let out = self.add_norm.apply(
            &[h, r, w],
            &[(shape, dtype), (shape, dtype)],
            (BLOCK, rows, 1),
            (BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(dtype)),
                ("D", Template::Int(d)),
                ("BLOCK", Template::Int(BLOCK)),
                ("EPS_BITS", eps_bits(eps)),
            ],
        )?;
        Ok(pair(out))
    }

    /// The last axis's argmax (uint32), as MLX's `argmax`.
    pub(crate) fn argmax(&self, logits: &Array) -> Result<Array> {
        let shape = logits.shape();
        let v = logits.dim(-1);
        let rows = shape[..shape.len() - 1].iter().product::<i32>();
        // Reshapes only where needed: each is a node of its own.
        let flat;
        let x = match shape.len() {
            2 => logits,
            _ => {
                flat = logits.reshape(&[rows, v])?;
                &flat
            }
        };
        let mut out = self.argmax.apply(
            &[x],
            &[(&[rows], Dtype::Uint32)],
            (rows * ARGMAX_BLOCK, 1, 1),
            (ARGMAX_BLOCK, 1, 1),
            &[
                ("T", Template::Dtype(logits.dtype())),
                ("BLOCK", Template::Int(ARGMAX_BLOCK)),
            ],
        )?;
        let ids = out.remove(0);
        Ok(match shape.len() {
            2 => ids,
            _ => ids.reshape(&shape[..shape.len() - 1])?,
        })
    }

    /// `silu(gate) * up` of a stacked gate/up product `[..., 2 * I]`.
    pub(crate) fn swiglu(&self, gu: &Array) -> Result<Array> {
        let i = gu.dim(-1) / 2;
        let rows = (gu.size() / gu.dim(-1).max(1) as usize) as i32;
        let mut shape = gu.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = i;
        }
        let mut out = self.swiglu.apply(
            &[gu],
            &[(&shape, gu.dtype())],
            (i, rows, 1),
            (BLOCK, 1, 1),
            &[("T", Template::Dtype(gu.dtype())), ("I", Template::Int(i))],
        )?;
        Ok(out.remove(0))
    }

    /// `input @ W.T` for a quantized `W` (`[N, K]` logical), `[rows, 1, N]`
    /// (`N / 2` for [`GemvOutput::Swiglu`]); with the residual sum first for
    /// [`GemvInput::AddNorm`].
    pub(crate) fn gemv(
        &self,
        input: &GemvInput,
        output: GemvOutput,
        wt: &QuantWeight,
    ) -> Result<Vec<Array>> {
        let first = match input {
            GemvInput::Plain(x) => *x,
            GemvInput::AddNorm { h, .. } => *h,
        };
        let (rows, k_dim, dtype) = (first.dim(0), first.dim(-1), first.dtype());
        let per_out = match output {
            GemvOutput::Product => 1,
            GemvOutput::Swiglu => 2,
        };
        let outs = wt.w.dim(0) / per_out;
        let (bt, xt) = tile(rows, k_dim, wt.bits, dtype);
        let looping = outs >= LOOP_OUTPUTS && *LOOP;
        let r = if looping { 1 } else { outputs_per_warp(outs) };
        let mut templates = vec![
            ("T", Template::Dtype(dtype)),
            ("K", Template::Int(k_dim)),
            ("BITS", Template::Int(wt.bits)),
            ("GS", Template::Int(wt.group_size)),
            ("BT", Template::Int(bt)),
            ("XT", Template::Dtype(xt)),
            ("R", Template::Int(r)),
            ("BLOCK", Template::Int(BLOCK)),
            ("LOOP", Template::Bool(looping)),
        ];
        let params = [wt.w, wt.scales, wt.biases];
        let out = [rows, 1, outs];
        let sum_shape = [rows, 1, k_dim];
        let (inputs, outputs, add_norm): (Vec<&Array>, Vec<(&[i32], Dtype)>, _) = match input {
            GemvInput::Plain(x) => (vec![*x], vec![(&out, dtype)], false),
            GemvInput::AddNorm { h, r, weight, eps } => {
                templates.push(("EPS_BITS", eps_bits(*eps)));
                let outputs = vec![(&sum_shape[..], dtype), (&out[..], dtype)];
                (vec![*h, *r, *weight], outputs, true)
            }
        };
        let kernel = &self.products[add_norm as usize][per_out as usize - 1];
        let inputs = [&inputs[..], &params].concat();
        let tiles = (rows + bt - 1) / bt;
        let mut blocks = (outs + 8 * r - 1) / (8 * r);
        if looping {
            // One wave: as many blocks as the device holds at once.
            let per_sm = kernel.resident_blocks(&inputs, &outputs, &templates, BLOCK)?;
            if let (Some(sms), Some(per_sm)) = (crate::cuda_kernel::multiprocessors(), per_sm) {
                blocks = blocks.min((sms * per_sm / tiles).max(1));
            }
        }
        let grid = (blocks * BLOCK, tiles, 1);
        kernel.apply(&inputs, &outputs, grid, (BLOCK, 1, 1), &templates)
    }
}

/// Outputs a warp computes where it does not loop: one (a block per 8,
/// every block's prologue on the same inputs) up to a few thousand; more for
/// wider products, where the repeated prologues would cost more than the
/// products (all a warp's weight rows are fetched at once, so they cost
/// registers, not trips). Products of `LOOP_OUTPUTS` or more take four only
/// with `EMLX_AXON_GEMV_LOOP=0`.
fn outputs_per_warp(outs: i32) -> i32 {
    match outs {
        LOOP_OUTPUTS.. => 4,
        4096.. => 2,
        _ => 1,
    }
}

/// Products at least this wide (an output head: 18,992 warps' worth of
/// outputs for Qwen3's 151,936) loop: one wave of blocks, each warp taking
/// outputs a grid apart with the next weight row always in flight, so that
/// each block's prologue (the add + norm of all its rows) is done a few
/// hundred times rather than thousands.
const LOOP_OUTPUTS: i32 = 32768;

/// Whether wide products loop (`EMLX_AXON_GEMV_LOOP=0`: a block per 32
/// outputs, as before, for comparison).
static LOOP: Lazy<bool> = Lazy::new(|| !crate::switch::off("EMLX_AXON_GEMV_LOOP"));

/// The product kernel for an input (plain, or add + norm) and an output
/// (each of `per_out` weight rows: 1 a product, 2 SwiGLU of gate and up).
fn product_kernel(add_norm: bool, per_out: i32) -> Result<CudaKernel> {
    let (stem, inputs, outputs, prologue): (_, &[&str], &[&str], _) = if add_norm {
        let inputs = &["h", "r", "nw", "wq", "scales", "biases"];
        (
            "emlx_axon_gemv_add_norm",
            inputs,
            &["sum", "y"],
            GEMV_ADD_NORM,
        )
    } else {
        (
            "emlx_axon_gemv",
            &["x", "wq", "scales", "biases"],
            &["y"],
            GEMV_PLAIN,
        )
    };
    let output = if per_out == 1 { "" } else { "_swiglu" };
    CudaKernel::new(
        &format!("{stem}{output}"),
        inputs,
        outputs,
        &[
            &format!("const int ROWS = {}_shape[0];", inputs[0]),
            &format!("constexpr int PER_OUT = {per_out};"),
            SWIGLU_OF,
            GEMV_START,
            prologue,
            GEMV_BODY,
        ]
        .concat(),
    )
}

/// A two-output kernel's outputs in order (`apply` returns as many as asked).
pub(crate) fn pair(mut outputs: Vec<Array>) -> (Array, Array) {
    let second = outputs.pop().expect("two outputs");
    (outputs.pop().expect("two outputs"), second)
}

/// Whether [`Kernels::embed_norm`] takes this table for a hidden size of
/// `dim`: values that never straddle a word, whole groups and words a row.
pub(crate) fn embeds(table: &QuantWeight, dim: i32) -> bool {
    matches!(table.bits, 2 | 4 | 8)
        && table.group_size > 0
        && dim % table.group_size == 0
        && dim % (32 / table.bits) == 0
        && table.w.ndim() == 2
        && table.w.dim(1) == dim * table.bits / 32
        && table.scales.dim(-1) == dim / table.group_size
}

/// Dtypes the kernels compute in.
pub(crate) fn takes_dtype(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_tiles_fit_and_spread_rows_evenly() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            for bits in [4, 8] {
                for k in [256, 1024, 2048, 3072, 8192] {
                    for rows in 1..=20 {
                        let (bt, xt) = tile(rows, k, bits, dtype);
                        let tiles = (rows + bt - 1) / bt;
                        assert!((1..=8).contains(&bt), "{rows} rows of {k}: {bt}");
                        assert!(xt == dtype || xt == Dtype::Float32);
                        assert!(
                            bt * tile_row_bytes(k, bits, xt) <= TILE_BYTES
                                || (bt == 1 && tile_row_bytes(k, bits, xt) <= ROW_BYTES),
                            "{rows} of {k}: {bt}"
                        );
                        // No tile is emptier than another by more than a row.
                        assert!(tiles * bt - rows < tiles, "{rows} of {k}: {bt} x {tiles}");
                    }
                }
            }
        }
        // Qwen3-0.6B's shapes: one row of any product and eight of its
        // hidden size in float32; eight rows of the MLP's width in two tiles.
        assert_eq!(tile(1, 3072, 4, Dtype::Bfloat16), (1, Dtype::Float32));
        assert_eq!(tile(8, 1024, 4, Dtype::Bfloat16), (8, Dtype::Float32));
        assert_eq!(tile(8, 3072, 4, Dtype::Bfloat16), (4, Dtype::Bfloat16));
        // A row too wide for a tile is refused.
        assert!(gemv_takes(4, 64, 17408, Dtype::Bfloat16));
        assert!(!gemv_takes(4, 64, 25600, Dtype::Bfloat16));
    }
}
