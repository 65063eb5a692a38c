//! Decode steps replayed as one CUDA graph give MLX's own tokens: greedy
//! generations with the replay on and off, alone, batched and side by side
//! on streams of their own, sampled ones, and constrained ones (their masks
//! written to the device each step). Where there is no CUDA GPU the replay
//! must not be used at all.

mod common;

use std::sync::Arc;

use common::tokenizer;
use common::{gpu_kernels_on, load, options, reference};
use emlx_axon_engine::backend::{Path, Paths, Work};
use emlx_axon_engine::runtime::device::{DeviceKind, MlxStream};
use emlx_axon_engine::{
    ConstraintSpec, GenerateOptions, Generation, LoadOptions, Model, RowOptions, SamplerConfig,
    SamplerKind, Stats,
};

const FIXTURE: &str = "qwen3-4bit-g64";

/// Whether this machine replays the fixture's steps.
fn replays_here() -> bool {
    gpu_kernels_on("EMLX_AXON_STEP_REPLAY")
}

/// Generated ids, and whether any step was replayed.
fn run(
    model: &Arc<Model>,
    stream: Option<MlxStream>,
    prompts: &[Vec<u32>],
    step_replay: bool,
) -> (Vec<Vec<u32>>, bool) {
    run_for(model, stream, prompts, step_replay, 40)
}

fn run_for(
    model: &Arc<Model>,
    stream: Option<MlxStream>,
    prompts: &[Vec<u32>],
    step_replay: bool,
    tokens: usize,
) -> (Vec<Vec<u32>>, bool) {
    let opts = GenerateOptions {
        step_replay,
        ..options(tokens, SamplerConfig::default())
    };
    let mut g = Generation::start(model.clone(), None, stream, prompts, opts).unwrap();
    let mut replayed = false;
    while !g.is_done() {
        g.next(5).unwrap();
        replayed |= g.replays_steps();
    }
    // The statistics say so too: replayed steps are most of the decode.
    let paths = g.stats().paths;
    assert_eq!(
        paths.main(Work::Decode) == Some(Path::CudaReplay),
        replayed,
        "{paths:?}"
    );
    if !replayed && step_replay && replays_here() {
        assert!(
            paths
                .fallbacks
                .iter()
                .any(|r| r.starts_with("cuda_replay:")),
            "{paths:?}"
        );
    }
    (g.generated(), replayed)
}

fn prompts() -> Vec<Vec<u32>> {
    reference(FIXTURE, "").into_iter().map(|r| r.1).collect()
}

#[test]
fn replayed_steps_give_the_tokens_of_mlx_steps() {
    let model = load(FIXTURE, &LoadOptions::default());
    let prompt = prompts().swap_remove(0);
    for rows in [vec![prompt.clone()], vec![prompt; 3]] {
        let (want, off) = run(&model, None, &rows, false);
        assert!(!off, "replayed although turned off");
        let (got, on) = run(&model, None, &rows, true);
        assert_eq!(got, want, "{} rows", rows.len());
        assert_eq!(on, replays_here(), "{} rows: replayed", rows.len());
    }
}

/// Timing a replay's kernels (the bench's profile) reruns them on the
/// step's buffers: the generation's tokens stay MLX's, and every kernel of
/// the step gets a time.
#[test]
fn timing_a_replays_kernels_leaves_its_tokens_alone() {
    use emlx_axon_engine::backend::cuda::replay::{kernel_times, time_next};
    let model = load(FIXTURE, &LoadOptions::default());
    let rows = vec![prompts().swap_remove(0)];
    let (want, _) = run(&model, None, &rows, false);
    time_next();
    let (got, on) = run(&model, None, &rows, true);
    assert_eq!(got, want);
    let times = kernel_times();
    assert_eq!(times.is_some(), on, "{times:?}");
    if let Some(times) = times {
        // The fixture's layers, a few kernels each, and its sampling.
        assert!(times.len() > model.config.num_layers, "{times:?}");
        for (name, us) in &times {
            assert!(
                name.starts_with("emlx_axon_") && *us > 0.0 && *us < 1e5,
                "{name}: {us}"
            );
        }
    }
    assert!(kernel_times().is_none(), "taken once");
}

#[test]
fn short_generations_keep_mlx_steps() {
    // Too few steps left to repay building a replay.
    let model = load(FIXTURE, &LoadOptions::default());
    let rows = vec![prompts().swap_remove(0)];
    let (want, _) = run_for(&model, None, &rows, false, 20);
    let (got, on) = run_for(&model, None, &rows, true, 20);
    assert_eq!(got, want);
    assert!(!on, "a 20-token generation was replayed");
}

#[test]
fn replays_side_by_side_on_streams_of_their_own() {
    let model = load(FIXTURE, &LoadOptions::default());
    let prompts = prompts();
    let wants: Vec<_> = prompts
        .iter()
        .map(|p| run(&model, None, std::slice::from_ref(p), false).0)
        .collect();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let model = model.clone();
            let prompt = prompts[i % prompts.len()].clone();
            std::thread::spawn(move || {
                let stream = MlxStream::new(DeviceKind::default_kind()).unwrap();
                run(&model, Some(stream), &[prompt], true)
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (got, on) = h.join().unwrap();
        assert_eq!(got, wants[i % prompts.len()], "thread {i}");
        assert_eq!(on, replays_here(), "thread {i}: replayed");
    }
}

/// Qwen3's recommended sampling, seeded.
fn qwen3_sampling(seed: u64) -> SamplerConfig {
    SamplerConfig {
        kind: SamplerKind::TopPGpu,
        temperature: 0.6,
        top_p: 0.95,
        top_k: 20,
        min_p: 0.0,
        min_tokens_to_keep: 1,
        seed: Some(seed),
    }
}

/// A sampled generation's ids and paths.
fn run_sampled(
    model: &Arc<Model>,
    prompts: &[Vec<u32>],
    step_replay: bool,
    seed: u64,
) -> (Vec<Vec<u32>>, Paths) {
    let opts = GenerateOptions {
        step_replay,
        ..options(64, qwen3_sampling(seed))
    };
    let mut g = Generation::start(model.clone(), None, None, prompts, opts).unwrap();
    while !g.is_done() {
        g.next(5).unwrap();
    }
    (g.generated(), g.stats().paths)
}

/// Whether sampled steps are replayed here: the CUDA kernels run, the
/// sampling kernel passed its check, and replays are on.
fn sampled_replays_here() -> bool {
    replays_here() && emlx_axon_engine::backend::cuda::layer::sample_checked() == Some(true)
}

#[test]
fn sampled_steps_replay_with_the_tokens_of_mlx_steps() {
    if !emlx_axon_engine::runtime::device::gpu_available() {
        eprintln!("skipped: sampled steps are replayed only on a CUDA GPU");
        return;
    }
    let model = load(FIXTURE, &LoadOptions::default());
    let prompt = prompts().swap_remove(0);
    for rows in [vec![prompt.clone()], vec![prompt; 3]] {
        let (want, off) = run_sampled(&model, &rows, false, 7);
        assert_ne!(off.main(Work::Decode), Some(Path::CudaReplay), "{off:?}");
        let (got, on) = run_sampled(&model, &rows, true, 7);
        assert_eq!(got, want, "{} rows", rows.len());
        if !sampled_replays_here() {
            eprintln!(
                "skipped the replay's part: no sampled replays here ({:?})",
                on.fallbacks
            );
            continue;
        }
        assert_eq!(on.main(Work::Decode), Some(Path::CudaReplay), "{on:?}");
        assert!(
            !on.fallbacks
                .iter()
                .any(|r| r.starts_with("sample kernel:") && !r.contains("a prompt's token")),
            "{on:?}"
        );
    }
}

#[test]
fn sampled_replays_repeat_by_seed() {
    if !emlx_axon_engine::runtime::device::gpu_available() {
        eprintln!("skipped: sampled steps are replayed only on a CUDA GPU");
        return;
    }
    let model = load(FIXTURE, &LoadOptions::default());
    let rows = vec![prompts().swap_remove(0); 2];
    let (a, paths) = run_sampled(&model, &rows, true, 7);
    let (b, _) = run_sampled(&model, &rows, true, 7);
    assert_eq!(a, b, "the same seed drew other tokens");
    let (c, _) = run_sampled(&model, &rows, true, 8);
    assert_ne!(a, c, "another seed drew the same tokens");
    // Rows seeded apart from one seed draw apart too.
    assert_ne!(a[0], a[1], "two rows drew the same tokens");
    if sampled_replays_here() {
        assert_eq!(
            paths.main(Work::Decode),
            Some(Path::CudaReplay),
            "{paths:?}"
        );
    } else {
        eprintln!("the replay's part skipped: no sampled replays here");
    }
}

/// A list of short strings: choices inside the strings, forced separators.
const SCHEMA: &str = r#"{"type": "object", "properties": {"items": {"type": "array",
  "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 40}},
  "required": ["items"], "additionalProperties": false}"#;

/// A constrained generation's ids and statistics: every row under
/// [`SCHEMA`], seeded apart.
fn run_constrained(
    model: &Arc<Model>,
    prompts: &[Vec<u32>],
    sampler: SamplerConfig,
    step_replay: bool,
    fast_forward: bool,
) -> (Vec<Vec<u32>>, Stats) {
    let opts = GenerateOptions {
        step_replay,
        fast_forward,
        rows: (0..prompts.len())
            .map(|i| RowOptions {
                seed: Some(11 + i as u64),
                constraint: Some(ConstraintSpec::JsonSchema(SCHEMA.into())),
            })
            .collect(),
        ..options(64, sampler)
    };
    let tokenizer = tokenizer(FIXTURE);
    let mut g = Generation::start(model.clone(), Some(tokenizer), None, prompts, opts).unwrap();
    while !g.is_done() {
        g.next(5).unwrap();
    }
    (g.generated(), g.stats())
}

#[test]
fn constrained_steps_replay_with_the_tokens_of_mlx_steps() {
    if !emlx_axon_engine::runtime::device::gpu_available() {
        eprintln!("skipped: constrained steps are replayed only on a CUDA GPU");
        return;
    }
    let model = load(FIXTURE, &LoadOptions::default());
    let prompt = prompts().swap_remove(0);
    for sampler in [SamplerConfig::default(), qwen3_sampling(5)] {
        for rows in [vec![prompt.clone()], vec![prompt.clone(); 2]] {
            let what = format!("{} rows, greedy {}", rows.len(), sampler.is_greedy());
            // MLX's steps, each row's forced tokens one a step.
            let (want, off) = run_constrained(&model, &rows, sampler.clone(), false, false);
            assert_ne!(
                off.paths.main(Work::Decode),
                Some(Path::CudaReplay),
                "{what}: {:?}",
                off.paths
            );
            assert!(want.iter().all(|r| r.len() > 8), "{what}: {want:?}");
            // Replayed, with fast-forward off and on: a single row takes its
            // forced tokens one a step there (no run ahead), as its masks
            // would force them.
            for fast_forward in [false, true] {
                let (got, on) = run_constrained(&model, &rows, sampler.clone(), true, fast_forward);
                assert_eq!(got, want, "{what}, fast-forward {fast_forward}");
                let replays = replays_here() && (sampler.is_greedy() || sampled_replays_here());
                if !replays {
                    eprintln!(
                        "skipped the replay's part ({what}): {:?}",
                        on.paths.fallbacks
                    );
                    continue;
                }
                assert_eq!(
                    on.paths.main(Work::Decode),
                    Some(Path::CudaReplay),
                    "{what}: {:?}",
                    on.paths
                );
                assert!(
                    !on.paths.fallbacks.iter().any(|r| r.starts_with("sample kernel:")
                        && !r.contains("a prompt's token")),
                    "{what}: {:?}",
                    on.paths
                );
                if fast_forward {
                    assert!(on.forced_tokens.iter().all(|&f| f > 0), "{what}");
                    assert_eq!(on.forward_passes, off.forward_passes, "{what}");
                }
            }
        }
    }
}
