//! Token selection from last-position logits: greedy, or nucleus (top-p)
//! sampling with temperature, top-k and min-p, on the device or the host.

use mlx_rs::ops::indexing::{argmax_axis, take_along_axis};
use mlx_rs::ops::{argsort_axis, select, softmax_axis};
use mlx_rs::{random, Array, Dtype};

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerKind {
    Greedy,
    /// Nucleus sampling on the host from logits copied back each step.
    TopPCpu,
    /// Nucleus sampling as MLX ops, so decoding never waits on the host.
    TopPGpu,
}

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub kind: SamplerKind,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 0 disables.
    pub min_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            kind: SamplerKind::Greedy,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(Error::invalid(format!(
                "temperature must be > 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(Error::invalid(format!(
                "min_p must be in [0, 1), got {}",
                self.min_p
            )));
        }
        Ok(())
    }
}

/// SplitMix64: a tiny, well-distributed generator; enough for sampling and
/// reproducible from a seed without another dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    config: SamplerConfig,
    rng: SplitMix64,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Ok(Sampler {
            config,
            rng: SplitMix64(seed),
        })
    }

    /// Whether `sample_device` applies; otherwise use `sample_host`.
    pub fn on_device(&self) -> bool {
        self.config.kind != SamplerKind::TopPCpu
    }

    /// `[B, V]` logits -> `[B]` uint32 token ids, as a lazy MLX array.
    pub fn sample_device(&mut self, logits: &Array) -> Result<Array> {
        let ids = match self.config.kind {
            SamplerKind::Greedy => argmax_axis(logits, -1, false)?,
            _ => {
                let masked = self.filtered_logits(logits)?;
                let key = random::key(self.rng.next_u64())?;
                random::categorical(&masked, -1, None, &key)?
            }
        };
        Ok(ids.as_dtype(Dtype::Uint32)?)
    }

    /// Logits scaled by temperature with every token outside the top-k, the
    /// nucleus and the min-p band set to -inf.
    fn filtered_logits(&self, logits: &Array) -> Result<Array> {
        let c = &self.config;
        let logits = logits
            .as_dtype(Dtype::Float32)?
            .divide(Array::from_f32(c.temperature))?;
        let probs = softmax_axis(&logits, -1, true)?;
        // Descending order, then the smallest probability each filter keeps.
        let order = argsort_axis(probs.negative()?, -1)?;
        let sorted = take_along_axis(&probs, &order, -1)?;
        let vocab = sorted.dim(-1);
        let mut threshold = Array::from_f32(0.0);
        if c.top_p < 1.0 {
            let before = sorted.cumsum(-1, None, None)?.subtract(&sorted)?;
            let kept = select(
                before.lt(Array::from_f32(c.top_p))?,
                &sorted,
                Array::from_f32(f32::INFINITY),
            )?;
            threshold = mlx_rs::ops::maximum(&threshold, kept.min_axis(-1, true)?)?;
        }
        if c.top_k > 0 && (c.top_k as i32) < vocab {
            let kth = mlx_rs::ops::indexing::IndexOp::index(
                &sorted,
                (.., (c.top_k as i32 - 1)..(c.top_k as i32)),
            );
            threshold = mlx_rs::ops::maximum(&threshold, kth)?;
        }
        if c.min_p > 0.0 {
            let top = mlx_rs::ops::indexing::IndexOp::index(&sorted, (.., 0..1));
            threshold = mlx_rs::ops::maximum(&threshold, top.multiply(Array::from_f32(c.min_p))?)?;
        }
        Ok(select(
            probs.ge(&threshold)?,
            &logits,
            Array::from_f32(f32::NEG_INFINITY),
        )?)
    }

    /// `[B, V]` logits -> token ids, sampled on the host.
    pub fn sample_host(&mut self, logits: &Array) -> Result<Vec<u32>> {
        let logits = logits.as_dtype(Dtype::Float32)?;
        logits.eval()?;
        let vocab = logits.dim(-1) as usize;
        let data: &[f32] = logits.as_slice();
        let mut out = Vec::with_capacity(data.len() / vocab);
        for row in data.chunks(vocab) {
            out.push(self.sample_row(row));
        }
        Ok(out)
    }

    fn sample_row(&mut self, logits: &[f32]) -> u32 {
        let c = &self.config;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, (((l - max) / c.temperature) as f64).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut keep = probs.len();
        if c.top_k > 0 {
            keep = keep.min(c.top_k);
        }
        if c.top_p < 1.0 {
            let mut cumulative = 0.0;
            let nucleus = probs
                .iter()
                .position(|p| {
                    cumulative += p.1;
                    cumulative >= c.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            keep = keep.min(nucleus);
        }
        if c.min_p > 0.0 {
            let floor = probs[0].1 * c.min_p as f64;
            keep = keep.min(probs.iter().take_while(|p| p.1 >= floor).count().max(1));
        }
        let kept = &probs[..keep.max(1)];
        let mass: f64 = kept.iter().map(|p| p.1).sum();
        let mut target = self.rng.next_f64() * mass;
        for p in kept {
            target -= p.1;
            if target <= 0.0 {
                return p.0;
            }
        }
        kept[kept.len() - 1].0
    }
}
