//! The generation loop: prefill, then decode steps, each feeding the last
//! tokens through the model and sampling the next ones.

use std::sync::Arc;
use std::time::Instant;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, ge, logical_and};
use mlx_rs::{transforms, Array};

use super::constrained::{Constraints, Rules};
use super::options::{cache_shape, capacity_and_chunk, prefill_chunk, validate, KV_KEEP};
use super::rows::Row;
use super::{FinishReason, GenerateOptions, RowDelta, Stats};
use crate::backend::cuda::kernel::{mark, Role};
use crate::error::{Error, Result};
use crate::kv::cache::KvCache;
use crate::kv::window::causal_mask;
use crate::model::{AttentionMask, Model};
use crate::runtime::device::{DeviceKind, Lease, MlxStream};
use crate::sample::Sampler;
use crate::text::tokenizer::Tokenizer;
use replay::{Pending, Replay};

mod replay;

pub struct Generation {
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The caller's stream; without one, each call runs on the calling
    /// thread's default stream (MLX's fastest path on GPU) and leaves nothing
    /// queued when it returns, since the next call may come on another thread.
    stream: Option<MlxStream>,
    /// CPU worker streams for the model's split projections.
    workers: Vec<Lease>,
    /// Which paths ran this generation's work (see [`crate::backend`]).
    paths: crate::backend::Paths,
    options: GenerateOptions,
    sampler: Sampler,
    cache: KvCache,
    /// The dtype `cache` was made in.
    kv_dtype: mlx_rs::Dtype,
    rows: Vec<Row>,
    constraints: Constraints,
    /// What rows produced before the first `next` call (forced tokens at
    /// the start of a single constrained row's output).
    carry: Option<Vec<RowDelta>>,
    /// Left padding of each row, when rows differ in length.
    padding: Option<Vec<i32>>,
    eos: Vec<u32>,
    /// The next tokens, possibly still being computed.
    pending: Option<Pending>,
    /// Tokens already read whose next step is queued by the next call.
    held: Option<Pending>,
    /// Why a call failed: its queued step is gone and the cache may have
    /// advanced, so later calls fail too rather than return nothing.
    failed: Option<String>,
    replay: Replay,
    started: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// The longest row's length after the first step.
    first_step_tokens: usize,
    timing: Timing,
    steps: usize,
    forward_passes: usize,
}

impl Generation {
    /// Validates the request and runs the prefill.
    pub fn start(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        stream: Option<MlxStream>,
        prompts: &[Vec<u32>],
        mut options: GenerateOptions,
    ) -> Result<Self> {
        let started = Instant::now();
        validate(&model, tokenizer.as_deref(), prompts, &options)?;
        let eos = crate::exec::request::eos_ids(&model, tokenizer.as_deref(), &options);
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let padding = prompts
            .iter()
            .any(|p| p.len() != longest)
            .then(|| prompts.iter().map(|p| (longest - p.len()) as i32).collect());
        let kind = stream
            .as_ref()
            .map_or_else(DeviceKind::default_kind, |s| s.kind);
        let on_cpu = kind == DeviceKind::Cpu;
        let kv_shape = cache_shape(&model, &options, on_cpu);
        let capacity = capacity_and_chunk(
            &model,
            &kv_shape,
            prompts.len(),
            longest,
            &mut options,
            on_cpu,
        )?;
        let row_seeds: Vec<Option<u64>> = if options.rows.is_empty() {
            vec![None; prompts.len()]
        } else {
            options.rows.iter().map(|r| r.seed).collect()
        };
        let sampler = Sampler::new(options.sampler.clone(), &row_seeds)?;
        let constraints = Constraints::new(tokenizer.as_deref(), &options, prompts.len())?;
        let workers = if model.parallel_ways > 1 && kind == DeviceKind::Cpu {
            Lease::workers(DeviceKind::Cpu, model.parallel_ways)?
        } else {
            vec![]
        };
        let rows = prompts.len() as i32;
        let cache = MlxStream::run_on(stream.as_ref(), || {
            match (options.max_kv_size, options.kv_quant) {
                (Some(size), _) => KvCache::rotating(&kv_shape, size as i32, KV_KEEP as i32),
                // Quantized after the pass that reaches `quantized_kv_start`
                // positions: dense up to the end of that pass at most.
                (None, Some(_)) => {
                    let dense = options
                        .quantized_kv_start
                        .saturating_add(prefill_chunk(&options));
                    let dense = i32::try_from(dense).unwrap_or(i32::MAX);
                    KvCache::quantizing(&kv_shape, rows, capacity, dense)
                }
                (None, None) => KvCache::new(&kv_shape, rows, capacity),
            }
        })?;
        let mut generation = Generation {
            model,
            tokenizer,
            stream,
            workers,
            paths: Default::default(),
            sampler,
            cache,
            kv_dtype: kv_shape.dtype,
            rows: prompts.iter().map(|p| Row::new(p.len())).collect(),
            constraints,
            carry: None,
            padding,
            eos,
            pending: None,
            held: None,
            failed: None,
            replay: Replay::Untried,
            started,
            first_token_at: None,
            last_token_at: None,
            first_step_tokens: 0,
            timing: Timing::default(),
            steps: 0,
            forward_passes: 0,
            options,
        };
        // Where steps will be replayed, a single constrained row takes its
        // forced tokens one a step (replayed, its masks written to the
        // device) instead of running ahead in passes of MLX's graph.
        generation.constraints.set_runs_ahead(false);
        let replayed = MlxStream::run_on(generation.stream.clone().as_ref(), || {
            Ok::<_, Error>(generation.not_replayed().is_none())
        })?;
        generation.constraints.set_runs_ahead(!replayed);
        // A single constrained row's forced opening follows its prompt
        // into the prefill.
        let mut carry = vec![RowDelta::default(); prompts.len()];
        let rules = Rules {
            options: &generation.options,
            eos: &generation.eos,
            tokenizer: generation.tokenizer.as_deref(),
        };
        let lead = generation
            .constraints
            .start(&mut generation.rows, &rules, &mut carry[0])?;
        generation.sampler.skip_draws(0, lead.len());
        generation.carry = (!lead.is_empty()).then_some(carry);
        let stream = generation.stream.clone();
        generation.timing.setup_ms = ms_since(started);
        MlxStream::run_on(stream.as_ref(), || {
            if !generation.rows_finished() {
                if lead.is_empty() {
                    generation.prefill(prompts, longest)?;
                } else {
                    let prompt = [prompts[0].as_slice(), &lead].concat();
                    generation.prefill(&[prompt], longest + lead.len())?;
                }
            }
            generation.settle_if_thread_bound()
        })?;
        Ok(generation)
    }

    fn prefill(&mut self, prompts: &[Vec<u32>], longest: usize) -> Result<()> {
        let begun = Instant::now();
        let batch = prompts.len() as i32;
        let mut ids = Vec::with_capacity(prompts.len() * longest);
        for p in prompts {
            ids.extend(std::iter::repeat_n(0u32, longest - p.len()));
            ids.extend(p);
        }
        let ids = Array::from_slice(&ids, &[batch, longest as i32]);
        let chunk = prefill_chunk(&self.options) as i32;
        let longest = longest as i32;
        // With a quantized or rotating cache asked for, the prompt's last
        // token goes on its own, as mlx-lm's generate_step feeds it: after
        // the cache may have been quantized, and as a step of the window.
        let own_last = self.options.kv_quant.is_some() || self.options.max_kv_size.is_some();
        let body = if own_last && longest > 1 {
            longest - 1
        } else {
            longest
        };
        let mut parts = Vec::new();
        let mut start = 0;
        while start < body {
            let end = (start + chunk).min(body);
            parts.push((start, end));
            start = end;
        }
        if body < longest {
            parts.push((body, longest));
        }
        for (i, &(start, end)) in parts.iter().enumerate() {
            let part = ids.index((.., start..end));
            let last = i + 1 == parts.len();
            let logits = self.forward(&part, last)?;
            if last {
                self.pending = Some(Pending::Array(self.sample(&logits)?));
                self.timing.prefill_graph_ms = ms_since(begun);
                break;
            }
            // Bound the graph: materialize the cache before the next chunk.
            transforms::eval(self.cache.arrays())?;
        }
        if self.options.profile_timing {
            transforms::eval(self.pending.iter().filter_map(Pending::array))?;
            self.timing.prefill_ms = ms_since(begun);
        }
        Ok(())
    }

    /// The attention mask for `len` new positions at the cache's offset.
    fn mask(&self, len: i32) -> Result<AttentionMask> {
        if let Some(window) = self.cache.window_mask(len)? {
            return Ok(AttentionMask::Array(window));
        }
        let Some(padding) = &self.padding else {
            return Ok(if len > 1 {
                AttentionMask::Causal
            } else {
                AttentionMask::None
            });
        };
        let offset = self.cache.offset();
        let keys = arange::<_, i32>(0, offset + len, 1)?.reshape(&[1, 1, 1, offset + len])?;
        let pad = Array::from_slice(padding, &[padding.len() as i32, 1, 1, 1]);
        let causal = causal_mask(offset, len, None)?.reshape(&[1, 1, len, offset + len])?;
        Ok(AttentionMask::Array(logical_and(ge(&keys, &pad)?, causal)?))
    }

    /// Logits `[B, 1, V]` -> next tokens `[B]` (uint32), queued on the device.
    fn sample(&mut self, logits: &Array) -> Result<Array> {
        let mut logits = logits.reshape(&[logits.dim(0), logits.dim(-1)])?;
        if self.constraints.active(&self.rows) {
            // The device computes the logits while the host computes masks.
            transforms::async_eval([&logits])?;
            let vocab = logits.dim(-1) as usize;
            self.constraints
                .prepare(&self.rows, &self.eos, self.options.ignore_eos, vocab)?;
            // On a GPU the masks go to the device as bits, for our kernels
            // (a replay writes each step's into this buffer).
            if self.sampler.on_device() && !crate::runtime::device::on_cpu_stream() {
                let mask = self.constraints.mask();
                mark(Role::Mask, &mask);
                // Where our kernels do not take it, the reason is noted, and
                // the masks are added to the logits below.
                if let Some(next) = self.sampler.sample_masked(&logits, &mask)? {
                    transforms::async_eval([&next])?;
                    return Ok(next);
                }
            }
            logits = logits.add(self.constraints.bias(vocab)?)?;
        }
        let next = if self.sampler.on_device() {
            self.sampler.sample_device(&logits)?
        } else {
            let ids = self.sampler.sample_host(&logits)?;
            Array::from_slice(&ids, &[ids.len() as i32])
        };
        let next = self.constraints.force(next)?;
        transforms::async_eval([&next])?;
        Ok(next)
    }

    /// Whether every row has finished and `next` has returned all of it.
    pub fn is_done(&self) -> bool {
        self.failed.is_some() || (self.carry.is_none() && self.rows_finished())
    }

    /// Ends row `row` now, as a caller that no longer reads it asks: it
    /// takes no more tokens, and the generation is done once its other rows
    /// are. Its computation in the batch's steps goes on until then.
    pub fn cancel_row(&mut self, row: usize) -> Result<()> {
        let rows = self.rows.len();
        let Some(r) = self.rows.get_mut(row) else {
            return Err(Error::invalid(format!(
                "row {row} is not in this generation of {rows} rows"
            )));
        };
        r.finish.get_or_insert(FinishReason::Cancelled);
        Ok(())
    }

    fn rows_finished(&self) -> bool {
        self.rows.iter().all(|r| r.finish.is_some())
    }

    /// Decodes up to `max_steps` steps for every unfinished row (a step
    /// is one token, or more where a grammar forces them).
    pub fn next(&mut self, max_steps: usize) -> Result<Vec<RowDelta>> {
        if let Some(why) = &self.failed {
            return Err(Error::invalid(format!(
                "this generation already failed: {why}"
            )));
        }
        let stream = self.stream.clone();
        let out: Result<Vec<RowDelta>> = MlxStream::run_on(stream.as_ref(), || {
            let deltas = self.decode(max_steps)?;
            self.settle_if_thread_bound()?;
            Ok(deltas)
        });
        if let Err(e) = &out {
            self.failed = Some(e.to_string());
        }
        out
    }

    /// On a thread's default stream, finishes queued work before returning:
    /// MLX cannot schedule an array of another thread's stream.
    fn settle_if_thread_bound(&self) -> Result<()> {
        if self.stream.is_none() {
            let pending = self.pending.iter().filter_map(Pending::array);
            transforms::eval(pending.chain(self.cache.arrays()))?;
        }
        Ok(())
    }

    fn decode(&mut self, max_steps: usize) -> Result<Vec<RowDelta>> {
        let mut deltas = self
            .carry
            .take()
            .unwrap_or_else(|| vec![RowDelta::default(); self.rows.len()]);
        let runs_ahead = self.constraints.runs_ahead();
        if let Some(read) = self.held.take() {
            self.pending = Some(self.queue_step(&read)?);
        }
        for i in 0..max_steps {
            let Some(current) = self.pending.take() else {
                break;
            };
            // Queue the following step before reading this one back.
            let more = self.steps + 1 < self.options.max_new_tokens
                && self.cache.offset() < self.cache.capacity();
            // A constrained step's mask needs this step's tokens: queue only
            // the forward pass now and sample once they are known. A row
            // running ahead feeds its forced tokens with this step's, known
            // only once it is read back.
            let constrained = self.constraints.active(&self.rows);
            // On a thread's default stream a call ends by evaluating what
            // it queued, so a step queued behind a call's last token would
            // run before that token is returned: the next call queues it.
            let hold = more
                && i + 1 == max_steps
                && self.stream.is_none()
                && self.constraints.none()
                && !self.replays_steps();
            let mut queued_logits = None;
            // A constrained step replayed: its head (the forward pass) is
            // queued now, its sampling once its masks are known.
            let mut head_queued = false;
            // A constrained step to record: once its masks are known.
            let mut record = false;
            if more && self.sampler.on_device() && !runs_ahead && !hold {
                match (&current, constrained) {
                    (_, true) if self.replays_masked() => {
                        if let Replay::On(replay) = &mut self.replay {
                            replay.launch_head()?;
                            head_queued = true;
                        }
                    }
                    (Pending::Array(_), true) if self.may_record() => record = true,
                    (Pending::Array(ids), true) => {
                        let logits = self.forward_step(ids)?;
                        transforms::async_eval([&logits])?;
                        queued_logits = Some(logits);
                    }
                    _ => self.pending = Some(self.queue_step(&current)?),
                }
            }
            let tokens = self.read(&current)?;
            if self.options.profile_timing {
                let now = Instant::now();
                self.first_token_at.get_or_insert(now);
                self.last_token_at = Some(now);
            }
            self.steps += 1;
            let rules = Rules {
                options: &self.options,
                eos: &self.eos,
                tokenizer: self.tokenizer.as_deref(),
            };
            let mut ahead = vec![];
            for (i, ((row, &token), delta)) in self
                .rows
                .iter_mut()
                .zip(&tokens)
                .zip(&mut deltas)
                .enumerate()
            {
                ahead = self.constraints.take(i, token, row, &rules, delta)?;
            }
            if self.steps == 1 {
                self.first_step_tokens = self.longest_row();
            }
            if self.rows_finished() {
                self.pending = None;
                break;
            }
            if head_queued {
                self.pending = Some(self.queue_masked_tail()?);
            } else if record {
                self.pending = Some(self.queue_step(&current)?);
            } else if let Some(logits) = queued_logits {
                self.pending = Some(Pending::Array(self.sample(&logits)?));
            } else if runs_ahead {
                self.sampler.skip_draws(0, ahead.len());
                let ids = [tokens.as_slice(), &ahead].concat();
                let ids = Array::from_slice(&ids, &[1, ids.len() as i32]);
                let logits = self.forward(&ids, true)?;
                self.pending = Some(Pending::Array(self.sample(&logits)?));
            } else if hold {
                self.held = Some(current);
            } else if more && !self.sampler.on_device() {
                self.pending = Some(self.queue_step(&current)?);
            }
        }
        Ok(deltas)
    }

    fn longest_row(&self) -> usize {
        self.rows
            .iter()
            .map(|r| r.generated.len())
            .max()
            .unwrap_or(0)
    }

    /// Feeds `tokens` `[B]` through the model and samples the next ones.
    fn step(&mut self, tokens: &Array) -> Result<Array> {
        let logits = self.forward_step(tokens)?;
        self.sample(&logits)
    }

    /// Feeds `tokens` `[B]` through the model: the next logits (lazy).
    fn forward_step(&mut self, tokens: &Array) -> Result<Array> {
        let ids = tokens.reshape(&[tokens.dim(0), 1])?;
        self.forward(&ids, false)
    }

    /// Feeds `ids` `[B, L]` through the model at the cache's offset: logits
    /// `[B, L, V]`, or `[B, 1, V]` of the last position when `last_only`.
    fn forward(&mut self, ids: &Array, last_only: bool) -> Result<Array> {
        let mask = self.mask(ids.dim(1))?;
        self.forward_passes += 1;
        let logits = self
            .model
            .forward(ids, &mut self.cache, &mask, last_only, &self.workers);
        self.collect_paths();
        // As mlx-lm: after the forward pass that brings the cache to
        // `quantized_kv_start` positions, what it holds is quantized.
        if let Some(quant) = self.options.kv_quant {
            if self.cache.offset() as usize >= self.options.quantized_kv_start {
                self.cache.quantize(quant)?;
            }
        }
        logits
    }

    /// Takes what the backend noted on this thread into this generation's
    /// paths.
    pub(super) fn collect_paths(&mut self) {
        self.paths.merge(&crate::backend::take());
    }

    pub fn stats(&self) -> Stats {
        let mut stats = Stats {
            prompt_tokens: self.rows.iter().map(|r| r.prompt_len).collect(),
            generated_tokens: self.rows.iter().map(|r| r.generated.len()).collect(),
            forced_tokens: self.constraints.forced.clone(),
            forward_passes: self.forward_passes,
            setup_ms: self.timing.setup_ms,
            prefill_graph_ms: self.timing.prefill_graph_ms,
            prefill_ms: self.timing.prefill_ms,
            constraint_ms: self.constraints.ms,
            paths: self.paths.clone(),
            kv_dtype: Some(self.kv_dtype),
            ..Stats::default()
        };
        if let (true, Some(first), Some(last)) = (
            self.options.profile_timing,
            self.first_token_at,
            self.last_token_at,
        ) {
            stats.time_to_first_token_ms = (first - self.started).as_secs_f64() * 1e3;
            stats.decode_ms = (last - first).as_secs_f64() * 1e3;
            let tokens = self.longest_row().saturating_sub(self.first_step_tokens);
            if tokens > 0 && stats.decode_ms > 0.0 {
                stats.decode_tokens_per_s = tokens as f64 / (stats.decode_ms / 1e3);
            }
        }
        stats
    }

    /// Whether decode steps are replayed as one CUDA graph (`backend/cuda/replay.rs`).
    pub fn replays_steps(&self) -> bool {
        matches!(self.replay, Replay::On(_))
    }

    /// Every row's generated ids so far.
    pub fn generated(&self) -> Vec<Vec<u32>> {
        self.rows.iter().map(|r| r.generated.clone()).collect()
    }
}

/// Host-side times of a generation's start; the prefill's only with
/// `profile_timing` (it waits for the prefill then).
#[derive(Default)]
struct Timing {
    setup_ms: f64,
    prefill_graph_ms: f64,
    prefill_ms: f64,
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LoadOptions;

    /// A step that fails leaves the generation failed: later calls give an
    /// error too, and it is done, where they used to return empty deltas
    /// forever.
    #[test]
    fn a_failed_step_fails_every_later_call() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../.cache/fixtures/qwen3-4bit-g64");
        let model = Arc::new(Model::load(&dir, &LoadOptions::default()).unwrap());
        let options = GenerateOptions {
            max_new_tokens: 8,
            ..GenerateOptions::default()
        };
        let mut g = Generation::start(model, None, None, &[vec![1, 2, 3]], options).unwrap();
        assert!(!g.is_done());
        // A replayed step with no replay: reading it fails.
        g.pending = Some(Pending::Replayed(7));
        let first = g.next(2).unwrap_err();
        assert!(g.is_done());
        let again = g.next(2).unwrap_err();
        assert_eq!(again.kind(), "invalid_argument");
        assert!(again.to_string().contains(&first.to_string()), "{again}");
    }
}
