//! Every environment switch the engine reads, each read once per process.
//!
//! | variable | default | effect |
//! |---|---|---|
//! | `EMLX_AXON_GPU_LAYER` | on | `0`: one-token steps on a CUDA GPU from MLX's ops instead of our layer kernels |
//! | `EMLX_AXON_GPU_GEMV` | on | `0`: the CUDA layer kernels with MLX's quantized products instead of ours |
//! | `EMLX_AXON_PREFILL_KERNELS` | on | `0`: prompts on a CUDA GPU from MLX's ops instead of the prompt kernels |
//! | `EMLX_AXON_STEP_REPLAY` | on | `0`: one-token CUDA steps in MLX's graph instead of replayed as one CUDA graph |
//! | `EMLX_AXON_CPU_THREADS` | cores | CPU worker streams a projection is split across (1 turns splitting off) |
//! | `EMLX_AXON_MASK_THREADS` | half the cores, at most 8 | threads (and parts of the vocabulary) one constrained row's mask is computed on (1: one thread) |
//! | `EMLX_AXON_KERNEL_CACHE` | `$XDG_CACHE_HOME/emlx_axon/cuda` | where compiled CUDA kernels are kept |
//!
//! The CPU kernels' crate (`emlx_axon_kernels`) reads its own:
//! `EMLX_AXON_KERNELS` (`mlx` off, `scalar`/`avx2` a lesser instruction
//! set), `EMLX_AXON_CPU_ACTIVATIONS` (`int8`), `EMLX_AXON_POOL_SPIN_US`, and
//! `EMLX_AXON_CPU_THREADS` too. The README's table lists them all.

use std::ffi::OsString;

use once_cell::sync::Lazy;

/// `name` set to `0` or `false`.
fn off(name: &str) -> bool {
    matches!(std::env::var(name).as_deref(), Ok("0") | Ok("false"))
}

static GPU_LAYER: Lazy<bool> = Lazy::new(|| !off("EMLX_AXON_GPU_LAYER"));
static GPU_GEMV: Lazy<bool> = Lazy::new(|| !off("EMLX_AXON_GPU_GEMV"));
static PREFILL_KERNELS: Lazy<bool> = Lazy::new(|| !off("EMLX_AXON_PREFILL_KERNELS"));
static STEP_REPLAY: Lazy<bool> = Lazy::new(|| !off("EMLX_AXON_STEP_REPLAY"));
static CPU_THREADS: Lazy<Option<usize>> = Lazy::new(|| {
    std::env::var("EMLX_AXON_CPU_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
});
static MASK_THREADS: Lazy<Option<usize>> = Lazy::new(|| {
    std::env::var("EMLX_AXON_MASK_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
});
static KERNEL_CACHE: Lazy<Option<OsString>> =
    Lazy::new(|| std::env::var_os("EMLX_AXON_KERNEL_CACHE"));

/// Whether one-token CUDA steps may take our layer kernels.
pub fn gpu_layer() -> bool {
    *GPU_LAYER
}

/// Whether the CUDA layer kernels use our quantized products.
pub fn gpu_gemv() -> bool {
    *GPU_GEMV
}

/// Whether CUDA prompts may take the prompt kernels.
pub fn prefill_kernels() -> bool {
    *PREFILL_KERNELS
}

/// Whether one-token CUDA steps may be replayed as one CUDA graph.
pub fn step_replay() -> bool {
    *STEP_REPLAY
}

/// The CPU worker streams asked for, if any.
pub fn cpu_threads() -> Option<usize> {
    *CPU_THREADS
}

/// The threads a constrained row's mask is computed on, if asked for.
pub fn mask_threads() -> Option<usize> {
    *MASK_THREADS
}

/// Where compiled CUDA kernels go, if chosen.
pub fn kernel_cache() -> Option<OsString> {
    KERNEL_CACHE.clone()
}

/// Each switch as it was read, for diagnostics (`EMLXAxon.mlx_info/0`).
pub fn all() -> Vec<(&'static str, String)> {
    let on_off = |b: bool| if b { "on" } else { "off" }.to_string();
    vec![
        ("EMLX_AXON_GPU_LAYER", on_off(gpu_layer())),
        ("EMLX_AXON_GPU_GEMV", on_off(gpu_gemv())),
        ("EMLX_AXON_PREFILL_KERNELS", on_off(prefill_kernels())),
        ("EMLX_AXON_STEP_REPLAY", on_off(step_replay())),
        (
            "EMLX_AXON_CPU_THREADS",
            cpu_threads().map_or("cores".into(), |n| n.to_string()),
        ),
        (
            "EMLX_AXON_MASK_THREADS",
            mask_threads().map_or("half the cores".into(), |n| n.to_string()),
        ),
        (
            "EMLX_AXON_KERNEL_CACHE",
            kernel_cache().map_or("default".into(), |p| p.to_string_lossy().into_owned()),
        ),
    ]
}
