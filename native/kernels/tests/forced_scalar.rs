//! EMLX_AXON_KERNELS=scalar forces the portable variant, as on a CPU without
//! AVX2; the product and the elementwise steps it builds still match MLX.
//! (Its own test binary: the variant is chosen once per process.)

mod common;

use common::on_cpu;
use emlx_axon_kernels::{causal_softmax, quantized_linear, swiglu, Isa};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{arange, quantize, quantized_matmul, select, sigmoid, softmax_axis};
use mlx_rs::random::{key, normal};
use mlx_rs::Array;

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
        // The elementwise primitives too: a causal softmax of 2 heads x 5
        // queries over 7 keys, and a SwiGLU.
        let scores = normal::<f32>(&[10, 7][..], None, 3.0, &key(3).unwrap()).unwrap();
        let ours = causal_softmax(&scores, 5).unwrap().unwrap();
        let q = arange::<_, i32>(2, 7, None)
            .unwrap()
            .reshape(&[1, 5, 1])
            .unwrap();
        let k = arange::<_, i32>(0, 7, None)
            .unwrap()
            .reshape(&[1, 1, 7])
            .unwrap();
        let masked = select(
            q.ge(&k).unwrap(),
            scores.reshape(&[2, 5, 7]).unwrap(),
            Array::from_f32(f32::MIN),
        )
        .unwrap();
        let theirs = softmax_axis(&masked, -1, true).unwrap();
        let worst = ours
            .as_slice::<f32>()
            .iter()
            .zip(theirs.as_slice::<f32>())
            .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
        assert!(worst < 1e-6, "softmax: {worst}");
        let x = normal::<f32>(&[3, 2 * 50][..], None, 2.0, &key(4).unwrap()).unwrap();
        let ours = swiglu(&x).unwrap().unwrap();
        let (gate, up) = (x.index((.., ..50)), x.index((.., 50..)));
        let theirs = gate
            .multiply(sigmoid(&gate).unwrap())
            .unwrap()
            .multiply(&up)
            .unwrap();
        let worst = ours
            .as_slice::<f32>()
            .iter()
            .zip(theirs.as_slice::<f32>())
            .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
        assert!(worst < 1e-5, "swiglu: {worst}");
    })
}
