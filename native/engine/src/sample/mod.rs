//! Token selection from last-position logits, as mlx-lm's `make_sampler`
//! does it: greedy at temperature 0, otherwise top-p, min-p and top-k filter
//! the untempered log-probabilities ([`filter`]) and the token is drawn from
//! what is left, scaled by the temperature. Sampling runs on the device or on
//! the host; each batch row draws from its own random stream, so a seeded
//! row's tokens do not depend on the rows it is batched with. On a CUDA GPU
//! with top-k of at most 64, one kernel of ours filters and draws
//! ([`kernel`]), its uniform values a hash of each row's seed and position
//! rather than a stream: reproducible too, but other tokens than the
//! streams' for the same seed. On a CPU stream the host's filters and draws
//! run as a node of the step's graph, whichever sampler is asked for, so a
//! sampled step is queued behind the running one as a greedy step is.

pub mod filter;
pub mod kernel;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{argmax_axis, take_along_axis, IndexOp};
use mlx_rs::{random, Array, Dtype};

use crate::backend::cuda::layer::SampleKernel;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SamplerKind {
    Greedy,
    /// The host's filters and draws: on a CPU stream a node of the step's
    /// graph (queued with it, as a device sampler is), on a GPU from logits
    /// copied back each step.
    TopPCpu,
    /// Sampling on the device, so decoding never waits on the host: our
    /// kernel on a CUDA GPU where it applies, else MLX's ops; on a CPU
    /// stream (where the host is the device) the host's filters as a node
    /// of the step's graph, as `TopPCpu` there.
    TopPGpu,
}

/// The last axis's argmax as uint32 token ids, lazily: our kernel on a
/// CUDA stream (one node instead of MLX's two, and faster), else MLX's.
pub fn greedy(logits: &Array) -> Result<Array> {
    match crate::backend::cuda::layer::argmax(logits, None)? {
        Some(ids) => Ok(ids),
        None => Ok(argmax_axis(logits, -1, false)?.as_dtype(Dtype::Uint32)?),
    }
}

#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub kind: SamplerKind,
    /// 0 samples greedily, whatever the kind.
    pub temperature: f32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 (or the vocabulary size or more) disables.
    pub top_k: usize,
    /// 0 disables.
    pub min_p: f32,
    /// Tokens min-p never drops (the most likely ones).
    pub min_tokens_to_keep: usize,
    /// Seeds every row without a seed of its own; see [`row_seed`].
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
            min_tokens_to_keep: 1,
            seed: None,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::invalid(format!(
                "temperature must be >= 0 (0 is greedy), got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(Error::invalid(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        if self.min_tokens_to_keep == 0 {
            return Err(Error::invalid("min_tokens_to_keep must be at least 1"));
        }
        Ok(())
    }

    /// Whether tokens are chosen by argmax.
    pub fn is_greedy(&self) -> bool {
        self.kind == SamplerKind::Greedy || self.temperature == 0.0
    }
}

/// SplitMix64: a tiny, well-distributed generator; enough for sampling and
/// reproducible from a seed without another dependency.
#[derive(Debug, Clone)]
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

/// The seed of row `row` when it has none of its own: the generation's seed
/// for the first row (so a single prompt samples as it always did), a
/// distinct stream derived from it for the others.
pub fn row_seed(generation_seed: u64, row: usize) -> u64 {
    if row == 0 {
        generation_seed
    } else {
        SplitMix64(generation_seed ^ SplitMix64(row as u64).next_u64()).next_u64()
    }
}

pub struct Sampler {
    config: SamplerConfig,
    /// One random stream per batch row.
    rngs: Vec<SplitMix64>,
    /// Each row's seed, for the sampling kernel's stateless draws.
    seeds: Vec<u64>,
    /// The sampling kernel's seeds and parameters, made at its first use
    /// and kept (a replayed step reads these very buffers).
    kernel_inputs: Option<(Array, Array)>,
}

impl Sampler {
    /// `row_seeds` holds one entry per batch row (`None`: derived from the
    /// configuration's seed).
    pub fn new(config: SamplerConfig, row_seeds: &[Option<u64>]) -> Result<Self> {
        config.validate()?;
        let base = config.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let seeds: Vec<u64> = row_seeds
            .iter()
            .enumerate()
            .map(|(i, seed)| seed.unwrap_or_else(|| row_seed(base, i)))
            .collect();
        Ok(Sampler {
            config,
            rngs: seeds.iter().map(|&s| SplitMix64(s)).collect(),
            seeds,
            kernel_inputs: None,
        })
    }

    /// Whether every row takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.config.is_greedy()
    }

    /// Whether sampled rows over `vocab` tokens take the sampling kernel on
    /// a CUDA GPU: `Some(true)` once it passed its check, `Some(false)`
    /// where it cannot (greedy rows, the host's sampler, filters it does
    /// not cover, a failed check), `None` until it is checked.
    pub fn kernel_ready(&self, vocab: usize) -> Option<bool> {
        if self.config.is_greedy()
            || self.config.kind != SamplerKind::TopPGpu
            || kernel::declines(&self.config, vocab).is_some()
        {
            return Some(false);
        }
        crate::backend::cuda::layer::sample_checked()
    }

    /// Whether `sample_device` applies (the tokens are queued with the
    /// step); otherwise use `sample_host`.
    pub fn on_device(&self) -> bool {
        self.config.is_greedy() || self.config.kind != SamplerKind::TopPCpu || host_node_here()
    }

    /// Moves row `row`'s random stream past `draws` draws, as if it had
    /// sampled that many tokens: a token a grammar forces takes a draw
    /// whether it is sampled from a one-token mask or taken directly, so a
    /// seeded row samples the same tokens either way.
    pub fn skip_draws(&mut self, row: usize, draws: usize) {
        if self.config.is_greedy() {
            return;
        }
        if let Some(rng) = self.rngs.get_mut(row) {
            for _ in 0..draws {
                rng.next_u64();
            }
        }
    }

    fn check_rows(&self, rows: usize) -> Result<()> {
        if rows != self.rngs.len() {
            return Err(Error::invalid(format!(
                "the sampler was made for {} rows, got logits for {rows}",
                self.rngs.len()
            )));
        }
        Ok(())
    }

    /// `[B, V]` logits -> `[B]` uint32 token ids, as a lazy MLX array.
    pub fn sample_device(&mut self, logits: &Array) -> Result<Array> {
        let ids = if self.config.is_greedy() {
            greedy(logits)?
        } else {
            self.check_rows(logits.dim(0) as usize)?;
            if self.config.kind == SamplerKind::TopPCpu || host_node_here() {
                self.host_node(logits)?
            } else {
                match self.sample_kernel(logits, None)? {
                    Some(ids) => ids,
                    None => self.sample_ops(logits)?,
                }
            }
        };
        Ok(ids.as_dtype(Dtype::Uint32)?)
    }

    /// The host's filters and draws ([`Sampler::sample_host`]'s, with the
    /// same random numbers, so the same tokens) as a node of the CPU
    /// stream's graph; where none can be built, on the host now (noted).
    fn host_node(&mut self, logits: &Array) -> Result<Array> {
        let before = self.rngs.clone();
        let draws: Vec<f64> = self.rngs.iter_mut().map(SplitMix64::next_f64).collect();
        let config = self.config.clone();
        let f = Box::new(move |row: usize, x: &[f32]| {
            let kept = filter::kept_host(&config, x);
            draw(&filter::distribution_kept(&config, &kept), draws[row])
        });
        let logits = logits.as_dtype(Dtype::Float32)?;
        if let Some(ids) = crate::backend::cpu::rows_to_ids(&logits, f)? {
            return Ok(ids);
        }
        self.rngs = before;
        crate::backend::declined("host sampling node: not on a CPU stream with our kernels");
        let ids = self.sample_host(&logits)?;
        Ok(Array::from_slice(&ids, &[ids.len() as i32]))
    }

    /// Each row's token drawn by MLX's ops (lazily), each row from its own
    /// stream.
    fn sample_ops(&mut self, logits: &Array) -> Result<Array> {
        // With top-k, the draw is among the candidates, whose ids it
        // maps back to; otherwise among the whole vocabulary.
        let (candidates, lp) = match filter::filtered_candidates(&self.config, logits)? {
            Some((ids, lp)) => (Some(ids), lp),
            None => (None, filter::filtered_logprobs(&self.config, logits)?),
        };
        let scaled = lp.multiply(Array::from_f32(1.0 / self.config.temperature))?;
        // One draw per row with the row's own key: a batched draw's
        // noise for a row would depend on the batch's shape.
        let rows = self
            .rngs
            .iter_mut()
            .enumerate()
            .map(|(i, rng)| {
                let key = random::key(rng.next_u64())?;
                let row = scaled.index((i as i32..i as i32 + 1, ..));
                random::categorical(&row, -1, None, &key)
            })
            .collect::<Result<Vec<Array>, _>>()?;
        let drawn = if rows.len() == 1 {
            rows.into_iter().next().expect("one row")
        } else {
            concatenate(&rows, 0)?
        };
        Ok(match candidates {
            Some(ids) => {
                let at = drawn.reshape(&[-1, 1])?.as_dtype(Dtype::Int32)?;
                take_along_axis(&ids, &at, -1)?.reshape(&[-1])?
            }
            None => drawn,
        })
    }

    /// Each row's token from our kernel where it takes the work (see
    /// [`kernel_for`]), among those `mask` allows; otherwise `None` (MLX's
    /// ops then).
    fn sample_kernel(&mut self, logits: &Array, mask: Option<&Array>) -> Result<Option<Array>> {
        let Some((k, positions)) = kernel_for(&self.config, logits, mask.is_some()) else {
            return Ok(None);
        };
        let (seeds, params) = self
            .kernel_inputs
            .get_or_insert_with(|| (kernel::seeds(&self.seeds), kernel::params(&self.config)));
        Ok(Some(k.draw(logits, &positions, seeds, params, mask)?))
    }

    /// `[B, V]` logits -> `[B]` uint32 tokens (lazy), each row among the
    /// tokens its `mask` allows (`[B, ceil(V / 32)]` uint32: bit `i % 32`
    /// of word `i / 32` allows token `i`; a row allowing none is drawn
    /// unmasked), by our CUDA kernels: greedy rows by the argmax, sampled
    /// ones by the sampling kernel. `None` where neither takes this step
    /// (another device or sampler, a failed check; the reason noted): the
    /// caller masks the logits itself.
    pub fn sample_masked(&mut self, logits: &Array, mask: &Array) -> Result<Option<Array>> {
        if self.config.is_greedy() {
            return crate::backend::cuda::layer::argmax(logits, Some(mask));
        }
        self.check_rows(logits.dim(0) as usize)?;
        if self.config.kind != SamplerKind::TopPGpu || host_node_here() {
            return Ok(None);
        }
        self.sample_kernel(logits, Some(mask))
    }

    /// `[B, V]` logits -> token ids, sampled on the host.
    pub fn sample_host(&mut self, logits: &Array) -> Result<Vec<u32>> {
        // Contiguous: a view (a broadcast or a slice) has no flat host buffer.
        let logits = logits.as_dtype(Dtype::Float32)?.contiguous()?;
        logits.eval()?;
        let vocab = logits.dim(-1) as usize;
        self.check_rows(logits.dim(0) as usize)?;
        let data: &[f32] = logits
            .try_as_slice()
            .map_err(|e| Error::Mlx(format!("reading logits back: {e:?}")))?;
        let config = &self.config;
        Ok(data
            .chunks(vocab)
            .zip(self.rngs.iter_mut())
            .map(|(row, rng)| {
                let kept = filter::kept_host(config, row);
                draw(&filter::distribution_kept(config, &kept), rng.next_f64())
            })
            .collect())
    }
}

/// One row each of `logits` (`[rows, V]`) drawn in one call of our CUDA
/// sampling kernel, row `i` with `samplers[i]`'s seed (`None`: a row drawn
/// elsewhere, greedy or free, whose token is not used): a scheduler's rows,
/// each a request with a sampler of its own. The kernel takes one set of
/// filters, so every sampler must ask for the same; and it needs the step's
/// positions, which it takes. With `mask` (`[rows, ceil(V / 32)]` bits, see
/// [`Sampler::sample_masked`]), each row draws among the tokens it allows.
/// `None` (a reason noted) where it does not run: the rows then sample one
/// by one.
pub fn sample_rows(
    samplers: &[Option<&Sampler>],
    logits: &Array,
    mask: Option<&Array>,
) -> Result<Option<Array>> {
    let sampled: Vec<&Sampler> = samplers.iter().flatten().copied().collect();
    let Some(first) = sampled.first() else {
        return Ok(None);
    };
    let c = &first.config;
    if c.kind != SamplerKind::TopPGpu {
        return Ok(None);
    }
    let same = |s: &&Sampler| {
        let o = &s.config;
        o.kind == c.kind
            && (o.temperature, o.top_p, o.min_p) == (c.temperature, c.top_p, c.min_p)
            && (o.top_k, o.min_tokens_to_keep) == (c.top_k, c.min_tokens_to_keep)
            && s.seeds.len() == 1
    };
    if !sampled.iter().all(same) {
        crate::backend::declined(
            "sample kernel: the rows' samplers differ (one kernel call takes one set of filters)",
        );
        return Ok(None);
    }
    let Some((k, positions)) = kernel_for(c, logits, mask.is_some()) else {
        return Ok(None);
    };
    let seeds: Vec<u64> = samplers
        .iter()
        .map(|s| s.map_or(0, |s| s.seeds[0]))
        .collect();
    let ids = k.draw(
        logits,
        &positions,
        &kernel::seeds(&seeds),
        &kernel::params(c),
        mask,
    )?;
    Ok(Some(ids))
}

/// Our sampling kernel and the step's positions where the kernel takes
/// `logits` (`[rows, V]`) sampled with `c`: a CUDA GPU stream, filters it
/// covers, and the positions of the step whose logits these are (the
/// layers keep them; taken here whatever happens, so that no step's
/// positions outlive it). Otherwise `None`, the reason noted.
fn kernel_for(c: &SamplerConfig, logits: &Array, masked: bool) -> Option<(SampleKernel, Array)> {
    use crate::backend::cuda::layer;
    if !layer::wanted() {
        return None;
    }
    let positions = layer::take_step_positions();
    let vocab = logits.dim(-1).max(0) as usize;
    let why = match kernel::declines(c, vocab) {
        Some(why) => why,
        None => match layer::sample_kernel(logits, masked, |k, masked| {
            kernel::check(k, logits.dtype(), masked)
        }) {
            Err(why) => why,
            Ok(k) => match positions.filter(|p| p.size() == logits.dim(0) as usize) {
                Some(positions) => return Some((k, positions)),
                None => "sample kernel: no step positions for these rows (a prompt's token)",
            },
        },
    };
    crate::backend::declined(why);
    None
}

/// Whether sampled rows take the host's filters as a node of the graph
/// ([`Sampler::host_node`]): on a CPU stream with our kernels.
fn host_node_here() -> bool {
    crate::runtime::device::on_cpu_stream() && crate::backend::cpu::available()
}

/// Fails when a row's draw failed on the stream ([`Sampler::host_node`]'s
/// node marks it with an id past any vocabulary).
pub fn check_drawn(tokens: &[u32]) -> Result<()> {
    if tokens.contains(&emlx_axon_kernels::FAILED_ROW) {
        return Err(Error::Mlx("sampling a row failed on the CPU stream".into()));
    }
    Ok(())
}

/// The token whose cumulative probability (in ascending ids) first reaches
/// `u` (in `[0, 1)`), from the kept tokens' probabilities.
fn draw(probs: &[(usize, f64)], u: f64) -> u32 {
    let mut target = u;
    let mut last = 0;
    for &(i, p) in probs {
        if p > 0.0 {
            last = i;
            target -= p;
            if target < 0.0 {
                return i as u32;
            }
        }
    }
    last as u32
}
