//! A decoder block's parts: attention and the MLP (dense SwiGLU, or routed
//! experts) with their norms.

use mlx_rs::Array;

use crate::error::Result;
use crate::nn::attention::Attention;
use crate::nn::layers::{Linear, LinearGroup, RmsNorm, Workers};
use crate::nn::moe::SparseMoe;

pub(crate) struct Mlp {
    /// gate and up projections, outputs in that order.
    pub(crate) gate_up: LinearGroup,
    pub(crate) down: Linear,
}

/// A block's feed-forward part.
pub(crate) enum Ffn {
    Dense(Mlp),
    /// Routed experts.
    Sparse(SparseMoe),
}

impl Ffn {
    /// The dense MLP, `None` for routed experts.
    pub(crate) fn dense(&self) -> Option<&Mlp> {
        match self {
            Ffn::Dense(mlp) => Some(mlp),
            Ffn::Sparse(_) => None,
        }
    }

    /// The routed experts, `None` for a dense MLP.
    pub(crate) fn sparse(&self) -> Option<&SparseMoe> {
        match self {
            Ffn::Dense(_) => None,
            Ffn::Sparse(moe) => Some(moe),
        }
    }

    /// `x` (`[B, L, hidden]`, normalized) through the MLP, with MLX's ops
    /// (the dense one's activation from our CPU kernel where it runs).
    pub(crate) fn forward(&self, x: &Array, workers: Workers) -> Result<Array> {
        match self {
            Ffn::Dense(mlp) => {
                let act = mlp.gate_up.swiglu(x, workers)?;
                mlp.down.forward(&act, workers)
            }
            Ffn::Sparse(moe) => moe.forward(x, workers),
        }
    }

    pub(crate) fn arrays(&self) -> Vec<&Array> {
        match self {
            Ffn::Dense(mlp) => {
                let mut all = mlp.gate_up.arrays();
                all.extend(mlp.down.arrays());
                all
            }
            Ffn::Sparse(moe) => moe.arrays(),
        }
    }
}

pub(crate) struct Block {
    pub(crate) attn: Attention,
    pub(crate) mlp: Ffn,
    pub(crate) input_norm: RmsNorm,
    pub(crate) post_norm: RmsNorm,
}
