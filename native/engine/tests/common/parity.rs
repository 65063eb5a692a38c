//! Parity with mlx-lm: greedy ids and every step's logits against the
//! references `scripts/setup` stores beside each fixture.

use std::collections::HashMap;

use emlx_axon_engine::kv::cache::KvCache;
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::runtime::device::DeviceKind;
use emlx_axon_engine::{generate, Dtype, GenerateOptions, LoadOptions};
use mlx_rs::Array;

use super::{fixture, load, reference};

pub fn f32_load() -> LoadOptions {
    LoadOptions {
        dtype: Some(Dtype::Float32),
        quantize: None,
        cpu_parallel: None,
        ..LoadOptions::default()
    }
}

pub fn greedy(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ignore_eos: true,
        ..GenerateOptions::default()
    }
}

/// mlx-lm's logits for every step, `[16, vocab]` per prompt.
pub fn reference_logits(name: &str, suffix: &str) -> HashMap<String, (Vec<f32>, usize)> {
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

pub fn check_fixture(name: &str, suffix: &str, options: LoadOptions) {
    check_model(name, suffix, load(name, &options), true);
}

/// Greedy ids against mlx-lm's, and with `check_logits` every step's logits.
pub fn check_model(
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
        let mut cache =
            KvCache::new(&model.kv_shape(), 1, (prompt.len() + expected.len()) as i32).unwrap();
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
