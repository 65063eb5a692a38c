//! Token-for-token and logit parity with mlx-lm on the same checkpoints.

mod common;

use std::collections::HashMap;

use common::*;
use emlx_axon_engine::cache::KvCache;
use emlx_axon_engine::device::{DeviceKind, Lease};
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::{generate, Dtype, GenerateOptions, LoadOptions, QuantSpec};
use mlx_rs::Array;

fn f32_load() -> LoadOptions {
    LoadOptions {
        dtype: Some(Dtype::Float32),
        quantize: None,
        cpu_parallel: None,
        ..LoadOptions::default()
    }
}

fn greedy(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ignore_eos: true,
        ..GenerateOptions::default()
    }
}

/// mlx-lm's logits for every step, `[16, vocab]` per prompt.
fn reference_logits(name: &str, suffix: &str) -> HashMap<String, (Vec<f32>, usize)> {
    let path = fixture(name).join(format!("reference{suffix}.safetensors"));
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let data: Vec<f32> = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (
                k.trim_end_matches(".logits").to_string(),
                (data, v.shape()[1]),
            )
        })
        .collect()
}

fn check_fixture(name: &str, suffix: &str, options: LoadOptions) {
    check_model(name, suffix, load(name, &options), true);
}

/// Greedy ids against mlx-lm's, and with `check_logits` every step's logits.
fn check_model(
    name: &str,
    suffix: &str,
    model: std::sync::Arc<emlx_axon_engine::Model>,
    check_logits: bool,
) {
    let logits = reference_logits(name, suffix);
    for (prompt_name, prompt, expected) in reference(name, suffix) {
        let out = generate(model.clone(), None, &prompt, greedy(expected.len())).unwrap();
        let (reference, vocab) = &logits[&prompt_name];
        if let Some(step) = out.ids.iter().zip(&expected).position(|(a, b)| a != b) {
            // The CPU computes what mlx-lm computed, so its ids must match.
            // A GPU's float32 products sum in another order: there the ids
            // may part at a step where mlx-lm's top logits nearly tie, and
            // our pick must then be one of its top 4.
            assert!(
                DeviceKind::default_kind() == DeviceKind::Gpu,
                "{name}{suffix} `{prompt_name}`: greedy ids differ from mlx-lm: {:?} vs {expected:?}",
                out.ids
            );
            let row = &reference[step * vocab..(step + 1) * vocab];
            let mut top: Vec<usize> = (0..*vocab).collect();
            top.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            assert!(
                top[..4].contains(&(out.ids[step] as usize)),
                "{name}{suffix} `{prompt_name}`: step {step}: {} is not in mlx-lm's top 4 {:?}",
                out.ids[step],
                &top[..4]
            );
        }

        if !check_logits {
            continue;
        }
        // Teacher-forced logits at every step, against mlx-lm's.
        let mut cache = KvCache::new(&model, 1, (prompt.len() + expected.len()) as i32).unwrap();
        let mut input = Array::from_slice(&prompt, &[1, prompt.len() as i32]);
        let mut worst = 0f32;
        for (step, &token) in expected.iter().enumerate() {
            let mask = if step == 0 {
                AttentionMask::Causal
            } else {
                AttentionMask::None
            };
            let out = model.forward(&input, &mut cache, &mask, true, &[]).unwrap();
            out.eval().unwrap();
            let ours: &[f32] = out.as_slice();
            let theirs = &reference[step * vocab..(step + 1) * vocab];
            let scale = theirs.iter().fold(1f32, |m, x| m.max(x.abs()));
            for (a, b) in ours.iter().zip(theirs) {
                worst = worst.max((a - b).abs() / scale);
            }
            input = Array::from_slice(&[token], &[1, 1]);
        }
        assert!(worst < 1e-4, "{name}{suffix} `{prompt_name}`: logits differ from mlx-lm by {worst} (relative to the largest)");
    }
}

#[test]
fn qwen3_4bit_group64() {
    check_fixture("qwen3-4bit-g64", "", f32_load());
}

#[test]
fn qwen3_4bit_group128_sharded() {
    check_fixture("qwen3-4bit-g128", "", f32_load());
}

#[test]
fn qwen3_dense_bf16_checkpoint() {
    check_fixture("qwen3-bf16", "", f32_load());
}

#[test]
fn qwen3_dense_quantized_at_load() {
    let options = LoadOptions {
        quantize: Some(QuantSpec::new(4, 128).unwrap()),
        ..f32_load()
    };
    if DeviceKind::default_kind() == DeviceKind::Cpu {
        return check_fixture("qwen3-bf16", "_q4g128", options);
    }
    // mlx-lm quantized its reference on the CPU. A GPU's quantization kernel
    // rounds some of the bfloat16 scales (and so some values) otherwise, so
    // that its logits are those of other weights: a model quantized on the
    // GPU must pick as mlx-lm does, one quantized on the CPU (then run on
    // the GPU) must also give its logits.
    check_model("qwen3-bf16", "_q4g128", load("qwen3-bf16", &options), false);
    let on_cpu = mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || load("qwen3-bf16", &options));
    check_model("qwen3-bf16", "_q4g128", on_cpu, true);
}

#[test]
fn qwen3_mixed_per_layer_quantization() {
    check_fixture("qwen3-mixed", "", f32_load());
}

#[test]
fn qwen2_4bit_group64_untied() {
    check_fixture("qwen2-4bit-g64", "", f32_load());
}

/// Qwen3-0.6B's widths, where the CPU kernels split rows across threads,
/// tile the prompt's matrix products and run 8-bit (down_proj) as well as
/// 4-bit projections.
#[test]
fn qwen3_wide_checkpoint() {
    check_fixture("qwen3-wide", "", f32_load());
}

#[test]
fn qwen2_rope_traditional() {
    check_fixture("qwen2-rope-traditional", "", f32_load());
}

#[test]
fn splitting_projections_across_cpu_streams_changes_no_logit() {
    let run = |parallel: bool| {
        let options = LoadOptions {
            cpu_parallel: Some(parallel),
            ..f32_load()
        };
        let model = load("qwen2-4bit-g64", &options);
        let prompt = &reference("qwen2-4bit-g64", "")[0].1;
        let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
        let workers = Lease::workers(DeviceKind::Cpu, model.parallel_ways).unwrap();
        assert_eq!(workers.len(), model.parallel_ways);
        let cores = emlx_axon_engine::device::cpu_parallelism();
        assert_eq!(model.parallel_ways > 1, parallel && cores > 1);
        // On a CPU stream, whole or split: on a GPU build the default stream
        // is the GPU's, whose products are summed in another order.
        let own = Lease::new(DeviceKind::Cpu).unwrap();
        own.stream().run(|| {
            let mut cache = KvCache::new(&model, 1, prompt.len() as i32).unwrap();
            let logits = model
                .forward(&ids, &mut cache, &AttentionMask::Causal, true, &workers)
                .unwrap();
            logits.eval().unwrap();
            logits.as_slice::<f32>().to_vec()
        })
    };
    assert_eq!(run(true), run(false));
}
