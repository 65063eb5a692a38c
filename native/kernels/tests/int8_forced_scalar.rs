//! EMLX_AXON_CPU_ACTIVATIONS=int8 with EMLX_AXON_KERNELS=scalar: the
//! primitive runs the portable int8 product for prompt batches, as on a CPU
//! without AVX2, and that differs from the float32 one; a decode batch keeps
//! the float32 product. (Its own test binary: both settings are
//! read once per process.)

mod common;

use common::{case, check_against_mlx, on_cpu};
use emlx_axon_kernels::{int8_takes, qmm_int8_with, qmm_with, quantized_linear, Activations, Isa};

#[test]
fn forced_scalar_int8_variant() {
    on_cpu(|| {
        std::env::set_var("EMLX_AXON_KERNELS", "scalar");
        std::env::set_var("EMLX_AXON_CPU_ACTIVATIONS", "int8");
        assert_eq!(Isa::selected(), Isa::Scalar);
        assert_eq!(Activations::selected(), Activations::Int8);
        for (bits, group, m) in [(4, 64, 1), (4, 64, 7), (8, 32, 8), (4, 128, 17)] {
            let c = case(90 + m as u64, m, 257, 512, bits, group, false);
            let y = quantized_linear(&c.x, &c.w, &c.scales, &c.biases, group, bits)
                .unwrap()
                .unwrap();
            y.eval().unwrap();
            let ours = y.as_slice::<f32>();
            let x = c.x.as_slice::<f32>();
            let mut int8 = vec![0f32; m * 257];
            qmm_int8_with(Isa::Scalar, 1, x, &c.matrix(), &mut int8).unwrap();
            let mut f32s = vec![0f32; m * 257];
            qmm_with(Isa::Scalar, 1, x, &c.matrix(), &mut f32s).unwrap();
            let what = format!("bits={bits} group={group} m={m}");
            let same = |theirs: &[f32]| {
                ours.iter()
                    .zip(theirs)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            };
            if !int8_takes(m, 512, bits) {
                assert!(
                    same(&f32s),
                    "{what}: a decode batch did not keep the float32 product"
                );
                continue;
            }
            assert!(same(&int8), "{what}: not the scalar int8 product");
            assert!(ours != &f32s[..], "{what}: the float32 product ran");
            check_against_mlx(&c, ours, &what);
        }
    })
}
