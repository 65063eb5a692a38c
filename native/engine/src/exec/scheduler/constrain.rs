//! Constrained rows of the running batch: each one's allowed tokens become
//! an additive logit bias (0 or -inf) on its own row, computed on the host
//! (rows spread over the cores) while the device runs the step's forward
//! pass. Rows without a
//! constraint get zeros, which leave their logits exactly as they were.

use std::time::Instant;

use mlx_rs::{transforms, Array};

use super::Request;
use crate::error::Result;

/// Whether some request among `requests` is constrained.
pub(super) fn any_constrained<'a>(mut requests: impl Iterator<Item = &'a Request>) -> bool {
    requests.any(|r| r.constraint.is_some())
}

/// `logits` `[rows, V]` with each constrained row's mask added; `requests`
/// holds row `i`'s request, or `None` for a free slot or a row that has
/// left. `buffer` is reused from step to step. Returns `logits` itself when
/// no row is constrained.
pub(super) fn mask_logits(
    logits: Array,
    requests: &mut [Option<&mut Request>],
    buffer: &mut Vec<f32>,
) -> Result<Array> {
    if !any_constrained(requests.iter().flatten().map(|r| &**r)) {
        return Ok(logits);
    }
    // The device computes the logits while the host computes the masks.
    transforms::async_eval([&logits])?;
    let rows = requests.len();
    let vocab = logits.dim(-1) as usize;
    buffer.clear();
    buffer.resize(rows * vocab, 0.0);
    let mut jobs: Vec<(&mut [f32], &mut Request)> = buffer
        .chunks_mut(vocab)
        .zip(requests.iter_mut())
        .filter_map(|(out, r)| r.as_deref_mut().map(|r| (out, r)))
        .filter(|(_, r)| r.constraint.is_some())
        .collect();
    // Rows' grammars are independent: several are computed at once.
    crate::exec::each_on_threads(&mut jobs, |(out, r)| write_row(out, r))?;
    // In the logits' dtype (0 and -inf are exact in any float type), so a
    // free row's sampler sees its logits unchanged, not promoted.
    let bias = Array::from_slice(buffer, &[rows as i32, vocab as i32]).as_dtype(logits.dtype())?;
    Ok(logits.add(&bias)?)
}

/// Writes one constrained row's bias into `out` and counts its time.
fn write_row(out: &mut [f32], request: &mut Request) -> Result<()> {
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
    if !constraint.write_bias(eos, options.ignore_eos, out)? {
        // Complete: the row ends before taking this step's token.
        out.fill(0.0);
    }
    *constraint_ms += started.elapsed().as_secs_f64() * 1e3;
    Ok(())
}
