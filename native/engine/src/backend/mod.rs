//! Each backend's fast paths, in a room of its own ([`cpu`], [`cuda`]), and
//! the record of which path ran.
//!
//! A forward pass is built from MLX's ops ([`crate::nn`]) unless a backend
//! takes the work: on a CPU stream, one-token steps run each layer as two
//! nodes of our CPU kernels ([`cpu::layer`]); on a CUDA GPU, one-token steps
//! run as a few kernels a layer ([`cuda::layer`]), replayed as one CUDA
//! graph when every node is ours ([`cuda::replay`]), and prompts take the
//! prompt kernels ([`cuda::prefill`]). Whichever path ran is noted here
//! (`note`) by the code that took it, with the reason a faster one did
//! not take the work, and [`Paths`] reaches every result's statistics:
//! no path is taken silently.

pub mod cpu;
pub mod cuda;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// The implementations a forward pass may run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Path {
    /// Steps replayed as one CUDA graph of our kernels.
    CudaReplay,
    /// Our CUDA kernels inside MLX's graph (one-token layers or prompt kernels).
    CudaLayers,
    /// Our CPU kernels, two nodes a layer.
    CpuLayers,
    /// MLX's own ops.
    Mlx,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::CudaReplay => "cuda_replay",
            Path::CudaLayers => "cuda_layers",
            Path::CpuLayers => "cpu_layers",
            Path::Mlx => "mlx",
        }
    }
}

/// What a forward pass did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Work {
    /// One token per row.
    Decode,
    /// Several tokens per row (a prompt or a chunk of one).
    Prefill,
}

/// The paths that ran a generation's (or a request's) work, how often, and
/// why faster ones declined.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Paths {
    /// Forward passes per (work, path).
    pub counts: BTreeMap<(Work, Path), usize>,
    /// Each reason a faster path did not take work, once.
    pub fallbacks: Vec<String>,
}

impl Paths {
    /// The path that ran most of `work` (`None` when none ran).
    pub fn main(&self, work: Work) -> Option<Path> {
        self.counts
            .iter()
            .filter(|((w, _), _)| *w == work)
            .max_by_key(|(&(_, path), &n)| (n, std::cmp::Reverse(path)))
            .map(|(&(_, path), _)| path)
    }

    /// [`Paths::main`]'s name, `"none"` when no such work ran.
    pub fn main_name(&self, work: Work) -> &'static str {
        self.main(work).map_or("none", Path::name)
    }

    /// Adds `other`'s counts and its fallbacks not yet here (a forward pass
    /// of a batch is merged into every row's, so it is borrowed).
    pub fn merge(&mut self, other: &Paths) {
        for (&key, &n) in &other.counts {
            *self.counts.entry(key).or_default() += n;
        }
        for reason in &other.fallbacks {
            if !self.fallbacks.contains(reason) {
                self.fallbacks.push(reason.clone());
            }
        }
    }
}

thread_local! {
    /// What ran on this thread since the last [`take`]: a bounded tally.
    static RAN: RefCell<Paths> = RefCell::new(Paths::default());
}

/// Records that `path` ran one forward pass of `work`, and why a faster path
/// declined it, if one did.
pub(crate) fn note(work: Work, path: Path, why_not_faster: Option<&str>) {
    RAN.with(|ran| *ran.borrow_mut().counts.entry((work, path)).or_default() += 1);
    if let Some(reason) = why_not_faster {
        declined(reason);
    }
}

/// Records why a faster path did not take work (kept once).
pub(crate) fn declined(reason: &str) {
    RAN.with(|ran| {
        let mut ran = ran.borrow_mut();
        if !ran.fallbacks.iter().any(|r| r == reason) && ran.fallbacks.len() < 32 {
            ran.fallbacks.push(reason.to_string());
        }
    });
}

/// What ran on this thread since the last call, and clears it.
pub fn take() -> Paths {
    RAN.with(|ran| std::mem::take(&mut *ran.borrow_mut()))
}

/// Process-wide notices: a kernel check that failed, a replay that was
/// turned off. Each is kept once, for the host application to log.
static NOTICES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Keeps `message` once (see [`notices`]).
pub(crate) fn notice(message: String) {
    let mut all = NOTICES.lock().unwrap_or_else(|p| p.into_inner());
    if !all.contains(&message) && all.len() < 64 {
        all.push(message);
    }
}

/// Every notice so far, oldest first.
pub fn notices() -> Vec<String> {
    NOTICES.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// What this build and device offer: each fast path and whether it can run
/// here (`Some(false)` once its check failed, `None` before it was checked).
pub fn offered() -> Vec<(&'static str, bool, Option<bool>)> {
    vec![
        ("cpu_layers", cpu::available(), Some(cpu::available())),
        ("cuda_layers", cuda::layer::wanted(), cuda::layer::checked()),
        (
            "cuda_prompt",
            cuda::layer::wanted() && cuda::prefill::wanted(),
            cuda::prefill::checked(),
        ),
        (
            "cuda_replay",
            cuda::layer::wanted() && cuda::replay::wanted(),
            cuda::replay::usable(),
        ),
    ]
}
