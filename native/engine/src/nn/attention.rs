//! Grouped-query self-attention of Qwen2 and Qwen3 (the two differ only in
//! q/k RMSNorm versus q/k/v bias), following mlx-lm's models/qwen3.py and
//! qwen2.py.
//!
//! q, k and v come from one stacked projection. On a CPU stream, where MLX's
//! fast ops expand into many small ones, queries and keys are normalized and
//! rotated together, and attention without a mask folds each key head's
//! query heads into one matrix product; every step keeps MLX's own float
//! arithmetic, so the values are those of the fast ops.

use mlx_rs::fast::{rms_norm, scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{
    broadcast_to, concatenate, dequantize, expand_dims, matmul, quantized_matmul, select,
    softmax_axis,
};
use mlx_rs::{Array, Dtype};

use crate::checkpoint::config::ModelConfig;
use crate::checkpoint::weights::{Join, Weights};
use crate::error::Result;
use crate::kv::cache::{KvQuant, KvStore, KvView};
use crate::kv::window::causal_mask;
use crate::nn::layers::{Linear, LinearGroup, LoadPlan, Member, RmsNorm, Workers};
use crate::nn::rope::Rope;

pub enum AttentionMask {
    None,
    Causal,
    Array(Array),
    /// A bool mask `[B, 1, 1, S]` that is, for each row, a range of keys
    /// (the scheduler's rows at their own positions): one-token layers of
    /// the backends read the ranges from the cache's positions instead.
    Ranges(Array),
}

struct QkNorm {
    q: Array,
    k: Array,
    /// Weights `[heads + kv_heads, head_dim]`: `q` for the query heads, `k`
    /// for the key heads, to normalize both at once.
    both: RmsNorm,
}

pub(crate) struct Attention {
    /// q, k and v projections, outputs in that order.
    pub(crate) qkv: LinearGroup,
    pub(crate) o: Linear,
    norm: Option<QkNorm>,
    /// The softmax scale as MLX's attention applies it, in the compute
    /// dtype, as a scalar and shaped like a one-token batch-1 step's queries
    /// (`[1, kv_heads, heads / kv_heads, head_dim]`, no broadcast needed).
    scale: Array,
    scale_step: Array,
}

/// A layer's q, k and v projections, read stacked.
pub(crate) fn qkv_join() -> Join {
    let path = |name: &str| format!("self_attn.{name}");
    Join {
        name: path("qkv_proj"),
        members: vec![path("q_proj"), path("k_proj"), path("v_proj")],
    }
}

impl Attention {
    /// Loads layer `prefix`'s attention (`<prefix>.self_attn.*`).
    pub(crate) fn load(
        weights: &mut Weights,
        c: &ModelConfig,
        prefix: &str,
        plan: impl Fn(&str) -> LoadPlan,
        dtype: Dtype,
        ways: usize,
    ) -> Result<Self> {
        let (d, hd) = (c.hidden_size, c.head_dim);
        let path = |name: &str| format!("{prefix}.self_attn.{name}");
        let join = qkv_join().at(prefix);
        let [q, k, v] = &join.members[..] else {
            unreachable!("q, k and v");
        };
        fn member<'a>(
            prefix: &'a str,
            out_dim: i32,
            plan: &impl Fn(&str) -> LoadPlan,
        ) -> Member<'a> {
            Member {
                prefix,
                out_dim,
                plan: plan(prefix),
            }
        }
        let qkv = LinearGroup::load(
            weights,
            &join.name,
            &[
                member(q, c.num_heads * hd, &plan),
                member(k, c.num_kv_heads * hd, &plan),
                member(v, c.num_kv_heads * hd, &plan),
            ],
            d,
            !c.arch.has_qk_norm(),
            ways,
        )?;
        let o_path = path("o_proj");
        let o = Linear::load(
            weights,
            &o_path,
            c.num_heads * hd,
            d,
            false,
            plan(&o_path),
            ways,
        )?;
        // On the host: each would be a device kernel inside the load.
        let (norm, scale, scale_step) =
            crate::runtime::device::on_host(|| Self::load_constants(weights, c, prefix, dtype))?;
        Ok(Attention {
            qkv,
            o,
            norm,
            scale,
            scale_step,
        })
    }

    /// The q/k norms (Qwen3) and the softmax scales, in the compute dtype.
    fn load_constants(
        weights: &mut Weights,
        c: &ModelConfig,
        prefix: &str,
        dtype: Dtype,
    ) -> Result<(Option<QkNorm>, Array, Array)> {
        let hd = c.head_dim;
        let path = |name: &str| format!("{prefix}.self_attn.{name}");
        let norm = match c.arch.has_qk_norm() {
            true => {
                let mut take = |name: &str| -> Result<Array> {
                    Ok(weights
                        .take(&format!("{}.weight", path(name)), Some(&[hd]))?
                        .as_dtype(dtype)?)
                };
                let (q, k) = (take("q_norm")?, take("k_norm")?);
                let both = RmsNorm::new(
                    concatenate(
                        &[
                            broadcast_to(&q, &[c.num_heads, hd])?,
                            broadcast_to(&k, &[c.num_kv_heads, hd])?,
                        ],
                        0,
                    )?,
                    c.rms_norm_eps,
                )?;
                Some(QkNorm { q, k, both })
            }
            false => None,
        };
        let scale = Array::from_f32((hd as f32).powf(-0.5)).as_dtype(dtype)?;
        let step = [1, c.num_kv_heads, c.num_heads / c.num_kv_heads, hd];
        let scale_step = Array::from_slice(
            &vec![(hd as f32).powf(-0.5); (c.num_heads * hd) as usize],
            &step,
        )
        .as_dtype(dtype)?;
        Ok((norm, scale, scale_step))
    }

    pub(crate) fn arrays(&self) -> Vec<&Array> {
        let mut all = self.qkv.arrays();
        all.extend(self.o.arrays());
        if let Some(n) = &self.norm {
            all.extend([&n.q, &n.k]);
            all.extend(n.both.arrays());
        }
        all.extend([&self.scale, &self.scale_step]);
        all
    }

    /// Qwen3's q and k norm weights (`[head_dim]` each) and their eps.
    pub(crate) fn qk_norms(&self) -> Option<(&Array, &Array, f32)> {
        self.norm.as_ref().map(|n| (&n.q, &n.k, n.both.eps()))
    }

    /// The queries' and keys' per-head norm (weights `[heads + kv_heads,
    /// head_dim]`) and its eps, if the model has one.
    pub(crate) fn qk_norm(&self) -> Option<(&Array, f32)> {
        self.norm.as_ref().map(|n| (n.both.weight(), n.both.eps()))
    }

    pub(crate) fn is_quantized(&self) -> bool {
        self.qkv.is_quantized()
    }

    /// `x` (`[B, L, hidden]`, normalized) through attention over the cache,
    /// whose layer `layer` receives the new keys and values; `rope` rotates
    /// this pass's positions.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<C: KvStore>(
        &self,
        c: &ModelConfig,
        x: &Array,
        cache: &mut C,
        layer: usize,
        mask: &AttentionMask,
        rope: &Rope,
        workers: Workers,
    ) -> Result<Array> {
        let (b, l) = (x.dim(0), x.dim(1));
        let (nq, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        // [B, L, nq + 2 nkv, hd]: query heads, then key heads, then value heads.
        let heads = self
            .qkv
            .forward(x, workers)?
            .reshape(&[b, l, nq + 2 * nkv, hd])?;
        let heads_first = |y: Array| y.transpose_axes(&[0, 2, 1, 3]);
        // Queries stay `[B, L, nq, hd]` on a CPU stream (see `unmasked_on_cpu`).
        let (q, k) = match rope {
            Rope::Table { .. } => {
                let qk = heads.index((.., .., ..nq + nkv, ..));
                let fused = rope.rotate_normed(
                    &qk,
                    self.norm.as_ref().map(|n| (n.both.weight(), n.both.eps())),
                )?;
                let qk = match (fused, &self.norm) {
                    (Some(qk), _) => qk,
                    (None, Some(n)) => rope.rotate_heads_last(&n.both.forward(&qk, true)?)?,
                    (None, None) => rope.rotate_heads_last(&qk)?,
                };
                (
                    qk.index((.., .., ..nq, ..)),
                    heads_first(qk.index((.., .., nq.., ..)))?,
                )
            }
            Rope::Fused { .. } => {
                let q = heads.index((.., .., ..nq, ..));
                let k = heads.index((.., .., nq..nq + nkv, ..));
                let (q, k) = match &self.norm {
                    Some(n) => (
                        rms_norm(&q, Some(&n.q), eps)?,
                        rms_norm(&k, Some(&n.k), eps)?,
                    ),
                    None => (q, k),
                };
                (
                    rope.rotate_heads_first(c, &heads_first(q)?)?,
                    rope.rotate_heads_first(c, &heads_first(k)?)?,
                )
            }
        };
        let v = heads_first(heads.index((.., .., nq + nkv.., ..)))?;
        let (keys, values) = match cache.update(layer, &k, &v)? {
            KvView::Dense(keys, values) => (keys, values),
            KvView::Quantized {
                keys,
                values,
                quant,
            } => {
                // A causal prompt chunk on a CPU stream: the cache
                // dequantized (the values mlx-lm's products take) through
                // our prompt attention node.
                let prompt = l > 1 && matches!(mask, AttentionMask::Causal);
                if prompt
                    && matches!(rope, Rope::Table { .. })
                    && crate::runtime::device::on_cpu_stream()
                {
                    let dense =
                        |[w, s, b]: &[Array; 3]| dequantize(w, s, b, quant.group_size, quant.bits);
                    let (k, v) = (dense(&keys)?, dense(&values)?);
                    if let Some(out) = self.on_cpu(c, &q, &k, &v, true, Ok)? {
                        return self.o.forward(&out, workers);
                    }
                }
                let q = match rope {
                    Rope::Table { .. } => heads_first(q)?,
                    Rope::Fused { .. } => q,
                };
                let out = attend_quantized(&q, &keys, &values, quant, mask)?
                    .transpose_axes(&[0, 2, 1, 3])?
                    .reshape(&[b, l, nq * hd])?;
                return self.o.forward(&out, workers);
            }
        };
        // A cache of another dtype than the pass's (`kv_dtype`) is read in
        // the pass's: by the prompt attention kernel as stored, elsewhere
        // through a float32 copy.
        let as_pass = |a: Array| -> Result<Array> {
            Ok(if a.dtype() == v.dtype() {
                a
            } else {
                a.as_dtype(v.dtype())?
            })
        };
        let q = match rope {
            Rope::Table { .. }
                if matches!(mask, AttentionMask::None)
                    || (matches!(mask, AttentionMask::Causal) && l > 1) =>
            {
                // Without our prompt attention (another dtype, kernels off),
                // MLX's attention with its mask below.
                let causal = matches!(mask, AttentionMask::Causal);
                match self.on_cpu(c, &q, &keys, &values, causal, as_pass)? {
                    Some(out) => return self.o.forward(&out, workers),
                    None => heads_first(q)?,
                }
            }
            Rope::Table { .. } => heads_first(q)?,
            Rope::Fused { .. } => q,
        };
        let (keys, values) = (as_pass(keys)?, as_pass(values)?);
        let out = attend(&q, &keys, &values, mask)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, nq * hd])?;
        self.o.forward(&out, workers)
    }

    /// MLX's attention without a mask, or with a causal one, as its CPU path
    /// computes it (scale the queries, scores, masked precise softmax,
    /// weighted values), with each key head's query heads folded into the
    /// rows of one product rather than a product per query head: `q`
    /// `[B, L, nq, hd]`, `keys`/`values` `[B, nkv, S, hd]` (the cache's
    /// dtype; `as_pass` gives the pass's) -> `[B, L, nq * hd]`. One token
    /// needs no transposes. A causal prompt chunk is our kernel's one node,
    /// which reads the cache where it lies, float16 included.
    fn on_cpu(
        &self,
        c: &ModelConfig,
        q: &Array,
        keys: &Array,
        values: &Array,
        causal: bool,
        as_pass: impl Fn(Array) -> Result<Array>,
    ) -> Result<Option<Array>> {
        let (b, l) = (q.dim(0), q.dim(1));
        let (nq, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let folded = [b, nkv, (nq / nkv) * l, hd];
        let q = if l == 1 {
            q.reshape(&folded)?
        } else {
            q.transpose_axes(&[0, 2, 1, 3])?.reshape(&folded)?
        };
        let q = if q.shape() == self.scale_step.shape() {
            self.scale_step.multiply(&q)?
        } else {
            self.scale.multiply(&q)?
        };
        let out = if causal {
            let attended = emlx_axon_kernels::prompt_attention(&q, keys, values, l)
                .map_err(|e| crate::error::Error::Mlx(e.to_string()))?;
            match attended {
                Some(out) => out,
                None => return Ok(None),
            }
        } else {
            let (keys, values) = (as_pass(keys.clone())?, as_pass(values.clone())?);
            let scores = matmul(&q, keys.swap_axes(-1, -2)?)?;
            matmul(&softmax_axis(&scores, -1, true)?, values)?
        };
        Ok(Some(if l == 1 {
            out.reshape(&[b, 1, nq * hd])?
        } else {
            out.reshape(&[b, nq, l, hd])?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, nq * hd])?
        }))
    }
}

/// Attention over a quantized cache as mlx-lm computes it
/// (`quantized_scaled_dot_product_attention`): the scaled queries, each
/// key head's query heads side by side, times the quantized keys, masked
/// with the dtype's lowest value, a precise softmax, times the quantized
/// values. `q` `[B, heads, L, head_dim]`, `keys`/`values` `[packed, scales,
/// biases]` of `[B, kv_heads, S, ...]`: `[B, heads, L, head_dim]`.
pub(crate) fn attend_quantized(
    q: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    quant: KvQuant,
    mask: &AttentionMask,
) -> Result<Array> {
    let (b, nq, l, hd) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
    let nkv = keys[0].dim(1);
    let repeats = nq / nkv;
    let scale = Array::from_f32((hd as f32).powf(-0.5)).as_dtype(q.dtype())?;
    let mut q = q.multiply(&scale)?;
    let grouped = |a: &Array| -> Result<Array> {
        Ok(if repeats > 1 {
            expand_dims(a, -3)?
        } else {
            a.clone()
        })
    };
    let (kw, ks, kb) = (grouped(&keys[0])?, grouped(&keys[1])?, grouped(&keys[2])?);
    let (vw, vs, vb) = (
        grouped(&values[0])?,
        grouped(&values[1])?,
        grouped(&values[2])?,
    );
    if repeats > 1 {
        q = q.reshape(&[b, nkv, repeats, l, hd])?;
    }
    let (gs, bits) = (quant.group_size, quant.bits);
    // A prompt's rows on a CPU stream: MLX's CPU quantized product takes
    // many rows slowly (minutes for a 2,048-token prompt's later chunks on
    // 2 cores), so the cache is dequantized, to the same values, for
    // float products; one-token steps keep the quantized products (or the
    // CPU layer nodes).
    let dense = l > 1 && crate::runtime::device::on_cpu_stream();
    let scores = if dense {
        let k = dequantize(&kw, &ks, &kb, gs, bits)?;
        matmul(&q, k.swap_axes(-1, -2)?)?
    } else {
        quantized_matmul(&q, &kw, &ks, &kb, true, gs, bits)?
    };
    let s = scores.dim(-1);
    let allowed = match mask {
        AttentionMask::None => None,
        AttentionMask::Causal => Some(causal_mask(s - l, l, None)?),
        AttentionMask::Array(m) | AttentionMask::Ranges(m) => {
            Some(if repeats > 1 && m.ndim() > 3 {
                expand_dims(m, -3)?
            } else {
                m.clone()
            })
        }
    };
    let scores = match allowed {
        Some(m) if m.dtype() == mlx_rs::Dtype::Bool => {
            select(&m, &scores, lowest(scores.dtype())?)?
        }
        Some(m) => scores.add(&m)?,
        None => scores,
    };
    let weights = softmax_axis(&scores, -1, true)?;
    let out = if dense {
        matmul(&weights, dequantize(&vw, &vs, &vb, gs, bits)?)?
    } else {
        quantized_matmul(&weights, &vw, &vs, &vb, false, gs, bits)?
    };
    Ok(if repeats > 1 {
        out.reshape(&[b, nq, l, hd])?
    } else {
        out
    })
}

/// The lowest finite value of `dtype` (NumPy's `finfo(dtype).min`), which
/// masked scores take.
fn lowest(dtype: mlx_rs::Dtype) -> Result<Array> {
    Ok(match dtype {
        mlx_rs::Dtype::Float16 => Array::from_f32(-65504.0).as_dtype(dtype)?,
        mlx_rs::Dtype::Bfloat16 => Array::from_f32(-3.389_531_4e38).as_dtype(dtype)?,
        _ => Array::from_f32(f32::MIN).as_dtype(dtype)?,
    })
}

/// Attention of queries `[B, heads, L, head_dim]` over `keys`/`values`
/// `[B, kv_heads, S, head_dim]` under `mask`: `[B, heads, L, head_dim]`.
pub(crate) fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    mask: &AttentionMask,
) -> Result<Array> {
    let scale = (q.dim(-1) as f32).powf(-0.5);
    Ok(match mask {
        AttentionMask::None => scaled_dot_product_attention(q, keys, values, scale, None, None)?,
        AttentionMask::Causal => scaled_dot_product_attention(
            q,
            keys,
            values,
            scale,
            ScaledDotProductAttentionMask::Causal,
            None,
        )?,
        AttentionMask::Array(m) | AttentionMask::Ranges(m) => {
            scaled_dot_product_attention(q, keys, values, scale, m, None)?
        }
    })
}
