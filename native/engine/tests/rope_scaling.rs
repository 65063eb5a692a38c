//! `rope_scaling` (YaRN, llama3) against mlx-lm: teacher-forced logits at
//! every position of a 320-token sequence, a prompt pass then one-token
//! steps, on whatever paths this machine runs (the CPU layer kernels for
//! the 4-bit fixtures on a CPU; `rope_scaling_mlx_ops.rs` runs the same
//! checks with the CPU kernels off).

#[path = "rope_scaling/checks.rs"]
mod checks;
mod common;

#[test]
fn scaled_rope_matches_mlx_lm_at_every_position() {
    checks::scaled_rope_matches_mlx_lm(true);
}

#[test]
fn the_scaling_matters_at_these_positions() {
    checks::the_scaling_matters();
}
