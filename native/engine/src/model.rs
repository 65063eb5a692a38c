//! Qwen3 and Qwen2 decoder-only transformers (the two differ only in q/k
//! RMSNorm versus q/k/v bias), following mlx-lm's models/qwen3.py and qwen2.py.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_rs::fast::{
    rms_norm, rope, rope_dynamic, scaled_dot_product_attention, ScaledDotProductAttentionMask,
};
use mlx_rs::ops::{multiply, sigmoid};
use mlx_rs::{Array, Dtype};

use crate::cache::{KvStore, RopeOffset};
use crate::config::{add_missing, generation_eos_ids, Arch, ModelConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::layers::{Embedding, Linear, LoadPlan, Workers};
use crate::weights::Weights;

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute dtype; default float32 on CPU (MLX's CPU bf16 is ~10x slower),
    /// bfloat16 on GPU.
    pub dtype: Option<Dtype>,
    /// Quantize dense weights while loading.
    pub quantize: Option<QuantSpec>,
    /// Split projections across CPU worker streams (default: on when the
    /// model runs on the CPU and there is more than one core).
    pub cpu_parallel: Option<bool>,
    /// Refuse checkpoint tensors the model does not use, as mlx-lm's
    /// `load_model(strict=True)` does (default true).
    pub strict: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: None,
            quantize: None,
            cpu_parallel: None,
            strict: true,
        }
    }
}

pub enum AttentionMask {
    None,
    Causal,
    Array(Array),
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Array>,
    k_norm: Option<Array>,
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Block {
    attn: Attention,
    mlp: Mlp,
    input_norm: Array,
    post_norm: Array,
}

pub struct Model {
    pub config: ModelConfig,
    pub dtype: Dtype,
    pub path: PathBuf,
    pub load_ms: f64,
    pub weight_bytes: usize,
    /// Quantization applied at load, if any.
    pub quantized_at_load: Option<QuantSpec>,
    /// Row blocks per projection: a forward pass given this many CPU worker
    /// streams runs each projection's blocks in parallel.
    pub parallel_ways: usize,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: Array,
    lm_head: Option<Linear>,
}

// SAFETY: after loading, every array of the model is evaluated and only ever
// read as a graph input; MLX arrays are reference counted with atomic counts,
// so sharing them between threads (each running its own stream) is sound.
unsafe impl Sync for Model {}

pub fn default_dtype() -> Dtype {
    if crate::device::gpu_available() {
        Dtype::Bfloat16
    } else {
        Dtype::Float32
    }
}

impl Model {
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let started = Instant::now();
        if !dir.is_dir() {
            return Err(Error::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "checkpoint folder not found"),
            ));
        }
        let mut config = ModelConfig::from_file(&dir.join("config.json"))?;
        add_missing(&mut config.eos_token_ids, generation_eos_ids(dir)?);
        if config.quantization.is_some() && options.quantize.is_some() {
            return Err(Error::invalid(
                "the checkpoint is already quantized; drop the quantize option",
            ));
        }
        let dtype = options.dtype.unwrap_or_else(default_dtype);
        if !matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
            return Err(Error::invalid(format!(
                "compute dtype must be float32, float16 or bfloat16, got {dtype:?}"
            )));
        }
        let mut weights = Weights::load_dir(dir)?;
        let weight_bytes = weights.bytes;
        let c = &config;
        let plan = |path: &str| LoadPlan {
            stored: c.quantization.as_ref().map(|q| q.for_module(path)),
            at_load: options.quantize,
            dtype,
        };
        let norm = |w: &mut Weights, name: &str, dim: i32| -> Result<Array> {
            Ok(w.take(name, Some(&[dim]))?.as_dtype(dtype)?)
        };

        let on_cpu = crate::device::DeviceKind::default_kind() == crate::device::DeviceKind::Cpu;
        let ways = if options.cpu_parallel.unwrap_or(on_cpu) {
            crate::device::cpu_parallelism()
        } else {
            1
        };
        let (d, hd) = (c.hidden_size, c.head_dim);
        let tied_ways = if c.tie_word_embeddings { ways } else { 1 };
        let embed = Embedding::load(
            &mut weights,
            "model.embed_tokens",
            c.vocab_size,
            d,
            plan("model.embed_tokens"),
            tied_ways,
        )?;
        // Not `with_capacity(num_layers)`: the count comes from config.json,
        // and an absurd one must end in a missing tensor, not an abort.
        let mut blocks = Vec::new();
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let linear = |w: &mut Weights, name: &str, i: i32, o: i32, bias: bool| {
                let path = format!("{p}.{name}");
                Linear::load(w, &path, i, o, bias, plan(&path), ways)
            };
            let qkv_bias = c.arch == Arch::Qwen2;
            let attn = Attention {
                q: linear(
                    &mut weights,
                    "self_attn.q_proj",
                    d,
                    c.num_heads * hd,
                    qkv_bias,
                )?,
                k: linear(
                    &mut weights,
                    "self_attn.k_proj",
                    d,
                    c.num_kv_heads * hd,
                    qkv_bias,
                )?,
                v: linear(
                    &mut weights,
                    "self_attn.v_proj",
                    d,
                    c.num_kv_heads * hd,
                    qkv_bias,
                )?,
                o: linear(&mut weights, "self_attn.o_proj", c.num_heads * hd, d, false)?,
                q_norm: match c.arch {
                    Arch::Qwen3 => Some(norm(
                        &mut weights,
                        &format!("{p}.self_attn.q_norm.weight"),
                        hd,
                    )?),
                    Arch::Qwen2 => None,
                },
                k_norm: match c.arch {
                    Arch::Qwen3 => Some(norm(
                        &mut weights,
                        &format!("{p}.self_attn.k_norm.weight"),
                        hd,
                    )?),
                    Arch::Qwen2 => None,
                },
            };
            let mlp = Mlp {
                gate: linear(&mut weights, "mlp.gate_proj", d, c.intermediate_size, false)?,
                up: linear(&mut weights, "mlp.up_proj", d, c.intermediate_size, false)?,
                down: linear(&mut weights, "mlp.down_proj", c.intermediate_size, d, false)?,
            };
            blocks.push(Block {
                attn,
                mlp,
                input_norm: norm(&mut weights, &format!("{p}.input_layernorm.weight"), d)?,
                post_norm: norm(
                    &mut weights,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                )?,
            });
        }
        let final_norm = norm(&mut weights, "model.norm.weight", d)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(
                &mut weights,
                "lm_head",
                d,
                c.vocab_size,
                false,
                plan("lm_head"),
                ways,
            )?)
        };
        // What mlx-lm's `sanitize` drops before its strict load: a tied
        // model's stray output projection, Qwen2's precomputed RoPE table.
        if c.tie_word_embeddings {
            weights.discard(|name| name == "lm_head.weight");
        }
        if c.arch == Arch::Qwen2 {
            weights.discard(|name| name.contains("self_attn.rotary_emb.inv_freq"));
        }
        let unexpected = weights.remaining();
        if options.strict && !unexpected.is_empty() {
            return Err(Error::UnexpectedTensors(unexpected));
        }
        let model = Model {
            quantized_at_load: options.quantize,
            config,
            dtype,
            path: dir.to_path_buf(),
            load_ms: 0.0,
            weight_bytes,
            parallel_ways: ways,
            embed,
            blocks,
            norm: final_norm,
            lm_head,
        };
        // Converting or quantizing the weights allocates their final form
        // while the loaded tensors are still held.
        crate::memory::ensure_fits(
            Some(crate::memory::unevaluated_bytes(model.arrays())),
            "converting the weights",
        )?;
        // Materialize everything now: loading errors surface here rather than
        // mid-generation, and later readers only see evaluated arrays.
        mlx_rs::transforms::eval(model.arrays())?;
        Ok(Model {
            load_ms: started.elapsed().as_secs_f64() * 1e3,
            ..model
        })
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = self.embed.arrays();
        for b in &self.blocks {
            let a = &b.attn;
            for l in [&a.q, &a.k, &a.v, &a.o, &b.mlp.gate, &b.mlp.up, &b.mlp.down] {
                all.extend(l.arrays());
            }
            all.extend(a.q_norm.iter().chain(a.k_norm.iter()));
            all.push(&b.input_norm);
            all.push(&b.post_norm);
        }
        all.push(&self.norm);
        if let Some(h) = &self.lm_head {
            all.extend(h.arrays());
        }
        all
    }

    /// Whether any layer holds quantized weights.
    pub fn is_quantized(&self) -> bool {
        self.embed.is_quantized() || self.blocks.iter().any(|b| b.attn.q.is_quantized())
    }

    /// Runs `ids` (`[B, L]` int32) through the model, writing keys and values
    /// into `cache` at its offset. Returns logits `[B, L, vocab]`, or
    /// `[B, 1, vocab]` for the last position only when `last_only`.
    pub fn forward<C: KvStore>(
        &self,
        ids: &Array,
        cache: &mut C,
        mask: &AttentionMask,
        last_only: bool,
        workers: Workers,
    ) -> Result<Array> {
        let c = &self.config;
        let mut h = self.embed.forward(ids)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let r = self.attention(
                &block.attn,
                &rms_norm(&h, Some(&block.input_norm), c.rms_norm_eps)?,
                cache,
                i,
                mask,
                workers,
            )?;
            h = h.add(&r)?;
            let x = rms_norm(&h, Some(&block.post_norm), c.rms_norm_eps)?;
            let gate = block.mlp.gate.forward(&x, workers)?;
            let act = multiply(
                multiply(&gate, sigmoid(&gate)?)?,
                block.mlp.up.forward(&x, workers)?,
            )?;
            h = h.add(&block.mlp.down.forward(&act, workers)?)?;
        }
        cache.advance(ids.dim(1));
        if last_only {
            let l = h.dim(1);
            h = mlx_rs::ops::indexing::IndexOp::index(&h, (.., (l - 1).., ..));
        }
        let h = rms_norm(&h, Some(&self.norm), c.rms_norm_eps)?;
        match &self.lm_head {
            Some(head) => head.forward(&h, workers),
            None => self.embed.as_linear(&h, workers),
        }
    }

    fn attention<C: KvStore>(
        &self,
        a: &Attention,
        x: &Array,
        cache: &mut C,
        layer: usize,
        mask: &AttentionMask,
        workers: Workers,
    ) -> Result<Array> {
        let c = &self.config;
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
