//! Continuous batching: a scheduler resource holding the engine's driver,
//! whose thread steps the running batch and sends what every request
//! produced to the process that started it, as
//! `{:emlx_axon_scheduler, {:ok, {events, occupancy, elapsed_us}}}` or
//! `{:emlx_axon_scheduler, {:error, {kind, message}}}`.

use emlx_axon_engine::backend::Work;
use emlx_axon_engine::exec::scheduler::{Driver, Output, Pacing};
use emlx_axon_engine::runtime::device::on_large_stack;
use emlx_axon_engine::{FinishReason, GenerateOptions, RequestStats, Scheduler, SchedulerConfig};
use rustler::{Atom, Encoder, Env, NifMap, OwnedEnv, ResourceArc, Term};

use crate::constraint::constraint_spec;
use crate::error::{guard, NifError, NifResult};
use crate::generation::sampler_config;
use crate::model::ModelResource;
use crate::slot::Slot;
use crate::tokenizer::TokenizerResource;

mod atoms {
    rustler::atoms! { ok, error, eos, stop, length, max_len, cancelled, emlx_axon_scheduler }
}

pub struct SchedulerResource {
    driver: Slot<Driver>,
}

#[rustler::resource_impl]
impl rustler::Resource for SchedulerResource {}

impl SchedulerResource {
    fn with<T>(&self, f: impl FnOnce(&mut Driver) -> NifResult<T>) -> NifResult<T> {
        self.driver.with(f)
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
    /// Most decode steps between two chunks of a prompt being prefilled.
    steps_per_call: usize,
    /// No decode step starts this long after a chunk while a prompt waits
    /// (0: `steps_per_call` alone).
    step_budget_us: u64,
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

/// Starts a scheduler whose outputs go to the calling process.
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_new(
    env: Env,
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
        let pacing = Pacing {
            max_steps: o.steps_per_call.max(1),
            budget: (o.step_budget_us > 0)
                .then(|| std::time::Duration::from_micros(o.step_budget_us)),
        };
        let owner = env.pid();
        let mut messages = OwnedEnv::new();
        // The thread ends once the owner is gone.
        let sink = move |output: Output| {
            messages
                .send_and_clear(&owner, |env| encode_output(env, output))
                .is_ok()
        };
        let driver = Driver::spawn(scheduler, pacing, sink)?;
        Ok(ResourceArc::new(SchedulerResource {
            driver: Slot::new(driver, ("released", "the scheduler was freed")),
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
        // Outside the resource's lock: compiling a grammar can take long,
        // and cancellations should not wait for it. It evaluates no MLX
        // graph, but can recurse deeply.
        let intake = resource.with(|d| Ok(d.intake().clone()))?;
        Ok(on_large_stack(|| {
            intake.admit(prompt, options, constraint)
        })?)
    }))
}

/// Drops the requests wherever they are, within one decode step. Dirty: an
/// admission compiling a grammar holds the resource meanwhile.
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_cancel(resource: ResourceArc<SchedulerResource>, ids: Vec<u64>) -> NifResult<Atom> {
    guard(|| resource.with(|d| Ok(d.cancel(ids).map(|()| atoms::ok())?)))
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
    kv_dtype: Option<String>,
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
            kv_dtype: s.kv_dtype.map(|d| crate::model::dtype_name(d).into()),
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

fn encode_output(env: Env, output: Output) -> Term {
    let payload = match output {
        Output::Events {
            events,
            occupancy,
            elapsed,
        } => {
            let events: Vec<EventOut> = events
                .into_iter()
                .map(|e| EventOut {
                    id: e.id,
                    ids: e.delta.ids,
                    text: e.delta.text,
                    finish_reason: e.delta.finish.map(finish_atom),
                    stats: e.stats.map(StatsOut::from),
                })
                .collect();
            let elapsed_us = elapsed.as_micros() as u64;
            (atoms::ok(), (events, occupancy_out(occupancy), elapsed_us)).encode(env)
        }
        Output::Failed(error) => (atoms::error(), NifError::from(error)).encode(env),
    };
    (atoms::emlx_axon_scheduler(), payload).encode(env)
}

fn occupancy_out(o: emlx_axon_engine::exec::scheduler::Occupancy) -> OccupancyOut {
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
    resource.with(|d| Ok(occupancy_out(d.occupancy()?)))
}

#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_clear_prefix_cache(resource: ResourceArc<SchedulerResource>) -> NifResult<Atom> {
    resource.with(|d| Ok(d.clear_prefix_cache().map(|()| atoms::ok())?))
}

/// Stops the scheduler's thread and frees the slots' KV cache now rather
/// than when the resource is collected (waits for the step in flight).
#[rustler::nif(schedule = "DirtyCpu")]
fn scheduler_free(resource: ResourceArc<SchedulerResource>) -> Atom {
    if let Some(driver) = resource.driver.take() {
        driver.stop();
    }
    atoms::ok()
}
