//! The CPU backend: one-token layers as two nodes of our CPU kernels
//! (`emlx_axon_kernels`), which also take MLX's norms, RoPE and quantized
//! products on CPU streams.

pub mod layer;

/// Whether this build's CPU kernels run on this machine (see
/// `emlx_axon_kernels::enabled`).
pub fn available() -> bool {
    emlx_axon_kernels::enabled()
}

/// `f` over each row of float32 `x` `[rows, width]` as a node of the CPU
/// stream's graph (see `emlx_axon_kernels::rows_to_ids`); `None` off a CPU
/// stream, with the kernels off, or for another dtype or shape.
pub(crate) fn rows_to_ids(
    x: &mlx_rs::Array,
    f: emlx_axon_kernels::RowFn,
) -> crate::error::Result<Option<mlx_rs::Array>> {
    emlx_axon_kernels::rows_to_ids(x, f).map_err(|e| crate::error::Error::Mlx(e.to_string()))
}
