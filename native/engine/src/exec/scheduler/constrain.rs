//! Constrained rows of the running batch: each one's allowed tokens (a
//! bitmask, 32 tokens a word) computed on the host, rows spread over the
//! cores, while the device runs the step's forward pass. On a GPU our
//! sampling kernels read the bits; elsewhere they become an additive logit
//! bias (0 or -inf) on the row. Rows without a constraint allow every
//! token, which leaves their logits exactly as they were.

use std::time::Instant;

use mlx_rs::{transforms, Array};

use super::Request;
use crate::error::Result;

/// Whether some request among `requests` is constrained.
pub(super) fn any_constrained<'a>(mut requests: impl Iterator<Item = &'a Request>) -> bool {
    requests.any(|r| r.constraint.is_some())
}

/// Writes each row's mask over `vocab` tokens into `words`
/// (`ceil(vocab / 32)` a row; `requests` holds row `i`'s request, or `None`
/// for a free slot or a row that has left): every bit for rows without a
/// constraint, and for a row whose grammar allows nothing (it ends before
/// taking this step's token). False, with nothing written, when no row is
/// constrained. `logits` is queued first, so the device computes it
/// meanwhile.
pub(super) fn write_masks(
    logits: &Array,
    requests: &mut [Option<&mut Request>],
    words: &mut Vec<u32>,
) -> Result<bool> {
    if !any_constrained(requests.iter().flatten().map(|r| &**r)) {
        return Ok(false);
    }
    transforms::async_eval([logits])?;
    let vocab = logits.dim(-1) as usize;
    let per_row = vocab.div_ceil(32);
    words.clear();
    words.resize(requests.len() * per_row, u32::MAX);
    let mut jobs: Vec<(&mut [u32], &mut Request)> = words
        .chunks_mut(per_row.max(1))
        .zip(requests.iter_mut())
        .filter_map(|(out, r)| r.as_deref_mut().map(|r| (out, r)))
        .filter(|(_, r)| r.constraint.is_some())
        .collect();
    // Rows' grammars are independent: several are computed at once.
    crate::runtime::each_on_threads(&mut jobs, |(out, r)| write_row(out, vocab, r))?;
    Ok(true)
}

/// `logits` `[rows, V]` with the masks [`write_masks`] wrote added as a
/// bias, in the logits' dtype (0 and -inf are exact in any float type), so
/// a free row's sampler sees its logits unchanged, not promoted.
pub(super) fn add_masks(logits: Array, words: &[u32]) -> Result<Array> {
    let (rows, vocab) = (logits.dim(0) as usize, logits.dim(-1) as usize);
    let bias = crate::exec::mask_bias(words, rows, vocab, logits.dtype())?;
    Ok(logits.add(&bias)?)
}

/// `logits` `[rows, V]` with each constrained row's mask added (see
/// [`write_masks`]); `logits` itself when no row is constrained.
pub(super) fn mask_logits(
    logits: Array,
    requests: &mut [Option<&mut Request>],
    words: &mut Vec<u32>,
) -> Result<Array> {
    if !write_masks(&logits, requests, words)? {
        return Ok(logits);
    }
    add_masks(logits, words)
}

/// Writes one constrained row's mask into `out` and counts its time.
fn write_row(out: &mut [u32], vocab: usize, request: &mut Request) -> Result<()> {
    let Request {
        constraint: Some(constraint),
        eos,
        options,
        constraint_ms,
        ..
    } = request
    else {
        return Ok(());
    };
    let started = Instant::now();
    crate::exec::write_row_mask(constraint, eos, options.ignore_eos, vocab, out)?;
    *constraint_ms += started.elapsed().as_secs_f64() * 1e3;
    Ok(())
}
