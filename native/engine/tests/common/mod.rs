//! Shared helpers: the fixtures that `scripts/setup` builds with mlx-lm.
#![allow(dead_code)]

pub mod forced;
pub mod parity;
pub mod schema;

use std::path::PathBuf;
use std::sync::Arc;

use emlx_axon_engine::{GenerateOptions, LoadOptions, Model, SamplerConfig, Tokenizer};
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    exact_float32();
    let dir = std::env::var_os("EMLX_AXON_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/fixtures"));
    assert!(
        dir.join("qwen3-4bit-g64/config.json").exists(),
        "test fixtures missing at {}: run scripts/setup",
        dir.display()
    );
    dir
}

/// MLX's CUDA backend computes float32 matmuls in TF32 unless
/// `MLX_ENABLE_TF32=0` (read once, at its first float32 matmul): on an NVIDIA
/// H200 that moves the dense model's logits ~8e-4 from mlx-lm's float32 ones.
/// The references are full float32, so the tests turn it off before any
/// model runs. It does nothing on the CPU.
fn exact_float32() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("MLX_ENABLE_TF32").is_none() {
            std::env::set_var("MLX_ENABLE_TF32", "0");
        }
    });
}

/// Whether our CUDA kernels run here with the switch `var` left on: a CUDA
/// GPU whose step kernels passed their check, and `var` not `0`/`false`.
pub fn gpu_kernels_on(var: &str) -> bool {
    emlx_axon_engine::runtime::device::gpu_available()
        && emlx_axon_engine::backend::cuda::layer::checked() == Some(true)
        && !matches!(std::env::var(var).as_deref(), Ok("0") | Ok("false"))
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

pub fn load(name: &str, options: &LoadOptions) -> Arc<Model> {
    Arc::new(Model::load(&fixture(name), options).unwrap_or_else(|e| panic!("loading {name}: {e}")))
}

/// A fixture in float32, the dtype of its mlx-lm references.
pub fn load_f32(name: &str) -> Arc<Model> {
    load(
        name,
        &LoadOptions {
            dtype: Some(emlx_axon_engine::Dtype::Float32),
            ..LoadOptions::default()
        },
    )
}

pub fn tokenizer(name: &str) -> Arc<Tokenizer> {
    Arc::new(Tokenizer::load(&fixture(name)).unwrap())
}

pub fn json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// `reference<suffix>.json` prompts: name -> (prompt ids, greedy ids).
pub fn reference(name: &str, suffix: &str) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let r = json(fixture(name).join(format!("reference{suffix}.json")));
    let mut out: Vec<_> = r["prompts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, p)| (k.clone(), ids(&p["prompt_ids"]), ids(&p["greedy_ids"])))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// A fresh scratch folder holding a copy of fixture `name`, for tests that
/// damage a checkpoint.
pub fn scratch_copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("emlx-axon-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap().flatten() {
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    dir
}

/// `max_new_tokens` tokens with `sampler`, EOS ignored (every row runs to its
/// length).
pub fn options(max_new_tokens: usize, sampler: SamplerConfig) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        ignore_eos: true,
        sampler,
        ..GenerateOptions::default()
    }
}
