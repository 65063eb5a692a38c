//! A decoder block's parts: attention and the SwiGLU MLP with their norms.

use crate::nn::attention::Attention;
use crate::nn::layers::{Linear, LinearGroup, RmsNorm};

pub(crate) struct Mlp {
    /// gate and up projections, outputs in that order.
    pub(crate) gate_up: LinearGroup,
    pub(crate) down: Linear,
}

pub(crate) struct Block {
    pub(crate) attn: Attention,
    pub(crate) mlp: Mlp,
    pub(crate) input_norm: RmsNorm,
    pub(crate) post_norm: RmsNorm,
}
