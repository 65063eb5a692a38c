//! From requests to tokens: [`generate::Generation`] for a batch that starts
//! together, [`scheduler::Scheduler`] for requests that come and go.

pub mod generate;
mod request;
pub mod scheduler;

use mlx_rs::{Array, Dtype};

use crate::text::constraint::{bias_of_mask, RowConstraint};

/// Writes a constrained row's mask into `out`; a row that may take no
/// token gets every bit (its grammar is complete: the row ends). A row whose
/// mask in parts failed goes on with one parser, and says so once.
pub(crate) fn write_row_mask(
    c: &mut RowConstraint,
    eos: &[u32],
    ignore_eos: bool,
    vocab: usize,
    out: &mut [u32],
) -> crate::error::Result<()> {
    let parts = c.mask_parts();
    if !c.write_mask(eos, ignore_eos, vocab, out)? {
        out.fill(u32::MAX);
    }
    if c.mask_parts() < parts {
        crate::backend::notice(format!(
            "a constrained row's mask in {parts} parts failed; the row computes it on one thread"
        ));
    }
    Ok(())
}

/// Constrained rows' masks (`words`, `ceil(V / 32)` a row, one row after
/// another, see [`crate::text::constraint::RowConstraint::write_mask`]) as
/// `[rows, ceil(V / 32)]` uint32, for our GPU sampling kernels.
pub(crate) fn mask_array(words: &[u32], rows: usize) -> Array {
    let per_row = words.len() / rows.max(1);
    Array::from_slice(words, &[rows as i32, per_row as i32])
}

/// The same masks as a `[rows, vocab]` additive bias in `dtype`: 0 where a
/// token is allowed, -inf elsewhere.
pub(crate) fn mask_bias(
    words: &[u32],
    rows: usize,
    vocab: usize,
    dtype: Dtype,
) -> crate::error::Result<Array> {
    let per_row = words.len() / rows.max(1);
    let mut bias = vec![0f32; rows * vocab];
    for (out, bits) in bias.chunks_mut(vocab).zip(words.chunks(per_row.max(1))) {
        bias_of_mask(bits, out);
    }
    Ok(Array::from_slice(&bias, &[rows as i32, vocab as i32]).as_dtype(dtype)?)
}
