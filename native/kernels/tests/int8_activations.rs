//! The int8-activation products of every variant: against a float64
//! evaluation of the same int8 algebra (tight), against MLX's float32
//! quantized_matmul (within the bound activation rounding allows), and
//! against each other (identical: integer sums are exact and every variant
//! rounds its float steps in the same order).

mod common;

use common::{activation_bound, case, check_within_bound, int8_reference, on_cpu, Case};
use emlx_axon_kernels::{qmm_int8_with, qmm_with, Activations, Isa};

/// Batch sizes: decode (1), the matrix-vector form's limit region (3) and
/// the repacked matrix product (17, 128: neither a multiple of its 4-row or
/// 2-row tiles past the first).
const BATCHES: [usize; 4] = [1, 3, 17, 128];
/// (rows, cols): rows not a multiple of 8 or 32 weight rows per tile, nor of
/// the threads' split; cols multiples of 128 (every group size) but not of
/// 256, and long enough (1152, 3200) that the matrix products take K in
/// several slices (AVX-512: 768 columns, AVX2: 3072).
const SHAPES: [(usize, usize); 3] = [(70, 384), (301, 1152), (45, 3200)];

fn run(c: &Case, isa: Isa, threads: usize) -> Vec<f32> {
    let x = c.x.as_slice::<f32>();
    let mut y = vec![f32::NAN; c.m * c.n];
    if c.bf16 {
        let (s, b) = c.bf16_params();
        let m = emlx_axon_kernels::QuantizedMatrix {
            w: c.w.as_slice::<u32>(),
            scales: &s[..],
            biases: &b[..],
            rows: c.n,
            cols: c.k,
            bits: c.bits,
            group_size: c.group,
        };
        qmm_int8_with(isa, threads, x, &m, &mut y).unwrap();
    } else {
        qmm_int8_with(isa, threads, x, &c.matrix(), &mut y).unwrap();
    }
    y
}

fn for_each_case(mut f: impl FnMut(&Case, &str)) {
    let mut seed = 1u64;
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            for &(n, k) in &SHAPES {
                for &m in &BATCHES {
                    // bfloat16 parameters on every other case.
                    let bf16 = seed.is_multiple_of(2);
                    let c = case(seed * 7, m, n, k, bits, group, bf16);
                    let what = format!("bits={bits} group={group} m={m} n={n} k={k} bf16={bf16}");
                    f(&c, &what);
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn every_variant_matches_a_float64_evaluation_of_the_int8_algebra() {
    on_cpu(|| {
        let mut checked = 0;
        for_each_case(|c, what| {
            let reference = int8_reference(c);
            let scalar = run(c, Isa::Scalar, 1);
            for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                for threads in [1, 0] {
                    let y = if isa == Isa::Scalar && threads == 1 {
                        scalar.clone()
                    } else {
                        run(c, isa, threads)
                    };
                    for (i, (&o, &(r, mag))) in y.iter().zip(&reference).enumerate() {
                        let err = (o as f64 - r).abs();
                        assert!(
                            err <= 1e-6 * mag + 1e-12,
                            "{isa:?} threads={threads} {what}: output {i}: {o} vs {r} (terms {mag})"
                        );
                    }
                    // Bit for bit what the scalar variant gives.
                    let differ = y
                        .iter()
                        .zip(&scalar)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ, 0,
                        "{isa:?} threads={threads} {what}: outputs differ from scalar"
                    );
                    checked += 1;
                }
            }
        });
        assert!(checked >= 2 * 3 * 3 * 4 * 2);
    })
}

#[test]
fn every_variant_stays_within_the_activation_rounding_bound_of_mlx() {
    on_cpu(|| {
        let (mut worst, mut worst_rms) = (0f64, 0f64);
        for_each_case(|c, what| {
            let bound = activation_bound(c);
            for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                let y = run(c, isa, 0);
                let what = format!("{isa:?} {what}");
                worst = worst.max(check_within_bound(c, &bound, &y, &what));
                let rms = |v: &mut dyn Iterator<Item = f64>| {
                    let (s, n) = v.fold((0f64, 0usize), |(s, n), e| (s + e * e, n + 1));
                    (s / n as f64).sqrt()
                };
                let err = rms(&mut y.iter().zip(&c.mlx).map(|(a, b)| (a - b) as f64));
                let size = rms(&mut c.mlx.iter().map(|&v| v as f64));
                worst_rms = worst_rms.max(err / size);
            }
        });
        // Rounding normal activations to 255 levels per block of 32 moves
        // each element by about 0.5% of its block's spread, and the products
        // by about as much (root mean square: the errors are independent and
        // the dequantized weights centred); and it does move them (the int8
        // path is not the float one).
        println!(
            "largest error {worst} of the largest output, rms error {worst_rms} of rms output"
        );
        assert!(worst_rms < 1e-2, "rms error {worst_rms} of the rms output");
        assert!(
            worst > 1e-5,
            "largest error {worst}: activations not rounded?"
        );
    })
}

#[test]
fn the_float32_path_is_the_default_and_unchanged() {
    on_cpu(|| {
        if std::env::var_os("EMLX_AXON_CPU_ACTIVATIONS").is_none() {
            assert_eq!(Activations::selected(), Activations::F32);
        }
        // qmm_with stays the float32 product whatever the int8 path does.
        let c = case(3, 5, 70, 384, 4, 64, false);
        let mut y = vec![0f32; 5 * 70];
        qmm_with(Isa::Scalar, 1, c.x.as_slice::<f32>(), &c.matrix(), &mut y).unwrap();
        let scale = c.mlx.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
        for (a, b) in y.iter().zip(&c.mlx) {
            assert!((a - b).abs() <= 1e-5 * scale);
        }
    })
}

#[test]
fn zero_and_constant_activation_blocks() {
    on_cpu(|| {
        // An all-zero block has scale 0 (no division by zero); a constant
        // block rounds to exactly +-127 and loses nothing.
        let mut c = case(11, 3, 70, 256, 4, 64, false);
        let mut x = vec![0f32; 3 * 256];
        for (i, v) in x.iter_mut().enumerate() {
            if (i / 32) % 2 == 1 {
                *v = if i % 64 < 48 { 0.75 } else { -0.75 };
            }
        }
        c.x = mlx_rs::Array::from_slice(&x, &[3, 256]);
        let y0 =
            mlx_rs::ops::quantized_matmul(&c.x, &c.w, &c.scales, &c.biases, true, 64, 4).unwrap();
        c.mlx = y0.as_slice::<f32>().to_vec();
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let y = run(&c, isa, 1);
            assert!(y.iter().all(|v| v.is_finite()));
            let scale = c.mlx.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
            for (a, b) in y.iter().zip(&c.mlx) {
                assert!((a - b).abs() <= 1e-5 * scale, "{isa:?}: {a} vs {b}");
            }
        }
    })
}

#[test]
fn every_variant_quantizes_subnormal_and_huge_blocks_alike() {
    on_cpu(|| {
        // Blocks whose scale is subnormal (1 / scale overflows to infinity),
        // whose values straddle float32's range, or are exact halves of a
        // step: the SIMD quantizers must round and clamp as the portable one.
        let mut c = case(13, 3, 70, 256, 4, 64, false);
        let mut x = c.x.as_slice::<f32>().to_vec();
        for (i, v) in x.iter_mut().enumerate() {
            *v = match (i / 32) % 4 {
                0 => (i % 7) as f32 * 1e-40 - 3e-40,
                1 => ((i % 5) as f32 - 2.0) * 1e37,
                2 => (i % 32) as f32 * 0.5 - 7.5,
                _ => *v,
            };
        }
        c.x = mlx_rs::Array::from_slice(&x, &[3, 256]);
        let scalar = run(&c, Isa::Scalar, 1);
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let y = run(&c, isa, 1);
            assert!(
                y.iter()
                    .zip(&scalar)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?} differs from scalar"
            );
        }
    })
}

#[test]
fn a_nan_in_the_activations_reaches_the_outputs_it_feeds() {
    on_cpu(|| {
        let mut c = case(12, 2, 70, 256, 4, 64, false);
        let mut x = c.x.as_slice::<f32>().to_vec();
        x[256 + 100] = f32::NAN;
        c.x = mlx_rs::Array::from_slice(&x, &[2, 256]);
        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
            let y = run(&c, isa, 1);
            assert!(y[..70].iter().all(|v| v.is_finite()), "{isa:?}");
            assert!(y[70..].iter().all(|v| v.is_nan()), "{isa:?}");
        }
    })
}

#[test]
fn mismatched_buffers_are_refused() {
    let w = [0u32; 8];
    let s = [0f32; 1];
    let m = emlx_axon_kernels::QuantizedMatrix {
        w: &w,
        scales: &s,
        biases: &s,
        rows: 1,
        cols: 64,
        bits: 4,
        group_size: 64,
    };
    let mut y = [0f32; 1];
    assert!(qmm_int8_with(Isa::Scalar, 1, &[0.0; 63], &m, &mut y).is_err());
    assert!(qmm_int8_with(Isa::Scalar, 1, &[0.0; 64], &m, &mut y).is_ok());
}
