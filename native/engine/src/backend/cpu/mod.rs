//! The CPU backend: one-token layers as two nodes of our CPU kernels
//! (`emlx_axon_kernels`), which also take MLX's norms, RoPE and quantized
//! products on CPU streams.

pub mod layer;

/// Whether this build's CPU kernels run on this machine (see
/// `emlx_axon_kernels::enabled`).
pub fn available() -> bool {
    emlx_axon_kernels::enabled()
}
