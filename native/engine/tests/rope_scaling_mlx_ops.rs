//! The checks of `rope_scaling.rs` with the CPU kernels off
//! (`EMLX_AXON_KERNELS=mlx`, read once per process): MLX's ops on every path.

#[path = "rope_scaling/checks.rs"]
mod checks;
mod common;

#[test]
fn scaled_rope_matches_mlx_lm_with_mlx_ops() {
    std::env::set_var("EMLX_AXON_KERNELS", "mlx");
    assert!(
        !emlx_axon_kernels::enabled(),
        "the kernels were read on before"
    );
    checks::scaled_rope_matches_mlx_lm(false);
}
