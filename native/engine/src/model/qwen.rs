//! Qwen3, Qwen2 and Qwen3-MoE decoder-only transformers (Qwen3 and Qwen2
//! differ only in their attention: see [`crate::nn::attention`]; Qwen3-MoE
//! is Qwen3 with routed experts in place of some MLPs: see
//! [`crate::nn::moe`]), following mlx-lm's models/qwen3.py, qwen2.py and
//! qwen3_moe.py.

use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_rs::{Array, Dtype};

use crate::backend::{cuda, declined, note, Path as Ran, Work};
use crate::checkpoint::config::{add_missing, generation_eos_ids, Arch, ModelConfig, QuantSpec};
use crate::checkpoint::weights::{Join, Weights};
use crate::error::{Error, Result};
use crate::kv::cache::{KvShape, KvStore};
use crate::nn::attention::{Attention, AttentionMask};
use crate::nn::block::{Block, Ffn, Mlp};
use crate::nn::layers::{Embedding, Linear, LinearGroup, LoadPlan, Member, RmsNorm, Workers};
use crate::nn::moe::{expert_joins, SparseMoe};
use crate::nn::rope::Rope;

/// Layers of a multi-token forward per commit on a CUDA GPU: about 80 of
/// MLX's nodes, close to the size MLX itself would launch graphs at.
const COMMIT_LAYERS: usize = 4;

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

/// Which positions' logits a forward pass returns.
enum Take<'a> {
    All,
    Last,
    At(&'a Array),
}

/// `h`'s positions that the logits are asked for.
fn take_rows(h: Array, take: Take) -> Result<Array> {
    Ok(match take {
        Take::All => h,
        Take::Last => {
            let l = h.dim(1);
            mlx_rs::ops::indexing::IndexOp::index(&h, (.., (l - 1).., ..))
        }
        Take::At(at) => {
            let at = at.reshape(&[at.dim(0), 1, 1])?;
            h.take_along_axis(&at, 1)?
        }
    })
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
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// What RoPE on a CPU stream turns into its cosines and sines.
    rope_probe: Array,
    /// One-token GPU steps' rotations, read by the layer kernels.
    step_rope: crate::nn::rope::PositionTable,
    /// Set once a one-token step of this model was found to hold nodes that
    /// are not our kernels, so that no later generation records one again.
    pub(crate) steps_not_replayable: std::sync::atomic::AtomicBool,
}

// SAFETY: after loading, every array of the model is evaluated and only ever
// read as a graph input; MLX arrays are reference counted with atomic counts,
// so sharing them between threads (each running its own stream) is sound.
unsafe impl Sync for Model {}

/// Why a MoE model's layers are not fused.
const MOE_DECLINED: &str = "cpu_layers: routed experts (MoE) that are not quantized, or whose \
     router is not, run as separate nodes; the CPU layer nodes take quantized experts only";

const MOE_PROMPT_DECLINED: &str = "cuda_prompt: routed experts (MoE) run MLX's ops in prompts; \
     the prompt kernels take dense MLPs only";

/// A layer's gate and up projections, read stacked.
fn gate_up_join() -> Join {
    Join {
        name: "mlp.gate_up_proj".into(),
        members: vec!["mlp.gate_proj".into(), "mlp.up_proj".into()],
    }
}

pub fn default_dtype() -> Dtype {
    if crate::runtime::device::gpu_available() {
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
        let mut joins = vec![crate::nn::attention::qkv_join(), gate_up_join()];
        if let Some(moe) = &config.moe {
            joins.extend(expert_joins(moe));
        }
        let mut weights = Weights::load_dir(dir, &joins)?;
        let weight_bytes = weights.bytes;
        let c = &config;
        let plan = |path: &str| LoadPlan {
            stored: c.quantization.as_ref().map(|q| q.for_module(path)),
            at_load: options.quantize,
            dtype,
        };
        let norm = |w: &mut Weights, name: &str, dim: i32| -> Result<RmsNorm> {
            let weight = w.take(name, Some(&[dim]))?;
            crate::runtime::device::on_host(|| {
                RmsNorm::new(weight.as_dtype(dtype)?, c.rms_norm_eps)
            })
        };

        let on_cpu = crate::runtime::device::DeviceKind::default_kind()
            == crate::runtime::device::DeviceKind::Cpu;
        let ways = if options.cpu_parallel.unwrap_or(on_cpu) {
            crate::runtime::device::cpu_parallelism()
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
            let attn = Attention::load(&mut weights, c, &p, plan, dtype, ways)?;
            let mlp = match &c.moe {
                Some(moe) if moe.is_sparse(i) => {
                    Ffn::Sparse(SparseMoe::load(&mut weights, moe, &p, d, plan, ways)?)
                }
                _ => {
                    let join = gate_up_join().at(&p);
                    let member = |prefix| Member {
                        prefix,
                        out_dim: c.intermediate_size,
                        plan: plan(prefix),
                    };
                    Ffn::Dense(Mlp {
                        gate_up: LinearGroup::load(
                            &mut weights,
                            &join.name,
                            &[member(&join.members[0]), member(&join.members[1])],
                            d,
                            false,
                            ways,
                        )?,
                        down: linear(&mut weights, "mlp.down_proj", c.intermediate_size, d, false)?,
                    })
                }
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
        let (rope_probe, step_rope) = crate::runtime::device::on_host(|| -> Result<_> {
            Ok((
                crate::nn::rope::probe(c.head_dim, c.rope_traditional, dtype)?,
                crate::nn::rope::PositionTable::new(c)?,
            ))
        })?;
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
            rope_probe,
            step_rope,
            steps_not_replayable: Default::default(),
        };
        // Converting or quantizing the weights allocates their final form
        // while the loaded tensors are still held.
        crate::runtime::memory::ensure_fits(
            Some(crate::runtime::memory::unevaluated_bytes(model.arrays())),
            "converting the weights",
        )?;
        // Materialize everything now: loading errors surface here rather than
        // mid-generation, and later readers only see evaluated arrays.
        mlx_rs::transforms::eval(model.arrays())?;
        // Shared between threads from here on: every weight readable from
        // the host now, before any CPU stream reads one (device.rs says why).
        crate::runtime::device::share_with_host(&model.arrays())?;
        Ok(Model {
            load_ms: started.elapsed().as_secs_f64() * 1e3,
            ..model
        })
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = self.embed.arrays();
        for b in &self.blocks {
            all.extend(b.attn.arrays());
            all.extend(b.mlp.arrays());
            all.extend(b.input_norm.arrays());
            all.extend(b.post_norm.arrays());
        }
        all.extend(self.norm.arrays());
        all.extend([&self.rope_probe, self.step_rope.probe()]);
        if let Some(h) = &self.lm_head {
            all.extend(h.arrays());
        }
        all
    }

    /// What a KV cache for this model holds per position.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.config.num_layers,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            dtype: self.dtype,
        }
    }

    /// Whether any layer holds quantized weights.
    pub fn is_quantized(&self) -> bool {
        self.embed.is_quantized()
            || self.blocks.iter().any(|b| {
                b.attn.is_quantized() || matches!(&b.mlp, Ffn::Sparse(m) if m.is_quantized())
            })
    }

    /// Runs `ids` (`[B, L]` int32) through the model, writing keys and values
    /// into `cache` at its offset. Returns logits `[B, L, vocab]`, or
    /// `[B, 1, vocab]` for the last position only when `last_only`.
    ///
    /// On a CUDA GPU a one-token step's layer kernels write its keys and
    /// values into the cache's buffers in place, as the step's output is
    /// evaluated: evaluate the output (a generation reads each step's
    /// token) before the cache's contents are read or the next pass is
    /// evaluated.
    pub fn forward<C: KvStore>(
        &self,
        ids: &Array,
        cache: &mut C,
        mask: &AttentionMask,
        last_only: bool,
        workers: Workers,
    ) -> Result<Array> {
        let cpu = crate::runtime::device::on_cpu_stream();
        let take = if last_only { Take::Last } else { Take::All };
        self.forward_ops(ids, cache, mask, take, workers, cpu)
    }

    /// [`Model::forward`] returning the logits `[B, 1, vocab]` of one position
    /// per row, `at` (`[B]` int32): the last token of right-padded prompts.
    pub fn forward_at<C: KvStore>(
        &self,
        ids: &Array,
        cache: &mut C,
        mask: &AttentionMask,
        at: &Array,
        workers: Workers,
    ) -> Result<Array> {
        let cpu = crate::runtime::device::on_cpu_stream();
        self.forward_ops(ids, cache, mask, Take::At(at), workers, cpu)
    }

    /// [`Model::forward`] with MLX's fast ops expanded by hand for a CPU
    /// stream (`cpu_ops`) or not (what a GPU runs; tests compare the two).
    fn forward_ops<C: KvStore>(
        &self,
        ids: &Array,
        cache: &mut C,
        mask: &AttentionMask,
        take: Take,
        workers: Workers,
        cpu_ops: bool,
    ) -> Result<Array> {
        let c = &self.config;
        // The sampling kernel reads only this pass's step positions.
        cuda::layer::forget_step_positions();
        // One-token steps: a node per layer on a CPU stream, five on a CUDA
        // GPU (eight with MLX's products), where the kernels take the model.
        let step_rows = match mask {
            AttentionMask::None | AttentionMask::Ranges(_)
                if ids.dim(1) == 1 && (cpu_ops || cuda::layer::wanted()) =>
            {
                cache.step_rows()
            }
            _ => None,
        };
        // Routed experts: the CPU layer nodes and the CUDA prompt kernels
        // take dense MLPs only (the CUDA step's layers take experts).
        let sparse = self.has_experts();
        if sparse && !cpu_ops && ids.dim(1) > 1 && cuda::layer::wanted() {
            declined(MOE_PROMPT_DECLINED);
        }
        // A quantized cache or a rotating window has no dense buffers for
        // the CUDA layers; the CPU layer nodes read a quantized cache's
        // (they have step rows), not a window's.
        let no_buffers = cache.no_buffers();
        let unread = if cpu_ops {
            step_rows.is_none()
        } else {
            cuda::layer::wanted()
        };
        if let Some(why) = no_buffers.filter(|_| unread) {
            declined(&format!("layers: {why}"));
        }
        if let (Some(rows), false, None) = (&step_rows, cpu_ops, no_buffers) {
            let stack = cuda::layer::Stack {
                embed: self.embed.quantized(),
                blocks: &self.blocks,
                final_norm: &self.norm,
                head: self.quantized_head(),
            };
            let tokens = cuda::layer::Tokens {
                ids,
                dtype: self.dtype,
                embed: &|| self.embed.forward(ids),
            };
            let out = cuda::layer::forward(c, stack, &tokens, cache, rows, &self.step_rope)?;
            if out.is_none() {
                declined(if cuda::layer::checked() == Some(false) {
                    "cuda_layers: the kernels failed their check on this device (see the notices)"
                } else {
                    "cuda_layers: the kernels do not take this model, dtype or step"
                });
            }
            if let Some(out) = out {
                note(Work::Decode, Ran::CudaLayers, None);
                cache.advance(1);
                return match out {
                    cuda::layer::Output::Logits(logits) => Ok(logits),
                    cuda::layer::Output::Normed(x) => self.head(&x, workers),
                };
            }
        }
        let mut h = self.embed.forward(ids)?;
        // Every layer rotates the same positions.
        let rope = Rope::new(
            c,
            cache.rope_offset(),
            ids.dim(0),
            ids.dim(1),
            c.num_heads + c.num_kv_heads,
            &self.rope_probe,
            cpu_ops,
        )?;
        // A multi-token forward on a GPU is committed every few layers, so
        // that the device starts on the first layers while the host encodes
        // the rest (MLX's graphs are sized for whole one-token steps, see
        // `device::prepare_mlx`).
        let commit_every =
            (ids.dim(1) > 1 && !cpu_ops && !cfg!(feature = "metal")).then_some(COMMIT_LAYERS);
        if ids.dim(1) > 1 && !cpu_ops && !sparse && no_buffers.is_none() {
            let prompt = cuda::prefill::Prompt {
                config: c,
                blocks: &self.blocks,
                final_norm: &self.norm,
                table: &self.step_rope,
                mask,
                commit_every,
            };
            let mut attend = |x: &Array, block: &Block, i: usize, cache: &mut C| {
                block.attn.forward(c, x, cache, i, mask, &rope, workers)
            };
            if let Some(x) = cuda::prefill::layers(&prompt, &h, cache, &mut attend)? {
                note(Work::Prefill, Ran::CudaLayers, None);
                cache.advance(ids.dim(1));
                return self.head(&take_rows(x, take)?, workers);
            }
            if cuda::layer::wanted() && cuda::prefill::wanted() {
                declined(if cuda::prefill::checked() == Some(false) {
                    "cuda_prompt: the prompt kernels failed their check on this device (see the notices)"
                } else {
                    "cuda_prompt: the prompt kernels do not take this model, dtype or cache"
                });
            }
        }
        let mut cpu_layers = 0;
        for (i, block) in self.blocks.iter().enumerate() {
            if commit_every.is_some_and(|n| i > 0 && i % n == 0) {
                mlx_rs::transforms::async_eval([&h])?;
            }
            if let (Some(rows), true) = (&step_rows, cpu_ops) {
                if let Some(next) =
                    crate::backend::cpu::layer::forward(c, block, &h, cache, i, &rope, rows)?
                {
                    h = next;
                    cpu_layers += 1;
                    continue;
                }
            }
            let r = block.attn.forward(
                c,
                &block.input_norm.forward(&h, cpu_ops)?,
                cache,
                i,
                mask,
                &rope,
                workers,
            )?;
            h = h.add(&r)?;
            let x = block.post_norm.forward(&h, cpu_ops)?;
            h = h.add(&block.mlp.forward(&x, workers)?)?;
        }
        cache.advance(ids.dim(1));
        let work = if ids.dim(1) == 1 {
            Work::Decode
        } else {
            Work::Prefill
        };
        match (
            step_rows.is_some() && cpu_ops,
            cpu_layers == self.blocks.len(),
        ) {
            (true, true) => note(work, Ran::CpuLayers, None),
            (true, false) if sparse && !self.experts_quantized() => {
                note(work, Ran::Mlx, Some(MOE_DECLINED))
            }
            (true, false) => note(
                work,
                Ran::Mlx,
                Some("cpu_layers: the CPU kernels do not take every layer of this model or dtype"),
            ),
            _ => note(work, Ran::Mlx, None),
        }
        let h = self.norm.forward(&take_rows(h, take)?, cpu_ops)?;
        self.head(&h, workers)
    }

    /// Whether any layer routes its tokens to experts.
    fn has_experts(&self) -> bool {
        self.blocks.iter().any(|b| matches!(b.mlp, Ffn::Sparse(_)))
    }

    /// Whether every layer's experts and router are quantized.
    fn experts_quantized(&self) -> bool {
        self.blocks
            .iter()
            .filter_map(|b| b.mlp.sparse())
            .all(|moe| moe.quantized().is_some())
    }

    /// The output head's weight when quantized and without bias.
    fn quantized_head(&self) -> Option<emlx_axon_kernels::QuantWeight<'_>> {
        match &self.lm_head {
            Some(head) => match head.quantized()? {
                (w, None) => Some(w),
                _ => None,
            },
            None => self.embed.quantized(),
        }
    }

    /// Logits of the normalized hidden state `h`.
    fn head(&self, h: &Array, workers: Workers) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(h, workers),
            None => self.embed.as_linear(h, workers),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::cache::KvCache;
    use crate::runtime::device::{DeviceKind, Lease};

    /// As the integration tests find them: `EMLX_AXON_FIXTURES`, else the
    /// checkout's `.cache/fixtures`.
    fn fixture(name: &str) -> PathBuf {
        std::env::var_os("EMLX_AXON_FIXTURES")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/fixtures")
            })
            .join(name)
    }

    /// The CUDA step's products take a quantized Qwen3-MoE checkpoint's
    /// layers, its experts through the expert kernels (mlx-lm's layout:
    /// stacked experts, an 8-bit router, a dense layer among them), and not
    /// an unquantized one's.
    #[test]
    fn cuda_step_products_take_quantized_experts() {
        use crate::backend::cuda::layer::takes_experts_of;
        let options = LoadOptions {
            dtype: Some(Dtype::Float32),
            ..LoadOptions::default()
        };
        let quantized = Model::load(&fixture("qwen3-moe-4bit"), &options).unwrap();
        assert!(takes_experts_of(&quantized.blocks, Dtype::Float32));
        assert!(takes_experts_of(&quantized.blocks, Dtype::Bfloat16));
        let dense = Model::load(&fixture("qwen3-moe"), &options).unwrap();
        assert!(!takes_experts_of(&dense.blocks, Dtype::Float32));
    }

    /// Logits of a 5-token prompt and three decode steps after it.
    fn logits(model: &Model, cpu_ops: bool) -> Vec<Vec<f32>> {
        let mut cache = KvCache::new(&model.kv_shape(), 1, 16).unwrap();
        let mut out = Vec::new();
        let mut ids = Array::from_slice(&[3u32, 14, 15, 92, 6], &[1, 5]);
        let mut mask = AttentionMask::Causal;
        for step in 0..4u32 {
            let y = model
                .forward_ops(&ids, &mut cache, &mask, Take::All, &[], cpu_ops)
                .unwrap();
            let y = y.as_dtype(Dtype::Float32).unwrap();
            out.push(y.as_slice::<f32>().to_vec());
            ids = Array::from_slice(&[7 + step * 11], &[1, 1]);
            mask = AttentionMask::None;
        }
        out
    }

    /// The CPU's hand-expanded RMSNorm, RoPE, q/k norm and unmasked
    /// attention give exactly the logits of MLX's fast ops (on a CPU stream,
    /// their own expansion): Qwen3 with q/k norms, Qwen2 with biases and
    /// traditional RoPE, a dense checkpoint, bfloat16 compute. In float32
    /// our CPU kernels take the norms, RoPE and the prompt's softmax instead,
    /// with their own summation order and exp: the same logits to 1e-5.
    #[test]
    fn cpu_ops_give_the_fast_ops_logits() {
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        for (name, dtype) in [
            ("qwen3-4bit-g64", Dtype::Float32),
            ("qwen2-rope-traditional", Dtype::Float32),
            ("qwen3-bf16", Dtype::Float32),
            ("qwen3-4bit-g64", Dtype::Bfloat16),
        ] {
            lease.stream().run(|| {
                let options = LoadOptions {
                    dtype: Some(dtype),
                    cpu_parallel: Some(false),
                    ..LoadOptions::default()
                };
                let model = Model::load(&fixture(name), &options).unwrap();
                let (cpu, fast) = (logits(&model, true), logits(&model, false));
                let kernels = dtype == Dtype::Float32 && emlx_axon_kernels::enabled();
                for (step, (a, b)) in cpu.iter().zip(&fast).enumerate() {
                    if kernels {
                        let worst = crate::nn::layers::tests::relative_error(a, b);
                        assert!(worst < 1e-5, "{name} ({dtype:?}): step {step}: {worst}");
                    } else {
                        assert!(a == b, "{name} ({dtype:?}): step {step} differs");
                    }
                }
            });
        }
    }

    /// One-token steps on a CPU stream run each layer as two nodes of our
    /// kernels (see `crate::backend::cpu::layer`); an array mask with the same
    /// content keeps the separate nodes. Both give the same logits, for a
    /// batch-1 cache and for the scheduler's rows at different positions:
    /// Qwen3 at 0.6B widths with 8-bit group-32 down projections (threaded
    /// products), Qwen2 with q/k/v biases and traditional RoPE, and
    /// Qwen3-MoE with quantized experts (top 2 of 8, an 8-bit router, a
    /// dense layer among them).
    #[test]
    fn one_token_layer_nodes_give_the_separate_nodes_logits() {
        if !emlx_axon_kernels::enabled() {
            return;
        }
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        for name in ["qwen3-wide", "qwen2-rope-traditional", "qwen3-moe-4bit"] {
            lease.stream().run(|| {
                let options = LoadOptions {
                    dtype: Some(Dtype::Float32),
                    cpu_parallel: Some(false),
                    ..LoadOptions::default()
                };
                let model = Model::load(&fixture(name), &options).unwrap();
                let c = &model.config;
                let prompt = Array::from_slice(&[3u32, 14, 15, 92, 6], &[1, 5]);
                let prefilled = || {
                    let mut cache = KvCache::new(&model.kv_shape(), 1, 16).unwrap();
                    model
                        .forward_ops(
                            &prompt,
                            &mut cache,
                            &AttentionMask::Causal,
                            Take::All,
                            &[],
                            true,
                        )
                        .unwrap();
                    cache
                };

                // The layer nodes are taken for every layer of these models.
                let mut cache = prefilled();
                let rows = cache.step_rows().unwrap();
                let h = model
                    .embed
                    .forward(&Array::from_slice(&[7u32], &[1, 1]))
                    .unwrap();
                let rope = Rope::new(
                    c,
                    cache.rope_offset(),
                    1,
                    1,
                    c.num_heads + c.num_kv_heads,
                    &model.rope_probe,
                    true,
                )
                .unwrap();
                for (i, block) in model.blocks.iter().enumerate() {
                    let out = crate::backend::cpu::layer::forward(
                        c, block, &h, &mut cache, i, &rope, &rows,
                    )
                    .unwrap();
                    assert!(out.is_some(), "{name}: layer {i} was not taken");
                }

                let (batch_1, two_slots) = one_token_steps_both_ways(&model, true, 5);
                assert!(batch_1 < 1e-5, "{name}: batch 1: {batch_1}");
                assert!(two_slots < 1e-5, "{name}: two slots: {two_slots}");
            });
        }
    }

    /// Relative error between one-token steps that may take the layer nodes
    /// or kernels (no mask, or ranges) and the same steps built from MLX's
    /// separate ops (an array mask of the same content): batch 1 for three
    /// steps after a `prompt_len`-token prompt, then two slots at positions
    /// `prompt_len` and 3 (the second holding the first three prompt
    /// tokens), one step each.
    fn one_token_steps_both_ways(model: &Model, cpu_ops: bool, prompt_len: i32) -> (f32, f32) {
        use crate::kv::slots::SlotCache;
        let all_keys = |len: i32| {
            AttentionMask::Array(Array::from_slice(
                &vec![true; len as usize],
                &[1, 1, 1, len],
            ))
        };
        let logits = |y: Array| -> Vec<f32> {
            y.as_dtype(Dtype::Float32)
                .unwrap()
                .as_slice::<f32>()
                .to_vec()
        };
        let ids: Vec<u32> = [3u32, 14, 15, 92, 6]
            .into_iter()
            .chain((5..prompt_len as u32).map(|i| (i * 7919) % 151_000))
            .take(prompt_len as usize)
            .collect();
        let prompt = Array::from_slice(&ids, &[1, prompt_len]);
        let capacity = prompt_len + 11;
        let prefilled = || {
            let mut cache = KvCache::new(&model.kv_shape(), 1, capacity).unwrap();
            let mask = AttentionMask::Causal;
            model
                .forward_ops(&prompt, &mut cache, &mask, Take::All, &[], cpu_ops)
                .unwrap();
            cache
        };
        let batch_1 = |fused: bool| {
            let mut cache = prefilled();
            let mut all = Vec::new();
            for t in 0..3u32 {
                let ids = Array::from_slice(&[7 + t * 11], &[1, 1]);
                let mask = if fused {
                    AttentionMask::None
                } else {
                    all_keys(cache.offset() + 1)
                };
                let y = model
                    .forward_ops(&ids, &mut cache, &mask, Take::All, &[], cpu_ops)
                    .unwrap();
                all.extend(logits(y));
            }
            all
        };
        let two_slots = |fused: bool| {
            let full = prefilled();
            let mut slots = SlotCache::new(&model.kv_shape(), 2, capacity).unwrap();
            slots
                .write_prompt(0, &full.prefix(prompt_len).unwrap())
                .unwrap();
            slots.write_prompt(1, &full.prefix(3).unwrap()).unwrap();
            slots.set_positions(&[prompt_len, 3]).unwrap();
            let mask = match slots.key_ranges().unwrap() {
                Some(mask) if !fused => AttentionMask::Array(mask),
                Some(mask) => AttentionMask::Ranges(mask),
                None => AttentionMask::None,
            };
            let ids = Array::from_slice(&[7u32, 92], &[2, 1]);
            let y = model
                .forward_ops(&ids, &mut slots, &mask, Take::All, &[], cpu_ops)
                .unwrap();
            logits(y)
        };
        let error = |f: &dyn Fn(bool) -> Vec<f32>| {
            crate::nn::layers::tests::relative_error(&f(true), &f(false))
        };
        (error(&batch_1), error(&two_slots))
    }

    /// On a CUDA GPU (unless `EMLX_AXON_GPU_LAYER=0`; with our products or,
    /// `EMLX_AXON_GPU_GEMV=0`, MLX's), one-token steps run each layer from
    /// our kernels (`crate::backend::cuda::layer`): the same logits as MLX's separate
    /// ops, to float32 summation order, and close in bfloat16 (whose roundings the
    /// kernels repeat, but whose norms and products sum in another order).
    /// Elsewhere the kernels are not used and this test has nothing to run.
    #[test]
    fn gpu_layer_kernels_give_the_separate_ops_logits() {
        if !cuda::layer::wanted() {
            eprintln!("no CUDA GPU, or EMLX_AXON_GPU_LAYER=0: nothing to compare");
            return;
        }
        let lease = Lease::new(DeviceKind::Gpu).unwrap();
        // Every case runs before any is asserted, so that a failure shows
        // them all.
        let mut failed = Vec::new();
        for (name, dtype, bound) in [
            ("qwen3-wide", Dtype::Float32, 1e-4),
            ("qwen2-rope-traditional", Dtype::Float32, 1e-4),
            ("qwen3-4bit-g64", Dtype::Bfloat16, 5e-2),
        ] {
            lease.stream().run(|| {
                let options = LoadOptions {
                    dtype: Some(dtype),
                    ..LoadOptions::default()
                };
                let model = Model::load(&fixture(name), &options).unwrap();
                // 600 keys: the attention kernel splits a row's keys over
                // blocks.
                for prompt_len in [5, 600] {
                    let (batch_1, two_slots) = one_token_steps_both_ways(&model, false, prompt_len);
                    assert_eq!(cuda::layer::checked(), Some(true), "kernels unavailable");
                    for (what, error) in [("batch 1", batch_1), ("two slots", two_slots)] {
                        if error.is_nan() || error >= bound {
                            failed.push(format!(
                                "{name} ({dtype:?}, {prompt_len}-token prompt): {what}: {error}"
                            ));
                        }
                    }
                }
            });
        }
        assert!(failed.is_empty(), "{}", failed.join("; "));
    }
}
