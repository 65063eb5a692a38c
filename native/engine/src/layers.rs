//! Linear and embedding layers, dense or affine-quantized (MLX layout:
//! `<name>.weight` packed uint32, `<name>.scales`, `<name>.biases`).
//!
//! On CPU, 4- and 8-bit quantized projections with float32 activations run on
//! our own kernels (`emlx_axon_kernels`: an MLX primitive, threaded over
//! output rows). Anything else uses MLX's ops, and MLX's CPU backend runs each
//! of those on its stream's single thread: such a projection can be split by
//! output rows across several CPU streams (one thread each), which run in
//! parallel and are joined with a concatenation; the row blocks are views of
//! the same weight buffers.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, dequantize, matmul, quantize, quantized_matmul};
use mlx_rs::{Array, Dtype};

use crate::config::QuantSpec;
use crate::error::{Error, Result};
use crate::weights::Weights;

/// Scales and biases in the compute dtype, except that bfloat16 ones stay
/// bfloat16 for float32 compute without a GPU: our CPU kernels read them as
/// stored (the widening is exact), which saves a float32 copy (an eighth of a
/// 4-bit checkpoint's bytes) and its memory traffic every step. (On a GPU,
/// MLX's op would need a cast per call.)
fn params_dtype(a: Array, compute: Dtype) -> Result<Array> {
    if compute == Dtype::Float32 && a.dtype() == Dtype::Bfloat16 && !crate::device::gpu_available()
    {
        return Ok(a);
    }
    Ok(a.as_dtype(compute)?)
}

/// `a` in `x`'s dtype (a no-op when it already is).
fn as_dtype_of(a: &Array, x: &Array) -> Result<Array> {
    if a.dtype() == x.dtype() {
        return Ok(a.clone());
    }
    Ok(a.as_dtype(x.dtype())?)
}

/// How the loader should treat a module's weight.
#[derive(Debug, Clone, Copy)]
pub struct LoadPlan {
    /// The checkpoint's spec for this module, if the checkpoint is quantized.
    pub stored: Option<QuantSpec>,
    /// Quantize a dense weight now, at load.
    pub at_load: Option<QuantSpec>,
    pub dtype: Dtype,
}

/// Worker streams (one per row block) for a forward pass; empty for none.
pub type Workers<'a> = &'a [crate::device::Lease];

pub enum Weight {
    Dense(Array),
    Quantized {
        w: Array,
        scales: Array,
        biases: Array,
        spec: QuantSpec,
    },
}

impl Weight {
    /// Loads `<prefix>.weight` of logical shape `[rows, cols]`. A module is
    /// quantized in the checkpoint exactly when `<prefix>.scales` exists, as
    /// mlx-lm decides; others stay dense.
    fn load(
        weights: &mut Weights,
        prefix: &str,
        rows: i32,
        cols: i32,
        plan: LoadPlan,
    ) -> Result<Self> {
        let name = format!("{prefix}.weight");
        if weights.contains(&format!("{prefix}.scales")) {
            let spec = plan.stored.ok_or_else(|| {
                Error::Config(format!(
                    "`{prefix}` is quantized but config.json has no `quantization` block"
                ))
            })?;
            let packed = cols * spec.bits / 32;
            let w = weights.take(&name, Some(&[rows, packed]))?;
            let groups = [rows, cols / spec.group_size];
            let scales = weights.take(&format!("{prefix}.scales"), Some(&groups))?;
            let biases = weights.take(&format!("{prefix}.biases"), Some(&groups))?;
            return Ok(Weight::Quantized {
                w,
                scales: params_dtype(scales, plan.dtype)?,
                biases: params_dtype(biases, plan.dtype)?,
                spec,
            });
        }
        let w = weights.take(&name, Some(&[rows, cols]))?;
        match plan.at_load {
            // Quantize in the checkpoint's own dtype, as mlx-lm does, so the
            // scales are the same as those of a model converted ahead of time.
            Some(spec) if cols % spec.group_size == 0 => {
                let (w, scales, biases) = quantize(&w, spec.group_size, spec.bits)?;
                Ok(Weight::Quantized {
                    w,
                    scales: params_dtype(scales, plan.dtype)?,
                    biases: params_dtype(biases, plan.dtype)?,
                    spec,
                })
            }
            _ => Ok(Weight::Dense(w.as_dtype(plan.dtype)?)),
        }
    }

    /// `x @ W.T`.
    fn apply_transposed(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Weight::Dense(w) => matmul(x, w.t())?,
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => {
                // MLX's op wants scales in the activations' dtype.
                let (scales, biases) = (as_dtype_of(scales, x)?, as_dtype_of(biases, x)?);
                quantized_matmul(x, w, &scales, &biases, true, spec.group_size, spec.bits)?
            }
        })
    }

    fn arrays(&self) -> Vec<&Array> {
        match self {
            Weight::Dense(w) => vec![w],
            Weight::Quantized {
                w, scales, biases, ..
            } => vec![w, scales, biases],
        }
    }

    fn rows(&self) -> i32 {
        match self {
            Weight::Dense(w) | Weight::Quantized { w, .. } => w.dim(0),
        }
    }

    /// Rows `start..end`, as views of this weight's buffers.
    fn row_block(&self, start: i32, end: i32) -> Weight {
        let block = |a: &Array| a.index((start..end, ..));
        match self {
            Weight::Dense(w) => Weight::Dense(block(w)),
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => Weight::Quantized {
                w: block(w),
                scales: block(scales),
                biases: block(biases),
                spec: *spec,
            },
        }
    }

    pub fn is_quantized(&self) -> bool {
        matches!(self, Weight::Quantized { .. })
    }
}

/// A weight and, when split across worker streams, its row blocks.
struct Projection {
    weight: Weight,
    blocks: Vec<Weight>,
}

impl Projection {
    fn new(weight: Weight, ways: usize) -> Self {
        let rows = weight.rows();
        let n = ways as i32;
        // Small projections are not worth the cross-stream synchronization.
        let blocks = if n > 1 && rows >= 256 * n {
            (0..n)
                .map(|i| weight.row_block(rows * i / n, rows * (i + 1) / n))
                .collect()
        } else {
            vec![]
        };
        Projection { weight, blocks }
    }

    fn apply(&self, x: &Array, workers: Workers) -> Result<Array> {
        if let Weight::Quantized {
            w,
            scales,
            biases,
            spec,
        } = &self.weight
        {
            // Our kernels thread internally, so the whole weight goes at once.
            if let Some(y) = emlx_axon_kernels::quantized_linear(
                x,
                w,
                scales,
                biases,
                spec.group_size,
                spec.bits,
            )
            .map_err(|e| Error::Mlx(e.to_string()))?
            {
                return Ok(y);
            }
        }
        if self.blocks.is_empty() || workers.len() < self.blocks.len() {
            return self.weight.apply_transposed(x);
        }
        let parts = self
            .blocks
            .iter()
            .zip(workers)
            .map(|(w, lease)| lease.stream().run_leased(|| w.apply_transposed(x)))
            .collect::<Result<Vec<_>>>()?;
        Ok(concatenate(&parts, -1)?)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut all = self.weight.arrays();
        for w in &self.blocks {
            all.extend(w.arrays());
        }
        all
    }
}

pub struct Linear {
    projection: Projection,
    bias: Option<Array>,
}

impl Linear {
    pub fn load(
        weights: &mut Weights,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
        plan: LoadPlan,
        ways: usize,
    ) -> Result<Self> {
        let weight = Projection::new(Weight::load(weights, prefix, out_dim, in_dim, plan)?, ways);
        let bias = if bias {
            Some(
                weights
                    .take(&format!("{prefix}.bias"), Some(&[out_dim]))?
                    .as_dtype(plan.dtype)?,
            )
        } else {
            None
        };
        Ok(Linear {
            projection: weight,
            bias,
        })
    }

    pub fn forward(&self, x: &Array, workers: Workers) -> Result<Array> {
        let y = self.projection.apply(x, workers)?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut all = self.projection.arrays();
        all.extend(self.bias.iter());
        all
    }

    pub fn is_quantized(&self) -> bool {
        self.projection.weight.is_quantized()
    }
}

pub struct Embedding {
    /// Split into row blocks only when tied: the blocks serve the output projection.
    projection: Projection,
    dtype: Dtype,
}

impl Embedding {
    pub fn load(
        weights: &mut Weights,
        prefix: &str,
        vocab: i32,
        dim: i32,
        plan: LoadPlan,
        tied_ways: usize,
    ) -> Result<Self> {
        let weight = Weight::load(weights, prefix, vocab, dim, plan)?;
        Ok(Embedding {
            projection: Projection::new(weight, tied_ways),
            dtype: plan.dtype,
        })
    }

    /// Rows for `ids` (any shape) -> `[..ids, dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.projection.weight {
            Weight::Dense(w) => w.take_axis(ids, 0)?,
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => {
                // In the compute dtype, as mlx-lm dequantizes after its cast.
                let rows = dequantize(
                    w.take_axis(ids, 0)?,
                    scales.take_axis(ids, 0)?.as_dtype(self.dtype)?,
                    &biases.take_axis(ids, 0)?.as_dtype(self.dtype)?,
                    spec.group_size,
                    spec.bits,
                )?;
                rows.as_dtype(self.dtype)?
            }
        })
    }

    /// Tied output projection: `x @ E.T`.
    pub fn as_linear(&self, x: &Array, workers: Workers) -> Result<Array> {
        self.projection.apply(x, workers)
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.projection.arrays()
    }

    pub fn is_quantized(&self) -> bool {
        self.projection.weight.is_quantized()
    }
}
