//! Decode steps as replays of one recorded step ([`crate::backend::cuda::replay`]):
//! rows on a CUDA GPU, greedy or sampled by our kernel (whose draws hash
//! each row's position, which the replay advances), where every node of a
//! step is a kernel of ours. Constrained rows' masks go to the device as
//! bits each step: the step's forward pass is queued while the host
//! computes them, its sampling once they are written. On unless the options
//! or `EMLX_AXON_STEP_REPLAY=0` turn it off.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::backend::cuda::kernel::{mark, record, Role};
use crate::backend::{declined, note, notice, Path, Work};

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::{transforms, Array};

use super::Generation;
use crate::backend::cuda::replay::{self, exact_copy, Built, StepReplay};
use crate::error::{Error, Result};
use crate::kv::cache::KvStore;

/// Steps a generation must have left for its replay to be built: building
/// one (a recorded step, the capture and a checked replay) took 8-12 ms on
/// an NVIDIA H200, where a replayed step saves 0.3-1.2 ms against MLX's.
const MIN_STEPS_LEFT: usize = 32;

/// Set once a replay could not be built for another reason (CUDA, memory),
/// said once; later generations still try.
static SAID: AtomicBool = AtomicBool::new(false);

/// A queued step's tokens.
pub(super) enum Pending {
    /// As an MLX array `[B]` (uint32), possibly still being computed.
    Array(Array),
    /// The replay's step of this number.
    Replayed(u64),
}

impl Pending {
    pub(super) fn array(&self) -> Option<&Array> {
        match self {
            Pending::Array(a) => Some(a),
            Pending::Replayed(_) => None,
        }
    }
}

/// A replayed step's tokens asked for where there is no replay.
fn orphan() -> Error {
    Error::Mlx("a replayed step without its replay".into())
}

/// Whether steps are replayed.
pub(super) enum Replay {
    /// Not tried yet: the next step is recorded if the generation allows.
    Untried,
    Off,
    On(StepReplay),
}

impl Generation {
    /// Queues the step after `current`: a replay, the recorded step that
    /// starts them, or MLX's graph.
    pub(super) fn queue_step(&mut self, current: &Pending) -> Result<Pending> {
        if let Replay::On(replay) = &mut self.replay {
            // The replay feeds each step's tokens to the next itself.
            let n = replay.launch()?;
            return Ok(self.replayed(n));
        }
        let Pending::Array(current) = current else {
            return Err(orphan());
        };
        if self.may_record() {
            match self.not_replayed() {
                None => return self.record_step(current),
                // On a CPU stream a replay does not apply: nothing stepped
                // aside.
                Some(why) if replay::wanted() && !crate::runtime::device::on_cpu_stream() => {
                    declined(why);
                    self.collect_paths();
                }
                Some(_) => {}
            }
            self.replay = Replay::Off;
        }
        Ok(Pending::Array(self.step(current)?))
    }

    /// Whether the next step may be recorded for a replay: not before the
    /// first token is out (recording waits for its step, and building takes
    /// a few milliseconds), and for sampled rows not before the sampling
    /// kernel's check (at its first use): a recorded step that samples with
    /// MLX's ops is refused for good.
    pub(super) fn may_record(&self) -> bool {
        let vocab = self.model.config.vocab_size.max(0) as usize;
        let unchecked = self.sampler.kernel_ready(vocab).is_none() && replay::wanted();
        matches!(self.replay, Replay::Untried) && self.steps > 0 && !unchecked
    }

    /// Whether steps are replayed with masks the host writes (constrained
    /// rows): each step's head is queued before its tokens' masks are known.
    pub(super) fn replays_masked(&self) -> bool {
        matches!(&self.replay, Replay::On(r) if r.masked())
    }

    /// The rest of a replayed step whose head is queued: this step's masks
    /// (for the tokens just taken), then its sampling.
    pub(super) fn queue_masked_tail(&mut self) -> Result<Pending> {
        let vocab = self.model.config.vocab_size.max(0) as usize;
        self.constraints
            .prepare(&self.rows, &self.eos, self.options.ignore_eos, vocab)?;
        let Replay::On(replay) = &mut self.replay else {
            return Err(orphan());
        };
        replay.set_mask(self.constraints.mask_words())?;
        let n = replay.launch()?;
        Ok(self.replayed(n))
    }

    /// A replayed step queued: step `n` of the replay.
    fn replayed(&mut self, n: u64) -> Pending {
        note(Work::Decode, Path::CudaReplay, None);
        self.collect_paths();
        self.cache.advance(1);
        self.forward_passes += 1;
        Pending::Replayed(n)
    }

    /// `current`'s tokens, one a row, once they are known.
    pub(super) fn read(&mut self, current: &Pending) -> Result<Vec<u32>> {
        match (current, &mut self.replay) {
            (Pending::Array(a), _) => {
                a.eval()?;
                let tokens = a.as_slice::<u32>().to_vec();
                crate::sample::check_drawn(&tokens)?;
                Ok(tokens)
            }
            (Pending::Replayed(n), Replay::On(replay)) => replay.tokens(*n),
            (Pending::Replayed(_), _) => Err(orphan()),
        }
    }

    /// Why this generation's steps are not replayed (`None`: they can be):
    /// replays must be on, repay their build, and run unpadded rows one
    /// token a step, greedy or sampled by our kernel, on a GPU stream
    /// through the model's own layers.
    pub(super) fn not_replayed(&self) -> Option<&'static str> {
        let offset = self.cache.offset().max(0) as usize;
        let steps_left = (self.options.max_new_tokens.saturating_sub(self.steps))
            .min(self.options.max_len.saturating_sub(offset))
            .min((self.cache.capacity().max(0) as usize).saturating_sub(offset));
        // Of those, the recorded step and the one not yet read are no replays.
        let why = if !replay::wanted() {
            "cuda_replay: off in this build, device or environment"
        } else if replay::usable() == Some(false) {
            "cuda_replay: a replay differed from MLX's step in this process (see the notices)"
        } else if self.model.steps_not_replayable.load(Ordering::Relaxed) {
            "cuda_replay: this model's steps are not all our kernels"
        } else if !self.options.step_replay {
            "cuda_replay: turned off by the generation's options"
        } else if self.options.kv_quant.is_some() {
            "cuda_replay: the KV cache is quantized, or will be"
        } else if self.options.max_kv_size.is_some() {
            "cuda_replay: the KV cache is a rotating window"
        } else if steps_left.saturating_sub(2) < MIN_STEPS_LEFT {
            "cuda_replay: too few steps left to repay building a replay"
        } else if !self.sampler.is_greedy()
            && self
                .sampler
                .kernel_ready(self.model.config.vocab_size.max(0) as usize)
                != Some(true)
        {
            "cuda_replay: sampled rows are replayed only with the sampling kernel"
        } else if self.constraints.runs_ahead() {
            "cuda_replay: a constrained row runs ahead through its forced tokens"
        } else if self.padding.is_some() {
            "cuda_replay: padded rows are not replayed"
        } else if !self.workers.is_empty() || crate::runtime::device::on_cpu_stream() {
            "cuda_replay: not on a GPU stream"
        } else {
            return None;
        };
        Some(why)
    }

    /// Runs the step after `current` through MLX while recording it, then
    /// builds its replay. Where the replay cannot be built or differs from
    /// MLX's run, the recorded step stands and MLX runs the rest.
    fn record_step(&mut self, current: &Array) -> Result<Pending> {
        self.replay = Replay::Off;
        let at = self.cache.offset();
        transforms::eval(self.cache.arrays().chain([current]))?;
        let (next, recording) = record(|| {
            let ids = current.reshape(&[current.dim(0), 1])?;
            mark(Role::Ids, &ids);
            let logits = self.forward(&ids, false)?;
            self.sample(&logits)
        })?;
        // The keys and values the step wrote, for putting back if the
        // replay's check wrote others.
        let written = self
            .cache
            .arrays()
            .map(|a| exact_copy(&a.index((.., .., at..at + 1, ..))))
            .collect::<Result<Vec<_>>>()?;
        // The tokens as MLX computed them: the check's replay writes its own
        // into `next`'s buffer.
        let kept = exact_copy(&next)?;
        transforms::eval(written.iter().chain([&next, &kept]))?;
        let said = match StepReplay::build(recording, &next, &kept) {
            Ok(Built::Ready(replay)) => {
                self.replay = Replay::On(replay);
                return Ok(Pending::Array(kept));
            }
            // Refused before anything ran: a step of MLX's own ops, as
            // expected of models the fused layers do not cover, and so for
            // every later generation of this model.
            Err(Error::Unsupported(_)) => {
                self.model
                    .steps_not_replayable
                    .store(true, Ordering::Relaxed);
                return Ok(Pending::Array(kept));
            }
            Ok(Built::Differs(why)) => {
                (!replay::set_differed()).then(|| format!("for the rest of this process ({why})"))
            }
            Err(e) => (!SAID.swap(true, Ordering::Relaxed)).then(|| format!("({e})")),
        };
        if let Some(said) = said {
            notice(format!("decode steps stay in MLX's graph {said}"));
        }
        // The check's replay may have written the cache rows: MLX's go back.
        let mut written = written.into_iter();
        for (k, v) in self.cache.layers_mut() {
            for (a, row) in [(k, written.next()), (v, written.next())] {
                if let Some(row) = row {
                    a.try_index_mut((.., .., at..at + 1, ..), row)?;
                }
            }
        }
        transforms::eval(self.cache.arrays())?;
        Ok(Pending::Array(kept))
    }
}
