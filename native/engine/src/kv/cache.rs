//! Preallocated KV cache: one `[B, kv_heads, capacity, head_dim]` buffer per
//! layer for keys and for values, written in place at the current offset.
//! [`KvStore`] is what the model needs of a cache, so a cache whose rows sit
//! at different positions (the scheduler's slots) runs the same layers.

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::zeros_dtype;
use mlx_rs::Array;

use crate::error::{Error, Result};

/// Where RoPE starts for the new positions of a forward pass.
pub enum RopeOffset {
    /// Every row at the same position.
    Scalar(i32),
    /// One position per row, `[B]` int32.
    PerRow(Array),
}

/// Each row's position in a one-token step (where its key goes, and its
/// RoPE position) and the first key it attends, as the host knows them.
pub struct StepRows {
    pub positions: Vec<i32>,
    pub starts: Vec<i32>,
}

/// A cache the model's layers write keys and values into.
pub trait KvStore {
    fn rope_offset(&self) -> RopeOffset;
    /// Stores `k`, `v` (`[B, kv_heads, L, head_dim]`) of layer `layer` and
    /// returns the keys and values attention reads.
    fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<(Array, Array)>;
    /// Called once per forward pass with the number of new positions.
    fn advance(&mut self, n: i32);
    /// The rows of a one-token step, for layers that read the cache's
    /// whole buffers (see [`crate::backend::cpu::layer`]); `None` when this cache
    /// cannot say or has no room (the layers are then built from MLX ops).
    fn step_rows(&self) -> Option<StepRows> {
        None
    }
    /// Layer `layer`'s whole key and value buffers, `[rows, kv_heads,
    /// capacity, head_dim]`, which such a layer reads after `update`.
    fn buffers(&self, layer: usize) -> &(Array, Array);
    /// Replaces layer `layer`'s buffers with handles on the same memory
    /// (the CUDA backend's in-place writes).
    fn set_buffers(&mut self, layer: usize, keys: Array, values: Array);
}

/// What a cache holds per position: its layers' key/value heads and dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub dtype: mlx_rs::Dtype,
}

pub struct KvCache {
    layers: Vec<(Array, Array)>,
    offset: i32,
    capacity: i32,
}

impl KvCache {
    pub fn new(kv: &KvShape, batch: i32, capacity: i32) -> Result<Self> {
        let shape = [batch, kv.kv_heads, capacity, kv.head_dim];
        let mut layers = Vec::with_capacity(kv.layers);
        for _ in 0..kv.layers {
            layers.push((
                zeros_dtype(&shape, kv.dtype)?,
                zeros_dtype(&shape, kv.dtype)?,
            ));
        }
        Ok(KvCache {
            layers,
            offset: 0,
            capacity,
        })
    }

    pub fn offset(&self) -> i32 {
        self.offset
    }

    pub fn capacity(&self) -> i32 {
        self.capacity
    }

    /// Starts the cache with the keys and values of a prompt prefix: per
    /// layer `[B, kv_heads, len, head_dim]` arrays.
    pub fn load_prefix(&mut self, layers: &[(Array, Array)]) -> Result<()> {
        if layers.len() != self.layers.len() {
            return Err(Error::invalid(
                "a cached prefix has the wrong number of layers",
            ));
        }
        self.offset = 0;
        for (layer, (k, v)) in layers.iter().enumerate() {
            KvStore::update(self, layer, k, v)?;
        }
        self.offset = layers.first().map_or(0, |(k, _)| k.dim(2));
        Ok(())
    }

    /// Keys and values of the first `len` positions of every layer.
    pub fn prefix(&self, len: i32) -> Vec<(Array, Array)> {
        self.layers
            .iter()
            .map(|(k, v)| (k.index((.., .., ..len, ..)), v.index((.., .., ..len, ..))))
            .collect()
    }

    /// The buffers, for a replay's check to put MLX's rows back.
    pub(crate) fn layers_mut(&mut self) -> &mut Vec<(Array, Array)> {
        &mut self.layers
    }

    /// Every buffer, for evaluation alongside a step's output.
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flat_map(|(k, v)| [k, v])
    }
}

impl KvStore for KvCache {
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Scalar(self.offset)
    }

    fn advance(&mut self, n: i32) {
        self.offset += n;
    }

    fn step_rows(&self) -> Option<StepRows> {
        let rows = self.layers.first()?.0.dim(0) as usize;
        (self.offset < self.capacity).then(|| StepRows {
            positions: vec![self.offset; rows],
            starts: vec![0; rows],
        })
    }

    fn buffers(&self, layer: usize) -> &(Array, Array) {
        &self.layers[layer]
    }

    fn set_buffers(&mut self, layer: usize, keys: Array, values: Array) {
        self.layers[layer] = (keys, values);
    }

    /// Writes `k`, `v` (`[B, kv_heads, L, head_dim]`) at the offset and returns
    /// the filled part of the buffers. Replacing our handle with the update's
    /// result leaves the graph as the buffer's only owner, so MLX donates it
    /// and the write happens in place.
    fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let (start, end) = (self.offset, self.offset + k.dim(2));
        if end > self.capacity {
            return Err(Error::invalid(format!(
                "KV cache is full ({} positions)",
                self.capacity
            )));
        }
        let (keys, values) = &mut self.layers[layer];
        keys.try_index_mut((.., .., start..end, ..), k)
            .map_err(|e| Error::Mlx(e.to_string()))?;
        values
            .try_index_mut((.., .., start..end, ..), v)
            .map_err(|e| Error::Mlx(e.to_string()))?;
        Ok((
            keys.index((.., .., ..end, ..)),
            values.index((.., .., ..end, ..)),
        ))
    }
}
