//! The compiled decode step: one token for every row of a batch, traced
//! once by MLX's `compile` and replayed, so that a step costs no graph
//! building and MLX fuses its elementwise work.
//!
//! A step's shapes must not change from step to step: every row writes its
//! new key and value at its own position of a preallocated cache (a
//! scatter, in place) and attends over a fixed number of keys, rounded up
//! to [`ATTEND_BUCKET`], through a mask built from the rows' positions.
//! Positions and the mask are arrays, so rows advance, join and leave
//! without a new trace; only the batch size and the bucket select one.
//!
//! MLX keeps compiled functions in a cache of the thread that calls them,
//! and a trace is bound to the stream it was made on. Callers run on
//! whichever thread (BEAM dirty schedulers hop), so each [`CompiledStep`]
//! owns a thread that makes every call: one trace per shape, and the
//! cache entry (which holds the weights) dies with the step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use mlx_rs::error::Exception;
use mlx_rs::Array;

use crate::device::MlxStream;
use crate::error::{Error, Result};
use crate::model::{AttentionMask, Model};
use crate::scheduler::SlotCache;

/// Attended keys are rounded up to a multiple of this: a new trace every
/// 256 positions, and at most 255 masked keys read in vain.
pub const ATTEND_BUCKET: i32 = 256;

/// Set when a compiled step failed: later requests run eager steps.
static FAILED: AtomicBool = AtomicBool::new(false);

/// Whether decode steps run compiled: only when `EMLX_AXON_COMPILED_DECODE=1`.
/// Off by default on every device: on an NVIDIA H200 the compiled step
/// decoded at 195 tok/s against the eager step's 348 (Qwen3-0.6B shape,
/// bf16, batch 1), its explicit stream costing more than the trace saves
/// (bench/RESULTS-gpu.md); on a 2-core CPU (same shape, float32, 4-bit, one
/// stream) 38.5-39.2 tok/s against the eager step's 42.5, measured before
/// RMSNorm, RoPE and SwiGLU became single nodes of our CPU kernels (which
/// leaves a trace less to fuse); not profiled.
pub fn enabled() -> bool {
    if FAILED.load(Ordering::Relaxed) {
        return false;
    }
    crate::switch::on("EMLX_AXON_COMPILED_DECODE")
}

/// The keys a step attends to when the furthest row writes at `position`.
pub fn attend_for(position: i32, capacity: i32) -> i32 {
    let needed = position + 1;
    ((needed + ATTEND_BUCKET - 1) / ATTEND_BUCKET * ATTEND_BUCKET).min(capacity)
}

/// One step's arrays besides the cache.
pub struct StepInputs {
    /// `[rows, 1]` token ids.
    pub ids: Array,
    /// `[rows]` int32: where each row's token goes (and its RoPE position).
    pub positions: Array,
    /// `[slots, 1, 1, 1]` int32: the positions, padded over the cache's
    /// slots that the step does not run.
    pub scatter_at: Array,
    /// `[rows, 1, 1, attend]` bool: the keys each row sees, which are
    /// `starts[b]..ends[b]` (`[rows]` int32).
    pub mask: Array,
    pub starts: Array,
    pub ends: Array,
}

type Reply = std::result::Result<Vec<Array>, (Error, Vec<Array>)>;

struct Job {
    inputs: Vec<Array>,
    reply: mpsc::SyncSender<Reply>,
}

pub struct CompiledStep {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// A model's compiled steps, by stream index.
pub(crate) type Steps = Mutex<HashMap<i32, Arc<CompiledStep>>>;

/// `model`'s compiled step on `stream`, made on first use and kept with the
/// model: requests on a stream share one trace per shape, so only the first
/// pays for tracing. Calls on one stream are serialized by its gate.
pub fn for_stream(model: &Arc<Model>, stream: &MlxStream) -> Result<Arc<CompiledStep>> {
    let mut steps = model
        .compiled_steps
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(step) = steps.get(&stream.index()) {
        return Ok(step.clone());
    }
    let step = Arc::new(CompiledStep::new(model, stream.clone())?);
    steps.insert(stream.index(), step.clone());
    Ok(step)
}

impl CompiledStep {
    /// A step for `model` traced on `stream`.
    fn new(model: &Arc<Model>, stream: MlxStream) -> Result<Self> {
        let model = Arc::downgrade(model);
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("emlx-decode-step".into())
            .stack_size(crate::device::LARGE_STACK_BYTES)
            .spawn(move || {
                let trace = move |args: &[Array]| -> std::result::Result<Vec<Array>, Exception> {
                    traced_step(&model, args).map_err(|e| Exception::custom(e.to_string()))
                };
                let mut step = mlx_rs::transforms::compile::compile(trace, false);
                let default = stream.make_thread_default();
                // Checks the attention kernel now: a trace cannot evaluate.
                stream.run_leased(crate::decode_attention::available);
                for Job { inputs, reply } in queue {
                    if let Err(e) = &default {
                        let _ = reply.send(Err((Error::Mlx(e.to_string()), inputs)));
                        continue;
                    }
                    // The caller holds the stream's gate while it waits.
                    let outcome = stream.run_leased(|| step(&inputs));
                    let answer = match outcome {
                        // Dropping our handles leaves the old cache buffers
                        // to the graph alone, so the scatters write in place.
                        Ok(outputs) => {
                            drop(inputs);
                            Ok(outputs)
                        }
                        Err(e) => Err((Error::from(e), inputs)),
                    };
                    let _ = reply.send(answer);
                }
            })
            .map_err(|e| Error::Mlx(format!("could not start the decode step's thread: {e}")))?;
        Ok(CompiledStep {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Queues one step: returns the logits `[rows, 1, vocab]` (lazy) and
    /// replaces `layers` (per layer `[slots, kv_heads, capacity, head_dim]`
    /// keys and values) with their updated buffers. On failure `layers` are
    /// left as they were.
    pub fn run(&self, step: StepInputs, layers: &mut Vec<(Array, Array)>) -> Result<Array> {
        let count = layers.len();
        let mut inputs = Vec::with_capacity(INPUTS + 2 * count);
        inputs.extend([
            step.ids,
            step.positions,
            step.scatter_at,
            step.mask,
            step.starts,
            step.ends,
        ]);
        inputs.extend(flatten(layers.drain(..)));
        let (reply, answer) = mpsc::sync_channel(1);
        let gone = || Error::Mlx("the decode step's thread has stopped".into());
        let jobs = self.jobs.as_ref().ok_or_else(gone)?;
        if let Err(mpsc::SendError(job)) = jobs.send(Job { inputs, reply }) {
            restore(layers, job.inputs);
            return Err(gone());
        }
        match answer.recv().map_err(|_| gone())? {
            Ok(outputs) if outputs.len() == 1 + 2 * count => {
                layers.extend(pairs(&outputs[1..]));
                Ok(outputs.into_iter().next().expect("checked length"))
            }
            Ok(_) => Err(Error::Mlx(
                "the compiled decode step returned the wrong number of arrays".into(),
            )),
            Err((e, inputs)) => {
                restore(layers, inputs);
                // The caller runs the step eagerly instead (the cache is as
                // it was); a step that cannot be compiled here never will be.
                if !FAILED.swap(true, Ordering::Relaxed) {
                    eprintln!("emlx_axon: compiled decode steps turned off: {e}");
                }
                Err(e)
            }
        }
    }
}

impl Drop for CompiledStep {
    /// Ends the thread, and with it the trace and its hold on the weights.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            // The model (and so this step) may end on the step's own thread
            // if a trace held the last reference: that thread is ending.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn restore(layers: &mut Vec<(Array, Array)>, inputs: Vec<Array>) {
    layers.extend(pairs(&inputs[INPUTS.min(inputs.len())..]));
}

/// Per-layer keys and values from `[k0, v0, k1, v1, ...]`.
fn pairs(arrays: &[Array]) -> impl Iterator<Item = (Array, Array)> + '_ {
    arrays.chunks(2).map(|p| (p[0].clone(), p[1].clone()))
}

/// `[k0, v0, k1, v1, ...]` from per-layer keys and values.
fn flatten(layers: impl IntoIterator<Item = (Array, Array)>) -> impl Iterator<Item = Array> {
    layers.into_iter().flat_map(|(k, v)| [k, v])
}

/// Arrays of a step before the cache's.
const INPUTS: usize = 6;

/// What `compile` traces: `[ids, positions, scatter_at, mask, starts, ends,
/// k0, v0, ...]` -> `[logits, k0', v0', ...]`.
fn traced_step(model: &Weak<Model>, args: &[Array]) -> Result<Vec<Array>> {
    let model = model
        .upgrade()
        .ok_or_else(|| Error::invalid("the model was freed"))?;
    let [ids, positions, scatter_at, mask, starts, ends, cache @ ..] = args else {
        return Err(Error::invalid(
            "a decode step takes ids, positions and masks",
        ));
    };
    let mut cache = SlotCache::traced(
        pairs(cache).collect(),
        positions.clone(),
        scatter_at.clone(),
        ids.dim(0),
        mask.dim(-1),
    );
    let mask = AttentionMask::Ranges {
        mask: mask.clone(),
        starts: starts.clone(),
        ends: ends.clone(),
    };
    let logits = model.forward(ids, &mut cache, &mask, false, &[])?;
    Ok(std::iter::once(logits)
        .chain(flatten(cache.into_layers()))
        .collect())
}
