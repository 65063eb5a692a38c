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
        lp = top_p_cut(c.top_p, &sorted, &lp, None)?;
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

/// [`filtered_logprobs`] where top-k holds the filters to `k` tokens: the
/// `k` most likely tokens of each row (a partition, not a sort of the
/// vocabulary) as `([B, k]` uint32 ids, `[B, k]` float32 log-probabilities
/// with every filtered one at -inf`)`. `None` without top-k.
pub fn filtered_candidates(c: &SamplerConfig, logits: &Array) -> Result<Option<(Array, Array)>> {
    let vocab = logits.dim(-1);
    if !(c.top_k > 0 && (c.top_k as i32) < vocab) {
        return Ok(None);
    }
    let k = c.top_k as i32;
    let logits = logits.as_dtype(Dtype::Float32)?;
    let lse = logits.logsumexp_axis(-1, true)?;
    let ids = argpartition_axis(logits.negative()?, k - 1, -1)?.index((.., ..k));
    let mut lp = take_along_axis(&logits, &ids, -1)?.subtract(&lse)?;
    let neg_inf = || Array::from_f32(f32::NEG_INFINITY);
    // Ascending, as the full version's sort: the candidates are the top of it.
    let sorted = sort_axis(&lp, -1)?;
    if c.top_p > 0.0 && c.top_p < 1.0 {
        // The mass above a candidate is all in the candidates; the total is
        // the whole row's.
        let total = logits.subtract(&lse)?.exp()?.sum_axis(-1, true)?;
        lp = top_p_cut(c.top_p, &sorted, &lp, Some(total))?;
    }
    if c.min_p > 0.0 {
        let top = sorted.index((.., (k - 1)..));
        let mut floor = top.add(Array::from_f32(c.min_p.ln()))?;
        let keep = c.min_tokens_to_keep.min(k as usize) as i32;
        if keep > 1 {
            // The `keep` most likely stay whatever the floor.
            let kth = sorted.index((.., (k - keep)..(k - keep + 1)));
            floor = mlx_rs::ops::minimum(&floor, &kth)?;
        }
        lp = select(lp.lt(&floor)?, neg_inf(), &lp)?;
    }
    Ok(Some((ids.as_dtype(Dtype::Uint32)?, lp)))
}

/// `lp` with the tokens top-p drops at -inf, from `sorted` (the same values
/// ascending): a token goes when the tokens above it already hold `top_p` of
/// the mass (`total`, else all of `sorted`'s); ties with the last kept stay.
fn top_p_cut(top_p: f32, sorted: &Array, lp: &Array, total: Option<Array>) -> Result<Array> {
    let probs = sorted.exp()?;
    let above = probs.cumsum(-1, true, false)?;
    let total = match total {
        Some(t) => t,
        None => above.index((.., 0..1)).add(probs.index((.., 0..1)))?,
    };
    let dropped = above
        .ge(total.multiply(Array::from_f32(top_p))?)?
        .sum_axis(-1, true)?
        .as_dtype(Dtype::Int32)?;
    let threshold = take_along_axis(sorted, &dropped, -1)?;
    Ok(select(
        lp.lt(&threshold)?,
        Array::from_f32(f32::NEG_INFINITY),
        lp,
    )?)
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
    let mut lp = vec![f32::NEG_INFINITY; logits.len()];
    for (i, x) in kept_host(c, logits) {
        lp[i] = x;
    }
    lp
}

/// The host version of [`distribution`] for one row of logits.
pub fn distribution_host(c: &SamplerConfig, logits: &[f32]) -> Vec<f64> {
    let mut p = vec![0f64; logits.len()];
    for (i, x) in distribution_kept(c, &kept_host(c, logits)) {
        p[i] = x;
    }
    p
}

/// The tokens the filters keep, ascending by id, with their
/// log-probabilities: what [`filtered_logprobs_host`] leaves finite.
///
/// Every filter keeps the most likely tokens (top-p a prefix by mass, min-p
/// one by value, top-k one by count), so the kept tokens are among the
/// first few of the vocabulary by rank: those are selected (linear time)
/// and sorted, never the whole vocabulary, unless the filters keep most of
/// it.
pub fn kept_host(c: &SamplerConfig, logits: &[f32]) -> Vec<(usize, f32)> {
    let vocab = logits.len();
    let top_p = c.top_p > 0.0 && c.top_p < 1.0;
    let top_k = (c.top_k > 0 && c.top_k < vocab).then_some(c.top_k);
    // At least the tokens min-p protects, so that they are among the ranked.
    let protected = if c.min_p > 0.0 {
        c.min_tokens_to_keep
    } else {
        1
    };
    let mut m = top_k.unwrap_or(64.max(protected)).min(vocab);
    let filtered = top_p || c.min_p > 0.0 || top_k.is_some();
    // One pass ranks the first `m` tokens (and so finds the largest value),
    // another sums the exponentials: two reads of the row, no sort of it.
    let mut ranked = if filtered {
        top_ranked(logits, m)
    } else {
        Vec::new()
    };
    let max = match ranked.first() {
        Some(&i) => logits[i],
        None => logits.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    };
    let sum = sum_exp(logits, max);
    let lse = max + (sum as f32).ln();
    let lp = |i: usize| logits[i] - lse;
    if !filtered {
        return (0..vocab).map(|i| (i, lp(i))).collect();
    }
    // Every token's mass, exp(x - lse), summed.
    let total = sum * ((max - lse) as f64).exp();
    loop {
        let mut end = m;
        // Top-p: a token goes when the tokens above it already hold
        // `top_p` of the mass; ties with the last kept token stay.
        let mut settled = top_k.is_some() || m == vocab;
        if top_p {
            let limit = c.top_p as f64 * total;
            let mut above = 0f64;
            for (j, &i) in ranked.iter().enumerate() {
                if above >= limit {
                    let threshold = lp(ranked[j - 1]);
                    end = j + ranked[j..]
                        .iter()
                        .take_while(|&&t| lp(t) >= threshold)
                        .count();
                    settled |= end < m;
                    break;
                }
                above += lp(i).exp() as f64;
            }
        }
        // Min-p: below the top token's log-probability plus ln(min_p), but
        // never the first `min_tokens_to_keep`.
        if c.min_p > 0.0 {
            let floor = lp(ranked[0]) + c.min_p.ln();
            let keep = c.min_tokens_to_keep.min(end);
            let above_floor = ranked[..end]
                .iter()
                .take_while(|&&t| lp(t) >= floor)
                .count();
            settled |= above_floor < end || end < m;
            end = above_floor.max(keep);
        }
        if let Some(k) = top_k {
            end = end.min(k);
        }
        if settled {
            let mut kept: Vec<(usize, f32)> = ranked[..end].iter().map(|&i| (i, lp(i))).collect();
            kept.sort_unstable_by_key(|&(i, _)| i);
            return kept;
        }
        m = (m * 4).min(vocab);
        ranked = top_ranked(logits, m);
    }
}

/// `exp(x - max)` summed over `logits`, `max` their largest value. Masses
/// add up in float64 across blocks of 256 (a wide nucleus ends where each
/// token holds less than float32's resolution of a running sum); within a
/// block, sixteen float32 lanes of [`exp_lanes`] that the compiler
/// vectorizes, where the math library's exponential is a call per element.
pub fn sum_exp(logits: &[f32], max: f32) -> f64 {
    let blocks = logits.chunks_exact(256);
    let rest = blocks.remainder();
    let mut sum = 0f64;
    for block in blocks {
        let mut lanes = [0f32; 16];
        for chunk in block.chunks_exact(16) {
            for (lane, &x) in lanes.iter_mut().zip(chunk) {
                *lane += exp_lanes(x - max);
            }
        }
        sum += lanes.iter().map(|&l| l as f64).sum::<f64>();
    }
    sum + rest.iter().map(|&x| exp_lanes(x - max) as f64).sum::<f64>()
}

/// `exp(x)` for `x <= 0` within 3e-7 relative: `2^n * exp(r)`, `n` the
/// nearest integer to `x / ln 2` and `exp(r)` its Taylor polynomial of degree
/// 6 (`|r| <= ln 2 / 2`); below -87 (where float32 underflows) as at -87.
#[inline(always)]
fn exp_lanes(x: f32) -> f32 {
    // Adding and taking away 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    // ln 2 as 355/512 (0.693359375, 9 bits: `n` times it is exact) minus a
    // remainder.
    let r = (x - n * 0.693_359_4) + n * 2.121_944_4e-4;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The ids of the `m` largest logits, largest first, the lower id first
/// among equals. Few are asked for: one pass keeps them in a short sorted
/// list that a new token rarely enters; many: a selection, then a sort.
fn top_ranked(logits: &[f32], m: usize) -> Vec<usize> {
    let by_rank = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    if m > 256 {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if m < order.len() {
            order.select_nth_unstable_by(m - 1, by_rank);
            order.truncate(m);
        }
        order.sort_unstable_by(by_rank);
        return order;
    }
    let mut best: Vec<usize> = Vec::with_capacity(m + 1);
    for (i, &x) in logits.iter().enumerate() {
        if best.len() == m {
            // Ids come in order: an equal value never outranks the last.
            let last = logits[best[m - 1]];
            if x.total_cmp(&last) != std::cmp::Ordering::Greater {
                continue;
            }
            best.pop();
        }
        let at = best.partition_point(|&j| by_rank(&j, &i) == std::cmp::Ordering::Less);
        best.insert(at, i);
    }
    best
}

/// The probabilities of the kept tokens (ascending ids, as [`kept_host`]
/// gives them): softmax of their log-probabilities divided by the
/// temperature, in float64.
pub fn distribution_kept(c: &SamplerConfig, kept: &[(usize, f32)]) -> Vec<(usize, f64)> {
    let scale = 1.0 / c.temperature as f64;
    let max = kept
        .iter()
        .map(|&(_, x)| x)
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<(usize, f64)> = kept
        .iter()
        .map(|&(i, x)| (i, ((x as f64 - max) * scale).exp()))
        .collect();
    let total: f64 = p.iter().map(|&(_, x)| x).sum();
    p.iter_mut().for_each(|(_, x)| *x /= total);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_lanes_is_within_its_bound_down_to_underflow() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let exact = (x as f64).exp();
            worst = worst.max((exp_lanes(x) as f64 - exact).abs() / exact);
        }
        assert!(worst < 3e-7, "relative error {worst}");
    }

    #[test]
    fn sum_exp_adds_up_every_element() {
        for len in [0, 1, 255, 256, 257, 151_936] {
            let logits: Vec<f32> = (0..len)
                .map(|i| ((i * 7919) % 1000) as f32 * -0.02)
                .collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exact: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
            let ours = sum_exp(&logits, max);
            assert!(
                (ours - exact).abs() <= 1e-6 * exact.max(1e-30),
                "{len}: {ours} vs {exact}"
            );
        }
    }
}
