//! EMLX_AXON_KERNELS=scalar forces the portable variant, as on a CPU without
//! AVX2; the product and the elementwise steps it builds still match MLX.
//! (Its own test binary: the variant is chosen once per process.)

mod common;

use common::on_cpu;
use emlx_axon_kernels::{prompt_attention, quantized_linear, swiglu, Isa};
use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{quantize, quantized_matmul, sigmoid};
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
        // The prompt attention and the SwiGLU too: 2 key heads of 2 query
        // heads, 5 queries after 2 cached keys, against MLX's attention.
        let q = normal::<f32>(&[1, 2, 2 * 5, 16][..], None, 0.5, &key(3).unwrap()).unwrap();
        let kv = normal::<f32>(&[1, 2, 7, 16][..], None, None, &key(5).unwrap()).unwrap();
        let ours = prompt_attention(&q, &kv, &kv, 5).unwrap().unwrap();
        let heads = q.reshape(&[1, 4, 5, 16]).unwrap();
        let theirs = scaled_dot_product_attention(
            &heads,
            &kv,
            &kv,
            1.0,
            ScaledDotProductAttentionMask::Causal,
            None,
        )
        .unwrap();
        let worst = ours
            .as_slice::<f32>()
            .iter()
            .zip(theirs.as_slice::<f32>())
            .fold(0f32, |a, (p, q)| a.max((p - q).abs()));
        assert!(worst < 1e-5, "prompt attention: {worst}");
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
