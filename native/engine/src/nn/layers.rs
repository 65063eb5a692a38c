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

use crate::checkpoint::config::QuantSpec;
use crate::checkpoint::weights::Weights;
use crate::error::{Error, Result};

/// Scales and biases in the compute dtype, except that bfloat16 ones stay
/// bfloat16 for float32 compute without a GPU: our CPU kernels read them as
/// stored (the widening is exact), which saves a float32 copy (an eighth of a
/// 4-bit checkpoint's bytes) and its memory traffic every step. (On a GPU,
/// MLX's op would need a cast per call.)
pub(crate) fn params_dtype(a: Array, compute: Dtype) -> Result<Array> {
    if compute == Dtype::Float32
        && a.dtype() == Dtype::Bfloat16
        && !crate::runtime::device::gpu_available()
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

/// Whether a quantized product with `in_dim` inputs per row is computed
/// from the dequantized weight rather than by MLX's `quantized_matmul`: on
/// a GPU stream, when one quantization group spans a whole input row.
///
/// MLX 0.32's CUDA backend sends exactly those products (of more than one
/// row, or with more than 16,384 outputs) to its CUTLASS sm90 kernel, which
/// it compiles at first use against the CUDA headers of the nvidia pip
/// wheels; where those lack `crt/mma.h` (as on the NVIDIA H200 machine this
/// was found on) the kernel cannot be built, and every such product fails,
/// in float32 and bfloat16 alike. Only models no wider than a group (128
/// inputs: small test checkpoints) have such layers, so the cost is small,
/// and all their products take this way, prompt and decode steps alike:
/// `x @ dequantize(w).T` is the same sum, over the same weight values
/// (`scale * q + bias`, in the activations' dtype), as a plain matmul, with
/// a float32 matmul's own precision (the sm90 kernel would compute float32
/// in TF32).
pub(crate) fn dequantized_on_gpu(
    in_dim: i32,
    spec: &QuantSpec,
    on_cpu_stream: impl FnOnce() -> bool,
) -> bool {
    in_dim <= spec.group_size && !on_cpu_stream()
}

/// How the loader should treat a module's weight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadPlan {
    /// The checkpoint's spec for this module, if the checkpoint is quantized.
    pub stored: Option<QuantSpec>,
    /// Quantize a dense weight now, at load.
    pub at_load: Option<QuantSpec>,
    pub dtype: Dtype,
}

/// Worker streams (one per row block) for a forward pass; empty for none.
pub type Workers<'a> = &'a [crate::runtime::device::Lease];

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
        let Weight::Quantized {
            w,
            scales,
            biases,
            spec,
        } = self
        else {
            return self.apply_dequantized(x);
        };
        if dequantized_on_gpu(x.dim(-1), spec, crate::runtime::device::on_cpu_stream) {
            return self.apply_dequantized(x);
        }
        // MLX's op wants scales in the activations' dtype.
        let (scales, biases) = (as_dtype_of(scales, x)?, as_dtype_of(biases, x)?);
        Ok(quantized_matmul(
            x,
            w,
            &scales,
            &biases,
            true,
            spec.group_size,
            spec.bits,
        )?)
    }

    /// `x @ W.T` through the weight dequantized in `x`'s dtype: a plain
    /// matmul of the same weight values as `quantized_matmul`'s (of a dense
    /// weight, its matmul).
    fn apply_dequantized(&self, x: &Array) -> Result<Array> {
        Ok(match self {
            Weight::Dense(w) => matmul(x, w.t())?,
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => {
                let (scales, biases) = (as_dtype_of(scales, x)?, as_dtype_of(biases, x)?);
                let dense = dequantize(w, &scales, &biases, spec.group_size, spec.bits)?;
                matmul(x, dense.t())?
            }
        })
    }

    pub(crate) fn arrays(&self) -> Vec<&Array> {
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

    /// The weight as the GPU product kernels take it, when quantized.
    pub fn quantized(&self) -> Option<emlx_axon_kernels::QuantWeight<'_>> {
        match self {
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => Some(emlx_axon_kernels::QuantWeight {
                w,
                scales,
                biases,
                bits: spec.bits,
                group_size: spec.group_size,
            }),
            Weight::Dense(_) => None,
        }
    }

    /// The weights' rows stacked into one weight, when they share a layout:
    /// all dense in one dtype, or all quantized with the same spec and
    /// parameter dtype. Exact: MLX's affine groups run along a row, so
    /// stacking rows stacks their packed words, scales and biases unchanged.
    fn stacked(parts: &[Weight]) -> Result<Option<Weight>> {
        if parts.len() < 2 {
            return Ok(None);
        }
        let dense: Option<Vec<&Array>> = parts
            .iter()
            .map(|p| match p {
                Weight::Dense(w) => Some(w),
                Weight::Quantized { .. } => None,
            })
            .collect();
        if let Some(ws) = dense {
            if ws.iter().any(|w| w.dtype() != ws[0].dtype()) {
                return Ok(None);
            }
            return Ok(Some(Weight::Dense(concatenate(&ws, 0)?)));
        }
        let quantized: Option<Vec<[&Array; 3]>> = parts
            .iter()
            .map(|p| match p {
                Weight::Quantized {
                    w, scales, biases, ..
                } => Some([w, scales, biases]),
                Weight::Dense(_) => None,
            })
            .collect();
        let (Some(q), Weight::Quantized { spec, scales, .. }) = (quantized, &parts[0]) else {
            return Ok(None);
        };
        let same = parts.iter().all(|p| {
            matches!(p, Weight::Quantized { spec: s, scales: sc, biases: b, .. }
                if s == spec && sc.dtype() == scales.dtype() && b.dtype() == scales.dtype())
        });
        if !same {
            return Ok(None);
        }
        let stack = |i: usize| concatenate(&q.iter().map(|t| t[i]).collect::<Vec<_>>(), 0);
        Ok(Some(Weight::Quantized {
            w: stack(0)?,
            scales: stack(1)?,
            biases: stack(2)?,
            spec: *spec,
        }))
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
        self.with_bias(self.projection.apply(x, workers)?)
    }

    /// [`Linear::forward`] as one matmul of the dequantized weight, whatever
    /// the stream (the backends choose where that pays).
    pub fn forward_dequantized(&self, x: &Array) -> Result<Array> {
        self.with_bias(self.projection.weight.apply_dequantized(x)?)
    }

    fn with_bias(&self, y: Array) -> Result<Array> {
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }

    /// Outputs per row.
    pub fn out_dim(&self) -> i32 {
        self.projection.weight.rows()
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut all = self.projection.arrays();
        all.extend(self.bias.iter());
        all
    }

    pub fn is_quantized(&self) -> bool {
        self.projection.weight.is_quantized()
    }

    /// The weight as our kernels take it, and the bias.
    pub fn quantized(&self) -> Option<(emlx_axon_kernels::QuantWeight<'_>, Option<&Array>)> {
        Some((self.projection.weight.quantized()?, self.bias.as_ref()))
    }
}

/// RMSNorm over the last axis with a weight of shape `rows x dim` (`rows`
/// leading axes of the normalized arrays, usually none).
///
/// On a GPU stream this is MLX's fused kernel. On a CPU stream MLX expands
/// its `rms_norm` into about 11 ops, 3 of them broadcasts of its constants
/// and weight; here the same expansion runs with those already shaped like
/// a one-token batch-1 step's arrays, which then need no broadcast.
pub struct RmsNorm {
    /// `[dim]`, or `[rows, dim]`.
    weight: Array,
    /// `weight` as `[1, 1, (rows,) dim]`.
    weight_step: Array,
    /// float32 `1 / dim` and `eps`, as `[1, 1, (rows,) 1]`.
    inv_dim: Array,
    eps_step: Array,
    eps: f32,
}

impl RmsNorm {
    /// `weight`: `[dim]` or `[rows, dim]`, in the compute dtype.
    pub fn new(weight: Array, eps: f32) -> Result<Self> {
        let mut step = vec![1, 1];
        step.extend_from_slice(weight.shape());
        let weight_step = weight.reshape(&step)?;
        *step.last_mut().unwrap() = 1;
        // As MLX's `mean` makes its normalizer: 1 / n in double, then float32.
        let dim = weight.shape()[weight.ndim() - 1];
        let count = step.iter().product::<i32>() as usize;
        let constant = |v: f32| Array::from_slice(&vec![v; count], &step);
        Ok(RmsNorm {
            inv_dim: constant((1.0 / dim as f64) as f32),
            eps_step: constant(eps),
            weight,
            weight_step,
            eps,
        })
    }

    /// Normalizes `x` (`[B, L, (rows,) dim]`); `cpu`: the expansion for a
    /// CPU stream, else MLX's `rms_norm`.
    pub fn forward(&self, x: &Array, cpu: bool) -> Result<Array> {
        if !cpu {
            return Ok(if self.weight.ndim() == 1 {
                mlx_rs::fast::rms_norm(x, Some(&self.weight), self.eps)?
            } else {
                mlx_rs::fast::rms_norm(x, None, self.eps)?.multiply(&self.weight)?
            });
        }
        // One node of our kernels where the expansion below builds seven
        // (float32 only; each node costs a decode step microseconds).
        if let Some(y) = emlx_axon_kernels::rms_norm(x, &self.weight, self.eps)
            .map_err(|e| Error::Mlx(e.to_string()))?
        {
            return Ok(y);
        }
        // MLX's fallback, step for step: float32 x * rsqrt(mean(x^2) + eps),
        // back to x's dtype, times the weight.
        let x32 = x.as_dtype(Dtype::Float32)?;
        let mean = x32.square()?.sum_axis(-1, true)?.multiply(&self.inv_dim)?;
        let normed = x32.multiply(mean.add(&self.eps_step)?.rsqrt()?)?;
        Ok(normed.as_dtype(x.dtype())?.multiply(&self.weight_step)?)
    }

    /// `[dim]`, or `[rows, dim]`.
    pub fn weight(&self) -> &Array {
        &self.weight
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    pub fn arrays(&self) -> Vec<&Array> {
        vec![
            &self.weight,
            &self.weight_step,
            &self.inv_dim,
            &self.eps_step,
        ]
    }
}

/// A projection computed either way: by the stream's own quantized product
/// or through the dequantized weight, for a backend that picks per product.
pub trait Projects {
    /// Outputs per row.
    fn out_dim(&self) -> i32;
    /// `x @ W.T`, plus the bias, with no worker streams.
    fn project(&self, x: &Array) -> Result<Array>;
    /// The same through the weight dequantized in `x`'s dtype.
    fn project_dequantized(&self, x: &Array) -> Result<Array>;
}

impl Projects for Linear {
    fn out_dim(&self) -> i32 {
        Linear::out_dim(self)
    }
    fn project(&self, x: &Array) -> Result<Array> {
        self.forward(x, &[])
    }
    fn project_dequantized(&self, x: &Array) -> Result<Array> {
        self.forward_dequantized(x)
    }
}

impl Projects for LinearGroup {
    fn out_dim(&self) -> i32 {
        LinearGroup::out_dim(self)
    }
    fn project(&self, x: &Array) -> Result<Array> {
        self.forward(x, &[])
    }
    fn project_dequantized(&self, x: &Array) -> Result<Array> {
        self.forward_dequantized(x)
    }
}

/// Projections of one input, stored as one stacked weight where their
/// layouts allow (one product per step instead of one each), else apart.
pub struct LinearGroup {
    /// Each member's output width, in order.
    sizes: Vec<i32>,
    layout: GroupLayout,
}

enum GroupLayout {
    Stacked(Linear),
    Apart(Vec<Linear>),
}

/// A member of a [`LinearGroup`]: its module path, output width and plan.
pub struct Member<'a> {
    pub prefix: &'a str,
    pub out_dim: i32,
    pub plan: LoadPlan,
}

impl LinearGroup {
    /// The members, stacked where they can be: as loaded under `joined`
    /// (see [`crate::checkpoint::weights::Join`]), else concatenated here.
    pub fn load(
        weights: &mut Weights,
        joined: &str,
        members: &[Member],
        in_dim: i32,
        bias: bool,
        ways: usize,
    ) -> Result<Self> {
        let sizes: Vec<i32> = members.iter().map(|m| m.out_dim).collect();
        if let Some(rows) = weights.joined_rows(&format!("{joined}.weight")) {
            let plan = members[0].plan;
            let bias_name = format!("{joined}.bias");
            // Anything else (another split, mixed plans, a bias missing or
            // unexpected) takes the members apart, for their own checks.
            if rows == sizes
                && members.iter().all(|m| m.plan == plan)
                && weights.contains(&bias_name) == bias
            {
                let total = sizes.iter().sum();
                let weight = Weight::load(weights, joined, total, in_dim, plan)?;
                let bias = match bias {
                    true => Some(
                        weights
                            .take(&bias_name, Some(&[total]))?
                            .as_dtype(plan.dtype)?,
                    ),
                    false => None,
                };
                return Ok(LinearGroup {
                    sizes,
                    layout: GroupLayout::Stacked(Linear {
                        projection: Projection::new(weight, ways),
                        bias,
                    }),
                });
            }
            weights.unjoin(joined);
        }
        let mut parts = Vec::with_capacity(members.len());
        let mut biases = Vec::with_capacity(members.len());
        for m in members {
            parts.push(Weight::load(weights, m.prefix, m.out_dim, in_dim, m.plan)?);
            if bias {
                biases.push(
                    weights
                        .take(&format!("{}.bias", m.prefix), Some(&[m.out_dim]))?
                        .as_dtype(m.plan.dtype)?,
                );
            }
        }
        let layout = match Weight::stacked(&parts)? {
            Some(weight) => {
                let linear = Linear {
                    projection: Projection::new(weight, ways),
                    bias: if bias {
                        Some(concatenate(&biases, 0)?)
                    } else {
                        None
                    },
                };
                // Now, so that the members' own buffers are freed group by
                // group rather than all held until the model is evaluated,
                // and given back to the system: in MLX's buffer cache they
                // would stay in sizes later work rarely asks for.
                mlx_rs::transforms::eval(linear.arrays())?;
                crate::runtime::memory::clear_cache()?;
                GroupLayout::Stacked(linear)
            }
            None => {
                let mut biases = biases.into_iter();
                GroupLayout::Apart(
                    parts
                        .into_iter()
                        .map(|weight| Linear {
                            projection: Projection::new(weight, ways),
                            bias: if bias { biases.next() } else { None },
                        })
                        .collect(),
                )
            }
        };
        Ok(LinearGroup { sizes, layout })
    }

    /// The members' outputs side by side: `[..., sum of widths]`.
    pub fn forward(&self, x: &Array, workers: Workers) -> Result<Array> {
        self.side_by_side(|l| l.forward(x, workers))
    }

    /// [`LinearGroup::forward`] through the dequantized weights (see
    /// [`Linear::forward_dequantized`]).
    pub fn forward_dequantized(&self, x: &Array) -> Result<Array> {
        self.side_by_side(|l| l.forward_dequantized(x))
    }

    /// `product` of each stored projection, side by side.
    fn side_by_side(&self, product: impl Fn(&Linear) -> Result<Array>) -> Result<Array> {
        match &self.layout {
            GroupLayout::Stacked(linear) => product(linear),
            GroupLayout::Apart(linears) => {
                let parts = linears.iter().map(product).collect::<Result<Vec<_>>>()?;
                Ok(concatenate(&parts, -1)?)
            }
        }
    }

    /// Outputs per row, every member's together.
    pub fn out_dim(&self) -> i32 {
        self.sizes.iter().sum()
    }

    /// Each member's output.
    pub fn forward_each(&self, x: &Array, workers: Workers) -> Result<Vec<Array>> {
        match &self.layout {
            GroupLayout::Stacked(linear) => {
                let y = linear.forward(x, workers)?;
                let mut ends: Vec<i32> = self
                    .sizes
                    .iter()
                    .scan(0, |end, size| {
                        *end += size;
                        Some(*end)
                    })
                    .collect();
                ends.pop();
                Ok(y.split_at_indices(&ends, -1)?)
            }
            GroupLayout::Apart(linears) => linears.iter().map(|l| l.forward(x, workers)).collect(),
        }
    }

    /// An MLP's activation `silu(gate) * up` from a group of two members,
    /// gate then up. On a CPU stream with the two stacked, one node of our
    /// kernels reads the stacked product (no split, MLX's sigmoid runs on
    /// one thread with a scalar exp); elsewhere MLX's ops, in the same order.
    pub fn swiglu(&self, x: &Array, workers: Workers) -> Result<Array> {
        if let (GroupLayout::Stacked(linear), [g, u]) = (&self.layout, self.sizes.as_slice()) {
            if g == u {
                let y = linear.forward(x, workers)?;
                if let Some(act) =
                    emlx_axon_kernels::swiglu(&y).map_err(|e| Error::Mlx(e.to_string()))?
                {
                    return Ok(act);
                }
            }
        }
        let [gate, up]: [Array; 2] = self
            .forward_each(x, workers)?
            .try_into()
            .map_err(|_| Error::invalid("the MLP's gate/up projection has two outputs"))?;
        Ok(gate.multiply(mlx_rs::ops::sigmoid(&gate)?)?.multiply(&up)?)
    }

    /// The stacked weight as [`Linear::quantized`] gives it, when the members
    /// share one and it is quantized.
    pub fn stacked_quantized(
        &self,
    ) -> Option<(emlx_axon_kernels::QuantWeight<'_>, Option<&Array>)> {
        match &self.layout {
            GroupLayout::Stacked(linear) => linear.quantized(),
            GroupLayout::Apart(_) => None,
        }
    }

    /// Each member's output width, in order.
    pub fn sizes(&self) -> &[i32] {
        &self.sizes
    }

    /// Whether the members share one stacked weight.
    pub fn is_stacked(&self) -> bool {
        matches!(self.layout, GroupLayout::Stacked(_))
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match &self.layout {
            GroupLayout::Stacked(linear) => linear.arrays(),
            GroupLayout::Apart(linears) => linears.iter().flat_map(|l| l.arrays()).collect(),
        }
    }

    pub fn is_quantized(&self) -> bool {
        match &self.layout {
            GroupLayout::Stacked(linear) => linear.is_quantized(),
            GroupLayout::Apart(linears) => linears.iter().any(|l| l.is_quantized()),
        }
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

    /// The quantized table, as the GPU embedding kernel and the tied output
    /// projection read it.
    pub fn quantized(&self) -> Option<emlx_axon_kernels::QuantWeight<'_>> {
        self.projection.weight.quantized()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::runtime::device::{DeviceKind, Lease};

    /// The largest difference between `ours` and `theirs`, relative to the
    /// largest magnitude in `theirs`.
    pub(crate) fn relative_error(ours: &[f32], theirs: &[f32]) -> f32 {
        assert_eq!(ours.len(), theirs.len());
        let scale = theirs.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        ours.iter()
            .zip(theirs)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale))
    }

    /// q/k/v-shaped members (rows 8, 4, 4 of 128 columns) quantized with
    /// the given bits each, with biases, as checkpoint tensors.
    fn checkpoint(bits: [i32; 3]) -> (Weights, Vec<(String, i32, QuantSpec)>) {
        let mut tensors = Vec::new();
        let mut members = Vec::new();
        for (i, (rows, bits)) in [8, 4, 4].into_iter().zip(bits).enumerate() {
            let name = format!("layer.m{i}");
            let spec = QuantSpec::new(bits, 64).unwrap();
            let w = mlx_rs::random::normal::<f32>(&[rows, 128], None, None, None).unwrap();
            let (w, scales, biases) = quantize(&w, 64, bits).unwrap();
            let bias = mlx_rs::random::normal::<f32>(&[rows], None, None, None).unwrap();
            tensors.extend([
                (format!("{name}.weight"), w),
                (format!("{name}.scales"), scales),
                (format!("{name}.biases"), biases),
                (format!("{name}.bias"), bias),
            ]);
            members.push((name, rows, spec));
        }
        (Weights::from_arrays(tensors), members)
    }

    fn group(bits: [i32; 3]) -> (LinearGroup, Vec<Linear>) {
        let plan = |spec| LoadPlan {
            stored: Some(spec),
            at_load: None,
            dtype: Dtype::Float32,
        };
        let (mut weights, members) = checkpoint(bits);
        let mut copy = Weights::from_arrays(
            weights
                .remaining()
                .into_iter()
                .map(|n| (n.clone(), weights.tensors_for_test(&n))),
        );
        let list: Vec<Member> = members
            .iter()
            .map(|(prefix, rows, spec)| Member {
                prefix,
                out_dim: *rows,
                plan: plan(*spec),
            })
            .collect();
        let group = LinearGroup::load(&mut weights, "layer.stacked", &list, 128, true, 1).unwrap();
        let apart = members
            .iter()
            .map(|(prefix, rows, spec)| {
                Linear::load(&mut copy, prefix, 128, *rows, true, plan(*spec), 1).unwrap()
            })
            .collect();
        (group, apart)
    }

    /// On a GPU stream, a product whose input rows fit in one quantization
    /// group takes the dequantized way; every other one, and every product
    /// on a CPU stream, MLX's `quantized_matmul`.
    #[test]
    fn only_products_one_group_wide_are_dequantized_on_a_gpu() {
        let g = |group| QuantSpec::new(4, group).unwrap();
        assert!(dequantized_on_gpu(128, &g(128), || false));
        assert!(dequantized_on_gpu(64, &g(128), || false));
        assert!(dequantized_on_gpu(64, &g(64), || false));
        assert!(!dequantized_on_gpu(128, &g(64), || false));
        assert!(!dequantized_on_gpu(256, &g(128), || false));
        assert!(!dequantized_on_gpu(1024, &g(32), || false));
        assert!(!dequantized_on_gpu(128, &g(128), || true));
        // Wider products do not even ask which device the stream is on.
        assert!(!dequantized_on_gpu(4096, &g(64), || unreachable!()));
    }

    /// What the dequantized way computes (`apply_dequantized`) equals MLX's
    /// quantized product on the same weights, up to float32 rounding, for
    /// both bit widths, one and several rows, and a batch.
    #[test]
    fn the_dequantized_product_matches_mlxs_quantized_matmul() {
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        lease.stream().run(|| {
            for bits in [4, 8] {
                for shape in [&[1, 1, 128][..], &[1, 9, 128], &[3, 5, 128]] {
                    let key = mlx_rs::random::key(bits as u64).unwrap();
                    let dense =
                        mlx_rs::random::normal::<f32>(&[200, 128], None, 0.05, &key).unwrap();
                    let (w, scales, biases) = quantize(&dense, 128, bits).unwrap();
                    let weight = Weight::Quantized {
                        w: w.clone(),
                        scales: scales.clone(),
                        biases: biases.clone(),
                        spec: QuantSpec::new(bits, 128).unwrap(),
                    };
                    let x = mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
                    // The CPU stream's own product, as a reference.
                    let theirs =
                        quantized_matmul(&x, &w, &scales, &biases, true, 128, bits).unwrap();
                    let ours = weight.apply_dequantized(&x).unwrap();
                    assert_eq!(ours.shape(), theirs.shape());
                    let (ours, theirs) = (ours.as_slice::<f32>(), theirs.as_slice::<f32>());
                    let worst = relative_error(ours, theirs);
                    assert!(worst < 1e-5, "bits {bits} shape {shape:?}: {worst}");
                    // On this CPU stream the layer itself keeps MLX's op.
                    let layer = weight.apply_transposed(&x).unwrap();
                    assert_eq!(layer.as_slice::<f32>(), theirs);
                }
            }
        });
    }

    /// Members of one quantization share a stacked weight, whose outputs are
    /// exactly the members' own; members of different bit widths stay apart.
    #[test]
    fn stacked_projections_give_each_members_output_exactly() {
        let lease = Lease::new(DeviceKind::Cpu).unwrap();
        lease.stream().run(|| {
            for (bits, stacked) in [([4, 4, 4], true), ([4, 8, 4], false)] {
                let (group, apart) = group(bits);
                assert_eq!(group.is_stacked(), stacked);
                let x = mlx_rs::random::normal::<f32>(&[1, 3, 128], None, None, None).unwrap();
                let each = group.forward_each(&x, &[]).unwrap();
                let joined = group.forward(&x, &[]).unwrap();
                let expected: Vec<Array> =
                    apart.iter().map(|l| l.forward(&x, &[]).unwrap()).collect();
                let expected_joined = concatenate(&expected, -1).unwrap();
                for (got, want) in each
                    .iter()
                    .zip(&expected)
                    .chain([(&joined, &expected_joined)])
                {
                    assert_eq!(got.shape(), want.shape());
                    let flat = |a: &Array| a.reshape(&[-1]).unwrap().as_slice::<f32>().to_vec();
                    assert!(flat(got) == flat(want), "bits {bits:?}");
                }
                // Through the dequantized weights, stacked or apart, biases
                // included: the same outputs up to float32 rounding.
                let dequantized = group.forward_dequantized(&x).unwrap();
                assert_eq!(dequantized.shape(), joined.shape());
                assert_eq!(group.out_dim(), joined.dim(-1));
                let worst = relative_error(
                    dequantized.reshape(&[-1]).unwrap().as_slice::<f32>(),
                    joined.reshape(&[-1]).unwrap().as_slice::<f32>(),
                );
                assert!(worst < 1e-5, "bits {bits:?}: {worst}");
            }
        });
    }
}
