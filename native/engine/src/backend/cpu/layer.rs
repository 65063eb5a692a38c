//! A one-token step's layer on a CPU stream as two nodes of our kernels
//! ([`emlx_axon_kernels::decode_qkv`] and
//! [`emlx_axon_kernels::decode_layer_rest`]) around the cache's own update,
//! instead of about thirty: on a 2-core CPU, MLX's scheduling of a step's
//! ~940 separate nodes cost a few milliseconds a token beside 13 ms of
//! products.
//!
//! The MLP is a dense SwiGLU or a quantized router with routed experts
//! (Qwen3-MoE). Layers whose parts the nodes do not take (dense or
//! unstacked projections, a bias outside q/k/v, bit widths or group sizes
//! without a kernel, MLX's rope, another dtype, unquantized experts or
//! router) return `None` before touching the cache, and are built from
//! separate nodes as before. The cache may be float16 under float32
//! activations (`kv_dtype`), or quantized to 8 or 4 bits (`kv_bits`): the
//! attention then reads its half or fewer bytes as they are stored.

use emlx_axon_kernels::RestMlp;
use mlx_rs::{Array, Dtype};

use crate::checkpoint::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::cache::{KvStore, StepRows};
use crate::nn::block::{Block, Ffn};
use crate::nn::rope::Rope;

/// The layer `layer` of `block` over `h` (`[rows, 1, hidden]`), or `None`
/// when the nodes do not take it (see the module).
pub(crate) fn forward<C: KvStore>(
    c: &ModelConfig,
    block: &Block,
    h: &Array,
    cache: &mut C,
    layer: usize,
    rope: &Rope,
    rows: &StepRows,
) -> Result<Option<Array>> {
    let Rope::Table {
        traditional,
        rows: (cos, signed_sin),
        ..
    } = rope
    else {
        return Ok(None);
    };
    let attn = &block.attn;
    let (Some((qkv, qkv_bias)), Some((o, None))) =
        (attn.qkv.stacked_quantized(), attn.o.quantized())
    else {
        return Ok(None);
    };
    let mlp = match &block.mlp {
        Ffn::Dense(mlp) => match (mlp.gate_up.stacked_quantized(), mlp.down.quantized()) {
            (Some((gate_up, None)), Some((down, None))) if matches!(mlp.gate_up.sizes(), [g, u] if g == u) => {
                RestMlp::Dense { gate_up, down }
            }
            _ => return Ok(None),
        },
        Ffn::Sparse(moe) => match moe.quantized() {
            Some(e) => RestMlp::Experts {
                router: e.router,
                gate: e.gate,
                up: e.up,
                down: e.down,
                top_k: e.top_k,
                norm_topk_prob: e.norm_topk_prob,
            },
            None => return Ok(None),
        },
    };
    // What the second node checks, checked before the first one's keys
    // reach the cache: past that point the layer cannot go back.
    let takes = |w: &emlx_axon_kernels::QuantWeight| {
        emlx_axon_kernels::supports(w.bits, w.group_size)
            && matches!(w.scales.dtype(), Dtype::Float32 | Dtype::Bfloat16)
    };
    let cache_read = match (cache.quantized(), cache.quantized_buffers(layer)) {
        (Some(q), Some((keys, _))) => {
            emlx_axon_kernels::attend_reads_quantized(c.head_dim, q.bits, q.group_size)
                && keys[1].dtype() == Dtype::Float32
        }
        (None, _) => matches!(
            cache.buffers(layer).0.dtype(),
            Dtype::Float32 | Dtype::Float16
        ),
        _ => false,
    };
    let mut products = vec![&o];
    products.extend(mlp.weights());
    if h.dtype() != Dtype::Float32 || !products.into_iter().all(takes) || !cache_read {
        return Ok(None);
    }
    let qkv_parts = emlx_axon_kernels::QkvParts {
        h,
        input_norm: (block.input_norm.weight(), block.input_norm.eps()),
        qkv,
        qkv_bias,
        qk_norm: attn.qk_norm(),
        cos,
        signed_sin,
        traditional: *traditional,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
    };
    let kernel_error = |e: emlx_axon_kernels::KernelError| Error::Mlx(e.to_string());
    let Some([q, k, v]) = emlx_axon_kernels::decode_qkv(&qkv_parts).map_err(kernel_error)? else {
        return Ok(None);
    };
    cache.update(layer, &k, &v)?;
    let kv = match (cache.quantized(), cache.quantized_buffers(layer)) {
        (Some(quant), Some((keys, values))) => emlx_axon_kernels::KvBuffers::Quantized {
            keys: [&keys[0], &keys[1], &keys[2]],
            values: [&values[0], &values[1], &values[2]],
            bits: quant.bits,
            group_size: quant.group_size,
        },
        _ => {
            let (keys, values) = cache.buffers(layer);
            emlx_axon_kernels::KvBuffers::Dense { keys, values }
        }
    };
    let rest = emlx_axon_kernels::RestParts {
        h,
        q: &q,
        kv,
        scale: (c.head_dim as f32).powf(-0.5),
        o,
        post_norm: (block.post_norm.weight(), block.post_norm.eps()),
        mlp,
    };
    emlx_axon_kernels::decode_layer_rest(&rest, &rows.positions, &rows.starts)
        .map_err(kernel_error)?
        .map(Some)
        .ok_or_else(|| Error::Mlx("a decode layer's kernels refused its second part".into()))
}
