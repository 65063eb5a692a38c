//! The running batch's KV cache: `[slots, kv_heads, capacity, head_dim]` per
//! layer, one slot per row. Every row sits at its own position, so a decode
//! step writes each row's key and value at that row's position (a scatter
//! along the position axis) and masks each row to its own length; shapes
//! depend only on the slot count, whatever rows join or leave.
//!
//! A step may run only the first `rows` slots (the scheduler keeps rows in
//! the lowest free slots and rounds `rows` up to a power of two, so a step
//! takes one of few shapes); the slots past them are free.

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{arange, concatenate, le, zeros_dtype};
use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::kv::cache::KvShape;
use crate::kv::cache::{stored_as, KvStore, KvView, RopeOffset, StepRows};

pub struct SlotCache {
    layers: Vec<(Array, Array)>,
    slots: i32,
    capacity: i32,
    /// Slots this step runs: `0..rows`.
    rows: i32,
    /// This step's position of every slot it runs, `[rows]` int32.
    positions: Array,
    /// `positions` on the host; empty in a traced step.
    host_positions: Vec<i32>,
    /// Where each slot's new key goes, `[slots, 1, 1, 1]`: the step's
    /// positions, 0 for the slots it does not run.
    scatter_at: Array,
    /// Keys read this step: one past the furthest position.
    attend: i32,
    /// Every slot of the step sits at the last key it reads, so the mask
    /// would keep every key.
    uniform: bool,
}

/// Bytes of a slot cache (`None` on overflow).
pub fn slot_cache_bytes(kv: &KvShape, slots: usize, capacity: usize) -> Option<usize> {
    let element = if kv.dtype == mlx_rs::Dtype::Float32 {
        4
    } else {
        2
    };
    [
        slots,
        2 * kv.layers,
        kv.kv_heads as usize,
        capacity,
        kv.head_dim as usize,
        element,
    ]
    .iter()
    .try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl SlotCache {
    pub fn new(kv: &KvShape, slots: i32, capacity: i32) -> Result<Self> {
        let shape = [slots, kv.kv_heads, capacity, kv.head_dim];
        let mut layers = Vec::with_capacity(kv.layers);
        for _ in 0..kv.layers {
            layers.push((
                zeros_dtype(&shape, kv.dtype)?,
                zeros_dtype(&shape, kv.dtype)?,
            ));
        }
        let cache = Self::over(layers, slots, capacity);
        mlx_rs::transforms::eval(cache.arrays())?;
        Ok(cache)
    }

    /// A cache over `layers`, every slot at position 0.
    fn over(layers: Vec<(Array, Array)>, slots: i32, capacity: i32) -> Self {
        SlotCache {
            layers,
            slots,
            capacity,
            rows: slots,
            positions: Array::from_slice(&vec![0i32; slots as usize], &[slots]),
            host_positions: vec![0; slots as usize],
            scatter_at: Array::from_slice(&vec![0i32; slots as usize], &[slots, 1, 1, 1]),
            attend: 1,
            uniform: false,
        }
    }

    pub fn capacity(&self) -> i32 {
        self.capacity
    }

    /// Sets where the next token of each of the first `positions.len()`
    /// slots goes, and that the step runs only those slots (a free slot may
    /// take any position: what it writes is never read).
    pub fn set_positions(&mut self, positions: &[i32]) -> Result<()> {
        if positions.is_empty() || positions.len() > self.slots as usize {
            return Err(Error::invalid(
                "a step runs between one slot and all of them",
            ));
        }
        let furthest = positions.iter().copied().max().unwrap_or(0);
        if furthest >= self.capacity {
            return Err(Error::invalid(format!(
                "KV cache is full ({} positions)",
                self.capacity
            )));
        }
        let rows = positions.len() as i32;
        let mut at = positions.to_vec();
        at.resize(self.slots as usize, 0);
        self.rows = rows;
        self.positions = Array::from_slice(positions, &[rows]);
        self.host_positions = positions.to_vec();
        self.scatter_at = Array::from_slice(&at, &[self.slots, 1, 1, 1]);
        self.attend = furthest + 1;
        self.uniform = positions.iter().all(|&p| p == furthest);
        Ok(())
    }

    /// The step's mask of each row's keys, `[rows, 1, 1, attend]` bool:
    /// from 0 (rows hold no padding) through its position. `None` when the
    /// rows sit at one position and need none: MLX's attention then has a
    /// single-query kernel on every device (with a mask, CUDA falls back to
    /// separate products, masking and softmax).
    pub fn key_ranges(&self) -> Result<Option<Array>> {
        if self.uniform {
            return Ok(None);
        }
        Ok(Some(self.mask()?))
    }

    /// `[rows, 1, 1, attend]`: each row sees its own keys up to its position.
    fn mask(&self) -> Result<Array> {
        let keys = arange::<_, i32>(0, self.attend, 1)?.reshape(&[1, 1, 1, self.attend])?;
        Ok(le(&keys, self.positions.reshape(&[self.rows, 1, 1, 1])?)?)
    }

    /// Copies `n` prompts' keys and values (per layer `[n, kv_heads, len,
    /// head_dim]`) into positions `0..len` of slots `slot..slot + n`.
    pub fn write_prompt(&mut self, slot: i32, prompt: &[(Array, Array)]) -> Result<()> {
        if prompt.len() != self.layers.len() {
            return Err(Error::invalid(
                "a prompt cache has the wrong number of layers",
            ));
        }
        for ((keys, values), (k, v)) in self.layers.iter_mut().zip(prompt) {
            let len = k.dim(2);
            if len > self.capacity {
                return Err(Error::invalid("a prompt is longer than a slot"));
            }
            let rows = k.dim(0);
            if slot + rows > self.slots {
                return Err(Error::invalid("prompt caches past the last slot"));
            }
            keys.try_index_mut((slot..slot + rows, .., 0..len, ..), k)
                .map_err(|e| Error::Mlx(e.to_string()))?;
            values
                .try_index_mut((slot..slot + rows, .., 0..len, ..), v)
                .map_err(|e| Error::Mlx(e.to_string()))?;
        }
        Ok(())
    }

    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flat_map(|(k, v)| [k, v])
    }
}

impl KvStore for SlotCache {
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::PerRow(self.positions.clone())
    }

    /// One new position per row run (`[rows, kv_heads, 1, head_dim]`),
    /// scattered to each row's own position. Replacing our handle with the
    /// scatter's result leaves the buffer to the graph alone, so MLX updates
    /// it in place; the scatter covers every slot (zeros at position 0 of the
    /// free ones past `rows`) so that it stays one in-place write.
    fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<KvView> {
        if k.dim(2) != 1 || k.dim(0) != self.rows {
            return Err(Error::invalid(
                "the slot cache takes one new position for every row of the step",
            ));
        }
        let (k, v) = stored_as(self.layers[layer].0.dtype(), k, v)?;
        let (k, v) = (&k, &v);
        let (k, v) = if self.rows < self.slots {
            let mut shape = k.shape().to_vec();
            shape[0] = self.slots - self.rows;
            let pad = zeros_dtype(&shape, k.dtype())?;
            (concatenate(&[k, &pad], 0)?, concatenate(&[v, &pad], 0)?)
        } else {
            (k.clone(), v.clone())
        };
        let (keys, values) = &mut self.layers[layer];
        *keys = keys.put_along_axis(&self.scatter_at, &k, 2)?;
        *values = values.put_along_axis(&self.scatter_at, &v, 2)?;
        Ok(KvView::Dense(
            keys.index((..self.rows, .., ..self.attend, ..)),
            values.index((..self.rows, .., ..self.attend, ..)),
        ))
    }

    fn advance(&mut self, _n: i32) {}

    /// Rows are the first slots; each attends its own keys from position 0.
    fn step_rows(&self) -> Option<StepRows> {
        (self.host_positions.len() == self.rows as usize).then(|| StepRows {
            positions: self.host_positions.clone(),
            starts: vec![0; self.rows as usize],
        })
    }

    fn buffers(&self, layer: usize) -> &(Array, Array) {
        &self.layers[layer]
    }

    fn set_buffers(&mut self, layer: usize, keys: Array, values: Array) {
        self.layers[layer] = (keys, values);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(slots: i32) -> SlotCache {
        SlotCache::over(Vec::new(), slots, 64)
    }

    #[test]
    fn rows_at_one_position_attend_without_a_mask() {
        let mut c = cache(4);
        c.set_positions(&[9, 9, 9, 9]).unwrap();
        assert!(c.key_ranges().unwrap().is_none());
        c.set_positions(&[9, 8, 9, 9]).unwrap();
        assert!(c.key_ranges().unwrap().is_some());
        c.set_positions(&[3, 3]).unwrap();
        assert!(c.key_ranges().unwrap().is_none());
    }
}
