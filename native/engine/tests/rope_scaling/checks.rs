//! Checks shared by `rope_scaling.rs` and `rope_scaling_mlx_ops.rs`.
#![allow(dead_code)]

use crate::common::forced::{forced_logits, reference, worst_error};
use crate::common::{fixture, load_f32, scratch_copy};
use emlx_axon_engine::backend::Path;
use emlx_axon_engine::{Dtype, LoadOptions, Model};

const FIXTURES: [&str; 3] = ["qwen3-yarn", "qwen3-yarn-4bit", "qwen2-llama3-4bit"];
const PROMPT: usize = 200;

pub fn scaled_rope_matches_mlx_lm(kernels: bool) {
    let cpu = !emlx_axon_engine::runtime::device::gpu_available();
    for name in FIXTURES {
        let reference = reference(name, "");
        let model = load_f32(name);
        let (ours, prefill, decode) = forced_logits(&model, &reference.ids, PROMPT);
        let worst = worst_error(&ours, &reference);
        eprintln!("{name}: prefill on {prefill:?}, steps on {decode:?}: worst {worst:e}");
        assert!(worst < 1e-4, "{name}: logits differ from mlx-lm by {worst}");
        if cpu && name.ends_with("4bit") {
            // The 4-bit fixtures are the CPU layer kernels' case.
            let expected = if kernels { Path::CpuLayers } else { Path::Mlx };
            assert_eq!(decode, expected, "{name}: steps ran on {decode:?}");
        }
        // The whole sequence in one pass too.
        let (ours, ..) = forced_logits(&model, &reference.ids, reference.ids.len());
        let worst = worst_error(&ours, &reference);
        assert!(worst < 1e-4, "{name}: one pass: {worst}");
    }
}

/// The same checkpoints without their `rope_scaling` give logits far from
/// mlx-lm's: the comparison above sees the scaling.
pub fn the_scaling_matters() {
    for name in FIXTURES {
        let dir = scratch_copy(name, &format!("unscaled-{name}"));
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config.as_object_mut().unwrap().remove("rope_scaling");
        std::fs::write(&path, config.to_string()).unwrap();
        let options = LoadOptions {
            dtype: Some(Dtype::Float32),
            ..LoadOptions::default()
        };
        let model = Model::load(&dir, &options).unwrap();
        let reference = reference(name, "");
        let (ours, ..) = forced_logits(&model, &reference.ids, PROMPT);
        let worst = worst_error(&ours, &reference);
        assert!(worst > 1e-2, "{name}: unscaled RoPE is as close: {worst}");
        std::fs::remove_dir_all(dir).unwrap();
        assert!(fixture(name).exists());
    }
}
