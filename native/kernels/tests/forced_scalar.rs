//! EMLX_AXON_KERNELS=scalar forces the portable variant, as on a CPU without
//! AVX2; the product it builds still matches MLX. (Its own test binary: the
//! variant is chosen once per process.)

mod common;

use common::on_cpu;
use emlx_axon_kernels::{quantized_linear, Isa};
use mlx_rs::ops::{quantize, quantized_matmul};
use mlx_rs::random::{key, normal};

#[test]
fn forced_scalar_variant_matches_mlx() {
    on_cpu(|| {
        std::env::set_var("EMLX_AXON_KERNELS", "scalar");
        assert_eq!(Isa::selected(), Isa::Scalar);
        for (bits, group, m) in [(4, 64, 1), (8, 32, 5), (4, 128, 6)] {
            let x = normal::<f32>(&[m, 512][..], None, None, &key(1).unwrap()).unwrap();
            let dense = normal::<f32>(&[257, 512][..], None, 0.05, &key(2).unwrap()).unwrap();
            let (w, s, b) = quantize(&dense, group, bits).unwrap();
            let expected = quantized_matmul(&x, &w, &s, &b, true, group, bits).unwrap();
            let ours = quantized_linear(&x, &w, &s, &b, group, bits)
                .unwrap()
                .unwrap();
            let theirs = expected.as_slice::<f32>();
            let scale = theirs.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
            let worst = ours
                .as_slice::<f32>()
                .iter()
                .zip(theirs)
                .fold(0f32, |a, (p, q)| a.max((p - q).abs() / scale));
            assert!(worst < 1e-5, "bits={bits} group={group} m={m}: {worst}");
        }
    })
}
