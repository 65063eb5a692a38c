
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
  // A long row's keys are split over up to SPLITS blocks (blockIdx.z) of at
  // least MIN_KEYS keys each, so a one-row step still fills the GPU; the
  // last block of a row's head to finish combines their partial sums. The
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
  __shared__ T normed[2][D];
  // The rotated query (0) and new key (1).
  __shared__ __align__(16) T qk[2][D];
  const T* ks = qk[1];
  const T* vnew = src + (NQ + NKV + kv) * D;
  const T* kb = keys + row * keys_strides[0] + kv * keys_strides[1] + lane * E;
  const T* vb = values + row * values_strides[0] + kv * values_strides[1] + lane * E;
#define KEY(j) ((j) == pos ? ks + lane * E : kb + (long)(j) * keys_strides[2])
#define VALUE(j) ((j) == pos ? vnew + lane * E : vb + (long)(j) * values_strides[2])
