//! mlx-lm's sampling filters (`sample_utils.py`), applied to untempered
//! log-probabilities in mlx-lm's order: top-p, then min-p, then top-k. Each
//! sets the tokens it drops to -inf; temperature applies only when sampling
//! from what is left. The device and the host versions compute the same
//! thing in float32, step for step, so both keep the same tokens.

use mlx_rs::ops::indexing::{put_along_axis, take_along_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, select, sort_axis};
use mlx_rs::{Array, Dtype};

use super::SamplerConfig;
use crate::error::Result;

/// `[B, V]` logits -> `[B, V]` float32 log-probabilities with every filtered
/// token at -inf.
pub fn filtered_logprobs(c: &SamplerConfig, logits: &Array) -> Result<Array> {
    let logits = logits.as_dtype(Dtype::Float32)?;
    let mut lp = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
    let vocab = lp.dim(-1);
    let neg_inf = || Array::from_f32(f32::NEG_INFINITY);
    if c.top_p > 0.0 && c.top_p < 1.0 {
        // Drop, from the least likely up, the tokens whose more likely
        // neighbours already hold at least `top_p` of the mass; ties with the
        // last kept token stay.
        let sorted = sort_axis(&lp, -1)?;
        let probs = sorted.exp()?;
        let above = probs.cumsum(-1, true, false)?;
        let total = above.index((.., 0..1)).add(probs.index((.., 0..1)))?;
        let dropped = above
            .ge(total.multiply(Array::from_f32(c.top_p))?)?
            .sum_axis(-1, true)?
            .as_dtype(Dtype::Int32)?;
        let threshold = take_along_axis(&sorted, &dropped, -1)?;
        lp = select(lp.lt(&threshold)?, neg_inf(), &lp)?;
    }
    if c.min_p > 0.0 {
        let top = lp.max_axis(-1, true)?;
        let floor = top.add(Array::from_f32(c.min_p.ln()))?;
        let mut remove = lp.lt(&floor)?;
        let keep = c.min_tokens_to_keep.min(vocab as usize) as i32;
        if keep > 1 {
            let top_ids = argpartition_axis(&lp, vocab - keep, -1)?.index((.., (vocab - keep)..));
            remove = put_along_axis(&remove, &top_ids, Array::from_bool(false), -1)?;
        }
        lp = select(&remove, neg_inf(), &lp)?;
    }
    if c.top_k > 0 && (c.top_k as i32) < vocab {
        let k = c.top_k as i32;
        let rest = argpartition_axis(lp.negative()?, k - 1, -1)?.index((.., k..));
        lp = put_along_axis(&lp, &rest, neg_inf(), -1)?;
    }
    Ok(lp)
}

/// The distribution sampled from: softmax of the filtered log-probabilities
/// divided by the temperature, `[B, V]` float32.
pub fn distribution(c: &SamplerConfig, logits: &Array) -> Result<Array> {
    let lp = filtered_logprobs(c, logits)?;
    Ok(mlx_rs::ops::softmax_axis(
        lp.multiply(Array::from_f32(1.0 / c.temperature))?,
        -1,
        true,
    )?)
}

/// The host version of [`filtered_logprobs`] for one row of logits.
pub fn filtered_logprobs_host(c: &SamplerConfig, logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
    let lse = max + sum.ln();
    let mut lp: Vec<f32> = logits.iter().map(|&x| x - lse).collect();
    let vocab = lp.len();
    if c.top_p > 0.0 && c.top_p < 1.0 {
        let mut sorted = lp.clone();
        sorted.sort_unstable_by(f32::total_cmp);
        let probs: Vec<f32> = sorted.iter().map(|x| x.exp()).collect();
        let mut above = vec![0f32; vocab];
        let mut acc = 0f32;
        for i in (0..vocab).rev() {
            above[i] = acc;
            acc += probs[i];
        }
        let total = above[0] + probs[0];
        let limit = c.top_p * total;
        let dropped = above.iter().filter(|&&m| m >= limit).count();
        let threshold = sorted[dropped.min(vocab - 1)];
        lp.iter_mut()
            .filter(|x| **x < threshold)
            .for_each(|x| *x = f32::NEG_INFINITY);
    }
    if c.min_p > 0.0 {
        let top = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let floor = top + c.min_p.ln();
        // The most likely token is never below the floor: only a larger
        // `min_tokens_to_keep` needs the ranking.
        let protected = (c.min_tokens_to_keep > 1).then(|| top_mask(&lp, c.min_tokens_to_keep));
        for (i, x) in lp.iter_mut().enumerate() {
            if *x < floor && !protected.as_ref().is_some_and(|p| p[i]) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    if c.top_k > 0 && c.top_k < vocab {
        let kept = top_mask(&lp, c.top_k);
        for (x, keep) in lp.iter_mut().zip(kept) {
            if !keep {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    lp
}

/// The host version of [`distribution`] for one row of logits.
pub fn distribution_host(c: &SamplerConfig, logits: &[f32]) -> Vec<f64> {
    let lp = filtered_logprobs_host(c, logits);
    let scale = 1.0 / c.temperature as f64;
    let max = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<f64> = lp
        .iter()
        .map(|&x| ((x as f64 - max) * scale).exp())
        .collect();
    let total: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= total);
    p
}

/// Marks the `k` largest values; among equal values the lower index wins
/// (MLX's partition leaves that choice open).
fn top_mask(values: &[f32], k: usize) -> Vec<bool> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    let by_value = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k < order.len() {
        order.select_nth_unstable_by(k, by_value);
    }
    let mut mask = vec![false; values.len()];
    for &i in order.iter().take(k) {
        mask[i] = true;
    }
    mask
}
