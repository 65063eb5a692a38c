//! Prefill and decode for one prompt or a batch of prompts decoded together.
//!
//! Rows are left-padded to a common length and masked, so every row attends
//! only to its own tokens; RoPE depends on relative positions, so padding does
//! not change a row's result. Decoding is chunked (`Generation::next`) so a
//! caller can stream, cancel or time out between chunks. With a device
//! sampler each step's graph is queued before the previous token is read
//! back (`async_eval`), as mlx-lm does, so the host never stalls the device.

pub(crate) mod rows;

use std::sync::Arc;
use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, ge, le, logical_and};
use mlx_rs::{transforms, Array};

use crate::cache::KvCache;
use crate::config::add_missing;
use crate::constraint::{ConstraintSpec, RowConstraint};
use crate::device::{DeviceKind, Lease, MlxStream};
use crate::error::{Error, Result};
use crate::model::{AttentionMask, Model};
use crate::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::Tokenizer;
use rows::Row;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// KV budget: prompt plus generated tokens of a row.
    pub max_len: usize,
    pub sampler: SamplerConfig,
    /// `None`: the model's EOS ids and the tokenizer's.
    pub eos_token_ids: Option<Vec<u32>>,
    pub ignore_eos: bool,
    /// Stop strings (need a tokenizer); the matched text is not returned.
    pub stop: Vec<String>,
    pub profile_timing: bool,
    /// Longest prompt slice run through the model at once.
    pub prefill_chunk: usize,
    /// Per-row settings, one per prompt, or empty for none.
    pub rows: Vec<RowOptions>,
}

/// Settings of one batch row that override the generation's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowOptions {
    /// The row's own sampling seed: with it, the row samples exactly as a
    /// single-prompt generation with `seed` would, whatever it is batched
    /// with. Without it, the row's stream derives from the sampler's seed.
    pub seed: Option<u64>,
    /// What the row's output must match (needs a tokenizer). The row ends
    /// with [`FinishReason::Stop`] once nothing but the end of the output
    /// can follow, or with `Eos` when the model ends a complete output.
    pub constraint: Option<ConstraintSpec>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 100,
            max_len: 2048,
            sampler: SamplerConfig::default(),
            eos_token_ids: None,
            ignore_eos: false,
            stop: vec![],
            profile_timing: true,
            prefill_chunk: 512,
            rows: vec![],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Eos,
    /// A stop string matched, or a constrained output is complete.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    MaxLen,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::MaxLen => "max_len",
        }
    }
}

/// What one `next` call produced for a row.
#[derive(Debug, Clone, Default)]
pub struct RowDelta {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: Option<FinishReason>,
}

#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub prompt_tokens: Vec<usize>,
    pub generated_tokens: Vec<usize>,
    pub prefill_ms: f64,
    pub time_to_first_token_ms: f64,
    pub decode_ms: f64,
    /// Decode steps after the first token, per second (per row).
    pub decode_tokens_per_s: f64,
    /// Host time spent computing constrained rows' token masks, in total.
    pub constraint_ms: f64,
}

pub struct Generation {
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The caller's stream; without one, each call runs on the calling
    /// thread's default stream (MLX's fastest path on GPU) and leaves nothing
    /// queued when it returns, since the next call may come on another thread.
    stream: Option<MlxStream>,
    /// CPU worker streams for the model's split projections.
    workers: Vec<Lease>,
    options: GenerateOptions,
    sampler: Sampler,
    cache: KvCache,
    rows: Vec<Row>,
    /// Each row's constraint, if it has one.
    constraints: Vec<Option<RowConstraint>>,
    /// Reused host buffer for the constrained rows' logit bias.
    bias: Vec<f32>,
    constraint_ms: f64,
    /// Left padding of each row, when rows differ in length.
    padding: Option<Vec<i32>>,
    eos: Vec<u32>,
    /// The next tokens `[B]`, possibly still being computed.
    pending: Option<Array>,
    started: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    prefill_ms: f64,
    steps: usize,
}

fn run_on<T>(stream: &Option<MlxStream>, f: impl FnOnce() -> T) -> T {
    match stream {
        Some(s) => s.run(f),
        None => f(),
    }
}

impl Generation {
    /// Validates the request and runs the prefill.
    pub fn start(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        stream: Option<MlxStream>,
        prompts: &[Vec<u32>],
        options: GenerateOptions,
    ) -> Result<Self> {
        validate(&model, tokenizer.as_deref(), prompts, &options)?;
        let eos = match &options.eos_token_ids {
            Some(ids) => ids.clone(),
            None => {
                let mut ids = model.config.eos_token_ids.clone();
                let from_tokenizer = tokenizer
                    .iter()
                    .flat_map(|t| t.eos_token_ids().iter().copied());
                add_missing(&mut ids, from_tokenizer);
                ids
            }
        };
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let padding = prompts
            .iter()
            .any(|p| p.len() != longest)
            .then(|| prompts.iter().map(|p| (longest - p.len()) as i32).collect());
        let capacity = cache_capacity(&model, prompts.len(), longest, &options)?;
        let row_seeds: Vec<Option<u64>> = if options.rows.is_empty() {
            vec![None; prompts.len()]
        } else {
            options.rows.iter().map(|r| r.seed).collect()
        };
        let sampler = Sampler::new(options.sampler.clone(), &row_seeds)?;
        // Compiled before any model work, so a bad grammar fails fast.
        let constraints = (0..prompts.len())
            .map(
                |i| match options.rows.get(i).and_then(|r| r.constraint.as_ref()) {
                    Some(spec) => {
                        let tokenizer = tokenizer.as_deref().ok_or_else(|| {
                            Error::InvalidConstraint(
                                "constrained decoding needs a tokenizer".into(),
                            )
                        })?;
                        RowConstraint::new(tokenizer, spec).map(Some)
                    }
                    None => Ok(None),
                },
            )
            .collect::<Result<Vec<_>>>()?;
        let kind = stream
            .as_ref()
            .map_or_else(DeviceKind::default_kind, |s| s.kind);
        let workers = if model.parallel_ways > 1 && kind == DeviceKind::Cpu {
            Lease::workers(DeviceKind::Cpu, model.parallel_ways)?
        } else {
            vec![]
        };
        let cache = run_on(&stream, || {
            KvCache::new(&model, prompts.len() as i32, capacity)
        })?;
        let mut generation = Generation {
            model,
            tokenizer,
            stream,
            workers,
            sampler,
            cache,
            rows: prompts.iter().map(|p| Row::new(p.len())).collect(),
            constraints,
            bias: vec![],
            constraint_ms: 0.0,
            padding,
            eos,
            pending: None,
            started: Instant::now(),
            first_token_at: None,
            last_token_at: None,
            prefill_ms: 0.0,
            steps: 0,
            options,
        };
        let stream = generation.stream.clone();
        run_on(&stream, || {
            generation.prefill(prompts, longest)?;
            generation.settle_if_thread_bound()
        })?;
        Ok(generation)
    }

    fn prefill(&mut self, prompts: &[Vec<u32>], longest: usize) -> Result<()> {
        let batch = prompts.len() as i32;
        let mut ids = Vec::with_capacity(prompts.len() * longest);
        for p in prompts {
            ids.extend(std::iter::repeat_n(0u32, longest - p.len()));
            ids.extend(p);
        }
        let ids = Array::from_slice(&ids, &[batch, longest as i32]);
        let chunk = self.options.prefill_chunk.max(1) as i32;
        let mut start = 0;
        loop {
            let end = (start + chunk).min(longest as i32);
            let part = ids.index((.., start..end));
            let mask = self.mask(end - start)?;
            let last = end == longest as i32;
            let logits = self
                .model
                .forward(&part, &mut self.cache, &mask, last, &self.workers)?;
            if last {
                self.pending = Some(self.sample(&logits)?);
                break;
            }
            // Bound the graph: materialize the cache before the next chunk.
            transforms::eval(self.cache.arrays())?;
            start = end;
        }
        if self.options.profile_timing {
            transforms::eval(self.pending.iter())?;
            self.prefill_ms = self.started.elapsed().as_secs_f64() * 1e3;
        }
        Ok(())
    }

    /// The attention mask for `len` new positions at the cache's offset.
    fn mask(&self, len: i32) -> Result<AttentionMask> {
        let Some(padding) = &self.padding else {
            return Ok(if len > 1 {
                AttentionMask::Causal
            } else {
                AttentionMask::None
            });
        };
        let offset = self.cache.offset();
        let keys = arange::<_, i32>(0, offset + len, 1)?.reshape(&[1, 1, 1, offset + len])?;
        let queries = arange::<_, i32>(offset, offset + len, 1)?.reshape(&[1, 1, len, 1])?;
        let pad = Array::from_slice(padding, &[padding.len() as i32, 1, 1, 1]);
        Ok(AttentionMask::Array(logical_and(
            ge(&keys, &pad)?,
            le(&keys, &queries)?,
        )?))
    }

    /// Logits `[B, 1, V]` -> next tokens `[B]` (uint32), queued on the device.
    fn sample(&mut self, logits: &Array) -> Result<Array> {
        let mut logits = logits.reshape(&[logits.dim(0), logits.dim(-1)])?;
        if self.constrained() {
            // The device computes the logits while the host computes masks.
            transforms::async_eval([&logits])?;
            let bias = self.constraint_bias(logits.dim(-1) as usize)?;
            logits = logits.add(&bias)?;
        }
        let next = if self.sampler.on_device() {
            self.sampler.sample_device(&logits)?
        } else {
            let ids = self.sampler.sample_host(&logits)?;
            Array::from_slice(&ids, &[ids.len() as i32])
        };
        transforms::async_eval([&next])?;
        Ok(next)
    }

    /// Whether some unfinished row is constrained.
    fn constrained(&self) -> bool {
        self.constraints
            .iter()
            .zip(&self.rows)
            .any(|(c, r)| c.is_some() && r.finish.is_none())
    }

    /// `[B, V]` float32 additive bias: each constrained row's mask (0 or
    /// -inf), zeros for the other rows so their logits keep their values.
    fn constraint_bias(&mut self, vocab: usize) -> Result<Array> {
        let started = Instant::now();
        let batch = self.rows.len();
        self.bias.clear();
        self.bias.resize(batch * vocab, 0.0);
        for (i, (c, row)) in self.constraints.iter_mut().zip(&self.rows).enumerate() {
            if let (Some(c), None) = (c, row.finish) {
                let out = &mut self.bias[i * vocab..(i + 1) * vocab];
                if !c.write_bias(&self.eos, self.options.ignore_eos, out)? {
                    // The row ends before taking this step's token.
                    out.fill(0.0);
                }
            }
        }
        let bias = Array::from_slice(&self.bias, &[batch as i32, vocab as i32]);
        self.constraint_ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(bias)
    }

    pub fn is_done(&self) -> bool {
        self.rows.iter().all(|r| r.finish.is_some())
    }

    /// Decodes up to `max_steps` tokens for every unfinished row.
    pub fn next(&mut self, max_steps: usize) -> Result<Vec<RowDelta>> {
        let stream = self.stream.clone();
        run_on(&stream, || {
            let deltas = self.decode(max_steps)?;
            self.settle_if_thread_bound()?;
            Ok(deltas)
        })
    }

    /// On a thread's default stream, finishes queued work before returning:
    /// MLX cannot schedule an array of another thread's stream.
    fn settle_if_thread_bound(&self) -> Result<()> {
        if self.stream.is_none() {
            transforms::eval(self.pending.iter().chain(self.cache.arrays()))?;
        }
        Ok(())
    }

    fn decode(&mut self, max_steps: usize) -> Result<Vec<RowDelta>> {
        let mut deltas = vec![RowDelta::default(); self.rows.len()];
        for _ in 0..max_steps {
            let Some(current) = self.pending.take() else {
                break;
            };
            // Queue the following step before reading this one back.
            let more = self.steps + 1 < self.options.max_new_tokens
                && self.cache.offset() < self.cache.capacity();
            // A constrained step's mask needs this step's tokens: queue only
            // the forward pass now and sample once they are known.
            let constrained = self.constrained();
            let mut queued_logits = None;
            if more && self.sampler.on_device() {
                if constrained {
                    let logits = self.forward(&current)?;
                    transforms::async_eval([&logits])?;
                    queued_logits = Some(logits);
                } else {
                    self.pending = Some(self.step(&current)?);
                }
            }
            current.eval()?;
            if self.options.profile_timing {
                let now = Instant::now();
                self.first_token_at.get_or_insert(now);
                self.last_token_at = Some(now);
            }
            self.steps += 1;
            let tokens: Vec<u32> = current.as_slice::<u32>().to_vec();
            for (((row, &token), delta), constraint) in self
                .rows
                .iter_mut()
                .zip(&tokens)
                .zip(&mut deltas)
                .zip(&mut self.constraints)
            {
                let tokenizer = self.tokenizer.as_deref();
                if constraint.as_ref().is_some_and(RowConstraint::is_complete) {
                    row.end(FinishReason::Stop, tokenizer, delta)?;
                    continue;
                }
                row.accept(token, &self.options, &self.eos, tokenizer, delta)?;
                if let (Some(c), None) = (constraint.as_mut(), row.finish) {
                    if c.consume(token)? {
                        row.end(FinishReason::Stop, tokenizer, delta)?;
                    }
                }
            }
            if self.is_done() {
                self.pending = None;
                break;
            }
            if let Some(logits) = queued_logits {
                self.pending = Some(self.sample(&logits)?);
            } else if more && !self.sampler.on_device() {
                self.pending = Some(self.step(&current)?);
            }
        }
        Ok(deltas)
    }

    /// Feeds `tokens` `[B]` through the model and samples the next ones.
    fn step(&mut self, tokens: &Array) -> Result<Array> {
        let logits = self.forward(tokens)?;
        self.sample(&logits)
    }

    /// Feeds `tokens` `[B]` through the model: the next logits (lazy).
    fn forward(&mut self, tokens: &Array) -> Result<Array> {
        let mask = self.mask(1)?;
        let ids = tokens.reshape(&[tokens.dim(0), 1])?;
        self.model
            .forward(&ids, &mut self.cache, &mask, false, &self.workers)
    }

    pub fn stats(&self) -> Stats {
        let mut stats = Stats {
            prompt_tokens: self.rows.iter().map(|r| r.prompt_len).collect(),
            generated_tokens: self.rows.iter().map(|r| r.generated.len()).collect(),
            prefill_ms: self.prefill_ms,
            constraint_ms: self.constraint_ms,
            ..Stats::default()
        };
        if let (true, Some(first), Some(last)) = (
            self.options.profile_timing,
            self.first_token_at,
            self.last_token_at,
        ) {
            stats.time_to_first_token_ms = (first - self.started).as_secs_f64() * 1e3;
            stats.decode_ms = (last - first).as_secs_f64() * 1e3;
            if self.steps > 1 && stats.decode_ms > 0.0 {
                stats.decode_tokens_per_s = (self.steps - 1) as f64 / (stats.decode_ms / 1e3);
            }
        }
        stats
    }

    /// Every row's generated ids so far.
    pub fn generated(&self) -> Vec<Vec<u32>> {
        self.rows.iter().map(|r| r.generated.clone()).collect()
    }
}

fn validate(
    model: &Model,
    tokenizer: Option<&Tokenizer>,
    prompts: &[Vec<u32>],
    o: &GenerateOptions,
) -> Result<()> {
    if prompts.is_empty() {
        return Err(Error::invalid("no prompts given"));
    }
    if !o.rows.is_empty() && o.rows.len() != prompts.len() {
        return Err(Error::invalid(format!(
            "row options were given for {} rows but there are {} prompts",
            o.rows.len(),
            prompts.len()
        )));
    }
    if o.max_new_tokens == 0 {
        return Err(Error::invalid("max_new_tokens must be at least 1"));
    }
    if o.max_len == 0 {
        return Err(Error::invalid("max_len must be at least 1"));
    }
    if let Some(t) = tokenizer {
        if t.vocab_size() > model.config.vocab_size as usize {
            return Err(Error::invalid(format!(
                "the tokenizer has {} tokens but the model only {}: they belong to different models",
                t.vocab_size(),
                model.config.vocab_size
            )));
        }
    }
    if !o.stop.is_empty() && tokenizer.is_none() {
        return Err(Error::invalid("stop strings need a tokenizer"));
    }
    if o.stop.iter().any(String::is_empty) {
        return Err(Error::invalid("stop strings must not be empty"));
    }
    o.sampler.validate()?;
    let vocab = model.config.vocab_size as u32;
    for p in prompts {
        if p.is_empty() {
            return Err(Error::invalid("a prompt is empty: give at least one token"));
        }
        if let Some(bad) = p.iter().find(|&&id| id >= vocab) {
            return Err(Error::invalid(format!(
                "token id {bad} is outside the model's vocabulary (size {vocab})"
            )));
        }
        if p.len() >= o.max_len {
            return Err(Error::PromptTooLong {
                len: p.len(),
                max_len: o.max_len,
            });
        }
    }
    Ok(())
}

/// The KV cache's length: the longest prompt plus what may be generated.
/// Refused when MLX cannot address it (shapes are i32: a silently wrapped
/// length would end decoding early with no finish reason) or when the cache,
/// with the attention scores of a prefill chunk, cannot fit in memory.
fn cache_capacity(model: &Model, batch: usize, longest: usize, o: &GenerateOptions) -> Result<i32> {
    let too_long = || {
        Error::invalid(format!(
            "max_new_tokens ({}) and max_len ({}) allow more positions than a KV cache can hold (2^31 - 1)",
            o.max_new_tokens, o.max_len
        ))
    };
    let positions = longest
        .checked_add(o.max_new_tokens.min(o.max_len))
        .ok_or_else(too_long)?;
    let capacity = i32::try_from(positions).map_err(|_| too_long())?;
    let c = &model.config;
    let element = if model.dtype == mlx_rs::Dtype::Float32 {
        4
    } else {
        2
    };
    let kv = [
        batch,
        2 * c.num_layers,
        c.num_kv_heads as usize,
        positions,
        c.head_dim as usize,
        element,
    ];
    let scores = [
        batch,
        c.num_heads as usize,
        longest.min(o.prefill_chunk.max(1)),
        positions,
        4,
    ];
    let product = |dims: &[usize]| dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let bytes = product(&kv)
        .zip(product(&scores))
        .and_then(|(kv, scores)| kv.checked_add(scores));
    crate::memory::ensure_fits(
        bytes,
        &format!("a KV cache of {positions} positions for {batch} prompt(s)"),
    )?;
    Ok(capacity)
}

/// Result of a whole single-prompt generation.
#[derive(Debug, Clone)]
pub struct Output {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub stats: Stats,
}

/// Generates for one prompt until it finishes.
pub fn generate(
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    prompt: &[u32],
    options: GenerateOptions,
) -> Result<Output> {
    let mut generation = Generation::start(model, tokenizer, None, &[prompt.to_vec()], options)?;
    let mut text = String::new();
    let mut finish = None;
    while !generation.is_done() {
        let delta = generation.next(16)?.remove(0);
        text.push_str(&delta.text);
        finish = delta.finish.or(finish);
    }
    Ok(Output {
        ids: generation.generated().remove(0),
        text,
        finish: finish.unwrap_or(FinishReason::Length),
        stats: generation.stats(),
    })
}
