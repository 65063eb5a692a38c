//! Teacher-forced logits at every position of a sequence, against the
//! references of `test/fixtures/build_rope_moe_fixtures.py` (mlx-lm's
//! float32 forward pass over the whole sequence).

use emlx_axon_engine::backend::{Path, Work};
use emlx_axon_engine::kv::cache::KvCache;
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::Model;
use mlx_rs::Array;

use super::fixture;

pub struct Reference {
    pub ids: Vec<u32>,
    /// `[ids, vocab]`.
    pub logits: Vec<f32>,
    pub vocab: usize,
    /// mlx-lm's greedy continuation of the first ids, where stored.
    pub greedy: Option<Vec<u32>>,
}

fn int32s(data: &[u8]) -> Vec<u32> {
    data.chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

pub fn reference(name: &str, suffix: &str) -> Reference {
    let bytes = std::fs::read(fixture(name).join(format!("reference{suffix}.safetensors")))
        .unwrap_or_else(|e| panic!("{name}: {e}: run scripts/setup"));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    Reference {
        ids: int32s(st.tensor("ids").unwrap().data()),
        vocab: logits.shape()[1],
        logits: logits
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        greedy: st.tensor("greedy").ok().map(|t| int32s(t.data())),
    }
}

/// Our logits at every position of `ids`: the first `prompt` in one
/// forward pass, then one token at a time; and the paths that ran them.
pub fn forced_logits(model: &Model, ids: &[u32], prompt: usize) -> (Vec<f32>, Path, Path) {
    let _ = emlx_axon_engine::backend::take();
    let mut cache = KvCache::new(&model.kv_shape(), 1, ids.len() as i32).unwrap();
    let mut all = Vec::new();
    let mut run = |chunk: &[u32], mask: AttentionMask| {
        let input = Array::from_slice(chunk, &[1, chunk.len() as i32]);
        let out = model
            .forward(&input, &mut cache, &mask, false, &[])
            .unwrap()
            .as_dtype(mlx_rs::Dtype::Float32)
            .unwrap();
        all.extend_from_slice(out.as_slice::<f32>());
    };
    run(&ids[..prompt], AttentionMask::Causal);
    for &id in &ids[prompt..] {
        run(&[id], AttentionMask::None);
    }
    let paths = emlx_axon_engine::backend::take();
    let main = |work| paths.main(work).unwrap_or(Path::Mlx);
    (all, main(Work::Prefill), main(Work::Decode))
}

/// The largest error over positions, each relative to the largest logit
/// magnitude of mlx-lm's at that position.
pub fn worst_error(ours: &[f32], reference: &Reference) -> f32 {
    worst_relative(ours, &reference.logits, reference.vocab)
}

/// [`worst_error`] of logits `[positions, vocab]` against `theirs`.
pub fn worst_relative(ours: &[f32], theirs: &[f32], vocab: usize) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let v = vocab;
    ours.chunks(v)
        .zip(theirs.chunks(v))
        .map(|(a, b)| {
            let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            a.iter()
                .zip(b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
        })
        .fold(0f32, f32::max)
}
