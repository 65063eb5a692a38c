//! Every result says which path ran its work, and why a faster one declined.

mod common;

use common::*;
use emlx_axon_engine::backend::{Path, Work};
use emlx_axon_engine::{Dtype, Generation, LoadOptions, SamplerConfig, Scheduler, SchedulerConfig};

const FIXTURE: &str = "qwen3-4bit-g64";

fn run(model: std::sync::Arc<emlx_axon_engine::Model>) -> emlx_axon_engine::Stats {
    let prompts = vec![vec![785u32, 3974, 13, 5]];
    let mut generation = Generation::start(
        model,
        None,
        None,
        &prompts,
        options(6, SamplerConfig::default()),
    )
    .unwrap();
    while !generation.is_done() {
        generation.next(2).unwrap();
    }
    generation.stats()
}

/// Where MLX's default device is the CPU: a float32 4-bit model decodes
/// through the CPU layer kernels (where this machine runs them) and its
/// prompt through MLX's graph; in bfloat16 the CPU layers decline, and the
/// reason says so. Every forward pass is counted once.
#[test]
fn generations_report_the_paths_that_ran() {
    if emlx_axon_engine::runtime::device::gpu_available() {
        eprintln!("a GPU is MLX's default device: the CUDA paths are checked by the GPU tests");
        return;
    }
    let stats = run(load_f32(FIXTURE));
    let paths = &stats.paths;
    let passes: usize = paths.counts.values().sum();
    assert_eq!(passes, stats.forward_passes, "{paths:?}");
    assert_eq!(paths.main(Work::Prefill), Some(Path::Mlx), "{paths:?}");
    if emlx_axon_engine::backend::cpu::available() {
        assert_eq!(paths.main(Work::Decode), Some(Path::CpuLayers), "{paths:?}");
        assert!(paths.fallbacks.is_empty(), "{paths:?}");
    } else {
        assert_eq!(paths.main(Work::Decode), Some(Path::Mlx), "{paths:?}");
    }

    let bf16 = load(
        FIXTURE,
        &LoadOptions {
            dtype: Some(Dtype::Bfloat16),
            ..LoadOptions::default()
        },
    );
    let stats = run(bf16);
    assert_eq!(
        stats.paths.main(Work::Decode),
        Some(Path::Mlx),
        "{:?}",
        stats.paths
    );
    if emlx_axon_engine::backend::cpu::available() {
        assert!(
            stats
                .paths
                .fallbacks
                .iter()
                .any(|r| r.starts_with("cpu_layers:")),
            "{:?}",
            stats.paths
        );
    }
}

/// A scheduler's requests carry the paths of the passes they took part in.
#[test]
fn scheduler_requests_report_their_paths() {
    if emlx_axon_engine::runtime::device::gpu_available() {
        return;
    }
    let mut scheduler = Scheduler::new(
        load_f32(FIXTURE),
        None,
        SchedulerConfig {
            slots: 2,
            capacity: 64,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    let id = scheduler
        .admit(vec![785, 3974, 13], options(5, SamplerConfig::default()))
        .unwrap();
    let mut stats = None;
    for _ in 0..100 {
        for event in scheduler.step(4).unwrap() {
            if event.id == id && event.stats.is_some() {
                stats = event.stats;
            }
        }
        if stats.is_some() {
            break;
        }
    }
    let stats = stats.expect("the request finished");
    assert!(
        stats.paths.main(Work::Prefill).is_some(),
        "{:?}",
        stats.paths
    );
    let decode = stats.paths.main(Work::Decode);
    if emlx_axon_engine::backend::cpu::available() {
        assert_eq!(decode, Some(Path::CpuLayers), "{:?}", stats.paths);
    } else {
        assert_eq!(decode, Some(Path::Mlx), "{:?}", stats.paths);
    }
}
