//! Token-for-token and logit parity with mlx-lm on the same checkpoints.

mod common;

use common::parity::*;
use common::*;
use emlx_axon_engine::kv::cache::KvCache;
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::runtime::device::{DeviceKind, Lease};
use emlx_axon_engine::{LoadOptions, QuantSpec};
use mlx_rs::Array;

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
    let on_cpu = emlx_axon_engine::runtime::device::on_host(|| load("qwen3-bf16", &options));
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
        let cores = emlx_axon_engine::runtime::device::cpu_parallelism();
        assert_eq!(model.parallel_ways > 1, parallel && cores > 1);
        // On a CPU stream, whole or split: on a GPU build the default stream
        // is the GPU's, whose products are summed in another order.
        let own = Lease::new(DeviceKind::Cpu).unwrap();
        own.stream().run(|| {
            let mut cache = KvCache::new(&model.kv_shape(), 1, prompt.len() as i32).unwrap();
            let logits = model
                .forward(&ids, &mut cache, &AttentionMask::Causal, true, &workers)
                .unwrap();
            logits.eval().unwrap();
            logits.as_slice::<f32>().to_vec()
        })
    };
    assert_eq!(run(true), run(false));
}
