//! Qwen3 and Qwen2 decoder-only transformers (the two differ only in their
//! attention: see [`crate::attention`]), following mlx-lm's models/qwen3.py
//! and qwen2.py.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::{multiply, sigmoid};
use mlx_rs::{Array, Dtype};

use crate::attention::Attention;
pub use crate::attention::AttentionMask;
use crate::cache::KvStore;
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
        let d = c.hidden_size;
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
            let attn = Attention::load(&mut weights, c, &p, &plan, dtype, ways)?;
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
            all.extend(b.attn.arrays());
            for l in [&b.mlp.gate, &b.mlp.up, &b.mlp.down] {
                all.extend(l.arrays());
            }
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
        self.embed.is_quantized() || self.blocks.iter().any(|b| b.attn.is_quantized())
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
            let r = block.attn.forward(
                c,
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
}
