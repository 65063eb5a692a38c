//! MLX's memory limit guards loading. A test binary of its own: the limit is
//! global, and other tests loading meanwhile would be refused.

mod common;

use common::*;
use emlx_axon_engine::runtime::memory;
use emlx_axon_engine::{Dtype, LoadOptions, Model};

fn load_error(name: &str) -> String {
    let options = LoadOptions {
        dtype: Some(Dtype::Float32),
        ..LoadOptions::default()
    };
    match Model::load(&fixture(name), &options) {
        Ok(_) => "ok".into(),
        Err(e) => format!("{}: {e}", e.kind()),
    }
}

#[test]
fn weights_that_cannot_fit_are_refused_before_they_are_allocated() {
    let active = memory::info().unwrap().active;
    let previous = memory::set_limit(active + 1_000_000).unwrap();
    let quantized = load_error("qwen3-4bit-g64");
    // 39 MB of bf16 weights fit, their float32 conversion does not.
    memory::set_limit(active + 50_000_000).unwrap();
    let converted = load_error("qwen3-bf16");
    memory::set_limit(previous).unwrap();
    assert!(
        quantized.starts_with("out_of_memory") && quantized.contains("model.safetensors needs"),
        "{quantized}"
    );
    assert!(
        converted.starts_with("out_of_memory") && converted.contains("converting the weights"),
        "{converted}"
    );
    assert_eq!(memory::info().unwrap().active, active);
    assert_eq!(load_error("qwen3-bf16"), "ok");
}
