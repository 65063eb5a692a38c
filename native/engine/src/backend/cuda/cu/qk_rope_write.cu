
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
