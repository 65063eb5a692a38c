//! Grouped-query self-attention of Qwen2 and Qwen3 (the two differ only in
//! q/k RMSNorm versus q/k/v bias), following mlx-lm's models/qwen3.py and
//! qwen2.py.

use mlx_rs::fast::{
    rms_norm, rope, rope_dynamic, scaled_dot_product_attention, ScaledDotProductAttentionMask,
};
use mlx_rs::{Array, Dtype};

use crate::cache::{KvStore, RopeOffset};
use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use crate::layers::{Linear, LoadPlan, Workers};
use crate::weights::Weights;

pub enum AttentionMask {
    None,
    Causal,
    Array(Array),
}

pub(crate) struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
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
        let qkv_bias = c.arch == Arch::Qwen2;
        let mut linear = |name: &str, i: i32, o: i32, bias: bool| {
            let path = format!("{prefix}.self_attn.{name}");
            Linear::load(weights, &path, i, o, bias, plan(&path), ways)
        };
        let q = linear("q_proj", d, c.num_heads * hd, qkv_bias)?;
        let k = linear("k_proj", d, c.num_kv_heads * hd, qkv_bias)?;
        let v = linear("v_proj", d, c.num_kv_heads * hd, qkv_bias)?;
        let o = linear("o_proj", c.num_heads * hd, d, false)?;
        let mut norm = |name: &str| -> Result<Option<Array>> {
            match c.arch {
                Arch::Qwen3 => Ok(Some(
                    weights
                        .take(&format!("{prefix}.self_attn.{name}.weight"), Some(&[hd]))?
                        .as_dtype(dtype)?,
                )),
                Arch::Qwen2 => Ok(None),
            }
        };
        let q_norm = norm("q_norm")?;
        let k_norm = norm("k_norm")?;
        Ok(Attention {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
        })
    }

    pub(crate) fn arrays(&self) -> Vec<&Array> {
        let mut all = Vec::new();
        for l in [&self.q, &self.k, &self.v, &self.o] {
            all.extend(l.arrays());
        }
        all.extend(self.q_norm.iter().chain(self.k_norm.iter()));
        all
    }

    pub(crate) fn is_quantized(&self) -> bool {
        self.q.is_quantized()
    }

    /// `x` (`[B, L, hidden]`, normalized) through attention over the cache,
    /// whose layer `layer` receives the new keys and values.
    pub(crate) fn forward<C: KvStore>(
        &self,
        c: &ModelConfig,
        x: &Array,
        cache: &mut C,
        layer: usize,
        mask: &AttentionMask,
        workers: Workers,
    ) -> Result<Array> {
        let a = self;
        let (b, l) = (x.dim(0), x.dim(1));
        let heads = |y: Array, n: i32, norm: &Option<Array>| -> Result<Array> {
            let y = y.reshape(&[b, l, n, c.head_dim])?;
            let y = match norm {
                Some(w) => rms_norm(&y, Some(w), c.rms_norm_eps)?,
                None => y,
            };
            Ok(y.transpose_axes(&[0, 2, 1, 3])?)
        };
        let offset = cache.rope_offset();
        let rotate = |y: &Array| match &offset {
            RopeOffset::Scalar(offset) => rope(
                y,
                c.head_dim,
                c.rope_traditional,
                c.rope_theta,
                c.rope_scale,
                *offset,
                None,
            ),
            RopeOffset::PerRow(offsets) => rope_dynamic(
                y,
                c.head_dim,
                c.rope_traditional,
                c.rope_theta,
                c.rope_scale,
                offsets,
                None,
            ),
        };
        let q = rotate(&heads(a.q.forward(x, workers)?, c.num_heads, &a.q_norm)?)?;
        let k = rotate(&heads(a.k.forward(x, workers)?, c.num_kv_heads, &a.k_norm)?)?;
        let v = heads(a.v.forward(x, workers)?, c.num_kv_heads, &None)?;
        let (keys, values) = cache.update(layer, &k, &v)?;
        let scale = (c.head_dim as f32).powf(-0.5);
        let out = match mask {
            AttentionMask::None => {
                scaled_dot_product_attention(&q, &keys, &values, scale, None, None)?
            }
            AttentionMask::Causal => scaled_dot_product_attention(
                &q,
                &keys,
                &values,
                scale,
                ScaledDotProductAttentionMask::Causal,
                None,
            )?,
            AttentionMask::Array(m) => {
                scaled_dot_product_attention(&q, &keys, &values, scale, m, None)?
            }
        };
        let out = out
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, l, c.num_heads * c.head_dim])?;
        a.o.forward(&out, workers)
    }
}
