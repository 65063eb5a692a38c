//! A prompt's layers (a multi-token forward) on a CUDA GPU from fewer MLX
//! nodes. A small model's prompt is bound by the host, not the device:
//! MLX spends about 6 µs on every node it builds and queues, views
//! included, and a layer took about 30. Here a layer is 14: MLX's products
//! and attention, with our kernels for the q/k norms + RoPE + cache write
//! ([`Kernels::qk_rope_write`]), each residual add + RMSNorm pair and
//! SwiGLU, over the `B x L` token rows, and a `depends` node that makes the
//! cache's handles wait for the in-place write. On an NVIDIA H200
//! (Qwen3-0.6B shape, 4-bit, bfloat16, bench/RESULTS-gpu.md) a 512-token
//! prompt took 9.3 ms to evaluate against 10.2 with MLX's ops (53.1k
//! against 46.9k tok/s to the first token), the host building its graph
//! for 6.1 ms of it against 7.8.
//!
//! Large products (a long chunk of an 8B model's, say) run as cuBLAS
//! matmuls of the weight dequantized for the chunk rather than MLX's
//! quantized product ([`DEQUANTIZED_WORK`]).
//!
//! On by default where the step kernels passed their check and these passed
//! theirs (`EMLX_AXON_PREFILL_KERNELS=0` keeps MLX's ops); where the q/k
//! kernel does not take the cache (rows at positions of their own)
//! attention is MLX's. The cache is written in place, so a forward's graph
//! reads it only in attention, and callers evaluate the cache before
//! reading it otherwise (see [`crate::backend::cuda::kernel::written_by`]).

use std::sync::Mutex;

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use once_cell::sync::Lazy;

use super::kernels::{takes_dtype, Kernels, QkvHeads};
use super::layer::{all_passed, check_rows, close, kernels, passes, HeadsCase};
use crate::backend::cuda::kernel::{within, written_by};
use crate::checkpoint::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::cache::{KvStore, RopeOffset};
use crate::nn::layers::{Projects, RmsNorm};
use crate::nn::rope::PositionTable;
use crate::nn::{attention::AttentionMask, block::Block};

static WANTED: Lazy<bool> = Lazy::new(crate::switches::prefill_kernels);

/// The prompt kernels' check result per compute dtype.
static CHECKED: Lazy<Mutex<Vec<(Dtype, bool)>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// Whether prompts may take the prompt kernels (asked for; the CUDA layers
/// decide the rest).
pub fn wanted() -> bool {
    *WANTED
}

/// Whether the prompt kernels passed their check in every dtype checked so
/// far (`None`: not checked, so not used).
pub fn checked() -> Option<bool> {
    all_passed(&CHECKED)
}

/// The add + RMSNorm kernel's grid has a block row per token row.
const MAX_GRID_ROWS: i32 = 65_535;

/// What a prompt's layers read besides its embeddings and the cache.
pub(crate) struct Prompt<'a> {
    pub config: &'a ModelConfig,
    pub blocks: &'a [Block],
    pub final_norm: &'a RmsNorm,
    pub table: &'a PositionTable,
    pub mask: &'a AttentionMask,
    /// Queue the graph every this many layers (see `model::COMMIT_LAYERS`).
    pub commit_every: Option<usize>,
}

/// MLX's attention sublayer: `[B, L, hidden]` normalized input, block,
/// layer index and cache -> `[B, L, hidden]`.
pub(crate) type MlxAttend<'a, C> = dyn FnMut(&Array, &Block, usize, &mut C) -> Result<Array> + 'a;

/// Every layer over embeddings `h` `[B, L, hidden]`, then the final norm
/// (`[B, L, hidden]`), the keys and values written into `cache` (not yet
/// advanced). `None`, before anything is built, where the kernels do not
/// take this model.
pub(crate) fn layers<C: KvStore>(
    p: &Prompt,
    h: &Array,
    cache: &mut C,
    mlx_attend: &mut MlxAttend<C>,
) -> Result<Option<Array>> {
    let (b, l) = (h.dim(0), h.dim(1));
    let dtype = h.dtype();
    let norms = p
        .blocks
        .iter()
        .flat_map(|b| [&b.input_norm, &b.post_norm])
        .chain([p.final_norm]);
    let takes = *WANTED
        && !crate::runtime::device::on_cpu_stream()
        && takes_dtype(dtype)
        && h.ndim() == 3
        && b * l <= MAX_GRID_ROWS
        && !p.blocks.is_empty()
        && norms.into_iter().all(|n| n.weight().ndim() == 1)
        && p.blocks.iter().all(|b| {
            // Routed experts run MLX's ops: these kernels take dense MLPs.
            b.mlp.dense().is_some_and(|m| {
                m.gate_up.is_stacked() && matches!(m.gate_up.sizes(), [g, u] if g == u)
            })
        });
    let Some(k) = takes
        .then(|| kernels(dtype))
        .flatten()
        .filter(|k| passes(&CHECKED, dtype, || check(k, dtype)))
    else {
        return Ok(None);
    };
    // The q/k kernel where it takes the cache: the first position (as an
    // array and a number) and the RoPE table's rows.
    let ours = match cache.rope_offset() {
        RopeOffset::Scalar(offset) if writes_cache(p.config, cache, b, offset + l, dtype) => {
            let (cos, signed_sin) = p.table.rows(p.config, offset + l - 1)?;
            Some((Array::from_slice(&[offset], &[1]), offset, cos, signed_sin))
        }
        _ => None,
    };
    let first = &p.blocks[0].input_norm;
    let mut h = h.clone();
    let mut x = rms_norm(&h, Some(first.weight()), first.eps())?;
    for (i, block) in p.blocks.iter().enumerate() {
        if p.commit_every.is_some_and(|n| i > 0 && i % n == 0) {
            mlx_rs::transforms::async_eval([&h, &x])?;
        }
        let r = match &ours {
            Some((at, offset, cos, signed_sin)) => {
                let (keys, values) = cache.buffers(i);
                let heads = QkvHeads {
                    qkv: &product(&x, &block.attn.qkv)?,
                    qk_norm: block.attn.qk_norms(),
                    cos,
                    signed_sin,
                    traditional: p.config.rope_traditional,
                    keys,
                    values,
                    heads: p.config.num_heads,
                    kv_heads: p.config.num_kv_heads,
                };
                let q = k.qk_rope_write(&heads, at)?;
                // Whatever reads the cache from here on (attention, the
                // next chunk, a prefix copy) waits for the kernel's write.
                let [keys, values] = written_by([keys, values], &q)?;
                let end = offset + l;
                let out = crate::nn::attention::attend(
                    &q,
                    &keys.index((.., .., ..end, ..)),
                    &values.index((.., .., ..end, ..)),
                    p.mask,
                )?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, p.config.num_heads * p.config.head_dim])?;
                cache.set_buffers(i, keys, values);
                product(&out, &block.attn.o)?
            }
            None => mlx_attend(&x, block, i, cache)?,
        };
        let post = &block.post_norm;
        let (h1, x1) = k.add_norm(&h, &r, post.weight(), post.eps())?;
        let mlp = block.mlp.dense().ok_or_else(|| {
            crate::error::Error::Mlx("the prompt kernels were given routed experts".into())
        })?;
        let act = k.swiglu(&product(&x1, &mlp.gate_up)?)?;
        let down = product(&act, &mlp.down)?;
        let next = p.blocks.get(i + 1).map_or(p.final_norm, |b| &b.input_norm);
        (h, x) = k.add_norm(&h1, &down, next.weight(), next.eps())?;
    }
    Ok(Some(x))
}

/// Products of at least this many multiply-adds (token rows x outputs x
/// inputs) run as one matmul of the weight dequantized for the chunk.
/// MLX 0.32's quantized product for many rows on CUDA (its sm90 kernel)
/// runs at about the same rate at every size, while cuBLAS on the dequantized
/// weight gains with size; at about this size the two cost the same on an
/// NVIDIA H200, dequantizing included (bench/RESULTS-gpu-prefill.md).
const DEQUANTIZED_WORK: i64 = 1 << 32;

/// Whether a prompt's product of `rows` token rows, `outputs` and `inputs`
/// runs through the dequantized weight.
pub fn dequantizes(rows: usize, outputs: i32, inputs: i32) -> bool {
    rows as i64 * outputs as i64 * inputs as i64 >= DEQUANTIZED_WORK
}

/// `projection`'s product of `x` `[.., inputs]`, the way [`dequantizes`]
/// picks.
fn product(x: &Array, projection: &impl Projects) -> Result<Array> {
    let inputs = x.dim(-1);
    if dequantizes(
        x.size() / inputs.max(1) as usize,
        projection.out_dim(),
        inputs,
    ) {
        projection.project_dequantized(x)
    } else {
        projection.project(x)
    }
}

/// Whether the q/k kernel can write `rows` rows' keys up to position `end`
/// into this cache's buffers: `[rows, kv_heads, capacity, head_dim]` in the
/// compute dtype, heads a block of threads each.
fn writes_cache<C: KvStore>(c: &ModelConfig, cache: &C, rows: i32, end: i32, dtype: Dtype) -> bool {
    let hd = c.head_dim;
    let (keys, values) = cache.buffers(0);
    hd % 32 == 0
        && (32..=256).contains(&hd)
        && c.num_heads + c.num_kv_heads <= 65_535
        && [keys, values].iter().all(|a| {
            a.dtype() == dtype
                && a.ndim() == 4
                && a.dim(0) == rows
                && a.dim(1) == c.num_kv_heads
                && a.dim(2) >= end
                && a.dim(3) == hd
                && a.strides().last() == Some(&1)
        })
}

/// The prompt kernels against MLX's ops: the residual add + RMSNorm and
/// SwiGLU over `[B, L, D]` rows, and the q/k kernel against MLX's norm and
/// rotation on a prompt of 5 tokens in 2 rows at offset 3 of a 16-position
/// cache (the queries, the keys and values written, and nothing else in the
/// cache touched).
fn check(k: &Kernels, dtype: Dtype) -> Result<()> {
    check_rows(k, dtype, [2, 3], 41, "prompt ")?;

    let (nq, nkv, hd) = (HeadsCase::HEADS, HeadsCase::KV_HEADS, HeadsCase::HEAD_DIM);
    let (rows, l, offset) = (2, 5, 3);
    let case = HeadsCase::new([nq, nkv, hd], rows, l, rows, 16, 31, dtype)?;
    let (qkv, cos, sin, eps) = (&case.qkv, &case.cos, &case.sin, case.eps);
    let (qw, kw) = (&case.q_norm, &case.k_norm);
    let (keys, values) = (&case.keys, &case.values);
    let (keys_before, values_before) = (&case.keys_before, &case.values_before);
    let q = k.qk_rope_write(&case.heads(), &Array::from_slice(&[offset], &[1]))?;
    q.eval()?;
    let heads = qkv.reshape(&[rows, l, nq + 2 * nkv, hd])?;
    let half = hd / 2;
    let end = offset + l;
    // `[rows, L, heads, hd]` rotated at positions offset.., as `[rows, heads, L, hd]`.
    let rotate = |y: &Array| -> Result<Array> {
        let swapped = mlx_rs::ops::concatenate(
            &[y.index((.., .., .., half..)), y.index((.., .., .., ..half))],
            -1,
        )?;
        let f = |a: &Array| a.as_dtype(Dtype::Float32);
        let at = |t: &Array| t.index(offset..end).reshape(&[1, l, 1, hd]);
        Ok(f(y)?
            .multiply(at(cos)?)?
            .add(&f(&swapped)?.multiply(at(sin)?)?)?
            .as_dtype(dtype)?
            .transpose_axes(&[0, 2, 1, 3])?)
    };
    let want_q = rotate(&rms_norm(heads.index((.., .., ..nq, ..)), Some(qw), eps)?)?;
    let want_k = rotate(&rms_norm(
        heads.index((.., .., nq..nq + nkv, ..)),
        Some(kw),
        eps,
    )?)?;
    let want_v = heads
        .index((.., .., nq + nkv.., ..))
        .transpose_axes(&[0, 2, 1, 3])?;
    if q.shape() != want_q.shape() {
        return Err(Error::Mlx(
            "the prompt q/k kernel gives another shape".into(),
        ));
    }
    close("prompt queries", dtype, &q, &want_q)?;
    let written = |a: &Array| a.index((.., .., offset..end, ..));
    close("prompt key write", dtype, &written(keys), &want_k)?;
    close("prompt value write", dtype, &written(values), &want_v)?;
    // Nothing else was written.
    let what = format!("prompt q/k kernel's cache outside its positions ({dtype:?})");
    for (after, before) in [(&keys, &keys_before), (&values, &values_before)] {
        let (head, tail) = (
            |a: &Array| a.index((.., .., ..offset, ..)),
            |a: &Array| a.index((.., .., end.., ..)),
        );
        within(&what, &head(after), &head(before), 0.0)?;
        within(&what, &tail(after), &tail(before), 0.0)?;
    }
    Ok(())
}
