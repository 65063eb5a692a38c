//! EMLX_AXON_KERNELS=scalar forces the kernels' portable variant, as on a
//! CPU without AVX2: the one-token layer nodes (see `decode_layer.rs`), the
//! products and the elementwise steps still give mlx-lm's ids and logits.
//! (Its own test binary: the variant is chosen once per process.)

mod common;

use common::parity::*;

#[test]
fn forced_scalar_kernels_keep_parity_with_mlx_lm() {
    std::env::set_var("EMLX_AXON_KERNELS", "scalar");
    assert_eq!(
        emlx_axon_kernels::Isa::selected(),
        emlx_axon_kernels::Isa::Scalar
    );
    for name in ["qwen3-wide", "qwen2-rope-traditional", "qwen3-mixed"] {
        check_fixture(name, "", f32_load());
    }
}
