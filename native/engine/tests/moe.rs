//! Qwen3-MoE against mlx-lm: teacher-forced logits at every position (a
//! prompt pass, where tokens are sorted by expert, then one-token steps,
//! through the CPU's layer nodes where the experts are quantized),
//! float32, MLX-quantized and quantized at load; mlx-lm's layout and the
//! Hugging Face per-expert one; greedy generation through `Generation` and
//! the `Scheduler`.

mod common;

use std::fs;

use common::forced::{forced_logits, reference, worst_error};
use common::*;
use emlx_axon_engine::backend::{Path, Work};
use emlx_axon_engine::runtime::device::on_host;
use emlx_axon_engine::{
    Dtype, Generation, LoadOptions, Model, QuantSpec, SamplerConfig, Scheduler, SchedulerConfig,
};

const PROMPT: usize = 40;

fn f32() -> LoadOptions {
    LoadOptions {
        dtype: Some(Dtype::Float32),
        ..LoadOptions::default()
    }
}

fn check(name: &str, suffix: &str, options: &LoadOptions) {
    check_model(name, suffix, &load(name, options));
}

fn check_model(name: &str, suffix: &str, model: &Model) {
    let reference = reference(name, suffix);
    let (ours, prefill, decode) = forced_logits(model, &reference.ids, PROMPT);
    let worst = worst_error(&ours, &reference);
    eprintln!("{name}{suffix}: worst {worst:e}");
    assert!(
        worst < 1e-4,
        "{name}{suffix}: logits differ from mlx-lm by {worst}"
    );
    // One-token steps take a CUDA GPU's layer kernels (the experts' own
    // where they are quantized), and the CPU's layer nodes where the
    // experts and router are quantized; prompts run MLX's ops everywhere.
    let step = match emlx_axon_engine::backend::cuda::layer::checked() {
        Some(true) if emlx_axon_engine::runtime::device::gpu_available() => Path::CudaLayers,
        _ if !emlx_axon_engine::runtime::device::gpu_available()
            && emlx_axon_engine::backend::cpu::available()
            && model.is_quantized() =>
        {
            Path::CpuLayers
        }
        _ => Path::Mlx,
    };
    assert_eq!((prefill, decode), (Path::Mlx, step), "{name}");
    let (ours, ..) = forced_logits(model, &reference.ids, reference.ids.len());
    let worst = worst_error(&ours, &reference);
    assert!(worst < 1e-4, "{name}{suffix}: one pass: {worst}");
}

#[test]
fn float32_experts_match_mlx_lm() {
    check("qwen3-moe", "", &f32());
}

#[test]
fn quantized_experts_match_mlx_lms_quantized_model() {
    let model = load_f32("qwen3-moe-4bit");
    assert!(model.is_quantized());
    check("qwen3-moe-4bit", "", &f32());
}

/// The float32 checkpoint quantized at load (4 bits, groups of 64; the
/// router 8 bits, as mlx-lm converts it) against mlx-lm's quantization of
/// the same weights.
#[test]
fn experts_quantized_at_load_match_mlx_lm() {
    let options = LoadOptions {
        quantize: Some(QuantSpec::new(4, 64).unwrap()),
        ..f32()
    };
    // mlx-lm quantized its reference on the CPU, and a GPU's quantization
    // kernel rounds some values otherwise: the weights are quantized on the
    // CPU's stream (then run on the default device).
    let model = on_host(|| load("qwen3-moe", &options));
    check_model("qwen3-moe", "_q4g64", &model);
    // Unquantized, the model is measurably elsewhere: the check sees it.
    let reference = reference("qwen3-moe", "_q4g64");
    let (ours, ..) = forced_logits(&load_f32("qwen3-moe"), &reference.ids, PROMPT);
    assert!(worst_error(&ours, &reference) > 1e-3);
}

/// Hugging Face's per-expert tensors, whose experts the shards split, are
/// stacked at load; this fixture's sparse step is 2 and its top-k
/// probabilities are not renormalized.
#[test]
fn per_expert_tensors_are_stacked_at_load() {
    let config = &load_f32("qwen3-moe-hf").config;
    let moe = config.moe.as_ref().unwrap();
    assert_eq!((moe.decoder_sparse_step, moe.norm_topk_prob), (2, false));
    check("qwen3-moe-hf", "", &f32());
}

fn generation_ids(
    model: std::sync::Arc<Model>,
    prompt: &[u32],
    n: usize,
    quantized: bool,
) -> Vec<u32> {
    let mut generation = Generation::start(
        model,
        None,
        None,
        &[prompt.to_vec()],
        options(n, SamplerConfig::default()),
    )
    .unwrap();
    while !generation.is_done() {
        generation.next(4).unwrap();
    }
    let paths = generation.stats().paths;
    if !emlx_axon_engine::runtime::device::gpu_available() {
        // The CPU's layer nodes take quantized experts; float32 ones run
        // as separate nodes, and the reason says so.
        let nodes = quantized && emlx_axon_engine::backend::cpu::available();
        let expected = if nodes { Path::CpuLayers } else { Path::Mlx };
        assert_eq!(paths.main(Work::Decode), Some(expected), "{paths:?}");
        assert_eq!(
            paths.fallbacks.iter().any(|r| r.contains("MoE")),
            !nodes,
            "{paths:?}"
        );
    } else if emlx_axon_engine::backend::cuda::layer::checked() == Some(true) {
        // A CUDA step's layers take the experts, through the expert
        // kernels where the experts are quantized.
        assert_eq!(
            paths.main(Work::Decode),
            Some(Path::CudaLayers),
            "{paths:?}"
        );
        let in_mlx = paths
            .fallbacks
            .iter()
            .any(|r| r.starts_with("cuda_layers: routed experts"));
        assert_eq!(in_mlx, !quantized, "{paths:?}");
    }
    generation.generated().remove(0)
}

fn scheduler_ids(model: std::sync::Arc<Model>, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let config = SchedulerConfig {
        slots: 2,
        capacity: 64,
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(model, None, config).unwrap();
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            s.admit(p.clone(), options(n, SamplerConfig::default()))
                .unwrap()
        })
        .collect();
    let mut out = std::collections::HashMap::<_, Vec<u32>>::new();
    while !s.is_idle() {
        for e in s.step(2).unwrap() {
            out.entry(e.id).or_default().extend(&e.delta.ids);
        }
    }
    ids.iter()
        .map(|id| out.remove(id).unwrap_or_default())
        .collect()
}

/// Greedy ids through `Generation` and through the `Scheduler` (two rows
/// at different positions, prompts in chunks) are mlx-lm's.
#[test]
fn generation_and_scheduler_give_mlx_lms_greedy_ids() {
    for name in ["qwen3-moe", "qwen3-moe-4bit"] {
        let reference = reference(name, "");
        let expected = reference.greedy.clone().unwrap();
        let prompt = &reference.ids[..12];
        let model = load_f32(name);
        let quantized = name.ends_with("4bit");
        let generated = generation_ids(model.clone(), prompt, expected.len(), quantized);
        let other = reference.ids[20..27].to_vec();
        let scheduled = scheduler_ids(
            model.clone(),
            &[prompt.to_vec(), other.clone()],
            expected.len(),
        );
        assert_eq!(scheduled[0], generated, "{name}: scheduler vs generation");
        assert_eq!(
            scheduled[1],
            generation_ids(model, &other, expected.len(), quantized),
            "{name}: second row"
        );
        if !emlx_axon_engine::runtime::device::gpu_available() {
            assert_eq!(generated, expected, "{name}: greedy ids differ from mlx-lm");
        }
    }
}

/// A missing expert, or a config that cannot route, is a clear error.
#[test]
fn malformed_moe_checkpoints_are_refused() {
    let kind_of = |dir: &std::path::Path| match Model::load(dir, &f32()) {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("{}: {e}", e.kind()),
    };
    let dir = scratch_copy("qwen3-moe-hf", "moe-missing-expert");
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = fs::read(&shard).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let gone = "model.layers.3.mlp.experts.6.up_proj.weight";
    let kept: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != gone)
        .collect();
    assert!(kept.len() < st.len());
    safetensors::serialize_to_file(kept, None, &shard).unwrap();
    let err = kind_of(&dir);
    assert!(
        err.starts_with("missing_tensor") && err.contains(gone),
        "{err}"
    );
    fs::remove_dir_all(&dir).unwrap();

    let dir = scratch_copy("qwen3-moe", "moe-bad-config");
    let config = fs::read_to_string(dir.join("config.json")).unwrap();
    for (from, to) in [
        ("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"),
        ("\"num_experts\": 8", "\"num_experts\": 0"),
        ("\"num_experts\": 8", "\"num_experts\": 4"),
        (
            "\"mlp_only_layers\": [\n        1\n    ]",
            "\"mlp_only_layers\": \"1\"",
        ),
        (
            "\"moe_intermediate_size\": 64",
            "\"moe_intermediate_size\": 32",
        ),
    ] {
        assert!(config.contains(from), "{from}");
        fs::write(dir.join("config.json"), config.replace(from, to)).unwrap();
        let err = kind_of(&dir);
        assert!(
            err.starts_with("config") || err.starts_with("shape_mismatch"),
            "{to}: {err}"
        );
    }
    fs::remove_dir_all(&dir).unwrap();
}
