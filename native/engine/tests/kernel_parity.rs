//! Parity with mlx-lm on a checkpoint of Qwen3-0.6B's widths, where the CPU
//! kernels split rows across threads, tile the prompt's matrix products and
//! run 8-bit (down_proj) as well as 4-bit projections.

mod common;

use std::collections::HashMap;

use common::*;
use emlx_axon_engine::cache::KvCache;
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::{generate, Dtype, GenerateOptions, LoadOptions};
use mlx_rs::Array;

const WIDE: &str = "qwen3-wide";

fn f32_load() -> LoadOptions {
    LoadOptions {
        dtype: Some(Dtype::Float32),
        ..LoadOptions::default()
    }
}

fn reference_logits(name: &str) -> HashMap<String, (Vec<f32>, usize)> {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            let data = v
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

#[test]
fn wide_checkpoint_matches_mlx_lm() {
    let model = load(WIDE, &f32_load());
    let logits = reference_logits(WIDE);
    for (prompt_name, prompt, expected) in reference(WIDE, "") {
        let options = GenerateOptions {
            max_new_tokens: expected.len(),
            ignore_eos: true,
            ..GenerateOptions::default()
        };
        let out = generate(model.clone(), None, &prompt, options).unwrap();
        assert_eq!(
            out.ids, expected,
            "`{prompt_name}`: greedy ids differ from mlx-lm"
        );

        // Teacher-forced logits at every step: the prompt through the tiled
        // product, then one token at a time through the matrix-vector one.
        let (reference, vocab) = &logits[&prompt_name];
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
        assert!(
            worst < 1e-4,
            "`{prompt_name}`: logits differ from mlx-lm by {worst} (relative to the largest)"
        );
    }
}
