//! The elementwise kernels against MLX: the MLP's SwiGLU, RMSNorm, and
//! per-head norm with RoPE; every variant, lengths that the 16-wide vectors
//! do not divide, the MLX primitives on lazily computed strided inputs, and
//! the cases they decline. (The softmax rows are tested with the attention
//! that uses them, `attend.rs`.)

mod common;

use common::{on_cpu, rel_err};
use emlx_axon_kernels::{norm_rope, rms_norm, rms_norm_with, swiglu, swiglu_with, Isa};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::random::{key, normal};
use mlx_rs::Array;

/// MLX's `(g * sigmoid(g)) * up` for `x` `[rows, 2F]`.
fn expected_swiglu(x: &Array, f: i32) -> Vec<f32> {
    let gate = x.index((.., ..f));
    let up = x.index((.., f..));
    let y = gate
        .multiply(mlx_rs::ops::sigmoid(&gate).unwrap())
        .unwrap()
        .multiply(&up)
        .unwrap();
    y.eval().unwrap();
    y.as_slice::<f32>().to_vec()
}

#[test]
fn swiglu_matches_mlx_in_every_variant() {
    on_cpu(|| {
        let mut checked = 0;
        // One row (a decode step, split over its columns) and prompts.
        for (rows, f) in [(1, 3072), (1, 37), (3, 100), (64, 1024), (7, 2051)] {
            let x = normal::<f32>(&[rows, 2 * f][..], None, 3.0, &key(f as u64).unwrap()).unwrap();
            x.eval().unwrap();
            let theirs = expected_swiglu(&x, f);
            for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                for threads in [1, 0] {
                    let mut y = vec![f32::NAN; (rows * f) as usize];
                    swiglu_with(isa, threads, x.as_slice(), f as usize, &mut y).unwrap();
                    let err = rel_err(&y, &theirs);
                    assert!(
                        err < 1e-6,
                        "{isa:?} threads={threads} rows={rows} f={f}: {err}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 5 * 2);
        // The primitive, on a lazily computed strided [1, 5, 2F] input.
        let x = normal::<f32>(&[5, 1, 2 * 300][..], None, 2.0, &key(3).unwrap()).unwrap();
        let strided = x.transpose_axes(&[1, 0, 2]).unwrap();
        let y = swiglu(&strided)
            .unwrap()
            .expect("a CPU float32 swiglu is ours");
        assert_eq!(y.shape(), &[1, 5, 300]);
        y.eval().unwrap();
        let flat = strided.reshape(&[5, 600]).unwrap();
        let err = rel_err(y.as_slice(), &expected_swiglu(&flat, 300));
        assert!(err < 1e-6, "{err}");
        // Declined: an odd last axis, another dtype.
        assert!(swiglu(&x.index((.., .., ..599))).unwrap().is_none());
        assert!(swiglu(&x.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap())
            .unwrap()
            .is_none());
        let mut y = vec![0.0; 10];
        assert!(swiglu_with(Isa::Scalar, 1, &[0.0; 21], 10, &mut y).is_err());
    })
}

/// MLX's `rms_norm` (its fast op, which the engine's CPU expansion follows
/// step for step) of `x` `[rows, R, D]` with weight `[R, D]`, per weight row.
fn expected_norm(x: &Array, w: &Array, eps: f32) -> Vec<f32> {
    let y = mlx_rs::fast::rms_norm(x, None, eps)
        .unwrap()
        .multiply(w)
        .unwrap();
    y.eval().unwrap();
    y.as_slice::<f32>().to_vec()
}

#[test]
fn rms_norm_matches_mlx_in_every_variant() {
    on_cpu(|| {
        let mut checked = 0;
        // (rows, weight rows, dim): a decode step's hidden state, a prompt's,
        // per-head q/k norms, a dim the vectors do not divide.
        for (rows, r, d) in [
            (1, 1, 1024),
            (64, 1, 1024),
            (4, 24, 128),
            (3, 1, 37),
            (40, 2, 300),
        ] {
            let x = normal::<f32>(&[rows, r, d][..], None, 2.0, &key(d as u64).unwrap()).unwrap();
            let w = normal::<f32>(&[r, d][..], None, None, &key(7).unwrap()).unwrap();
            x.eval().unwrap();
            w.eval().unwrap();
            let theirs = expected_norm(&x, &w, 1e-6);
            for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                for threads in [1, 0] {
                    let mut y = vec![f32::NAN; (rows * r * d) as usize];
                    rms_norm_with(
                        isa,
                        threads,
                        x.as_slice(),
                        w.as_slice(),
                        d as usize,
                        1e-6,
                        &mut y,
                    )
                    .unwrap();
                    let err = rel_err(&y, &theirs);
                    assert!(
                        err < 1e-6,
                        "{isa:?} threads={threads} rows={rows} r={r} d={d}: {err}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 5 * 2);
        // The primitive: a [D] weight, and a [R, D] one over a strided input.
        let x = normal::<f32>(&[3, 5, 64][..], None, 2.0, &key(11).unwrap()).unwrap();
        let w = normal::<f32>(&[64][..], None, None, &key(12).unwrap()).unwrap();
        let y = rms_norm(&x, &w, 1e-5)
            .unwrap()
            .expect("a CPU float32 norm is ours");
        y.eval().unwrap();
        let theirs = mlx_rs::fast::rms_norm(&x, Some(&w), 1e-5).unwrap();
        assert!(rel_err(y.as_slice(), theirs.as_slice()) < 1e-6);
        let strided = x.transpose_axes(&[1, 0, 2]).unwrap();
        let rows = normal::<f32>(&[3, 64][..], None, None, &key(13).unwrap()).unwrap();
        let y = rms_norm(&strided, &rows, 1e-5).unwrap().unwrap();
        assert_eq!(y.shape(), &[5, 3, 64]);
        y.eval().unwrap();
        let err = rel_err(y.as_slice(), &expected_norm(&strided, &rows, 1e-5));
        assert!(err < 1e-6, "{err}");
        // Declined: weight rows that are not x's second-to-last axis, a
        // weight of another width, another dtype.
        assert!(rms_norm(&x, &rows, 1e-5).unwrap().is_none());
        assert!(rms_norm(&x, &w.index(..63), 1e-5).unwrap().is_none());
        let half = x.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
        assert!(rms_norm(&half, &w, 1e-5).unwrap().is_none());
    })
}

#[test]
fn norm_rope_matches_mlx_ops() {
    on_cpu(|| {
        use mlx_rs::ops::concatenate;
        // (B, L, H, hd, table rows, traditional, with a norm)
        for (b, l, h, hd, t, traditional, with_norm) in [
            (1, 1, 24, 128, 1, false, true),
            (2, 5, 3, 64, 2, false, true),
            (1, 7, 4, 16, 1, true, true),
            (3, 2, 2, 32, 1, false, false),
            (2, 3, 5, 8, 2, true, false),
        ] {
            let seed = (b * 1000 + l * 100 + h * 10 + hd) as u64;
            let x = normal::<f32>(&[b, l, h, hd][..], None, 2.0, &key(seed).unwrap()).unwrap();
            let w = normal::<f32>(&[h, hd][..], None, None, &key(seed + 1).unwrap()).unwrap();
            let cos = normal::<f32>(&[t, l, hd][..], None, None, &key(seed + 2).unwrap()).unwrap();
            let sin = normal::<f32>(&[t, l, hd][..], None, None, &key(seed + 3).unwrap()).unwrap();
            let norm = with_norm.then_some((&w, 1e-6f32));
            let y = norm_rope(&x, norm, &cos, &sin, traditional)
                .unwrap()
                .expect("a CPU float32 rotation is ours");
            y.eval().unwrap();
            // MLX: the norm, then x * cos + swapped(x) * signed_sin with the
            // tables broadcast over the heads.
            let n = if with_norm {
                mlx_rs::fast::rms_norm(&x, None, 1e-6)
                    .unwrap()
                    .multiply(&w)
                    .unwrap()
            } else {
                x.clone()
            };
            let swapped = if traditional {
                let pairs = n.reshape(&[b, l, h, hd / 2, 2]).unwrap();
                concatenate(
                    &[
                        pairs.index((.., .., .., .., 1..2)),
                        pairs.index((.., .., .., .., 0..1)),
                    ],
                    -1,
                )
                .unwrap()
                .reshape(&[b, l, h, hd])
                .unwrap()
            } else {
                concatenate(
                    &[
                        n.index((.., .., .., hd / 2..)),
                        n.index((.., .., .., ..hd / 2)),
                    ],
                    -1,
                )
                .unwrap()
            };
            let c = cos.reshape(&[t, l, 1, hd]).unwrap();
            let s = sin.reshape(&[t, l, 1, hd]).unwrap();
            let theirs = n
                .multiply(&c)
                .unwrap()
                .add(swapped.multiply(&s).unwrap())
                .unwrap();
            theirs.eval().unwrap();
            let err = rel_err(y.as_slice(), theirs.as_slice());
            assert!(
                err < 1e-6,
                "b={b} l={l} h={h} hd={hd} traditional={traditional} norm={with_norm}: {err}"
            );
        }
        // Declined: a table of another length, a weight of other heads, an odd head.
        let x = normal::<f32>(&[1, 2, 3, 8][..], None, None, &key(1).unwrap()).unwrap();
        let table = normal::<f32>(&[1, 2, 8][..], None, None, &key(2).unwrap()).unwrap();
        let short = table.index((.., ..1, ..));
        assert!(norm_rope(&x, None, &short, &short, false)
            .unwrap()
            .is_none());
        let w = normal::<f32>(&[4, 8][..], None, None, &key(3).unwrap()).unwrap();
        assert!(norm_rope(&x, Some((&w, 1e-6)), &table, &table, false)
            .unwrap()
            .is_none());
        let odd = x.index((.., .., .., ..7));
        let odd_table = table.index((.., .., ..7));
        assert!(norm_rope(&odd, None, &odd_table, &odd_table, false)
            .unwrap()
            .is_none());
    })
}
