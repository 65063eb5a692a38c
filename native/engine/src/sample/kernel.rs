//! Sampling with our CUDA kernel ([`crate::backend::cuda::layer::SampleKernel`]):
//! the filters of [`super::filter::kept_host`] over the top-k candidates
//! and a draw whose uniform value is a hash of the row's seed and position
//! ([`uniform`]), so that a step holds no random state and a replayed step
//! draws anew as its positions advance. The host and MLX's ops draw from
//! per-row streams instead: for the same seed the paths draw different
//! tokens, each reproducibly.

use mlx_rs::{Array, Dtype};

use super::filter::{distribution_kept, kept_host};
use super::{draw, SamplerConfig, SplitMix64};
use crate::backend::cuda::layer::{SampleKernel, SAMPLE_PARAMS, SAMPLE_TOP_K};
use crate::error::{Error, Result};

/// Row `seed`'s uniform value in `[0, 1)` at cache position `position`:
/// SplitMix64 started from the seed mixed with the position, 53 bits. The
/// kernel computes the same.
pub fn uniform(seed: u64, position: i32) -> f64 {
    let start = seed ^ u64::from(position as u32).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    SplitMix64(start).next_f64()
}

/// What the kernel draws for one row of logits and uniform value `u`, on
/// the host: [`kept_host`]'s tokens, their tempered softmax, then the first
/// token in ascending ids whose cumulative probability exceeds `u`.
pub fn reference_draw(c: &SamplerConfig, logits: &[f32], u: f64) -> u32 {
    draw(&distribution_kept(c, &kept_host(c, logits)), u)
}

/// Why the kernel does not take `c` over a vocabulary of `vocab` (`None`:
/// it does).
pub fn declines(c: &SamplerConfig, vocab: usize) -> Option<&'static str> {
    if c.top_k == 0 || c.top_k >= vocab {
        Some("sample kernel: no top-k (the kernel draws among the top-k)")
    } else if c.top_k > SAMPLE_TOP_K {
        Some("sample kernel: top-k above 64")
    } else {
        None
    }
}

/// The kernel's parameters for `c` (see [`SAMPLE_PARAMS`]).
pub(super) fn params(c: &SamplerConfig) -> Array {
    let mut p = [0f32; SAMPLE_PARAMS];
    p[0] = c.top_p;
    p[1] = c.min_p;
    p[2] = if c.min_p > 0.0 { c.min_p.ln() } else { 0.0 };
    p[3] = c.min_tokens_to_keep.min(SAMPLE_TOP_K) as f32;
    p[4] = c.temperature;
    p[5] = c.top_k.min(SAMPLE_TOP_K) as f32;
    Array::from_slice(&p, &[SAMPLE_PARAMS as i32])
}

/// The rows' seeds as the kernel reads them: uint64, padded with zeros to
/// [`SAMPLE_PARAMS`] elements at least (kept in device memory, as the
/// parameters).
pub(super) fn seeds(seeds: &[u64]) -> Array {
    let mut s = seeds.to_vec();
    s.resize(seeds.len().max(SAMPLE_PARAMS), 0);
    Array::from_slice(&s, &[s.len() as i32])
}

/// The kernel's tokens for `logits` `[rows, V]` at cache positions
/// `positions` with seeds `seeds` (one each a row), on the current stream:
/// `None` where the kernel does not run here (no CUDA GPU, filters it does
/// not cover, a failed check). For tests and tools that check its draws.
pub fn sample_at(
    c: &SamplerConfig,
    logits: &Array,
    positions: &[i32],
    row_seeds: &[u64],
) -> Result<Option<Vec<u32>>> {
    let rows = logits.dim(0) as usize;
    if positions.len() != rows || row_seeds.len() != rows || logits.ndim() != 2 {
        return Err(Error::invalid(
            "a position and a seed per row of [rows, vocab] logits",
        ));
    }
    if !crate::backend::cuda::layer::wanted()
        || declines(c, logits.dim(-1).max(0) as usize).is_some()
    {
        return Ok(None);
    }
    let dtype = logits.dtype();
    let Ok(k) = crate::backend::cuda::layer::sample_kernel(logits, false, |k, masked| {
        check(k, dtype, masked)
    }) else {
        return Ok(None);
    };
    let positions = Array::from_slice(positions, &[rows as i32]);
    let ids = k.draw(logits, &positions, &seeds(row_seeds), &params(c), None)?;
    ids.eval()?;
    Ok(Some(
        ids.try_as_slice::<u32>()
            .map_err(|e| Error::Mlx(format!("reading sampled tokens: {e}")))?
            .to_vec(),
    ))
}

/// Whether `u` lies within `tolerance` of a cumulative boundary of `probs`
/// (ascending ids, as the draw adds them): where float rounding may tip a
/// draw to the neighbouring token.
pub fn near_boundary(probs: &[(usize, f64)], u: f64, tolerance: f64) -> bool {
    let mut sum = 0.0;
    probs.iter().any(|&(_, p)| {
        sum += p;
        (sum - u).abs() < tolerance
    })
}

/// The kernel's draw against [`reference_draw`] for one row: equal, or
/// differing only where `u` is within 1e-5 of a boundary and the kernel's
/// token is kept.
pub fn agrees(c: &SamplerConfig, logits: &[f32], u: f64, got: u32) -> bool {
    let kept = kept_host(c, logits);
    let probs = distribution_kept(c, &kept);
    got == draw(&probs, u)
        || (near_boundary(&probs, u, 1e-5) && probs.iter().any(|&(i, _)| i == got as usize))
}

/// The kernel against [`reference_draw`] in `dtype`: random logits of
/// Qwen3's vocabulary at several scales, a row on a grid of quarters (ties
/// at the k-th largest) and one of equal values (every value ties: the
/// kernel's radix path), Qwen3's recommended settings and others, several
/// seeds and positions; with `masked`, the rows masked as
/// [`crate::backend::cuda::layer::check_mask`] masks them.
pub(crate) fn check(k: &SampleKernel, dtype: Dtype, masked: bool) -> Result<()> {
    let (rows, vocab) = (6, 151_936);
    let key = mlx_rs::random::key(31)?;
    let normal = mlx_rs::random::normal::<f32>(&[rows, vocab], None, None, &key)?;
    let scales = Array::from_slice(&[0.5f32, 2.0, 4.0, 8.0, 1.0, 0.0], &[rows, 1]);
    let quarters = Array::from_f32(4.0);
    let mut logits = normal.multiply(&scales)?;
    // Row 4 on a grid of quarters (exact in every dtype).
    let grid = logits.multiply(&quarters)?.round(None)?.divide(&quarters)?;
    let is_grid = Array::from_slice(&[0.0f32, 0.0, 0.0, 0.0, 1.0, 0.0], &[rows, 1]);
    logits = mlx_rs::ops::select(&is_grid.gt(Array::from_f32(0.5))?, &grid, &logits)?;
    let logits = logits.as_dtype(dtype)?;
    let host = logits.as_dtype(Dtype::Float32)?;
    host.eval()?;
    let host_rows: Vec<f32> = host
        .try_as_slice::<f32>()
        .map_err(|e| Error::Mlx(format!("reading the sample check's logits: {e}")))?
        .to_vec();
    let (allowed, bits) = crate::backend::cuda::layer::check_mask(rows as usize, vocab as usize);
    let mask = Array::from_slice(&bits, &[rows, (vocab + 31) / 32]);
    let masked_rows: Vec<f32> = host_rows
        .chunks(vocab as usize)
        .zip(allowed.chunks(vocab as usize))
        .flat_map(|(row, allowed)| {
            let none = !allowed.contains(&true);
            row.iter()
                .zip(allowed)
                .map(move |(&x, &a)| if a || none { x } else { f32::NEG_INFINITY })
        })
        .collect();
    let configs = [
        (0.6, 0.95, 20, 0.0, 1),
        (1.0, 1.0, 64, 0.0, 1),
        (0.8, 0.5, 40, 0.05, 3),
        (1.3, 0.9, 1, 0.0, 1),
        (1.0, 0.99, 7, 0.2, 1),
    ];
    let positions = [0i32, 17, 1000, 40_000, 5, 123];
    let position_array = Array::from_slice(&positions, &[rows]);
    for (n, (temperature, top_p, top_k, min_p, keep)) in configs.into_iter().enumerate() {
        let c = SamplerConfig {
            kind: super::SamplerKind::TopPGpu,
            temperature,
            top_p,
            top_k,
            min_p,
            min_tokens_to_keep: keep,
            seed: None,
        };
        for base in [1u64, u64::MAX - 7] {
            let row_seeds: Vec<u64> = (0..rows as u64)
                .map(|r| base.wrapping_add(r * 7919 + n as u64))
                .collect();
            let drawn = |mask: Option<&Array>| -> Result<Vec<u32>> {
                let got = k.draw(
                    &logits,
                    &position_array,
                    &seeds(&row_seeds),
                    &params(&c),
                    mask,
                )?;
                got.eval()?;
                Ok(got
                    .try_as_slice::<u32>()
                    .map_err(|e| Error::Mlx(format!("reading the sample check's tokens: {e}")))?
                    .to_vec())
            };
            // Masked: the host's draw over the logits with every token a
            // row's mask leaves out at -inf (a row allowing none draws
            // unmasked).
            let (got, rows_now) = if masked {
                (drawn(Some(&mask))?, &masked_rows)
            } else {
                (drawn(None)?, &host_rows)
            };
            {
                for (r, row) in rows_now.chunks(vocab as usize).enumerate() {
                    let u = uniform(row_seeds[r], positions[r]);
                    if !agrees(&c, row, u, got[r]) {
                        return Err(Error::Mlx(format!(
                            "the sample kernel ({dtype:?}{}) drew {} where the host draws {} \
                             (row {r}, temperature {temperature}, top-p {top_p}, top-k {top_k}, \
                             min-p {min_p})",
                            if masked { ", masked" } else { "" },
                            got[r],
                            reference_draw(&c, row, u)
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The uniform value is SplitMix64's first draw from the seed mixed with
    /// the position: in `[0, 1)`, a function of both, and stable (the
    /// kernel computes the same bits).
    #[test]
    fn uniform_values_hash_seed_and_position() {
        assert_eq!(uniform(0, 0), SplitMix64(0).next_f64());
        // SplitMix64's first output from 0 is 0xE220A8397B1DCDAF.
        assert_eq!(
            uniform(0, 0),
            (0xE220_A839_7B1D_CDAFu64 >> 11) as f64 / 2f64.powi(53)
        );
        let mut seen = std::collections::HashSet::new();
        for seed in [0u64, 1, 42, u64::MAX] {
            for position in [0, 1, 2, 1000, i32::MAX] {
                let u = uniform(seed, position);
                assert!((0.0..1.0).contains(&u));
                assert!(seen.insert(u.to_bits()), "{seed} {position}");
            }
        }
        // Roughly uniform over many positions.
        let mean = (0..10_000).map(|p| uniform(7, p)).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    /// The reference draw is the inverse of the kept tokens' cumulative
    /// distribution in ascending ids, and the tolerance admits a neighbour
    /// only near a boundary.
    #[test]
    fn the_reference_draws_by_the_cumulative_distribution() {
        let c = SamplerConfig {
            kind: super::super::SamplerKind::TopPGpu,
            temperature: 1.0,
            top_k: 3,
            ..SamplerConfig::default()
        };
        // Tokens 1, 3 and 4 kept (top-3), probabilities 0.2, 0.5, 0.3.
        let logits = [-9.0f32, 0.2f32.ln(), -9.0, 0.5f32.ln(), 0.3f32.ln()];
        let probs = distribution_kept(&c, &kept_host(&c, &logits));
        let ids: Vec<usize> = probs.iter().map(|&(i, _)| i).collect();
        assert_eq!(ids, [1, 3, 4]);
        for (u, want) in [
            (0.0, 1),
            (0.19, 1),
            (0.21, 3),
            (0.69, 3),
            (0.71, 4),
            (0.999, 4),
        ] {
            assert_eq!(reference_draw(&c, &logits, u), want, "u = {u}");
            assert!(agrees(&c, &logits, u, want));
        }
        // A neighbour is admitted at a boundary, not away from one, and a
        // dropped token never.
        assert!(agrees(&c, &logits, 0.2 + 1e-7, 1));
        assert!(!agrees(&c, &logits, 0.5, 1));
        assert!(!agrees(&c, &logits, 0.2 + 1e-7, 0));
        assert_eq!(declines(&c, 5), None);
        assert!(declines(
            &SamplerConfig {
                top_k: 65,
                ..c.clone()
            },
            1000
        )
        .is_some());
        assert!(declines(
            &SamplerConfig {
                top_k: 0,
                ..c.clone()
            },
            1000
        )
        .is_some());
        assert!(declines(&SamplerConfig { top_k: 5, ..c }, 5).is_some());
    }
}
