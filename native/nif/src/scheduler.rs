//! Continuous batching: a scheduler resource holding the running batch; each
//! `scheduler_step` is a short dirty call (one prompt chunk and a few decode
//! steps) returning what every request produced.

use emlx_axon_engine::backend::Work;
use emlx_axon_engine::runtime::device::on_large_stack;
use emlx_axon_engine::{FinishReason, GenerateOptions, RequestStats, Scheduler, SchedulerConfig};
use rustler::{Atom, NifMap, ResourceArc};

use crate::constraint::constraint_spec;
use crate::error::{guard, NifResult};
use crate::generation::sampler_config;
use crate::model::ModelResource;
use crate::slot::Slot;
use crate::tokenizer::TokenizerResource;

mod atoms {
    rustler::atoms! { ok, eos, stop, length, max_len, cancelled }
}

pub struct SchedulerResource {
    scheduler: Slot<Scheduler>,
}

#[rustler::resource_impl]
impl rustler::Resource for SchedulerResource {}

impl SchedulerResource {
    fn with<T>(&self, f: impl FnOnce(&mut Scheduler) -> NifResult<T>) -> NifResult<T> {
        self.scheduler.with(f)
    }
}

#[derive(NifMap)]
pub struct NewOptions {
    slots: usize,
    capacity: usize,
    prefill_chunk: usize,
    prefix_cache_bytes: usize,
    prefix_min_tokens: usize,
    /// `nil` (the model's) or the slots' dtype.
    kv_dtype: Option<String>,
}

#[derive(NifMap)]
pub struct RequestOptions {
    max_new_tokens: usize,
    max_len: usize,
    sampler: Atom,
    temperature: f64,
    top_p: f64,
    top_k: usize,
    min_p: f64,
    seed: Option<u64>,
    stop: Vec<String>,
    eos_token_ids: Option<Vec<u32>>,
    ignore_eos: bool,
    /// `nil` or `{:json_schema | :regex | :grammar, text}`.
    constraint: Option<(Atom, String)>,
    /// `nil` or the bits of a quantized KV cache, its group size and the
    /// positions before it is quantized.
    kv_bits: Option<i32>,
    kv_group_size: i32,
    quantized_kv_start: usize,
    /// `nil` or the positions of a rotating KV cache.
    max_kv_size: Option<usize>,
    /// `nil` (the model's) or the float KV cache's dtype.
    kv_dtype: Option<String>,
}

#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_new(
    model: ResourceArc<ModelResource>,
    tokenizer: Option<ResourceArc<TokenizerResource>>,
    o: NewOptions,
) -> NifResult<ResourceArc<SchedulerResource>> {
    guard(|| {
        let config = SchedulerConfig {
            slots: o.slots,
            capacity: o.capacity,
            prefill_chunk: o.prefill_chunk,
            prefix_cache_bytes: o.prefix_cache_bytes,
            prefix_min_tokens: o.prefix_min_tokens,
            kv_dtype: crate::generation::kv_dtype(o.kv_dtype.as_deref())?,
        };
        let scheduler = on_large_stack(|| {
            Scheduler::new(
                model.model.clone(),
                tokenizer.map(|t| t.tokenizer.clone()),
                config,
            )
        })?;
        Ok(ResourceArc::new(SchedulerResource {
            scheduler: Slot::new(scheduler, ("released", "the scheduler was freed")),
        }))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_admit(
    resource: ResourceArc<SchedulerResource>,
    prompt: Vec<u32>,
    o: RequestOptions,
) -> Result<NifResult<u64>, rustler::Error> {
    let constraint = constraint_spec(o.constraint)?;
    Ok(guard(|| {
        let options = GenerateOptions {
            max_new_tokens: o.max_new_tokens,
            max_len: o.max_len,
            sampler: sampler_config(o.sampler, o.temperature, o.top_p, o.top_k, o.min_p, o.seed)?,
            eos_token_ids: o.eos_token_ids,
            ignore_eos: o.ignore_eos,
            stop: o.stop,
            // Passed on so that the scheduler refuses them, rather than
            // running an unquantized cache silently.
            kv_quant: crate::generation::kv_quant(o.kv_bits, o.kv_group_size),
            quantized_kv_start: o.quantized_kv_start,
            max_kv_size: o.max_kv_size,
            kv_dtype: crate::generation::kv_dtype(o.kv_dtype.as_deref())?,
            ..GenerateOptions::default()
        };
        // Compiling a grammar evaluates no MLX graph, but can recurse deeply.
        resource.with(|s| {
            Ok(on_large_stack(|| {
                s.admit_constrained(prompt, options, constraint)
            })?)
        })
    }))
}

/// Whether the request was still there.
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_cancel(resource: ResourceArc<SchedulerResource>, ids: Vec<u64>) -> NifResult<usize> {
    guard(|| resource.with(|s| Ok(ids.into_iter().filter(|&id| s.cancel(id)).count())))
}

#[derive(NifMap)]
pub struct StatsOut {
    prompt_tokens: usize,
    cached_tokens: usize,
    generated_tokens: usize,
    queue_ms: f64,
    prefill_ms: f64,
    time_to_first_token_ms: f64,
    decode_tokens_per_s: f64,
    constraint_ms: f64,
    decode_path: String,
    prefill_path: String,
    fallbacks: Vec<String>,
}

impl From<RequestStats> for StatsOut {
    fn from(s: RequestStats) -> Self {
        StatsOut {
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            generated_tokens: s.generated_tokens,
            queue_ms: s.queue_ms,
            prefill_ms: s.prefill_ms,
            time_to_first_token_ms: s.time_to_first_token_ms,
            decode_tokens_per_s: s.decode_tokens_per_s,
            constraint_ms: s.constraint_ms,
            decode_path: s.paths.main_name(Work::Decode).into(),
            prefill_path: s.paths.main_name(Work::Prefill).into(),
            fallbacks: s.paths.fallbacks,
        }
    }
}

#[derive(NifMap)]
pub struct EventOut {
    id: u64,
    ids: Vec<u32>,
    text: String,
    finish_reason: Option<Atom>,
    stats: Option<StatsOut>,
}

/// A finish reason as the atom Elixir gets.
pub(crate) fn finish_atom(f: FinishReason) -> Atom {
    match f {
        FinishReason::Eos => atoms::eos(),
        FinishReason::Stop => atoms::stop(),
        FinishReason::Length => atoms::length(),
        FinishReason::MaxLen => atoms::max_len(),
        FinishReason::Cancelled => atoms::cancelled(),
    }
}

#[derive(NifMap)]
pub struct OccupancyOut {
    running: usize,
    slots: usize,
    waiting: usize,
    prefix_entries: usize,
    prefix_bytes: usize,
}

/// One prompt chunk and up to `max_steps` decode steps, starting none past
/// `budget_us` microseconds (0: no budget); returns the events and the
/// occupancy after them.
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_step(
    resource: ResourceArc<SchedulerResource>,
    max_steps: usize,
    budget_us: u64,
) -> NifResult<(Vec<EventOut>, OccupancyOut)> {
    let budget = (budget_us > 0).then(|| std::time::Duration::from_micros(budget_us));
    guard(|| {
        resource.with(|s| {
            let events = on_large_stack(|| s.step_within(max_steps, budget))?;
            let events = events
                .into_iter()
                .map(|e| EventOut {
                    id: e.id,
                    ids: e.delta.ids,
                    text: e.delta.text,
                    finish_reason: e.delta.finish.map(finish_atom),
                    stats: e.stats.map(StatsOut::from),
                })
                .collect();
            Ok((events, occupancy(s)))
        })
    })
}

fn occupancy(s: &Scheduler) -> OccupancyOut {
    let o = s.occupancy();
    OccupancyOut {
        running: o.running,
        slots: o.slots,
        waiting: o.waiting,
        prefix_entries: o.prefix_entries,
        prefix_bytes: o.prefix_bytes,
    }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_occupancy(resource: ResourceArc<SchedulerResource>) -> NifResult<OccupancyOut> {
    resource.with(|s| Ok(occupancy(s)))
}

#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_clear_prefix_cache(resource: ResourceArc<SchedulerResource>) -> NifResult<Atom> {
    resource.with(|s| {
        s.clear_prefix_cache();
        Ok(atoms::ok())
    })
}

/// Frees the slots' KV cache now rather than when the resource is collected.
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_free(resource: ResourceArc<SchedulerResource>) -> Atom {
    resource.scheduler.free();
    atoms::ok()
}
