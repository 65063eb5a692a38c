//! Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, whose
//! SwiGLU MLPs run through MLX's gathered products (`gather_mm`, or
//! `gather_qmm` for quantized experts), as mlx-lm's qwen3_moe and
//! switch_layers compute it.
//!
//! Experts are stored stacked, `[experts, out, in]` per projection: as
//! mlx-lm saves them (`mlp.switch_mlp.{gate,up,down}_proj`), or stacked at
//! load from the Hugging Face layout (`mlp.experts.{e}.{proj}`, read joined
//! by [`expert_joins`]). Quantized experts and router are read by the
//! layer nodes of a CPU step and the kernels of a CUDA step
//! ([`ExpertWeights`]); elsewhere (prompts, unquantized experts) these
//! blocks run as graph nodes, on a CPU stream the experts' products through
//! our kernels' gathered product (MLX's CPU `gather_qmm` runs one thread).

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{
    argpartition_axis, argsort_axis, dequantize, expand_dims_axes, flatten, floor_divide,
    gather_mm, gather_qmm, quantize, sigmoid, softmax_axis, squeeze_axes, stack, swap_axes,
    unflatten,
};
use mlx_rs::Array;

use crate::checkpoint::config::{MoeConfig, QuantSpec};
use crate::checkpoint::weights::{Join, Weights};
use crate::error::{Error, Result};
use crate::nn::layers::{dequantized_on_gpu, params_dtype, Linear, LoadPlan, Weight, Workers};
use emlx_axon_kernels::QuantWeight;

/// Tokens times experts from which the tokens are sorted by expert before
/// the gathered products, so that each expert's rows are read in one run
/// (mlx-lm's threshold).
const SORT_FROM: i32 = 64;

const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The Hugging Face layout's per-expert projections, each read stacked
/// under mlx-lm's name for it (`mlp.switch_mlp.{proj}`).
pub fn expert_joins(moe: &MoeConfig) -> Vec<Join> {
    PROJECTIONS
        .iter()
        .map(|proj| Join {
            name: format!("mlp.switch_mlp.{proj}"),
            members: (0..moe.num_experts)
                .map(|e| format!("mlp.experts.{e}.{proj}"))
                .collect(),
        })
        .collect()
}

/// A stacked tensor of the projection `switch` (`{switch}.{suffix}`,
/// `[experts, rows, cols]`): as stored, as joined at load from the
/// per-expert tensors of `member`, or stacked here from those.
fn take_stacked(
    weights: &mut Weights,
    switch: &str,
    member: &dyn Fn(i32) -> String,
    suffix: &str,
    experts: i32,
    [rows, cols]: [i32; 2],
) -> Result<Array> {
    let name = format!("{switch}.{suffix}");
    match weights.joined_rows(&name) {
        Some(parts) if parts == vec![rows; experts as usize] => {
            let joined = weights.take(&name, Some(&[experts * rows, cols]))?;
            return Ok(joined.reshape(&[experts, rows, cols])?);
        }
        // Another split: the members' own checks below say what is wrong.
        Some(_) => weights.unjoin(switch),
        None => {}
    }
    if weights.contains(&name) {
        return weights.take(&name, Some(&[experts, rows, cols]));
    }
    let parts = (0..experts)
        .map(|e| weights.take(&format!("{}.{suffix}", member(e)), Some(&[rows, cols])))
        .collect::<Result<Vec<_>>>()?;
    Ok(stack(&parts, 0)?)
}

/// Every expert's projection stacked, `[experts, out, in]`, and its product
/// with the rows routed to each.
impl Weight {
    /// Projection `switch` of `experts` experts, each `[rows, cols]`
    /// logically; quantized in the checkpoint exactly when it has scales.
    fn load_experts(
        weights: &mut Weights,
        switch: &str,
        member: &dyn Fn(i32) -> String,
        experts: i32,
        [rows, cols]: [i32; 2],
        plan: LoadPlan,
    ) -> Result<Self> {
        let quantized = weights.contains(&format!("{switch}.scales"))
            || weights.contains(&format!("{}.scales", member(0)));
        let mut take = |suffix: &str, cols: i32| {
            take_stacked(weights, switch, member, suffix, experts, [rows, cols])
        };
        if quantized {
            let spec = plan.stored.ok_or_else(|| {
                Error::Config(format!(
                    "`{switch}` is quantized but config.json has no `quantization` block"
                ))
            })?;
            let w = take("weight", cols * spec.bits / 32)?;
            let scales = take("scales", cols / spec.group_size)?;
            let biases = take("biases", cols / spec.group_size)?;
            return Ok(Weight::Quantized {
                w,
                scales: params_dtype(scales, plan.dtype)?,
                biases: params_dtype(biases, plan.dtype)?,
                spec,
            });
        }
        let w = take("weight", cols)?;
        match plan.at_load {
            // As mlx-lm quantizes a switch layer: every expert's rows, in
            // the checkpoint's dtype, where the groups divide the inputs.
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

    /// `x` (`[..., 1, in]`) times the transposed weight of the expert each
    /// of its rows is routed to (`idx`, broadcast against `x`'s leading
    /// axes), `sorted` when `idx` is in ascending order.
    fn gather(&self, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            Weight::Dense(w) => gather_mm(x, swap_axes(w, -1, -2)?, None::<&Array>, idx, sorted)?,
            Weight::Quantized {
                w,
                scales,
                biases,
                spec,
            } => {
                let cast = |a: &Array| -> Result<Array> {
                    Ok(if a.dtype() == x.dtype() {
                        a.clone()
                    } else {
                        a.as_dtype(x.dtype())?
                    })
                };
                let (scales, biases) = (cast(scales)?, cast(biases)?);
                // Where MLX's quantized product cannot run on a GPU (see
                // `dequantized_on_gpu`), the same sum over the dequantized
                // weight.
                if dequantized_on_gpu(x.dim(-1), spec, crate::runtime::device::on_cpu_stream) {
                    let dense = dequantize(w, &scales, &biases, spec.group_size, spec.bits)?;
                    gather_mm(x, swap_axes(&dense, -1, -2)?, None::<&Array>, idx, sorted)?
                } else {
                    gather_qmm(
                        x,
                        w,
                        &scales,
                        &biases,
                        None::<&Array>,
                        idx,
                        true,
                        spec.group_size,
                        spec.bits,
                        sorted,
                    )?
                }
            }
        })
    }

    /// Our kernels' gathered product, where they take it (quantized experts
    /// on a CPU stream, float32 rows): `x` `[T, 1 or C, in]` through the
    /// experts `ids` `[T, C]` names, `[T, C, out]`.
    fn gathered(&self, x: &Array, ids: &Array) -> Result<Option<Array>> {
        let Some(q) = self.quantized() else {
            return Ok(None);
        };
        emlx_axon_kernels::gathered_quantized_linear(
            x,
            q.w,
            q.scales,
            q.biases,
            ids,
            q.group_size,
            q.bits,
        )
        .map_err(|e| Error::Mlx(e.to_string()))
    }
}

/// A layer's routed experts with their router.
pub(crate) struct SparseMoe {
    router: Linear,
    gate: Weight,
    up: Weight,
    down: Weight,
    top_k: i32,
    norm_topk_prob: bool,
}

/// A layer's quantized router and experts, as a CPU or CUDA step's layer
/// kernels read them (`[experts, out, in]` stacks).
pub(crate) struct ExpertWeights<'a> {
    pub router: QuantWeight<'a>,
    pub gate: QuantWeight<'a>,
    pub up: QuantWeight<'a>,
    pub down: QuantWeight<'a>,
    pub top_k: i32,
    pub norm_topk_prob: bool,
}

/// The router's quantization when the model is quantized at load: 8 bits in
/// groups of 64, as mlx-lm's qwen3_moe predicate converts it.
pub fn router_at_load(at_load: Option<QuantSpec>) -> Option<QuantSpec> {
    at_load.map(|_| QuantSpec {
        bits: 8,
        group_size: 64,
    })
}

impl SparseMoe {
    /// Layer `prefix`'s experts (`{prefix}.mlp.*`) for inputs of width
    /// `hidden`; `plan` gives each module path's load plan.
    pub(crate) fn load(
        weights: &mut Weights,
        moe: &MoeConfig,
        prefix: &str,
        hidden: i32,
        plan: impl Fn(&str) -> LoadPlan,
        ways: usize,
    ) -> Result<Self> {
        let (e, inner) = (moe.num_experts, moe.moe_intermediate_size);
        let router_path = format!("{prefix}.mlp.gate");
        let router_plan = LoadPlan {
            at_load: router_at_load(plan(&router_path).at_load),
            ..plan(&router_path)
        };
        let router = Linear::load(weights, &router_path, hidden, e, false, router_plan, ways)?;
        let mut projection = |proj: &str, shape: [i32; 2]| {
            let switch = format!("{prefix}.mlp.switch_mlp.{proj}");
            let member = |i: i32| format!("{prefix}.mlp.experts.{i}.{proj}");
            Weight::load_experts(weights, &switch, &member, e, shape, plan(&switch))
        };
        Ok(SparseMoe {
            gate: projection("gate_proj", [inner, hidden])?,
            up: projection("up_proj", [inner, hidden])?,
            down: projection("down_proj", [hidden, inner])?,
            router,
            top_k: moe.top_k,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    /// `x` (`[B, L, hidden]`, normalized) through each token's top-k
    /// experts, weighted by the router's probabilities.
    pub(crate) fn forward(&self, x: &Array, workers: Workers) -> Result<Array> {
        let gates = softmax_axis(&self.router.forward(x, workers)?, -1, true)?;
        let (k, experts) = (self.top_k, gates.dim(-1));
        let picked = argpartition_axis(&gates, -k, -1)?.index((.., .., (experts - k)..));
        let mut scores = take_along_axis(&gates, &picked, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        let y = self.experts(x, &picked)?;
        let weighted = y.multiply(expand_dims_axes(&scores, &[-1])?)?;
        Ok(weighted.sum_axis(-2, false)?.as_dtype(y.dtype())?)
    }

    /// Each token's rows through its experts `picked` (`[B, L, k]`):
    /// `[B, L, k, hidden]`.
    fn experts(&self, x: &Array, picked: &Array) -> Result<Array> {
        if let Some(y) = self.experts_by_kernels(x, picked)? {
            return Ok(y);
        }
        // [B, L, 1, 1, hidden]: one row per token, batched over tokens.
        let x = expand_dims_axes(x, &[-2, -3])?;
        let k = picked.dim(-1);
        let mlp = |x: &Array, idx: &Array, sorted: bool| -> Result<Array> {
            let up = self.up.gather(x, idx, sorted)?;
            let gate = self.gate.gather(x, idx, sorted)?;
            let act = gate.multiply(sigmoid(&gate)?)?.multiply(&up)?;
            self.down.gather(&act, idx, sorted)
        };
        if (picked.size() as i32) < SORT_FROM {
            return Ok(squeeze_axes(&mlp(&x, picked, false)?, &[-2])?);
        }
        // Rows sorted by expert: each (token, choice) pair's token row.
        let flat = flatten(picked, None, None)?;
        let order = argsort_axis(&flat, 0)?;
        let inverse = argsort_axis(&order, 0)?;
        let tokens = floor_divide(&order, Array::from_slice(&[k as u32], &[]))?;
        let rows = flatten(&x, 0, -3)?.take_axis(&tokens, 0)?;
        let idx = flat.take_axis(&order, 0)?;
        let out = mlp(&rows, &idx, true)?.take_axis(&inverse, 0)?;
        Ok(squeeze_axes(&unflatten(&out, 0, picked.shape())?, &[-2])?)
    }

    /// [`SparseMoe::experts`] through our kernels' gathered products,
    /// where they take all three projections (on a CPU stream; MLX's CPU
    /// `gather_qmm` runs one thread). `None` otherwise.
    fn experts_by_kernels(&self, x: &Array, picked: &Array) -> Result<Option<Array>> {
        let (b, l, k, d) = (x.dim(0), x.dim(1), picked.dim(-1), x.dim(-1));
        let rows = x.reshape(&[b * l, 1, d])?;
        let ids = picked.reshape(&[b * l, k])?;
        let (Some(gate), Some(up)) = (
            self.gate.gathered(&rows, &ids)?,
            self.up.gathered(&rows, &ids)?,
        ) else {
            return Ok(None);
        };
        let act = gate.multiply(sigmoid(&gate)?)?.multiply(&up)?;
        let Some(y) = self.down.gathered(&act, &ids)? else {
            return Ok(None);
        };
        Ok(Some(y.reshape(&[b, l, k, d])?))
    }

    pub(crate) fn arrays(&self) -> Vec<&Array> {
        let mut all = self.router.arrays();
        for w in [&self.gate, &self.up, &self.down] {
            all.extend(w.arrays());
        }
        all
    }

    /// The router and experts when all are quantized (the router without
    /// a bias).
    pub(crate) fn quantized(&self) -> Option<ExpertWeights<'_>> {
        let (router, None) = self.router.quantized()? else {
            return None;
        };
        Some(ExpertWeights {
            router,
            gate: self.gate.quantized()?,
            up: self.up.quantized()?,
            down: self.down.quantized()?,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        })
    }

    pub(crate) fn is_quantized(&self) -> bool {
        self.gate.is_quantized()
    }
}
