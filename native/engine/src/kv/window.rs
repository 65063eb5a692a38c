//! A rotating window of keys and values, as mlx-lm's `RotatingKVCache`
//! keeps them: at most `max_size` positions, the first `keep` (attention
//! sinks) never dropped. A multi-token pass appends to the window in
//! temporal order, trimmed so that every new token still sees `max_size`
//! positions; one-token steps write in place, wrapping around past the
//! kept ones. The buffers' order is then not the positions' order, which
//! attention without a mask does not need.

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{arange, concatenate, ge, logical_and, lt, zeros_dtype};
use mlx_rs::Array;

use crate::error::{Error, Result};

/// Positions a one-token step grows the buffers by, as mlx-lm's.
const STEP: i32 = 256;

pub(crate) struct Window {
    max_size: i32,
    keep: i32,
    /// Each layer's next write position in its buffers (mlx-lm's `_idx`).
    idx: Vec<i32>,
}

fn mlx(e: impl std::fmt::Display) -> Error {
    Error::Mlx(e.to_string())
}

fn positions(a: &Array) -> i32 {
    if a.ndim() == 4 {
        a.dim(2)
    } else {
        0
    }
}

impl Window {
    pub(crate) fn new(layers: usize, max_size: i32, keep: i32) -> Self {
        Window {
            max_size,
            keep,
            idx: vec![0; layers],
        }
    }

    /// `v` without `trim` positions after the kept ones, then `append`.
    fn trim(&self, trim: i32, v: &Array, append: Option<&Array>) -> Result<Array> {
        let mut parts = if trim > 0 {
            vec![
                v.index((.., .., ..self.keep, ..)),
                v.index((.., .., trim + self.keep.., ..)),
            ]
        } else {
            vec![v.clone()]
        };
        parts.extend(append.cloned());
        Ok(concatenate(&parts, 2)?)
    }

    /// `v` in temporal order, its unused end sliced off.
    fn temporal(&self, v: &Array, idx: i32, offset: i32) -> Result<Array> {
        let len = positions(v);
        Ok(if idx == len {
            v.clone()
        } else if idx < offset {
            concatenate(
                &[
                    v.index((.., .., ..self.keep, ..)),
                    v.index((.., .., idx.., ..)),
                    v.index((.., .., self.keep..idx, ..)),
                ],
                2,
            )?
        } else {
            v.index((.., .., ..idx, ..))
        })
    }

    /// Stores `k`, `v` (`[B, kv_heads, L, head_dim]`) of layer `layer`,
    /// whose buffers are `kv` (empty before the first pass), `offset`
    /// positions in: returns what attention reads.
    pub(crate) fn update(
        &mut self,
        layer: usize,
        kv: &mut (Array, Array),
        offset: i32,
        k: &Array,
        v: &Array,
    ) -> Result<(Array, Array)> {
        let s = k.dim(2);
        let started = positions(&kv.0) > 0;
        if s > 1 {
            if started {
                let idx = self.idx[layer];
                let keys = self.temporal(&kv.0, idx, offset)?;
                let values = self.temporal(&kv.1, idx, offset)?;
                let trim = positions(&keys) - self.max_size + 1;
                kv.0 = self.trim(trim, &keys, Some(k))?;
                kv.1 = self.trim(trim, &values, Some(v))?;
            } else {
                *kv = (k.clone(), v.clone());
            }
            self.idx[layer] = positions(&kv.0);
            return Ok(kv.clone());
        }
        let mut idx = self.idx[layer];
        let len = positions(&kv.0);
        if !started || (offset >= len && len < self.max_size) {
            let grow = STEP.min(self.max_size - offset);
            let new = |a: &Array| -> Result<Array> {
                let mut shape = a.shape().to_vec();
                shape[2] = grow;
                Ok(zeros_dtype(&shape, a.dtype())?)
            };
            let (nk, nv) = (new(k)?, new(v)?);
            *kv = if started {
                (
                    concatenate(&[&kv.0, &nk], 2)?,
                    concatenate(&[&kv.1, &nv], 2)?,
                )
            } else {
                (nk, nv)
            };
            idx = offset;
        }
        let trim = positions(&kv.0) - self.max_size;
        if trim > 0 {
            kv.0 = self.trim(trim, &kv.0, None)?;
            kv.1 = self.trim(trim, &kv.1, None)?;
            idx = self.max_size;
        }
        if idx == self.max_size {
            idx = self.keep;
        }
        kv.0.try_index_mut((.., .., idx..idx + s, ..), k)
            .map_err(mlx)?;
        kv.1.try_index_mut((.., .., idx..idx + s, ..), v)
            .map_err(mlx)?;
        self.idx[layer] = idx + s;
        let filled = offset + s;
        Ok(if filled < positions(&kv.0) {
            (
                kv.0.index((.., .., ..filled, ..)),
                kv.1.index((.., .., ..filled, ..)),
            )
        } else {
            kv.clone()
        })
    }

    /// The mask of a pass of `n > 1` tokens, `offset` positions in, where
    /// the window is narrower than what the pass attends (mlx-lm's
    /// `create_causal_mask` with the window): `[1, 1, n, keys]` bool, keys
    /// counted as the update above leaves them. `None`: a causal mask.
    pub(crate) fn mask(&self, offset: i32, n: i32) -> Result<Option<Array>> {
        let offset = offset.min(self.max_size - 1);
        if n <= 1 || offset + n <= self.max_size {
            return Ok(None);
        }
        let mask = causal_mask(offset, n, Some(self.max_size))?;
        Ok(Some(mask.reshape(&[1, 1, n, offset + n])?))
    }
}

/// The causal mask (`[n, offset + n]` bool) of `n` queries at positions
/// `offset..offset + n` over keys `0..offset + n`, each query seeing at most
/// `window` keys where given (mlx-lm's `create_causal_mask`).
pub(crate) fn causal_mask(offset: i32, n: i32, window: Option<i32>) -> Result<Array> {
    let keys = arange::<_, i32>(0, offset + n, 1)?.reshape(&[1, offset + n])?;
    let queries = arange::<_, i32>(offset, offset + n, 1)?.reshape(&[n, 1])?;
    let causal = ge(&queries, &keys)?;
    Ok(match window {
        Some(w) => logical_and(causal, lt(&queries, keys.add(Array::from_int(w))?)?)?,
        None => causal,
    })
}
