//! One-token attention over a preallocated KV cache on CUDA, reading each
//! row's keys `starts[b]..ends[b]` only.
//!
//! A decode step with fixed shapes (see [`crate::decode_step`]) attends over
//! a bucket of keys through a mask, and MLX's CUDA attention kernel takes no
//! mask: it would fall back to separate products, softmax and masking, four
//! kernels a layer instead of one. This kernel (see [`crate::cuda_kernel`])
//! takes the rows' key ranges instead. One block per (query head, row); its
//! 8 warps take turns by 8 keys with an online softmax in float32, then
//! combine. Before first use it is checked against MLX's masked attention
//! on the device; a failure (no NVRTC, a wrong result) leaves the masked
//! path in use. Metal keeps the masked path.

use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, ge, logical_and};
use mlx_rs::{Array, Dtype};
use once_cell::sync::{Lazy, OnceCell};

use crate::cuda_kernel::{within, CudaKernel, Template};
use crate::error::{Error, Result};

/// The kernel up to its loop over keys: one block per (query head, row),
/// with the key range and pointers [`ATTEND_KEYS`] reads.
const START: &str = r#"
  constexpr int WARPS = 8;
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const int w = threadIdx.x / 32;
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int kv = head / GQA;
  const float scale = rsqrtf((float)D);
  const float neg_inf = __int_as_float(0xff800000);

  float qv[E];
  const T* qp = q + row * q_strides[0] + head * q_strides[1] + lane * E;
  for (int e = 0; e < E; e++) qv[e] = static_cast<float>(qp[e]) * scale;
  const T* kb = keys + row * keys_strides[0] + kv * keys_strides[1] + lane * E;
  const T* vb = values + row * values_strides[0] + kv * values_strides[1] + lane * E;
  const int first = starts[row];
  const int last = ends[row] - 1;
#define KEY(j) (kb + (long)(j) * keys_strides[2])
#define VALUE(j) (vb + (long)(j) * values_strides[2])
  constexpr bool FIRST_LOADED = false;
"#;

/// A warp's trip to memory for the keys and values `j0..j0 + U` (clamped
/// to `last`), all loads before any use: `load`, and the registers of a
/// warp's first trip, `kf0` and `vf0`, which a kernel may fill early
/// (`FIRST_LOADED`) so that the trip overlaps work before the loop.
pub(crate) const ATTEND_LOAD: &str = r#"
  constexpr int U = 8;
  auto load = [&](int j0, float (&kf)[U][E], float (&vf)[U][E]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int j = min(j0 + u, last);
      const T* kp = KEY(j);
      const T* vp = VALUE(j);
#pragma unroll
      for (int e = 0; e < E; e++) {
        kf[u][e] = static_cast<float>(kp[e]);
        vf[u][e] = static_cast<float>(vp[e]);
      }
    }
  };
  float kf0[U][E];
  float vf0[U][E];
"#;

/// The keys `first..=last` into each warp's online softmax (float32): its
/// running max `m`, sum `l` and weighted values `acc` (the lane's `E` of
/// them), the query `qv` prescaled; `KEY(j)` and `VALUE(j)` point at the
/// lane's part of key and value `j`. A warp takes `U` keys at a time
/// ([`ATTEND_LOAD`]), so that a trip to memory serves `U` keys (one key at
/// a time, a short context's attention was bound by the chain of trips),
/// and the warps take turns by `U` keys.
pub(crate) const ATTEND_KEYS: &str = r#"
  float m = neg_inf;
  float l = 0.f;
  float acc[E];
  for (int e = 0; e < E; e++) acc[e] = 0.f;
  auto update = [&](int j0, const float (&kf)[U][E], const float (&vf)[U][E]) {
    float s[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      s[u] = 0.f;
#pragma unroll
      for (int e = 0; e < E; e++) s[u] += qv[e] * kf[u][e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int u = 0; u < U; u++) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (j0 + u <= last) mn = fmaxf(mn, s[u]);
    }
    const float c = expf(m - mn);
    l *= c;
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] *= c;
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (j0 + u <= last) {
        const float p = expf(s[u] - mn);
        l += p;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] += p * vf[u][e];
      }
    }
    m = mn;
  };
  int j0 = first + w * U;
  if (j0 <= last) {
    if (!FIRST_LOADED) load(j0, kf0, vf0);
    update(j0, kf0, vf0);
    for (j0 += WARPS * U; j0 <= last; j0 += WARPS * U) {
      float kf[U][E];
      float vf[U][E];
      load(j0, kf, vf);
      update(j0, kf, vf);
    }
  }
"#;

/// The warps' softmaxes combined into the block's output row: `out` laid
/// out `[rows, heads, D]` with one block per (head, row).
pub(crate) const ATTEND_COMBINE: &str = r#"
  __shared__ float sm[WARPS];
  __shared__ float sl[WARPS];
  __shared__ float so[WARPS][D];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
  for (int e = 0; e < E; e++) so[w][lane * E + e] = acc[e];
  __syncthreads();
  if (threadIdx.x < D) {
    const int d = threadIdx.x;
    float big = neg_inf;
    for (int i = 0; i < WARPS; i++) big = fmaxf(big, sm[i]);
    float total = 0.f;
    float o = 0.f;
    for (int i = 0; i < WARPS; i++) {
      const float f = sm[i] == neg_inf ? 0.f : expf(sm[i] - big);
      total += sl[i] * f;
      o += so[i][d] * f;
    }
    out[((size_t)row * gridDim.x + head) * D + d] = static_cast<T>(o / total);
  }
"#;

/// Threads per block: 8 warps (the source's `WARPS`), few enough for any
/// register use of the kernel, and at least the head size for the combine.
const THREADS: i32 = 256;

/// The kernel once it has passed its check on this device; `None` when it
/// cannot be used.
static CHECKED: OnceCell<Option<CudaKernel>> = OnceCell::new();

/// Asked for (`EMLX_AXON_DECODE_ATTENTION=1`, read once) and possible: this
/// build's GPU is CUDA (MLX's Metal build has no `cuda_kernel`). Decided
/// once, as attention asks for every layer of every step.
static WANTED: Lazy<bool> = Lazy::new(|| {
    crate::switch::on("EMLX_AXON_DECODE_ATTENTION")
        && !cfg!(feature = "metal")
        && crate::device::gpu_available()
});

/// Whether [`attend`] may be used on the current stream: wanted (above), a
/// GPU stream, and the kernel passed its check (run here on first call).
/// Opt-in: the fused layer kernels (`crate::gpu_layer`) do one-token
/// attention by default on CUDA; this kernel serves the MLX-op layers.
pub fn available() -> bool {
    if !*WANTED || crate::rope::on_cpu_stream() {
        return false;
    }
    CHECKED
        .get_or_init(|| match checked_on_a_stream_of_its_own() {
            Ok(kernel) => Some(kernel),
            Err(e) => {
                eprintln!(
                    "emlx_axon: decode attention kernel unavailable, using masked attention ({e})"
                );
                None
            }
        })
        .is_some()
}

/// Whether the kernel has been checked and passed (`None`: not checked yet).
pub fn checked() -> Option<bool> {
    CHECKED.get().map(Option::is_some)
}

fn new_kernel() -> Result<CudaKernel> {
    CudaKernel::new(
        "emlx_axon_decode_attention",
        &["q", "keys", "values", "starts", "ends"],
        &["out"],
        &[START, ATTEND_LOAD, ATTEND_KEYS, ATTEND_COMBINE].concat(),
    )
}

/// Attention of one query per row: `q` `[rows, heads, 1, head_dim]`,
/// `keys`/`values` `[>= rows, kv_heads, >= max(ends), head_dim]` (views of
/// the cache), row `b` reading keys
/// `starts[b]..ends[b]` (`[rows]` int32). Returns `[rows, heads, 1, head_dim]`.
pub fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    starts: &Array,
    ends: &Array,
) -> Result<Array> {
    let kernel = CHECKED
        .get()
        .and_then(Option::as_ref)
        .ok_or_else(|| Error::invalid("the decode attention kernel is not available"))?;
    run(kernel, q, keys, values, starts, ends)
}

fn run(
    kernel: &CudaKernel,
    q: &Array,
    keys: &Array,
    values: &Array,
    starts: &Array,
    ends: &Array,
) -> Result<Array> {
    let (rows, heads, hd) = (q.dim(0), q.dim(1), q.dim(-1));
    if q.dim(2) != 1 {
        return Err(Error::invalid(
            "the decode attention kernel takes one query per row",
        ));
    }
    let kv_heads = keys.dim(1);
    if hd % 32 != 0 || hd > 256 || heads % kv_heads != 0 {
        return Err(Error::invalid(
            "the decode attention kernel takes a head size of 32..256 in steps of 32",
        ));
    }
    // Every input is read through its strides, except along the last axis,
    // which MLX's ops here leave contiguous.
    let mut out = kernel.apply(
        &[q, keys, values, starts, ends],
        &[(&[rows, heads, hd], q.dtype())],
        (heads * THREADS, rows, 1),
        (THREADS, 1, 1),
        &[
            ("T", Template::Dtype(q.dtype())),
            ("D", Template::Int(hd)),
            ("GQA", Template::Int(heads / kv_heads)),
        ],
    )?;
    Ok(out.remove(0).reshape(&[rows, heads, 1, hd])?)
}

/// [`check`] on a fresh GPU stream: a kernel MLX fails to launch leaves the
/// stream's command graph failing later work, so that stream is dropped.
fn checked_on_a_stream_of_its_own() -> Result<CudaKernel> {
    let stream = crate::device::MlxStream::new(crate::device::DeviceKind::Gpu)?;
    stream.run(check)
}

/// Runs the kernel on a small case (GQA, ragged rows, a cache wider than
/// what is read) and compares it with MLX's masked attention.
fn check() -> Result<CudaKernel> {
    let kernel = new_kernel()?;
    check_kernel(&kernel)?;
    Ok(kernel)
}

/// [`check`] of a kernel made by [`new_kernel`].
fn check_kernel(kernel: &CudaKernel) -> Result<()> {
    for dtype in [Dtype::Bfloat16, Dtype::Float32] {
        let (rows, heads, kv_heads, hd, cap) = (3, 4, 2, 128, 80);
        let key = mlx_rs::random::key(7)?;
        let normal = |shape: &[i32], k: &Array| -> Result<Array> {
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, k)?.as_dtype(dtype)?)
        };
        let keys_all = normal(&[rows + 1, kv_heads, cap, hd], &key)?;
        let values_all = normal(&[rows + 1, kv_heads, cap, hd], &mlx_rs::random::key(8)?)?;
        // Queries as attention sees them: heads moved ahead of the position.
        let q = normal(&[rows, 1, heads, hd], &mlx_rs::random::key(9)?)?.swap_axes(1, 2)?;
        let attend_len = 64;
        let keys = keys_all.index((..rows, .., ..attend_len, ..));
        let values = values_all.index((..rows, .., ..attend_len, ..));
        let starts = Array::from_slice(&[0i32, 5, 0], &[rows]);
        let ends = Array::from_slice(&[64i32, 40, 1], &[rows]);
        let got = run(kernel, &q, &keys, &values, &starts, &ends)?;
        let idx = arange::<_, i32>(0, attend_len, 1)?.reshape(&[1, 1, 1, attend_len])?;
        let mask = logical_and(
            &ge(&idx, &starts.reshape(&[rows, 1, 1, 1])?)?,
            &idx.lt(&ends.reshape(&[rows, 1, 1, 1])?)?,
        )?;
        let scale = (hd as f32).powf(-0.5);
        let want = scaled_dot_product_attention(&q, &keys, &values, scale, &mask, None)?;
        let tolerance = if dtype == Dtype::Float32 { 1e-4 } else { 3e-2 };
        within(&format!("attention ({dtype:?})"), &got, &want, tolerance)?;
    }
    Ok(())
}
