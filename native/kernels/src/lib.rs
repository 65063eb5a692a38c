//! CPU kernels for MLX's affine-quantized matrix products (4- and 8-bit,
//! groups of 32, 64 or 128, float32 activations), run as an MLX primitive so
//! that a model's forward pass stays one lazily built MLX graph.
//!
//! Variants: AVX-512, AVX2 + FMA and portable scalar code, picked at run time
//! for the CPU (`EMLX_AXON_KERNELS=scalar|avx2` forces a lesser one;
//! `EMLX_AXON_KERNELS=mlx` turns the kernels off in favour of MLX's). Work is
//! split over output rows across one process-wide thread pool sized to the
//! cores (`EMLX_AXON_CPU_THREADS` overrides).
//!
//! `EMLX_AXON_CPU_ACTIVATIONS=int8` (read once per process) makes the
//! products [`quantized_linear`] builds quantize their activations to int8
//! (symmetric, one float scale per row and block of 32 elements) and use
//! integer dot products (AVX512-VNNI `vpdpbusd`, AVX2 `pmaddubsw`, portable
//! code elsewhere; every variant gives the same bits), for the products
//! [`int8_takes`] names: prompts, and on an AVX512-VNNI CPU one-row products
//! of 4-bit weights (a matrix-vector form reading the weights as stored).
//! Faster, but it rounds the activations, so it is opt-in: each output moves by up
//! to `sum over blocks of (max |x| in the block / 254) * sum |w| in the
//! block` (about 0.7% of the outputs' root mean square on normal
//! activations). Unset (or any other value), the products are the float32
//! ones, unchanged.
//! See [`Activations`] and `csrc/qmm_int8.cpp` for the algebra.
//!
//! A prompt chunk's causal attention is one node, [`prompt_attention`]
//! (blocks of queries through the dense product and a vectorized softmax,
//! reading a float16 cache as stored). [`swiglu`] (the MLP's activation),
//! which MLX's CPU backend runs on one thread with a scalar exp, is a
//! threaded, vectorized primitive too; [`rms_norm`] and [`norm_rope`] are
//! one node each where MLX builds seven and about ten. A one-token step's whole layer is
//! two nodes, [`decode_qkv`] and [`decode_layer_rest`], around the cache's
//! update.

use std::ffi::{c_char, c_int, CStr};
use std::fmt;

use mlx_rs::{Array, Stream};

#[repr(C)]
#[derive(Clone, Copy)]
struct Handle {
    ctx: *mut std::ffi::c_void,
}

impl Handle {
    const NULL: Handle = Handle {
        ctx: std::ptr::null_mut(),
    };
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_quantized_linear(
        out: *mut Handle,
        x: Handle,
        w: Handle,
        scales: Handle,
        biases: Handle,
        group: c_int,
        bits: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_gathered_quantized_linear(
        out: *mut Handle,
        x: Handle,
        w: Handle,
        scales: Handle,
        biases: Handle,
        ids: Handle,
        group: c_int,
        bits: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_qmm(
        x: *const f32,
        w: *const u32,
        scales: *const f32,
        biases: *const f32,
        y: *mut f32,
        m: c_int,
        n: c_int,
        k: c_int,
        bits: c_int,
        group: c_int,
        isa: c_int,
        threads: c_int,
    ) -> c_int;
    fn emlx_kernels_cblas_sgemm(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_sgemm(
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
        isa: c_int,
        threads: c_int,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_qmm_int8(
        x: *const f32,
        w: *const u32,
        scales: *const std::ffi::c_void,
        biases: *const std::ffi::c_void,
        bf16_params: c_int,
        y: *mut f32,
        m: c_int,
        n: c_int,
        k: c_int,
        bits: c_int,
        group: c_int,
        isa: c_int,
        threads: c_int,
    ) -> c_int;
    fn emlx_kernels_prompt_attention(
        out: *mut Handle,
        q: Handle,
        keys: Handle,
        values: Handle,
        queries: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_attend_raw(
        q: *const f32,
        k: *const std::ffi::c_void,
        v: *const std::ffi::c_void,
        k_scales: *const f32,
        k_biases: *const f32,
        v_scales: *const f32,
        v_biases: *const f32,
        bits: c_int,
        group: c_int,
        out: *mut f32,
        g: c_int,
        n: c_int,
        hd: c_int,
        isa: c_int,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_prompt_attention_raw(
        q: *const f32,
        keys: *const std::ffi::c_void,
        values: *const std::ffi::c_void,
        bits: c_int,
        out: *mut f32,
        b: c_int,
        nkv: c_int,
        g: c_int,
        l: c_int,
        s: c_int,
        hd: c_int,
        isa: c_int,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_rows_to_ids(
        out: *mut Handle,
        x: Handle,
        f: RowsCall,
        ctx: *mut std::ffi::c_void,
        drop: RowsDrop,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn emlx_kernels_swiglu(
        out: *mut Handle,
        x: Handle,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn emlx_kernels_swiglu_raw(
        x: *const f32,
        y: *mut f32,
        rows: std::ffi::c_long,
        f: c_int,
        isa: c_int,
        threads: c_int,
    ) -> c_int;
    fn emlx_kernels_rms_norm(
        out: *mut Handle,
        x: Handle,
        w: Handle,
        eps: f32,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_rms_norm_raw(
        x: *const f32,
        w: *const f32,
        y: *mut f32,
        rows: std::ffi::c_long,
        d: c_int,
        r: c_int,
        eps: f32,
        isa: c_int,
        threads: c_int,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn emlx_kernels_norm_rope(
        out: *mut Handle,
        x: Handle,
        w: Handle,
        eps: f32,
        cos: Handle,
        sin: Handle,
        traditional: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn emlx_kernels_decode_qkv(
        outs: *mut Handle,
        arrays: *const Handle,
        qkv_bias: Handle,
        qk_norm: Handle,
        heads: c_int,
        kv_heads: c_int,
        bits: c_int,
        group: c_int,
        eps_in: f32,
        eps_qk: f32,
        traditional: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn emlx_kernels_decode_layer_rest(
        out: *mut Handle,
        arrays: *const Handle,
        bits: *const c_int,
        group: *const c_int,
        rows: c_int,
        positions: *const c_int,
        starts: *const c_int,
        eps_post: f32,
        scale: f32,
        kv_bits: c_int,
        kv_group: c_int,
        top_k: c_int,
        norm_topk: c_int,
        stream: Handle,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn emlx_kernels_activations() -> c_int;
    fn emlx_kernels_int8_takes(rows: c_int, cols: c_int, bits: c_int) -> c_int;
    fn emlx_kernels_attend_takes(hd: c_int, bits: c_int, group: c_int) -> c_int;
    fn emlx_kernels_int8_vnni() -> c_int;
    fn emlx_kernels_selected_isa() -> c_int;
    fn emlx_kernels_isa_supported(isa: c_int) -> c_int;
    fn emlx_kernels_threads() -> c_int;
}

/// A kernel failure, with MLX's or our message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError(pub String);

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

/// Instruction-set variants of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar = 0,
    Avx2 = 1,
    Avx512 = 2,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU runs the variant.
    pub fn supported(self) -> bool {
        // SAFETY: a pure query.
        unsafe { emlx_kernels_isa_supported(self as c_int) != 0 }
    }

    /// The variant products built by [`quantized_linear`] use.
    pub fn selected() -> Isa {
        // SAFETY: a pure query.
        match unsafe { emlx_kernels_selected_isa() } {
            2 => Isa::Avx512,
            1 => Isa::Avx2,
            _ => Isa::Scalar,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Whether a product of `rows` rows of activations against `bits`-bit
/// weights of `cols` columns takes [`Activations::Int8`] where it is
/// selected: prompts of 8 rows or more (the matrix product), and one row
/// where the selected variant has a matrix-vector form for it (AVX-512 VNNI,
/// 4 bits, `cols` a multiple of 128). Other products keep float32, which
/// reads the weights faster than the matrix product.
pub fn int8_takes(rows: usize, cols: usize, bits: i32) -> bool {
    // SAFETY: a pure query.
    unsafe { emlx_kernels_int8_takes(rows as c_int, cols as c_int, bits) != 0 }
}

/// Precision of the activations in the products [`quantized_linear`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// Exact float32 (the default).
    F32,
    /// Quantized to int8 per row and block of 32, integer dot products
    /// (`EMLX_AXON_CPU_ACTIVATIONS=int8`), for the products
    /// [`int8_takes`] names.
    Int8,
}

impl Activations {
    /// The precision chosen for this process (read once, on first use).
    pub fn selected() -> Activations {
        // SAFETY: a pure query.
        match unsafe { emlx_kernels_activations() } {
            1 => Activations::Int8,
            _ => Activations::F32,
        }
    }
}

/// Whether the int8 products of the AVX-512 variant use VNNI here (without
/// it they run the AVX2 int8 kernels).
pub fn int8_uses_vnni() -> bool {
    // SAFETY: a pure query.
    unsafe { emlx_kernels_int8_vnni() != 0 }
}

/// False when `EMLX_AXON_KERNELS=mlx` asks for MLX's own kernels.
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("EMLX_AXON_KERNELS").map_or(true, |v| v != "mlx"))
}

/// Threads of the shared pool, the calling thread included.
pub fn threads() -> usize {
    // SAFETY: a pure query (starts the pool on first use).
    unsafe { emlx_kernels_threads() as usize }
}

/// Whether the decode layer's attention reads keys and values quantized to
/// `bits` (8 or 4) in groups of `group_size` (a power of two dividing the
/// heads of `head_dim` values).
pub fn attend_reads_quantized(head_dim: i32, bits: i32, group_size: i32) -> bool {
    // SAFETY: a pure query.
    matches!(bits, 4 | 8) && unsafe { emlx_kernels_attend_takes(head_dim, bits, group_size) != 0 }
}

/// Whether [`quantized_linear`] takes products of this bit width and group size.
pub fn supports(bits: i32, group_size: i32) -> bool {
    matches!(bits, 4 | 8) && matches!(group_size, 32 | 64 | 128)
}

/// `x @ dequantize(w, scales, biases).T` as a lazy MLX array computed by our
/// kernels, on the calling thread's default stream. `Ok(None)` when the case
/// is not ours (kernels turned off, a GPU stream, non-float32 inputs, another bit width or group
/// size, or shapes that do not match): the caller then uses MLX's
/// `quantized_matmul`, which also reports bad shapes.
pub fn quantized_linear(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Option<Array>, KernelError> {
    if !supports(bits, group_size) {
        return Ok(None);
    }
    node(|out, stream, err, n| {
        // SAFETY: see `node`.
        unsafe {
            emlx_kernels_quantized_linear(
                out,
                handle(x),
                handle(w),
                handle(scales),
                handle(biases),
                group_size,
                bits,
                stream,
                err,
                n,
            )
        }
    })
}

/// Routed experts' products as a lazy MLX array computed by our kernels:
/// `x` `[T, R, K]` float32, the stacked weight `w` `[E, N, K * bits / 32]`
/// with `scales` and `biases` `[E, N, K / group_size]`, and `ids` `[T, C]`
/// (int32 or uint32) give `[T, C, N]`, row `(t, c)` being `x[t, 0]` (when
/// `R` is 1) or `x[t, c]` through expert `ids[t, c]`'s weight. Each
/// expert's rows go through it as one product. `Ok(None)` when the case is
/// not ours (a GPU stream, other dtypes, shapes, bit widths or group sizes):
/// the caller then uses MLX's `gather_qmm`.
pub fn gathered_quantized_linear(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    ids: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Option<Array>, KernelError> {
    if !supports(bits, group_size) {
        return Ok(None);
    }
    node(|out, stream, err, n| {
        // SAFETY: see `node`.
        unsafe {
            emlx_kernels_gathered_quantized_linear(
                out,
                handle(x),
                handle(w),
                handle(scales),
                handle(biases),
                handle(ids),
                group_size,
                bits,
                stream,
                err,
                n,
            )
        }
    })
}

/// A prompt chunk's causal attention as a lazy MLX array computed by our
/// kernels, on the calling thread's default stream: `q` `[B, kv_heads,
/// G * queries, head_dim]` float32, already scaled (each of a key head's
/// `G` query heads' `queries` positions in turn, the last `queries` of the
/// cache's `S`), `keys`/`values` `[B, kv_heads, S, head_dim]` float32 or
/// float16 (a slice of the cache's buffers, read in place) ->
/// `[B, kv_heads, G * queries, head_dim]`. Query `i` sees keys `0..=S -
/// queries + i`, as MLX's attention with a causal mask. `Ok(None)` when the
/// case is not ours (kernels turned off, a GPU stream, dtypes, shapes): the
/// caller then uses MLX's ops.
pub fn prompt_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    queries: i32,
) -> Result<Option<Array>, KernelError> {
    // SAFETY: see `node`.
    node(|out, stream, err, n| unsafe {
        emlx_kernels_prompt_attention(
            out,
            handle(q),
            handle(keys),
            handle(values),
            queries,
            stream,
            err,
            n,
        )
    })
}

/// A function of one row (its index and values) to that row's id.
pub type RowFn = Box<dyn FnMut(usize, &[f32]) -> u32 + Send>;

/// The id a row gets when its function panicked: past any vocabulary.
pub const FAILED_ROW: u32 = u32::MAX;

type RowsCall = unsafe extern "C" fn(
    *mut std::ffi::c_void,
    *const f32,
    std::ffi::c_long,
    c_int,
    *mut u32,
) -> c_int;
type RowsDrop = unsafe extern "C" fn(*mut std::ffi::c_void);

/// Calls the boxed [`RowFn`] at `ctx` on each of `rows` rows of `width`
/// floats at `x`, writing `out[row]`; -1 when it panicked (no panic
/// crosses into C++).
unsafe extern "C" fn rows_call(
    ctx: *mut std::ffi::c_void,
    x: *const f32,
    rows: std::ffi::c_long,
    width: c_int,
    out: *mut u32,
) -> c_int {
    let (rows, width) = (rows.max(0) as usize, width.max(0) as usize);
    // SAFETY: the C side passes the context `rows_to_ids` boxed, `rows *
    // width` floats and `rows` outputs, alive for the call.
    let (f, x, out) = unsafe {
        (
            &mut *(ctx as *mut RowFn),
            std::slice::from_raw_parts(x, rows * width),
            std::slice::from_raw_parts_mut(out, rows),
        )
    };
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for (i, (row, y)) in x.chunks_exact(width.max(1)).zip(out.iter_mut()).enumerate() {
            *y = f(i, row);
        }
    }));
    if ran.is_ok() {
        0
    } else {
        -1
    }
}

/// Drops the boxed [`RowFn`] at `ctx`.
unsafe extern "C" fn rows_drop(ctx: *mut std::ffi::c_void) {
    // SAFETY: `ctx` came from `Box::into_raw` in `rows_to_ids`, dropped once.
    let f = unsafe { Box::from_raw(ctx as *mut RowFn) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(f)));
}

/// One id per row of float32 `x` `[rows, width]`, computed by `f` as a task
/// of the calling thread's CPU stream: a lazy node, so that a value chosen
/// by host code (a sampled token) joins the graph instead of the host
/// waiting for `x`. A row whose `f` panicked gets [`FAILED_ROW`]. `Ok(None)`
/// when the case is not ours (kernels turned off, a GPU stream, not a
/// float32 matrix).
pub fn rows_to_ids(x: &Array, f: RowFn) -> Result<Option<Array>, KernelError> {
    let ctx = Box::into_raw(Box::new(f)) as *mut std::ffi::c_void;
    // SAFETY: see `node`; `ctx` is a boxed `RowFn` that the node owns once built.
    let built = node(|out, stream, err, n| unsafe {
        emlx_kernels_rows_to_ids(out, handle(x), rows_call, ctx, rows_drop, stream, err, n)
    });
    if matches!(built, Ok(None)) {
        // SAFETY: not built, so the context is still ours (see the C entry).
        unsafe { rows_drop(ctx) };
    }
    // On an error the node may hold the context: it is left to the node.
    built
}

/// `silu(x[..., :F]) * x[..., F:]` for float32 `x` `[..., 2F]` (an MLP's gate
/// and up projections side by side) as a lazy MLX array computed by our
/// kernels: one node in place of MLX's split, sigmoid and two products,
/// with MLX's operation order (`(g * sigmoid(g)) * up`). `Ok(None)` when the
/// case is not ours (kernels turned off, a GPU stream, another dtype, an odd
/// last axis): the caller then uses MLX's ops.
pub fn swiglu(x: &Array) -> Result<Option<Array>, KernelError> {
    // SAFETY: see `node`.
    node(|out, stream, err, n| unsafe { emlx_kernels_swiglu(out, handle(x), stream, err, n) })
}

/// [`swiglu`] on plain buffers: `x` `[rows, 2F]`, `y` `[rows, F]`, with a
/// chosen variant and at most `max_threads` threads (0: the whole pool).
pub fn swiglu_with(
    isa: Isa,
    max_threads: usize,
    x: &[f32],
    f: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    if f == 0 || !x.len().is_multiple_of(2 * f) || y.len() * 2 != x.len() {
        return Err(KernelError(format!(
            "swiglu: {} inputs and {} outputs for rows of {f}",
            x.len(),
            y.len()
        )));
    }
    // SAFETY: x holds rows * 2f floats and y rows * f, checked above.
    let status = unsafe {
        emlx_kernels_swiglu_raw(
            x.as_ptr(),
            y.as_mut_ptr(),
            (y.len() / f) as std::ffi::c_long,
            f as c_int,
            isa as c_int,
            max_threads as c_int,
        )
    };
    ran(status, isa, None)
}

/// RMSNorm of float32 `x` over its last axis, `x * rsqrt(mean(x^2) + eps) *
/// weight` in MLX's order of operations, as a lazy MLX array computed by our
/// kernels: one node where MLX's CPU backend builds seven. `weight` is
/// `[D]`, or `[R, D]` with `R` the second-to-last axis of `x` (one weight
/// row per head). `Ok(None)` when the case is not ours (kernels turned off,
/// a GPU stream, another dtype, shapes that do not match).
pub fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<Option<Array>, KernelError> {
    // SAFETY: see `node`.
    node(|out, stream, err, n| unsafe {
        emlx_kernels_rms_norm(out, handle(x), handle(weight), eps, stream, err, n)
    })
}

/// [`rms_norm`] on plain buffers: `x` and `y` `[rows, D]`, `weight`
/// `[R, D]` (row `r` takes weight row `r % R`), with a chosen variant and
/// at most `max_threads` threads (0: the whole pool).
pub fn rms_norm_with(
    isa: Isa,
    max_threads: usize,
    x: &[f32],
    weight: &[f32],
    d: usize,
    eps: f32,
    y: &mut [f32],
) -> Result<(), KernelError> {
    if d == 0
        || !x.len().is_multiple_of(d)
        || y.len() != x.len()
        || weight.is_empty()
        || !weight.len().is_multiple_of(d)
    {
        return Err(KernelError(format!(
            "rms_norm: {} inputs, {} weights and {} outputs for rows of {d}",
            x.len(),
            weight.len(),
            y.len()
        )));
    }
    // SAFETY: the buffers hold whole rows of d floats, checked above.
    let status = unsafe {
        emlx_kernels_rms_norm_raw(
            x.as_ptr(),
            weight.as_ptr(),
            y.as_mut_ptr(),
            (x.len() / d) as std::ffi::c_long,
            d as c_int,
            (weight.len() / d) as c_int,
            eps,
            isa as c_int,
            max_threads as c_int,
        )
    };
    ran(status, isa, None)
}

/// Queries' and keys' per-head RMSNorm (when `norm` gives the `[H, hd]`
/// weight and eps) and rotary embedding from a table, as one lazy MLX array
/// computed by our kernels: for `x` `[B, L, H, hd]` float32,
/// `n * cos + swapped(n) * signed_sin` with `n` the normalized `x`, where
/// `cos` and `signed_sin` are `[T, L, hd]` (`T` 1 or `B`) and `swapped`
/// exchanges the halves of each head (each pair's elements when
/// `traditional`), in MLX's order of operations. `Ok(None)` when the case is
/// not ours (kernels turned off, a GPU stream, another dtype, shapes).
pub fn norm_rope(
    x: &Array,
    norm: Option<(&Array, f32)>,
    cos: &Array,
    signed_sin: &Array,
    traditional: bool,
) -> Result<Option<Array>, KernelError> {
    let (w, eps) = match norm {
        Some((w, eps)) => (handle(w), eps),
        None => (Handle::NULL, 0.0),
    };
    node(|out, stream, err, n| {
        // SAFETY: see `node`; a null weight handle means no norm.
        unsafe {
            emlx_kernels_norm_rope(
                out,
                handle(x),
                w,
                eps,
                handle(cos),
                handle(signed_sin),
                traditional as c_int,
                stream,
                err,
                n,
            )
        }
    })
}

/// An affine-quantized weight in MLX's layout, as [`quantized_linear`] takes it.
#[derive(Clone, Copy)]
pub struct QuantWeight<'a> {
    pub w: &'a Array,
    pub scales: &'a Array,
    pub biases: &'a Array,
    pub bits: i32,
    pub group_size: i32,
}

/// The first part of a one-token step's layer, for [`decode_qkv`]: arrays
/// float32 on a CPU stream, `h` `[rows, 1, hidden]`, `cos`/`signed_sin` the
/// RoPE table `[1 or rows, 1, head_dim]` (see [`norm_rope`]).
pub struct QkvParts<'a> {
    pub h: &'a Array,
    /// Input norm weight `[hidden]` and eps.
    pub input_norm: (&'a Array, f32),
    /// q, k and v projections stacked, and their bias if any.
    pub qkv: QuantWeight<'a>,
    pub qkv_bias: Option<&'a Array>,
    /// Per-head norm `[heads + kv_heads, head_dim]` of queries and keys, and eps.
    pub qk_norm: Option<(&'a Array, f32)>,
    pub cos: &'a Array,
    pub signed_sin: &'a Array,
    pub traditional: bool,
    pub heads: i32,
    pub kv_heads: i32,
}

/// A one-token step's layer up to its new keys, as one lazy MLX node of our
/// kernels: input RMSNorm, the stacked q/k/v product (and bias), per-head
/// RMSNorm and RoPE. Returns the queries `[rows, heads, head_dim]` for
/// [`decode_layer_rest`] and the new keys and values `[rows, kv_heads, 1,
/// head_dim]` for the cache. `Ok(None)` when the case is not ours (kernels
/// off, a GPU stream, dtypes, shapes).
pub fn decode_qkv(p: &QkvParts) -> Result<Option<[Array; 3]>, KernelError> {
    if !enabled() || !supports(p.qkv.bits, p.qkv.group_size) {
        return Ok(None);
    }
    let arrays = [
        handle(p.h),
        handle(p.input_norm.0),
        handle(p.qkv.w),
        handle(p.qkv.scales),
        handle(p.qkv.biases),
        handle(p.cos),
        handle(p.signed_sin),
    ];
    nodes(|outs, stream, err, n| {
        // SAFETY: see `node`; `arrays` lives for the call and null optional
        // handles mean absent.
        unsafe {
            emlx_kernels_decode_qkv(
                outs,
                arrays.as_ptr(),
                p.qkv_bias.map_or(Handle::NULL, handle),
                p.qk_norm.map_or(Handle::NULL, |(w, _)| handle(w)),
                p.heads,
                p.kv_heads,
                p.qkv.bits,
                p.qkv.group_size,
                p.input_norm.1,
                p.qk_norm.map_or(0.0, |(_, eps)| eps),
                p.traditional as c_int,
                stream,
                err,
                n,
            )
        }
    })
}

/// The rest of a one-token step's layer, for [`decode_layer_rest`]: `h` and
/// `q` as [`decode_qkv`] took and gave them, `keys`/`values` the layer's
/// whole cache buffers `[>= rows, kv_heads, capacity, head_dim]` once they
/// hold the step's keys.
pub struct RestParts<'a> {
    pub h: &'a Array,
    pub q: &'a Array,
    pub kv: KvBuffers<'a>,
    /// The softmax scale.
    pub scale: f32,
    pub o: QuantWeight<'a>,
    /// Post-attention norm weight `[hidden]` and eps.
    pub post_norm: (&'a Array, f32),
    pub mlp: RestMlp<'a>,
}

/// A layer's feed-forward part, as [`decode_layer_rest`] takes it.
pub enum RestMlp<'a> {
    /// A SwiGLU MLP: gate and up projections stacked, gate first, of equal
    /// widths.
    Dense {
        gate_up: QuantWeight<'a>,
        down: QuantWeight<'a>,
    },
    /// Routed experts (Qwen3-MoE): the router `[experts, hidden]` and the
    /// experts' projections stacked `[experts, out, in]`. Each row goes
    /// through the `top_k` experts of its largest router probabilities
    /// (softmax in float32), weighted by them, renormalized over the k with
    /// `norm_topk_prob`, as mlx-lm's qwen3_moe computes it.
    Experts {
        router: QuantWeight<'a>,
        gate: QuantWeight<'a>,
        up: QuantWeight<'a>,
        down: QuantWeight<'a>,
        top_k: i32,
        norm_topk_prob: bool,
    },
}

impl<'a> RestMlp<'a> {
    /// The weights in the order the node takes them.
    pub fn weights(&self) -> Vec<&QuantWeight<'a>> {
        match self {
            RestMlp::Dense { gate_up, down } => vec![gate_up, down],
            RestMlp::Experts {
                router,
                gate,
                up,
                down,
                ..
            } => vec![router, gate, up, down],
        }
    }
}

/// A layer's whole cache buffers, `[>= rows, kv_heads, capacity, ...]`
/// (already holding the step's keys), as [`decode_layer_rest`] reads them.
pub enum KvBuffers<'a> {
    /// Keys and values in float32 or float16.
    Dense { keys: &'a Array, values: &'a Array },
    /// MLX's affine quantization of them (`[packed, scales, biases]` each,
    /// float32 scales and biases), `bits` 8 or 4, groups a power of two
    /// dividing the heads.
    Quantized {
        keys: [&'a Array; 3],
        values: [&'a Array; 3],
        bits: i32,
        group_size: i32,
    },
}

/// The rest of a one-token step's layer as one lazy MLX node of our
/// kernels: each row's attention over keys `starts[b]..=positions[b]`, the
/// output product and residual, RMSNorm, the MLP (SwiGLU or routed experts)
/// and residual. Returns the residual stream out, `[rows, 1, hidden]`.
/// `Ok(None)` when the case is not ours (as [`decode_qkv`], and positions
/// outside the cache).
pub fn decode_layer_rest(
    p: &RestParts,
    positions: &[i32],
    starts: &[i32],
) -> Result<Option<Array>, KernelError> {
    let rows = p.h.shape().first().copied().unwrap_or(0);
    let mut weights = vec![&p.o];
    weights.extend(p.mlp.weights());
    let (top_k, norm_topk) = match p.mlp {
        RestMlp::Dense { .. } => (0, false),
        RestMlp::Experts {
            top_k,
            norm_topk_prob,
            ..
        } => (top_k, norm_topk_prob),
    };
    if !enabled()
        || positions.len() != rows as usize
        || starts.len() != rows as usize
        || top_k < 0
        || !weights.iter().all(|w| supports(w.bits, w.group_size))
    {
        return Ok(None);
    }
    let (keys, values, quantized, kv_bits, kv_group) = match &p.kv {
        KvBuffers::Dense { keys, values } => (*keys, *values, vec![], 0, 0),
        KvBuffers::Quantized {
            keys: [kw, ks, kb],
            values: [vw, vs, vb],
            bits,
            group_size,
        } => (
            *kw,
            *vw,
            vec![handle(ks), handle(kb), handle(vs), handle(vb)],
            *bits,
            *group_size,
        ),
    };
    let mut arrays = vec![handle(p.h), handle(p.q), handle(keys), handle(values)];
    arrays.extend([handle(p.o.w), handle(p.o.scales), handle(p.o.biases)]);
    arrays.push(handle(p.post_norm.0));
    for w in p.mlp.weights() {
        arrays.extend([handle(w.w), handle(w.scales), handle(w.biases)]);
    }
    arrays.extend(quantized);
    let bits: Vec<c_int> = weights.iter().map(|w| w.bits).collect();
    let group: Vec<c_int> = weights.iter().map(|w| w.group_size).collect();
    node(|out, stream, err, n| {
        // SAFETY: see `node`; `arrays`, `bits`, `group`, `positions` and
        // `starts` live for the call and hold what the C side reads (one
        // bit width and group a product: o and the MLP's weights).
        unsafe {
            emlx_kernels_decode_layer_rest(
                out,
                arrays.as_ptr(),
                bits.as_ptr(),
                group.as_ptr(),
                rows,
                positions.as_ptr(),
                starts.as_ptr(),
                p.post_norm.1,
                p.scale,
                kv_bits,
                kv_group,
                top_k,
                norm_topk as c_int,
                stream,
                err,
                n,
            )
        }
    })
}

/// The MLX-C handle of `a`, borrowed: valid while `a` lives.
fn handle(a: &Array) -> Handle {
    Handle {
        ctx: a.as_ptr().ctx,
    }
}

/// Builds one primitive node through a C builder on the calling thread's
/// default stream: `build` gets the out handle, the stream's handle and an
/// error buffer (pointer, length) and returns the builder's status (see
/// [`built`]). `Ok(None)` without calling it when the kernels are off.
///
/// SAFETY (of the callers' `unsafe` blocks): the array handles they pass come
/// from `&Array`s borrowed for the whole call, the stream lives until `node`
/// returns, and `out` and the error buffer (`n` bytes, NUL-terminated by the
/// C side) are valid for the call; on success the C side writes a new heap
/// array into `out`, which [`built`] hands to an `Array` that takes it over.
fn node(
    build: impl FnOnce(*mut Handle, Handle, *mut c_char, usize) -> c_int,
) -> Result<Option<Array>, KernelError> {
    Ok(nodes::<1>(build)?.map(|[a]| a))
}

/// [`node`] for a node of `N` outputs: `build` gets `N` out handles.
fn nodes<const N: usize>(
    build: impl FnOnce(*mut Handle, Handle, *mut c_char, usize) -> c_int,
) -> Result<Option<[Array; N]>, KernelError> {
    if !enabled() {
        return Ok(None);
    }
    let stream = Stream::thread_local_or_default();
    let mut err = [0 as c_char; 512];
    let mut outs = [Handle::NULL; N];
    let status = build(
        outs.as_mut_ptr(),
        Handle {
            ctx: stream.as_ptr().ctx,
        },
        err.as_mut_ptr(),
        err.len(),
    );
    match status {
        // SAFETY: on 1 `outs` holds N new heap MLX arrays that `Array` takes over.
        1 => Ok(Some(outs.map(|o| unsafe {
            Array::from_ptr(mlx_sys::mlx_array { ctx: o.ctx })
        }))),
        0 => Ok(None),
        _ => {
            // SAFETY: the C side always NUL-terminates within `err`.
            let message = unsafe { CStr::from_ptr(err.as_ptr()) };
            Err(KernelError(message.to_string_lossy().into_owned()))
        }
    }
}

/// What a raw-buffer kernel returned: 0 it ran, else the variant does not
/// run on this CPU (the message names the kernel when `kernel` does).
fn ran(status: c_int, isa: Isa, kernel: Option<&str>) -> Result<(), KernelError> {
    match (status, kernel) {
        (0, _) => Ok(()),
        (_, Some(kernel)) => Err(KernelError(format!(
            "{kernel}: this CPU does not run the {} variant",
            isa.name()
        ))),
        (_, None) => Err(KernelError(format!(
            "{} does not run on this CPU",
            isa.name()
        ))),
    }
}

/// A one-token step's keys and values for [`attend_with`]: float32,
/// float16 as IEEE half bits (a `kv_dtype` float16 cache), or MLX's affine
/// quantization (`bits` 8 or 4 packed into words, a float32 scale and bias
/// per `group_size` values: `[words, scales, biases]` each).
pub enum KeysValues<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [u16], &'a [u16]),
    Quantized {
        keys: (&'a [u32], &'a [f32], &'a [f32]),
        values: (&'a [u32], &'a [f32], &'a [f32]),
        bits: i32,
        group_size: i32,
    },
}

/// Keys and values as [`attend_with`] passes them on: their pointers, a
/// quantized cache's scales and biases (keys', then values'), bits, group
/// and (keys, values) lengths in values.
type RawKv = (
    *const std::ffi::c_void,
    *const std::ffi::c_void,
    [*const f32; 4],
    i32,
    i32,
    (usize, usize),
);

/// [`RawKv`] of float32 or float16 keys and values (`bits` 32 or 16).
fn plain_kv<T>(k: &[T], v: &[T], bits: i32) -> RawKv {
    let none = std::ptr::null::<f32>();
    let (kp, vp) = (k.as_ptr().cast(), v.as_ptr().cast());
    (kp, vp, [none; 4], bits, 0, (k.len(), v.len()))
}

/// The decode layer's attention for one key head on plain buffers, with a
/// chosen variant: `q` `[G, hd]` (already scaled) over `n` keys and values
/// (`n * hd` values each), `out` `[G, hd]` = softmax(q . k) @ v. For tests
/// and benchmarks.
pub fn attend_with(
    isa: Isa,
    q: &[f32],
    kv: KeysValues<'_>,
    hd: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (k, v, params, bits, group, len): RawKv = match kv {
        KeysValues::F32(k, v) => plain_kv(k, v, 32),
        KeysValues::F16(k, v) => plain_kv(k, v, 16),
        KeysValues::Quantized {
            keys,
            values,
            bits,
            group_size,
        } => {
            let values_of = |w: &[u32]| w.len() * 32 / bits.max(1) as usize;
            let groups = |w: &[u32]| values_of(w) / group_size.max(1) as usize;
            let params_fit = [keys, values]
                .iter()
                .all(|(w, s, b)| s.len() == groups(w) && b.len() == groups(w));
            if !attend_reads_quantized(hd.min(i32::MAX as usize) as i32, bits, group_size)
                || !params_fit
            {
                return Err(KernelError(format!(
                    "attend: quantized keys and values of {bits} bits in groups of {group_size} \
                     for heads of {hd}"
                )));
            }
            (
                keys.0.as_ptr().cast(),
                values.0.as_ptr().cast(),
                [keys.1, keys.2, values.1, values.2].map(|p| p.as_ptr()),
                bits,
                group_size,
                (values_of(keys.0), values_of(values.0)),
            )
        }
    };
    let g = q.len() / hd.max(1);
    let n = len.0 / hd.max(1);
    if hd == 0
        || q.len() != g * hd
        || out.len() != q.len()
        || len.0 != n * hd
        || len.1 != len.0
        || n == 0
    {
        return Err(KernelError(format!(
            "attend: {} queries, {} keys, {} values and {} outputs for heads of {hd}",
            q.len(),
            len.0,
            len.1,
            out.len()
        )));
    }
    // SAFETY: q and out hold g * hd floats, k and v n * hd values (and a
    // quantized cache's scales and biases one per group of them), checked
    // above.
    let status = unsafe {
        emlx_kernels_attend_raw(
            q.as_ptr(),
            k,
            v,
            params[0],
            params[1],
            params[2],
            params[3],
            bits,
            group,
            out.as_mut_ptr(),
            g as c_int,
            n as c_int,
            hd as c_int,
            isa as c_int,
        )
    };
    ran(status, isa, Some("attend"))
}

/// The shape of a [`prompt_attention_with`] call: `batch` rows of
/// `kv_heads` key heads, `group` query heads per key head, `queries` query
/// positions (the last of `keys`), heads of `head_dim`.
#[derive(Debug, Clone, Copy)]
pub struct PromptShape {
    pub batch: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub queries: usize,
    pub keys: usize,
    pub head_dim: usize,
}

impl PromptShape {
    /// Values in the queries (and in the output).
    pub fn query_values(&self) -> usize {
        self.batch * self.kv_heads * self.group * self.queries * self.head_dim
    }

    /// Values in the keys (and in the values).
    pub fn cache_values(&self) -> usize {
        self.batch * self.kv_heads * self.keys * self.head_dim
    }
}

/// [`prompt_attention`] on plain buffers with a chosen variant: `q`
/// `[batch, kv_heads, group * queries, head_dim]` (already scaled), keys and
/// values [`KeysValues::F32`] or [`KeysValues::F16`] `[batch, kv_heads,
/// keys, head_dim]`, `out` shaped as `q`. For tests and benchmarks.
pub fn prompt_attention_with(
    isa: Isa,
    q: &[f32],
    kv: KeysValues<'_>,
    shape: PromptShape,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let PromptShape {
        batch,
        kv_heads,
        group,
        queries,
        keys,
        head_dim,
    } = shape;
    let (k, v, _, bits, _, len) = match kv {
        KeysValues::F32(k, v) => plain_kv(k, v, 32),
        KeysValues::F16(k, v) => plain_kv(k, v, 16),
        KeysValues::Quantized { .. } => {
            return Err(KernelError(
                "prompt attention: float32 or float16 keys and values only".into(),
            ))
        }
    };
    let (rows, cache) = (shape.query_values(), shape.cache_values());
    let int = |n: usize| i32::try_from(n).ok().filter(|&n| n > 0);
    let dims = [batch, kv_heads, group, queries, keys, head_dim].map(int);
    if q.len() != rows || out.len() != rows || len != (cache, cache) || queries > keys {
        return Err(KernelError(format!(
            "prompt attention: buffers of {} queries, {} keys, {} values and {} outputs \
             do not fit {shape:?}",
            q.len(),
            len.0,
            len.1,
            out.len()
        )));
    }
    let [Some(b), Some(nkv), Some(g), Some(l), Some(s), Some(hd)] = dims else {
        return Err(KernelError(format!(
            "prompt attention: {shape:?} has an empty or too large side"
        )));
    };
    // SAFETY: every buffer holds the elements the shape names, checked above.
    let status = unsafe {
        emlx_kernels_prompt_attention_raw(
            q.as_ptr(),
            k,
            v,
            bits,
            out.as_mut_ptr(),
            b,
            nkv,
            g,
            l,
            s,
            hd,
            isa as c_int,
        )
    };
    ran(status, isa, Some("prompt attention"))
}

/// A bfloat16 value as stored (its bits), for scales and biases read as
/// checkpoints keep them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Widening is exact.
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Element types of scales and biases the kernels read: `f32` or [`Bf16`].
pub trait Param: Copy + private::Sealed {
    #[doc(hidden)]
    const BF16: bool;
}
impl Param for f32 {
    const BF16: bool = false;
}
impl Param for Bf16 {
    const BF16: bool = true;
}
mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::Bf16 {}
}

/// A quantized matrix in MLX's affine layout, borrowed as plain slices.
pub struct QuantizedMatrix<'a, P = f32> {
    /// `[rows, cols * bits / 32]`
    pub w: &'a [u32],
    /// `[rows, cols / group_size]`
    pub scales: &'a [P],
    pub biases: &'a [P],
    pub rows: usize,
    pub cols: usize,
    pub bits: i32,
    pub group_size: i32,
}

/// `y = x @ dequantize(m).T` on plain buffers with a chosen variant and at
/// most `max_threads` threads (0: the whole pool). For tests and benchmarks.
pub fn qmm_with(
    isa: Isa,
    max_threads: usize,
    x: &[f32],
    m: &QuantizedMatrix,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let batch = check_qmm(x, m, y)?;
    // SAFETY: every buffer was checked against the shapes above.
    let status = unsafe {
        emlx_kernels_qmm(
            x.as_ptr(),
            m.w.as_ptr(),
            m.scales.as_ptr(),
            m.biases.as_ptr(),
            y.as_mut_ptr(),
            batch as c_int,
            m.rows as c_int,
            m.cols as c_int,
            m.bits,
            m.group_size,
            isa as c_int,
            max_threads.min(i32::MAX as usize) as c_int,
        )
    };
    ran(status, isa, Some("qmm"))
}

/// The rows of `x` when every buffer matches the matrix's shapes.
fn check_qmm<P>(x: &[f32], m: &QuantizedMatrix<P>, y: &[f32]) -> Result<usize, KernelError> {
    let bad = |what: &str| Err(KernelError(format!("qmm: {what}")));
    if !supports(m.bits, m.group_size) {
        return bad("unsupported bits or group size");
    }
    if m.cols == 0 || m.rows == 0 || !m.cols.is_multiple_of(m.group_size as usize) {
        return bad("columns must be a positive multiple of the group size");
    }
    let batch = x.len() / m.cols;
    if !x.len().is_multiple_of(m.cols)
        || m.w.len() != m.rows * m.cols * m.bits as usize / 32
        || m.scales.len() != m.rows * m.cols / m.group_size as usize
        || m.biases.len() != m.scales.len()
        || y.len() != batch * m.rows
    {
        return bad("buffer sizes do not match the shapes");
    }
    let fits = |v: usize| i32::try_from(v).is_ok();
    if !fits(batch) || !fits(m.rows) || !fits(m.cols) {
        return bad("dimensions too large");
    }
    Ok(batch)
}

/// [`qmm_with`] with int8 activations (what `EMLX_AXON_CPU_ACTIVATIONS=int8`
/// makes the primitive run), whatever that setting; scales and biases in
/// float32 or bfloat16. On [`Isa::Avx512`] without VNNI the AVX2 int8
/// kernels run (see [`int8_uses_vnni`]).
pub fn qmm_int8_with<P: Param>(
    isa: Isa,
    max_threads: usize,
    x: &[f32],
    m: &QuantizedMatrix<P>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let batch = check_qmm(x, m, y)?;
    // SAFETY: every buffer was checked against the shapes above; P is f32 or
    // bfloat16 bits as the flag says.
    let status = unsafe {
        emlx_kernels_qmm_int8(
            x.as_ptr(),
            m.w.as_ptr(),
            m.scales.as_ptr().cast(),
            m.biases.as_ptr().cast(),
            P::BF16 as c_int,
            y.as_mut_ptr(),
            batch as c_int,
            m.rows as c_int,
            m.cols as c_int,
            m.bits,
            m.group_size,
            isa as c_int,
            max_threads.min(i32::MAX as usize) as c_int,
        )
    };
    ran(status, isa, Some("qmm"))
}

/// The CBLAS `cblas_sgemm` entry point, exported so that libmlx, which
/// resolves it at load time, runs its CPU float32 matmuls (attention
/// included) on our kernels rather than the wheel's reference BLAS. A binary
/// takes part when this symbol is in its dynamic symbol table: a `cdylib`
/// (the NIF) exports it as is, an executable needs
/// `-Wl,--export-dynamic-symbol=cblas_sgemm` (see the engine's build script).
///
/// # Safety
/// The BLAS contract: the matrices are valid for the given sizes and strides.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cblas_sgemm(
    order: c_int,
    trans_a: c_int,
    trans_b: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
) {
    emlx_kernels_cblas_sgemm(
        order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc,
    )
}

/// A row-major operand of [`sgemm_with`]: `rows x cols` logical, stored with
/// leading dimension `ld`, transposed in memory when `trans`.
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub trans: bool,
    pub ld: usize,
}

/// Row-major `C = alpha * op(A) op(B) + beta * C` (`m x n`, inner size `k`,
/// `C` with leading dimension `ldc`) with a chosen variant. For tests and
/// benchmarks.
#[allow(clippy::too_many_arguments)]
pub fn sgemm_with(
    isa: Isa,
    max_threads: usize,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: &Operand,
    b: &Operand,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) -> Result<(), KernelError> {
    let need = |rows: usize, cols: usize, o: &Operand| {
        let (r, cl) = if o.trans { (cols, rows) } else { (rows, cols) };
        o.ld >= cl && (r == 0 || o.data.len() >= (r - 1) * o.ld + cl)
    };
    if !need(m, k, a) || !need(k, n, b) || ldc < n || (m > 0 && c.len() < (m - 1) * ldc + n) {
        return Err(KernelError("sgemm: buffers do not match the shapes".into()));
    }
    let int = |v: usize| i32::try_from(v).map_err(|_| KernelError("sgemm: too large".into()));
    // SAFETY: every buffer was checked against the shapes above.
    let status = unsafe {
        emlx_kernels_sgemm(
            a.trans as c_int,
            b.trans as c_int,
            int(m)?,
            int(n)?,
            int(k)?,
            alpha,
            a.data.as_ptr(),
            int(a.ld)?,
            b.data.as_ptr(),
            int(b.ld)?,
            beta,
            c.as_mut_ptr(),
            int(ldc)?,
            isa as c_int,
            int(max_threads)?,
        )
    };
    ran(status, isa, Some("sgemm"))
}
