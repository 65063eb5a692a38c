//! Backend-neutral layers built from MLX's ops: linear and embedding layers
//! (dense or quantized), norms, RoPE, attention, routed experts and the
//! decoder block.

pub mod attention;
pub mod block;
pub mod layers;
pub mod moe;
pub mod rope;
