//! Continuous batching: a fixed set of slots decoded together, with rows
//! joining and leaving between steps.
//!
//! A request waits in a queue until a slot is free (the shortest prompt
//! first, with aging so long ones are not starved), then its prompt is run
//! through the model in bounded chunks (one chunk per [`Scheduler::step`], so
//! running rows keep their pace) into a cache of its own; when the prompt is
//! done its keys and values are copied into the slot and the row joins the
//! batch, in the lowest free slot. Each decode step feeds every running
//! row's last token at that row's own position ([`SlotCache`]), over the
//! first slots only when the high ones are free; finished or cancelled rows
//! leave at once and free their slot. Every request carries its own options
//! and sampler, so a seeded request samples the same tokens whatever it is
//! batched with, and a greedy row gives the ids of its solo run.
//!
//! A request may carry a constraint (a JSON Schema, regex or Lark grammar,
//! compiled when it is admitted): its row's logits are masked to the tokens
//! that can continue a valid output before its sampler runs, at the first
//! token and every decode step, and the row ends with
//! [`FinishReason::Stop`] once the output is complete.

mod constrain;
mod driver;
mod prefill;
mod queue;
mod step;
mod together;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{transforms, Array};

use crate::backend::Paths;
use crate::error::{Error, Result};
use crate::exec::generate::rows::Row;
use crate::exec::generate::{FinishReason, GenerateOptions, RowDelta};
use crate::exec::request;
use crate::kv::cache::{KvCache, KvShape};
use crate::kv::prefix::PrefixCache;
use crate::kv::slots::{slot_cache_bytes, SlotCache};
use crate::model::{AttentionMask, Model};
use crate::runtime::device::{DeviceKind, Lease};
use crate::sample::Sampler;
use crate::text::constraint::{ConstraintSpec, RowConstraint};
use crate::text::tokenizer::Tokenizer;

use driver::Driven;
pub use driver::{Driver, Intake, Output, Pacing};

pub type RequestId = u64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Rows decoded together.
    pub slots: usize,
    /// Positions (prompt plus generated tokens) a slot holds.
    pub capacity: usize,
    /// Most prompt tokens run per step.
    pub prefill_chunk: usize,
    /// Byte budget of the prefix cache; 0 turns it off.
    pub prefix_cache_bytes: usize,
    /// Shortest prompt prefix worth storing and reusing.
    pub prefix_min_tokens: usize,
    /// The dtype of the slots' keys and values (and of the prompts' and the
    /// prefix cache's), `None`: as `GenerateOptions::kv_dtype`'s default has
    /// it. A started scheduler's `config()` holds the dtype its slots took.
    pub kv_dtype: Option<mlx_rs::Dtype>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            slots: 8,
            capacity: 2048,
            prefill_chunk: 128,
            prefix_cache_bytes: 256 << 20,
            prefix_min_tokens: 16,
            kv_dtype: None,
        }
    }
}

/// Timings of one request, reported when it finishes.
#[derive(Debug, Clone, Default)]
pub struct RequestStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// From admission to the start of its prefill.
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// From admission to the first token.
    pub time_to_first_token_ms: f64,
    /// Tokens after the first, per second.
    pub decode_tokens_per_s: f64,
    /// Host time spent on the request's constraint (its token masks and
    /// the grammar taking each token); 0 without one.
    pub constraint_ms: f64,
    /// Which paths ran the forward passes this request took part in.
    pub paths: Paths,
    /// The dtype of the slot's keys and values (its scheduler's).
    pub kv_dtype: Option<mlx_rs::Dtype>,
}

/// What a step produced for one request.
#[derive(Debug, Clone)]
pub struct Event {
    pub id: RequestId,
    pub delta: RowDelta,
    /// Set with the last delta.
    pub stats: Option<RequestStats>,
}

/// Slot use, for load reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub running: usize,
    pub slots: usize,
    /// Admitted requests not yet running (the one being prefilled included).
    pub waiting: usize,
    pub prefix_entries: usize,
    pub prefix_bytes: usize,
}

struct Request {
    id: RequestId,
    prompt: Vec<u32>,
    options: GenerateOptions,
    eos: Vec<u32>,
    sampler: Sampler,
    row: Row,
    constraint: Option<RowConstraint>,
    constraint_ms: f64,
    admitted: Instant,
    prefill_started: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    cached_tokens: usize,
    /// How many later requests started their prefill before this one.
    passed_over: usize,
    /// The paths that ran the forward passes this request took part in.
    paths: Paths,
}

impl Request {
    fn stats(&self) -> RequestStats {
        let ms =
            |from: Instant, to: Option<Instant>| to.map_or(0.0, |t| (t - from).as_secs_f64() * 1e3);
        let generated = self.row.generated.len();
        let decode_ms = match (self.first_token, self.last_token) {
            (Some(a), Some(b)) => (b - a).as_secs_f64() * 1e3,
            _ => 0.0,
        };
        RequestStats {
            prompt_tokens: self.prompt.len(),
            cached_tokens: self.cached_tokens,
            generated_tokens: generated,
            queue_ms: ms(self.admitted, self.prefill_started),
            prefill_ms: self
                .prefill_started
                .map_or(0.0, |s| ms(s, self.first_token)),
            time_to_first_token_ms: ms(self.admitted, self.first_token),
            decode_tokens_per_s: if generated > 1 && decode_ms > 0.0 {
                (generated - 1) as f64 / (decode_ms / 1e3)
            } else {
                0.0
            },
            constraint_ms: self.constraint_ms,
            paths: self.paths.clone(),
            kv_dtype: None,
        }
    }

    /// Takes a sampled token; returns the delta. A constrained row whose
    /// output was already complete ends without it; one the token completes
    /// ends after it.
    fn accept(&mut self, token: u32, tokenizer: Option<&Tokenizer>) -> Result<RowDelta> {
        let mut delta = RowDelta::default();
        if self
            .constraint
            .as_ref()
            .is_some_and(RowConstraint::is_complete)
        {
            self.row.end(FinishReason::Stop, tokenizer, &mut delta)?;
            return Ok(delta);
        }
        let now = Instant::now();
        self.first_token.get_or_insert(now);
        self.last_token = Some(now);
        self.row
            .accept(token, &self.options, &self.eos, tokenizer, &mut delta)?;
        if let (Some(c), None) = (self.constraint.as_mut(), self.row.finish) {
            let started = Instant::now();
            let complete = c.consume(token)?;
            self.constraint_ms += started.elapsed().as_secs_f64() * 1e3;
            if complete {
                self.row.end(FinishReason::Stop, tokenizer, &mut delta)?;
            }
        }
        Ok(delta)
    }
}

/// A request whose prompt is being run, with its own cache.
struct Prefill {
    request: Request,
    cache: KvCache,
    done: usize,
}

/// A row of the running batch.
struct Running {
    request: Request,
    /// Where the next token's key and value go.
    position: i32,
    next: u32,
}

pub struct Scheduler {
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    config: SchedulerConfig,
    workers: Vec<Lease>,
    cache: SlotCache,
    slots: Vec<Option<Running>>,
    queue: VecDeque<Request>,
    prefill: Option<Prefill>,
    prefix: PrefixCache,
    next_id: Arc<AtomicU64>,
    /// Reused host buffer for the constrained rows' masks.
    masks: Vec<u32>,
    /// Calls in a row that returned before any decode step (see `step_into`).
    held: usize,
}

impl Scheduler {
    pub fn new(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        mut config: SchedulerConfig,
    ) -> Result<Self> {
        if config.slots == 0 || config.slots > 1024 {
            return Err(Error::invalid("slots must be between 1 and 1024"));
        }
        if config.capacity < 2 || config.capacity > i32::MAX as usize {
            return Err(Error::invalid(
                "capacity must be at least 2 positions and fit an i32",
            ));
        }
        if config.prefill_chunk == 0 {
            return Err(Error::invalid("prefill_chunk must be at least 1"));
        }
        request::check_tokenizer(&model, tokenizer.as_deref())?;
        if let Some(dtype) = config.kv_dtype {
            crate::exec::generate::check_kv_dtype(dtype)?;
        }
        // The slots' dtype, reported by `config()`.
        let on_cpu = DeviceKind::default_kind() == DeviceKind::Cpu;
        let kv_shape = model
            .kv_shape()
            .by_default(on_cpu)
            .in_dtype(config.kv_dtype);
        config.kv_dtype = Some(kv_shape.dtype);
        crate::runtime::memory::ensure_fits(
            slot_cache_bytes(&kv_shape, config.slots, config.capacity),
            &format!(
                "a KV cache of {} slots x {} positions",
                config.slots, config.capacity
            ),
        )?;
        let workers = if model.parallel_ways > 1 && on_cpu {
            Lease::workers(DeviceKind::Cpu, model.parallel_ways)?
        } else {
            vec![]
        };
        let cache = SlotCache::new(&kv_shape, config.slots as i32, config.capacity as i32)?;
        Ok(Scheduler {
            prefix: PrefixCache::new(config.prefix_cache_bytes, config.prefix_min_tokens),
            slots: (0..config.slots).map(|_| None).collect(),
            model,
            tokenizer,
            config,
            workers,
            cache,
            queue: VecDeque::new(),
            prefill: None,
            next_id: Arc::new(AtomicU64::new(1)),
            masks: vec![],
            held: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The shape (and dtype) of this scheduler's KV caches.
    pub(crate) fn kv_shape(&self) -> KvShape {
        self.model.kv_shape().in_dtype(self.config.kv_dtype)
    }

    /// Queues a request; its tokens come from later [`step`](Self::step)s.
    /// `options.rows` is ignored: the sampler's seed is the request's own.
    pub fn admit(&mut self, prompt: Vec<u32>, options: GenerateOptions) -> Result<RequestId> {
        self.admit_constrained(prompt, options, None)
    }

    /// [`admit`](Self::admit) with what the output must match (needs a
    /// tokenizer). The constraint is compiled here, so a bad schema, regex
    /// or grammar is an error and nothing is queued.
    pub fn admit_constrained(
        &mut self,
        prompt: Vec<u32>,
        options: GenerateOptions,
        constraint: Option<ConstraintSpec>,
    ) -> Result<RequestId> {
        let request = self.admission().prepare(prompt, options, constraint)?;
        let id = request.id;
        self.queue.push_back(request);
        Ok(id)
    }

    /// What checks and prepares requests for this scheduler apart from it,
    /// so that a [`Driver`] admits on its callers' threads.
    fn admission(&self) -> Admission {
        Admission {
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            capacity: self.config.capacity,
            kv_shape: self.kv_shape(),
            next_id: self.next_id.clone(),
        }
    }

    /// Drops a request wherever it is (queued, mid-prefill, decoding) and
    /// frees what it holds. Returns whether it was found.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.queue.iter().position(|r| r.id == id) {
            self.queue.remove(i);
            return true;
        }
        if self.prefill.as_ref().is_some_and(|p| p.request.id == id) {
            self.prefill = None;
            return true;
        }
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|r| r.request.id == id) {
                *slot = None;
                return true;
            }
        }
        false
    }

    pub fn occupancy(&self) -> Occupancy {
        Occupancy {
            running: self.slots.iter().filter(|s| s.is_some()).count(),
            slots: self.slots.len(),
            waiting: self.queue.len() + usize::from(self.prefill.is_some()),
            prefix_entries: self.prefix.len(),
            prefix_bytes: self.prefix.bytes(),
        }
    }

    /// Whether nothing is queued, prefilling or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.prefill.is_none() && self.slots.iter().all(Option::is_none)
    }

    /// Drops every stored prompt prefix.
    pub fn clear_prefix_cache(&mut self) {
        self.prefix.clear();
    }

    /// Runs one prompt chunk (when a slot is free for it) and up to
    /// `max_decode_steps` decode steps of the running batch. Returns the
    /// requests' new tokens, one event per request that produced any.
    pub fn step(&mut self, max_decode_steps: usize) -> Result<Vec<Event>> {
        self.step_within(max_decode_steps, None)
    }

    /// [`step`](Self::step), starting no decode step once `budget` has
    /// passed (at least one runs): a call then lasts about the same time
    /// whatever a step costs on this device and model, so short steps share
    /// the call's fixed cost and long ones do not hold later requests back.
    pub fn step_within(
        &mut self,
        max_decode_steps: usize,
        budget: Option<Duration>,
    ) -> Result<Vec<Event>> {
        let deadline = budget.map(|b| Instant::now() + b);
        let mut events: Vec<Event> = vec![];
        self.step_here(max_decode_steps, deadline, None, &mut events)?;
        Ok(events)
    }

    fn step_here(
        &mut self,
        max_decode_steps: usize,
        deadline: Option<Instant>,
        driven: Option<&mut Driven>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let result = self.step_into(max_decode_steps, deadline, driven, events);
        // Nothing stays queued between calls: the next may come on another
        // thread, whose default stream cannot schedule this one's arrays.
        transforms::eval(self.cache.arrays())?;
        result
    }

    fn step_into(
        &mut self,
        max_decode_steps: usize,
        mut deadline: Option<Instant>,
        driven: Option<&mut Driven>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let seated = self.prefill_together(events)?
            || match self.prefill_chunk()? {
                Some(event) => {
                    push(events, event);
                    true
                }
                None => false,
            };
        // Requests that come together reach the scheduler between its
        // calls, or more of them than one prefill pass takes: the first are
        // seated alone, and a full call of decode steps would run them far
        // ahead of the others (on a fast device, most of their answers)
        // before those can join. So a call that seats rows returns early:
        // at once while no row has taken a step and others may still join,
        // so that rows of equal prompts keep one position and step without
        // a mask; after one step when nobody waits. At most `slots` calls in
        // a row return at once (requests that end at their first token take
        // no slot), so the rows seated keep their pace.
        let fresh = || {
            self.slots
                .iter()
                .flatten()
                .all(|r| r.position as usize == r.request.prompt.len())
        };
        let mut steps = if !seated {
            max_decode_steps
        } else if fresh()
            && (self.queue.is_empty() || self.free_slot().is_some())
            && self.held < self.slots.len()
        {
            0
        } else if self.queue.is_empty() {
            max_decode_steps.min(1)
        } else {
            max_decode_steps
        };
        self.held = if steps == 0 { self.held + 1 } else { 0 };
        // A driven scheduler's steps go on until it is interrupted or a
        // waiting request can be seated; the limits only keep a prompt being
        // prefilled, chunk by chunk, from waiting behind the batch.
        if driven.is_some() && !seated && !self.seat_waiting() && self.prefill.is_none() {
            steps = usize::MAX;
            deadline = None;
        }
        self.decode(steps, deadline, driven, events)
    }

    /// Whether a queued request could start its prefill now.
    fn seat_waiting(&self) -> bool {
        !self.queue.is_empty() && self.prefill.is_none() && self.free_slot().is_some()
    }
}

/// Checks a request against a scheduler's model and slots and prepares it
/// (its sampler, its compiled constraint, its id).
#[derive(Clone)]
struct Admission {
    model: Arc<Model>,
    tokenizer: Option<Arc<Tokenizer>>,
    capacity: usize,
    kv_shape: KvShape,
    next_id: Arc<AtomicU64>,
}

impl Admission {
    fn prepare(
        &self,
        prompt: Vec<u32>,
        mut options: GenerateOptions,
        constraint: Option<ConstraintSpec>,
    ) -> Result<Request> {
        self.validate(&prompt, &options)?;
        let constraint = match &constraint {
            Some(spec) => {
                let tokenizer = self.tokenizer.as_deref().ok_or_else(|| {
                    Error::InvalidConstraint("constrained decoding needs a tokenizer".into())
                })?;
                Some(RowConstraint::new(&*tokenizer.constraint_factory()?, spec)?)
            }
            None => None,
        };
        options.max_len = options.max_len.min(self.capacity);
        request::check_length(&prompt, options.max_len)?;
        let eos = request::eos_ids(&self.model, self.tokenizer.as_deref(), &options);
        let sampler = Sampler::new(options.sampler.clone(), &[options.sampler.seed])?;
        Ok(Request {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            row: Row::new(prompt.len()),
            prompt,
            options,
            eos,
            sampler,
            constraint,
            constraint_ms: 0.0,
            admitted: Instant::now(),
            prefill_started: None,
            first_token: None,
            last_token: None,
            cached_tokens: 0,
            passed_over: 0,
            paths: Paths::default(),
        })
    }

    fn validate(&self, prompt: &[u32], o: &GenerateOptions) -> Result<()> {
        request::check_prompt(&self.model, prompt)?;
        if o.kv_quant.is_some() || o.max_kv_size.is_some() {
            return Err(Error::invalid(
                "kv_bits and max_kv_size are not offered by the scheduler's slots: generate without a scheduler (scheduler: false) for a quantized or rotating KV cache",
            ));
        }
        let slots = self.kv_shape.dtype;
        if o.kv_dtype.is_some_and(|d| d != slots) {
            return Err(Error::invalid(format!(
                "this scheduler's slots keep {slots:?} keys and values, not the kv_dtype {:?} asked for: start the scheduler with that kv_dtype",
                o.kv_dtype.unwrap_or(slots)
            )));
        }
        request::check_options(o, self.tokenizer.is_some())
    }
}

/// `[1, V]` logits -> the sampled token, lazily where the sampler allows.
fn sample_one_lazy(sampler: &mut Sampler, logits: &Array) -> Result<Array> {
    if sampler.on_device() {
        sampler.sample_device(logits)
    } else {
        let ids = sampler.sample_host(logits)?;
        Ok(Array::from_slice(&ids, &[1]))
    }
}

fn sample_one(sampler: &mut Sampler, logits: &Array) -> Result<u32> {
    let token = sample_one_lazy(sampler, logits)?;
    token.eval()?;
    Ok(token.as_slice::<u32>()[0])
}

/// Adds `event` to the request's earlier one in this call, if any.
fn push(events: &mut Vec<Event>, event: Event) {
    match events.iter_mut().find(|e| e.id == event.id) {
        Some(e) => {
            e.delta.ids.extend(event.delta.ids);
            e.delta.text.push_str(&event.delta.text);
            e.delta.finish = event.delta.finish;
            e.stats = event.stats;
        }
        None => events.push(event),
    }
}
