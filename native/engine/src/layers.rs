//! Linear and embedding layers, dense or affine-quantized (MLX layout:
//! `<name>.weight` packed uint32, `<name>.scales`, `<name>.biases`).

use mlx_rs::ops::{dequantize, matmul, quantize, quantized_matmul};
use mlx_rs::{Array, Dtype};

use crate::config::QuantSpec;
use crate::error::{Error, Result};
use crate::weights::Weights;

/// How the loader should treat a module's weight.
#[derive(Debug, Clone, Copy)]
pub struct LoadPlan {
    /// The checkpoint's spec for this module, if the checkpoint is quantized.
    pub stored: Option<QuantSpec>,
    /// Quantize a dense weight now, at load.
    pub at_load: Option<QuantSpec>,
    pub dtype: Dtype,
}

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
                scales: scales.as_dtype(plan.dtype)?,
                biases: biases.as_dtype(plan.dtype)?,
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
                    scales: scales.as_dtype(plan.dtype)?,
                    biases: biases.as_dtype(plan.dtype)?,
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
            } => quantized_matmul(x, w, scales, biases, true, spec.group_size, spec.bits)?,
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

    pub fn is_quantized(&self) -> bool {
        matches!(self, Weight::Quantized { .. })
    }
}

pub struct Linear {
    weight: Weight,
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
    ) -> Result<Self> {
        let weight = Weight::load(weights, prefix, out_dim, in_dim, plan)?;
        let bias = if bias {
            Some(
                weights
                    .take(&format!("{prefix}.bias"), Some(&[out_dim]))?
                    .as_dtype(plan.dtype)?,
            )
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.weight.apply_transposed(x)?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut all = self.weight.arrays();
        all.extend(self.bias.iter());
        all
    }

    pub fn is_quantized(&self) -> bool {
        self.weight.is_quantized()
    }
}

pub struct Embedding {
    weight: Weight,
    dtype: Dtype,
}

impl Embedding {
    pub fn load(
        weights: &mut Weights,
        prefix: &str,
        vocab: i32,
        dim: i32,
        plan: LoadPlan,
    ) -> Result<Self> {
        Ok(Embedding {
            weight: Weight::load(weights, prefix, vocab, dim, plan)?,
            dtype: plan.dtype,
        })
    }

    /// Rows for `ids` (any shape) -> `[..ids, dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.weight {
            Weight::Dense(w) => w.take_axis(ids, 0)?,
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => {
                let rows = dequantize(
                    w.take_axis(ids, 0)?,
                    scales.take_axis(ids, 0)?,
                    &biases.take_axis(ids, 0)?,
                    spec.group_size,
                    spec.bits,
                )?;
                rows.as_dtype(self.dtype)?
            }
        })
    }

    /// Tied output projection: `x @ E.T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.weight.apply_transposed(x)
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.weight.arrays()
    }

    pub fn is_quantized(&self) -> bool {
        self.weight.is_quantized()
    }
}
