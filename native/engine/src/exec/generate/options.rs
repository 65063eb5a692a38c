//! What a generation is asked for: its options, their checks against the
//! model and the prompts, and the KV cache they need.

use crate::error::{Error, Result};
use crate::kv::cache::{KvQuant, KvShape};
use crate::model::Model;
use crate::sample::SamplerConfig;
use crate::text::constraint::ConstraintSpec;
use crate::text::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// KV budget: prompt plus generated tokens of a row.
    pub max_len: usize,
    pub sampler: SamplerConfig,
    /// `None`: the model's EOS ids and the tokenizer's.
    pub eos_token_ids: Option<Vec<u32>>,
    pub ignore_eos: bool,
    /// Stop strings (need a tokenizer); the matched text is not returned.
    pub stop: Vec<String>,
    pub profile_timing: bool,
    /// Longest prompt slice run through the model at once; `None`: 2,048
    /// tokens on a GPU (mlx-lm's prefill step), where longer slices make
    /// larger, faster products, or 1,024 or 512 where a long context's
    /// attention scores would not fit in memory; 512 on the CPU.
    pub prefill_chunk: Option<usize>,
    /// Per-row settings, one per prompt, or empty for none.
    pub rows: Vec<RowOptions>,
    /// Tokens a row's grammar forces are taken without sampling or masking
    /// (default true). A single constrained prompt feeds them to the model
    /// with its next sampled token in one forward pass. The tokens are the
    /// ones the masks would force one step at a time, so the output is the
    /// same either way.
    pub fast_forward: bool,
    /// Decode steps may run as replays of one recorded step, launched as
    /// one CUDA graph, where the generation allows it and has at least 32
    /// steps left to replay (default true; see `backend/cuda/replay.rs`). Each
    /// replay is checked bit for bit against MLX's step before it is used.
    /// `EMLX_AXON_STEP_REPLAY=0` turns it off for the whole process.
    pub step_replay: bool,
    /// Keys and values kept quantized once the cache holds
    /// `quantized_kv_start` positions (mlx-lm's `kv_bits`,
    /// `kv_group_size`): the cache then takes about `bits / 16 + 2 / group`
    /// of a bfloat16 cache's memory, and attention runs MLX's quantized
    /// products instead of the fused layers.
    pub kv_quant: Option<KvQuant>,
    /// Positions the cache holds before it is quantized (mlx-lm's
    /// `quantized_kv_start`; default 5,000, as mlx-lm's).
    pub quantized_kv_start: usize,
    /// A rotating KV cache of at most this many positions, the first 4
    /// always kept (mlx-lm's `max_kv_size`): memory stays bounded however
    /// long the generation, and tokens past the window are forgotten.
    /// Attention then runs MLX's ops instead of the fused layers.
    pub max_kv_size: Option<usize>,
    /// The dtype of a float KV cache. `None`: float16 under a float32 model
    /// on the CPU, the model's dtype elsewhere (and for a quantized or
    /// rotating cache). A float16 cache under a float32 model reads half the
    /// bytes a step of a long context reads on the CPU, where that reading
    /// bounds the step; its keys and values are rounded to float16 as they
    /// are stored. `Float32` keeps them whole.
    pub kv_dtype: Option<mlx_rs::Dtype>,
}

/// Positions a rotating KV cache always keeps (mlx-lm's `keep`).
pub const KV_KEEP: usize = 4;

/// Settings of one batch row that override the generation's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowOptions {
    /// The row's own sampling seed: with it, the row samples exactly as a
    /// single-prompt generation with `seed` would, whatever it is batched
    /// with. Without it, the row's stream derives from the sampler's seed.
    pub seed: Option<u64>,
    /// What the row's output must match (needs a tokenizer). The row ends
    /// with [`FinishReason::Stop`](super::FinishReason::Stop) once nothing
    /// but the end of the output can follow, or with `Eos` when the model
    /// ends a complete output.
    pub constraint: Option<ConstraintSpec>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 100,
            max_len: 2048,
            sampler: SamplerConfig::default(),
            eos_token_ids: None,
            ignore_eos: false,
            stop: vec![],
            profile_timing: true,
            prefill_chunk: None,
            rows: vec![],
            fast_forward: true,
            step_replay: true,
            kv_quant: None,
            quantized_kv_start: 5000,
            max_kv_size: None,
            kv_dtype: None,
        }
    }
}

pub(super) fn validate(
    model: &Model,
    tokenizer: Option<&Tokenizer>,
    prompts: &[Vec<u32>],
    o: &GenerateOptions,
) -> Result<()> {
    if prompts.is_empty() {
        return Err(Error::invalid("no prompts given"));
    }
    if !o.rows.is_empty() && o.rows.len() != prompts.len() {
        return Err(Error::invalid(format!(
            "row options were given for {} rows but there are {} prompts",
            o.rows.len(),
            prompts.len()
        )));
    }
    use crate::exec::request::{check_length, check_options, check_prompt, check_tokenizer};
    check_tokenizer(model, tokenizer)?;
    check_options(o, tokenizer.is_some())?;
    for p in prompts {
        check_prompt(model, p)?;
        check_length(p, o.max_len)?;
    }
    if let Some(q) = o.kv_quant {
        check_kv_quant(model, q)?;
    }
    if let Some(dtype) = o.kv_dtype {
        check_kv_dtype(dtype)?;
        if o.kv_quant.is_some() {
            return Err(Error::invalid(
                "kv_dtype and kv_bits cannot be combined: kv_dtype is a float cache's dtype",
            ));
        }
    }
    if let Some(size) = o.max_kv_size {
        if size <= KV_KEEP || size > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "max_kv_size must be more than {KV_KEEP} (the positions always kept), got {size}"
            )));
        }
        if o.kv_quant.is_some() {
            return Err(Error::invalid(
                "kv_bits and max_kv_size cannot be combined: a rotating KV cache is not quantized (as in mlx-lm)",
            ));
        }
        if prompts.iter().any(|p| p.len() != prompts[0].len()) {
            return Err(Error::invalid(
                "max_kv_size needs prompts of one length (a rotating window has no padding mask)",
            ));
        }
    }
    Ok(())
}

/// A float KV cache's dtype (`kv_dtype`) is one of MLX's float types.
pub fn check_kv_dtype(dtype: mlx_rs::Dtype) -> Result<()> {
    if matches!(
        dtype,
        mlx_rs::Dtype::Float32 | mlx_rs::Dtype::Float16 | mlx_rs::Dtype::Bfloat16
    ) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "kv_dtype must be float32, float16 or bfloat16, got {dtype:?}"
        )))
    }
}

/// A KV quantization MLX can apply to this model's heads.
fn check_kv_quant(model: &Model, q: KvQuant) -> Result<()> {
    if !matches!(q.bits, 2 | 3 | 4 | 5 | 6 | 8) {
        return Err(Error::invalid(format!(
            "kv_bits must be 2, 3, 4, 5, 6 or 8, got {}",
            q.bits
        )));
    }
    if !matches!(q.group_size, 32 | 64 | 128) {
        return Err(Error::invalid(format!(
            "kv_group_size must be 32, 64 or 128, got {}",
            q.group_size
        )));
    }
    let hd = model.config.head_dim;
    if hd % q.group_size != 0 {
        return Err(Error::invalid(format!(
            "kv_group_size ({}) must divide the model's head size ({hd})",
            q.group_size
        )));
    }
    Ok(())
}

/// The cache a generation keeps: in `kv_dtype` where it is asked for; a
/// growing cache nobody chose a dtype for as [`KvShape::by_default`] has it
/// (`on_cpu`: the generation runs on the CPU); a quantized or rotating one
/// starts in the model's dtype, as mlx-lm's do.
pub(super) fn cache_shape(model: &Model, o: &GenerateOptions, on_cpu: bool) -> KvShape {
    let shape = model.kv_shape();
    let growing = o.kv_quant.is_none() && o.max_kv_size.is_none();
    let shape = if growing {
        shape.by_default(on_cpu)
    } else {
        shape
    };
    shape.in_dtype(o.kv_dtype)
}

/// The KV cache's length ([`cache_capacity`]), with `o`'s prompt slice
/// length filled in where it was not given: the longest of the device's
/// defaults whose chunk fits in memory beside the cache. On a GPU that is
/// 2,048 tokens, else 1,024, else 512 (a long context's attention scores
/// grow with the chunk); on the CPU (`on_cpu`) 512.
pub(super) fn capacity_and_chunk(
    model: &Model,
    kv: &KvShape,
    batch: usize,
    longest: usize,
    o: &mut GenerateOptions,
    on_cpu: bool,
) -> Result<i32> {
    let defaults: &[usize] = if on_cpu { &[512] } else { &[2048, 1024, 512] };
    first_fitting(o, defaults, |o| {
        cache_capacity(model, kv, batch, longest, o)
    })
}

/// `capacity` of `o` with its own prompt slice length, or with the first of
/// `defaults` it accepts (else its error for the last).
fn first_fitting(
    o: &mut GenerateOptions,
    defaults: &[usize],
    capacity: impl Fn(&GenerateOptions) -> Result<i32>,
) -> Result<i32> {
    if o.prefill_chunk.is_some() {
        return capacity(o);
    }
    let mut result = Err(Error::invalid("no prompt slice length to try"));
    for &chunk in defaults {
        o.prefill_chunk = Some(chunk);
        result = capacity(o);
        if result.is_ok() {
            break;
        }
    }
    result
}

/// `o`'s prompt slice length (filled in by [`capacity_and_chunk`]).
pub(super) fn prefill_chunk(o: &GenerateOptions) -> usize {
    o.prefill_chunk.unwrap_or(512).max(1)
}

/// The KV cache's length: the longest prompt plus what may be generated.
/// Refused when MLX cannot address it (shapes are i32: a silently wrapped
/// length would end decoding early with no finish reason) or when the cache,
/// with the attention scores of a prefill chunk, cannot fit in memory.
pub(super) fn cache_capacity(
    model: &Model,
    kv: &KvShape,
    batch: usize,
    longest: usize,
    o: &GenerateOptions,
) -> Result<i32> {
    let too_long = || {
        Error::invalid(format!(
            "max_new_tokens ({}) and max_len ({}) allow more positions than a KV cache can hold (2^31 - 1)",
            o.max_new_tokens, o.max_len
        ))
    };
    // Rounded up to whole buckets of positions: caches of recurring sizes
    // reuse MLX's freed buffers.
    let bucket = 256;
    let positions = longest
        .checked_add(o.max_new_tokens.min(o.max_len))
        .ok_or_else(too_long)?;
    // A rotating window holds its size, and a prefill chunk beside it.
    let positions = match o.max_kv_size {
        Some(size) => positions.min(size.saturating_add(prefill_chunk(o))),
        None => positions,
    };
    let positions = positions
        .checked_next_multiple_of(bucket)
        .map_or(positions, |p| p.min(i32::MAX as usize).max(positions));
    let capacity = i32::try_from(positions).map_err(|_| too_long())?;
    let kv = crate::kv::slots::slot_cache_bytes(kv, batch, positions);
    let scores = [
        batch,
        model.config.num_heads as usize,
        longest.min(prefill_chunk(o)),
        positions,
        4,
    ];
    let bytes = kv
        .zip(scores.iter().try_fold(1usize, |a, &d| a.checked_mul(d)))
        .and_then(|(kv, scores)| kv.checked_add(scores));
    crate::runtime::memory::ensure_fits(
        bytes,
        &format!("a KV cache of {positions} positions for {batch} prompt(s)"),
    )?;
    Ok(capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generation with no prompt slice length takes the longest default
    /// its cache accepts; one given is kept, fitting or not.
    #[test]
    fn the_longest_default_chunk_that_fits_is_taken() {
        // A cache that refuses chunks of more than 1,024 tokens.
        let capacity = |o: &GenerateOptions| match o.prefill_chunk {
            Some(chunk) if chunk <= 1024 => Ok(chunk as i32),
            _ => Err(Error::OutOfMemory("the chunk's scores".into())),
        };
        let gpu = [2048, 1024, 512];
        let mut o = GenerateOptions::default();
        assert_eq!(first_fitting(&mut o, &gpu, capacity).unwrap(), 1024);
        assert_eq!(o.prefill_chunk, Some(1024));

        let mut asked = GenerateOptions {
            prefill_chunk: Some(4096),
            ..GenerateOptions::default()
        };
        let err = first_fitting(&mut asked, &gpu, capacity).unwrap_err();
        assert_eq!(err.kind(), "out_of_memory");
        assert_eq!(asked.prefill_chunk, Some(4096));

        let mut none_fits = GenerateOptions::default();
        let err = first_fitting(&mut none_fits, &[8192, 4096], capacity).unwrap_err();
        assert_eq!(err.kind(), "out_of_memory");
        assert_eq!(none_fits.prefill_chunk, Some(4096));
    }
}
