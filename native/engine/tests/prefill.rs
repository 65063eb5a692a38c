//! A prompt's last logits are the same whether it goes through the model at
//! once (a prefill: on a CUDA GPU, our prompt kernels), in chunks (the
//! second chunk at an offset into the cache), or one token at a time (the
//! step path), in float32; for Qwen3 (q/k norms), Qwen2 (q/k/v biases,
//! no norms), a traditional RoPE, dense weights and heads wider than the
//! hidden size.

mod common;

use common::*;
use emlx_axon_engine::kv::cache::KvCache;
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::{Dtype, Model};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

/// Long enough for the CPU prompt attention's several blocks of queries
/// (and for a part at an offset that ends inside one).
fn prompt() -> Vec<u32> {
    (0..300u32).map(|i| (i * 7919 + 13) % 1000).collect()
}

/// The last position's logits, the prompt given in parts of `chunk` tokens;
/// each part's output is evaluated before the next part, as a generation
/// does (a one-token step's keys reach the cache as its output is
/// evaluated: see `Model::forward`).
fn logits_in_chunks(model: &Model, prompt: &[u32], chunk: usize) -> Vec<f32> {
    let mut cache = KvCache::new(&model.kv_shape(), 1, prompt.len() as i32 + 8).unwrap();
    let parts: Vec<&[u32]> = prompt.chunks(chunk).collect();
    for (i, part) in parts.iter().enumerate() {
        let ids = Array::from_slice(part, &[1, part.len() as i32]);
        let mask = if part.len() > 1 {
            AttentionMask::Causal
        } else {
            AttentionMask::None
        };
        let logits = model.forward(&ids, &mut cache, &mask, true, &[]).unwrap();
        if i + 1 < parts.len() {
            mlx_rs::transforms::eval(cache.arrays().chain([&logits])).unwrap();
            continue;
        }
        let logits = logits.index((0, 0, ..)).as_dtype(Dtype::Float32).unwrap();
        return logits.as_slice::<f32>().to_vec();
    }
    unreachable!("a prompt has at least one part")
}

#[test]
fn a_prompt_at_once_in_chunks_and_token_by_token_gives_the_same_logits() {
    let prompt = prompt();
    // Every checkpoint and part size is tried before failing, so that one
    // run says which of them differ.
    let mut failures = Vec::new();
    for name in [
        "qwen3-4bit-g64",
        "qwen2-4bit-g64",
        "qwen2-rope-traditional",
        "qwen3-bf16",
        "qwen3-wide",
    ] {
        let model = load_f32(name);
        let at_once = logits_in_chunks(&model, &prompt, prompt.len());
        if gpu_kernels_on("EMLX_AXON_PREFILL_KERNELS") {
            assert_eq!(
                emlx_axon_engine::backend::cuda::prefill::checked(),
                Some(true),
                "{name}: the prompt kernels were not used"
            );
        }
        let scale = at_once.iter().fold(0f32, |m, x| m.max(x.abs()));
        for chunk in [200, 16, 1] {
            let other = logits_in_chunks(&model, &prompt, chunk);
            let worst = at_once
                .iter()
                .zip(&other)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if worst > 1e-3 * scale {
                failures.push(format!(
                    "{name}: the prompt in parts of {chunk} moved the logits by {worst} (of {scale})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A prompt long enough sends the larger products of a checkpoint 1,024
/// wide through the dequantized weights on a CUDA GPU (the q/k/v and
/// gate/up products of 1,100 rows; `prefill::dequantizes`), while chunks of
/// 256 tokens keep MLX's quantized product: both give the same logits (on
/// the CPU both are the engine's own product).
#[test]
fn a_long_prompt_at_once_gives_the_logits_of_its_chunks() {
    use emlx_axon_engine::backend::cuda::prefill::dequantizes;
    let prompt: Vec<u32> = (0..1100u32).map(|i| (i * 7919 + 13) % 1000).collect();
    let model = load_f32("qwen3-wide");
    let c = &model.config;
    let qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    let gate_up = 2 * c.intermediate_size;
    for outputs in [qkv, gate_up] {
        assert!(dequantizes(prompt.len(), outputs, c.hidden_size));
        assert!(!dequantizes(256, outputs, c.hidden_size));
    }
    let at_once = logits_in_chunks(&model, &prompt, prompt.len());
    let chunked = logits_in_chunks(&model, &prompt, 256);
    let scale = at_once.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = at_once
        .iter()
        .zip(&chunked)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-3 * scale,
        "the prompt in parts of 256 moved the logits by {worst} (of {scale})"
    );
}
