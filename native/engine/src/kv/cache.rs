//! Preallocated KV cache: one `[B, kv_heads, capacity, head_dim]` buffer per
//! layer for keys and for values, written in place at the current offset,
//! or, once [`KvCache::quantize`]d, MLX's affine quantization of them (as
//! mlx-lm's `QuantizedKVCache` keeps them: packed values, scales and biases
//! per group of `group_size` along the head dimension). A cache that will
//! be quantized keeps dense buffers only as long as it needs before that
//! ([`KvCache::quantizing`]).
//! [`KvStore`] is what the model needs of a cache, so a cache whose rows sit
//! at different positions (the scheduler's slots) runs the same layers.

use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};
use mlx_rs::ops::{dequantize, quantize, zeros_dtype};
use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::kv::window::Window;

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

/// How a quantized cache stores keys and values: MLX's affine
/// quantization, `bits` bits a value, a scale and a bias per `group_size`
/// values of a head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvQuant {
    pub group_size: i32,
    pub bits: i32,
}

/// What attention reads of a layer: `[B, kv_heads, S, head_dim]` keys and
/// values, or their quantization (`[packed, scales, biases]` each).
pub enum KvView {
    Dense(Array, Array),
    Quantized {
        keys: [Array; 3],
        values: [Array; 3],
        quant: KvQuant,
    },
}

/// A cache the model's layers write keys and values into.
pub trait KvStore {
    fn rope_offset(&self) -> RopeOffset;
    /// Stores `k`, `v` (`[B, kv_heads, L, head_dim]`) of layer `layer` and
    /// returns what attention reads.
    fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<KvView>;
    /// How keys and values are quantized, if they are.
    fn quantized(&self) -> Option<KvQuant> {
        None
    }
    /// Why this cache has no whole dense buffers with each row's keys at
    /// its positions (quantized, or a rotating window), if it has none:
    /// the backends' fused layers then leave it to MLX's ops.
    fn no_buffers(&self) -> Option<&'static str> {
        None
    }
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
    /// A quantized cache's layer `layer`, keys then values, each
    /// `[packed, scales, biases]` over the whole capacity, which the CPU
    /// layer nodes read after `update` in place of [`KvStore::buffers`].
    fn quantized_buffers(&self, _layer: usize) -> Option<&QuantizedLayer> {
        None
    }
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

impl KvShape {
    /// The same shape in `dtype` where one is asked for (`kv_dtype`).
    pub fn in_dtype(self, dtype: Option<mlx_rs::Dtype>) -> KvShape {
        KvShape {
            dtype: dtype.unwrap_or(self.dtype),
            ..self
        }
    }

    /// The shape of a growing float cache whose dtype nobody asked for,
    /// on the CPU or not: float16 under a float32 model on the CPU, the
    /// model's dtype elsewhere. A step of a long context on the CPU is bound
    /// by reading the cache, the layer nodes read float16 rows, and
    /// llama.cpp keeps its cache in float16 too; `kv_dtype: float32` keeps
    /// the model's.
    pub fn by_default(self, on_cpu: bool) -> KvShape {
        let half = on_cpu && self.dtype == mlx_rs::Dtype::Float32;
        self.in_dtype(half.then_some(mlx_rs::Dtype::Float16))
    }
}

/// `k` and `v` in a cache buffer's `dtype` (a `kv_dtype` other than the
/// pass's), as they are stored.
pub(crate) fn stored_as(dtype: mlx_rs::Dtype, k: &Array, v: &Array) -> Result<(Array, Array)> {
    Ok(if k.dtype() == dtype {
        (k.clone(), v.clone())
    } else {
        (k.as_dtype(dtype)?, v.as_dtype(dtype)?)
    })
}

/// A layer's quantized keys and values, `[packed, scales, biases]` each.
pub type QuantizedLayer = ([Array; 3], [Array; 3]);

/// Empty dense buffers, where a layer keeps its keys and values otherwise
/// (quantized) or has none yet (a window before its first pass).
fn no_layer(dtype: mlx_rs::Dtype) -> Result<(Array, Array)> {
    Ok((zeros_dtype(&[0], dtype)?, zeros_dtype(&[0], dtype)?))
}

pub struct KvCache {
    /// Dense buffers; empty arrays once quantized.
    layers: Vec<(Array, Array)>,
    /// Once quantized: each layer's keys and values, `[packed, scales,
    /// biases]` over the whole capacity.
    quantized: Option<(KvQuant, Vec<QuantizedLayer>)>,
    /// A rotating window: `layers` then hold its positions, growing.
    window: Option<Window>,
    offset: i32,
    capacity: i32,
}

/// `a` (`[B, heads, len, d]`) followed by zeros up to `len` positions.
fn padded_to(a: Array, len: i32) -> Result<Array> {
    let n = a.dim(2);
    if len <= n {
        return Ok(a);
    }
    let mut out = zeros_dtype(&[a.dim(0), a.dim(1), len, a.dim(3)], a.dtype())?;
    out.try_index_mut((.., .., ..n, ..), &a)
        .map_err(|e| Error::Mlx(e.to_string()))?;
    Ok(out)
}

impl KvCache {
    pub fn new(kv: &KvShape, batch: i32, capacity: i32) -> Result<Self> {
        Self::with_dense(kv, batch, capacity, capacity)
    }

    /// A cache of `capacity` positions that is to be [`KvCache::quantize`]d
    /// once it holds about `dense` of them (a generation's `kv_bits` from
    /// `quantized_kv_start` on): its dense buffers are `dense` positions
    /// long, so that the whole capacity is never held in the model's dtype
    /// beside its quantized copy. A pass that writes past them grows them.
    pub fn quantizing(kv: &KvShape, batch: i32, capacity: i32, dense: i32) -> Result<Self> {
        Self::with_dense(kv, batch, capacity, dense.clamp(1, capacity.max(1)))
    }

    fn with_dense(kv: &KvShape, batch: i32, capacity: i32, dense: i32) -> Result<Self> {
        let shape = [batch, kv.kv_heads, dense, kv.head_dim];
        let mut layers = Vec::with_capacity(kv.layers);
        for _ in 0..kv.layers {
            layers.push((
                zeros_dtype(&shape, kv.dtype)?,
                zeros_dtype(&shape, kv.dtype)?,
            ));
        }
        Ok(KvCache {
            layers,
            quantized: None,
            window: None,
            offset: 0,
            capacity,
        })
    }

    /// A rotating window of at most `max_size` positions, the first `keep`
    /// kept (mlx-lm's `RotatingKVCache`); it grows as it is written, and
    /// holds any number of positions.
    pub fn rotating(kv: &KvShape, max_size: i32, keep: i32) -> Result<Self> {
        if max_size <= keep {
            return Err(Error::invalid(format!(
                "max_kv_size ({max_size}) must be more than the {keep} positions always kept"
            )));
        }
        let layers = (0..kv.layers)
            .map(|_| no_layer(kv.dtype))
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            quantized: None,
            window: Some(Window::new(kv.layers, max_size, keep)),
            offset: 0,
            capacity: i32::MAX,
        })
    }

    /// The mask of a pass of `n` tokens where a rotating window is
    /// narrower than what the pass attends (`[1, 1, n, keys]` bool); `None`
    /// where a causal mask (or none, for one token) is right.
    pub fn window_mask(&self, n: i32) -> Result<Option<Array>> {
        match &self.window {
            Some(w) => w.mask(self.offset, n),
            None => Ok(None),
        }
    }

    /// From now on keeps keys and values quantized (mlx-lm's `to_quantized`:
    /// what is stored is quantized as it stands); a no-op once quantized.
    /// `quant` must be one MLX quantizes with (group sizes 32, 64 or 128
    /// dividing the head size; 2, 3, 4, 5, 6 or 8 bits).
    pub fn quantize(&mut self, quant: KvQuant) -> Result<()> {
        if self.quantized.is_some() {
            return Ok(());
        }
        if self.window.is_some() {
            return Err(Error::invalid(
                "a rotating KV cache is not quantized (as in mlx-lm)",
            ));
        }
        // Over the whole capacity, where the dense buffers are shorter.
        let capacity = self.capacity;
        let triple = |a: &Array| -> Result<[Array; 3]> {
            let (w, scales, biases) = quantize(a, quant.group_size, quant.bits)?;
            Ok([
                padded_to(w, capacity)?,
                padded_to(scales, capacity)?,
                padded_to(biases, capacity)?,
            ])
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for (k, v) in &self.layers {
            layers.push((triple(k)?, triple(v)?));
        }
        for layer in &mut self.layers {
            *layer = no_layer(layer.0.dtype())?;
        }
        self.quantized = Some((quant, layers));
        Ok(())
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
        if self.window.is_some() {
            return Err(Error::invalid("a rotating KV cache takes no cached prefix"));
        }
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

    /// Keys and values of the first `len` positions of every layer (a
    /// quantized cache's dequantized).
    pub fn prefix(&self, len: i32) -> Result<Vec<(Array, Array)>> {
        if self.window.is_some() {
            return Err(Error::invalid("a rotating KV cache keeps no prefix"));
        }
        let Some((q, layers)) = &self.quantized else {
            return Ok(self
                .layers
                .iter()
                .map(|(k, v)| (k.index((.., .., ..len, ..)), v.index((.., .., ..len, ..))))
                .collect());
        };
        let dense = |[w, s, b]: &[Array; 3]| -> Result<Array> {
            let first = |a: &Array| a.index((.., .., ..len, ..));
            Ok(dequantize(
                first(w),
                first(s),
                &first(b),
                q.group_size,
                q.bits,
            )?)
        };
        layers
            .iter()
            .map(|(k, v)| Ok((dense(k)?, dense(v)?)))
            .collect()
    }

    /// The buffers, for a replay's check to put MLX's rows back.
    pub(crate) fn layers_mut(&mut self) -> &mut Vec<(Array, Array)> {
        &mut self.layers
    }

    /// Every buffer, for evaluation alongside a step's output.
    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        let quantized = self
            .quantized
            .iter()
            .flat_map(|(_, layers)| layers.iter().flat_map(|(k, v)| k.iter().chain(v.iter())));
        let dense = self
            .layers
            .iter()
            .filter(|_| self.quantized.is_none())
            .flat_map(|(k, v)| [k, v]);
        dense.chain(quantized)
    }
}

impl KvStore for KvCache {
    fn rope_offset(&self) -> RopeOffset {
        RopeOffset::Scalar(self.offset)
    }

    fn advance(&mut self, n: i32) {
        self.offset += n;
    }

    fn quantized(&self) -> Option<KvQuant> {
        self.quantized.as_ref().map(|(q, _)| *q)
    }

    fn no_buffers(&self) -> Option<&'static str> {
        if self.quantized.is_some() {
            Some("the KV cache is quantized; attention reads it outside the fused layers")
        } else if self.window.is_some() {
            Some("the KV cache is a rotating window; attention reads it through MLX's ops")
        } else {
            None
        }
    }

    /// Rows for a window: none (its positions rotate). A quantized cache's
    /// rows are its buffers' (the CPU layer nodes read them).
    fn step_rows(&self) -> Option<StepRows> {
        if self.window.is_some() {
            return None;
        }
        let rows = match &self.quantized {
            Some((_, layers)) => layers.first()?.0[0].dim(0),
            None => self.layers.first()?.0.dim(0),
        } as usize;
        (self.offset < self.capacity).then(|| StepRows {
            positions: vec![self.offset; rows],
            starts: vec![0; rows],
        })
    }

    fn buffers(&self, layer: usize) -> &(Array, Array) {
        &self.layers[layer]
    }

    fn quantized_buffers(&self, layer: usize) -> Option<&QuantizedLayer> {
        self.quantized.as_ref().map(|(_, layers)| &layers[layer])
    }

    fn set_buffers(&mut self, layer: usize, keys: Array, values: Array) {
        self.layers[layer] = (keys, values);
    }

    /// Writes `k`, `v` (`[B, kv_heads, L, head_dim]`) at the offset and returns
    /// the filled part of the buffers. Replacing our handle with the update's
    /// result leaves the graph as the buffer's only owner, so MLX donates it
    /// and the write happens in place.
    fn update(&mut self, layer: usize, k: &Array, v: &Array) -> Result<KvView> {
        let (k, v) = if self.quantized.is_some() {
            (k.clone(), v.clone())
        } else {
            stored_as(self.layers[layer].0.dtype(), k, v)?
        };
        let (k, v) = (&k, &v);
        if let Some(window) = &mut self.window {
            let (keys, values) =
                window.update(layer, &mut self.layers[layer], self.offset, k, v)?;
            return Ok(KvView::Dense(keys, values));
        }
        let (start, end) = (self.offset, self.offset + k.dim(2));
        if end > self.capacity {
            return Err(Error::invalid(format!(
                "KV cache is full ({} positions)",
                self.capacity
            )));
        }
        let put = |buffer: &mut Array, new: &Array| -> Result<Array> {
            buffer
                .try_index_mut((.., .., start..end, ..), new)
                .map_err(|e| Error::Mlx(e.to_string()))?;
            Ok(buffer.index((.., .., ..end, ..)))
        };
        if let Some((quant, layers)) = &mut self.quantized {
            let (keys, values) = &mut layers[layer];
            let put_quantized = |stored: &mut [Array; 3], new: &Array| -> Result<[Array; 3]> {
                let (w, s, b) = quantize(new, quant.group_size, quant.bits)?;
                Ok([
                    put(&mut stored[0], &w)?,
                    put(&mut stored[1], &s)?,
                    put(&mut stored[2], &b)?,
                ])
            };
            return Ok(KvView::Quantized {
                keys: put_quantized(keys, k)?,
                values: put_quantized(values, v)?,
                quant: *quant,
            });
        }
        let (keys, values) = &mut self.layers[layer];
        if end > keys.dim(2) {
            // Past a quantizing cache's dense buffers: longer ones (a copy),
            // in whole buckets or twice as long.
            let wanted = end.max(keys.dim(2).saturating_mul(2)) as i64;
            let len = ((wanted + 255) / 256 * 256).min(self.capacity as i64) as i32;
            *keys = padded_to(keys.clone(), len)?;
            *values = padded_to(values.clone(), len)?;
        }
        Ok(KvView::Dense(put(keys, k)?, put(values, v)?))
    }
}
