//! Every variant against MLX's own quantized_matmul on random data: each bit
//! width and group size, odd batch sizes, and row counts that neither the
//! 4-row blocks nor the thread split divide.

mod common;

use common::{on_cpu, rel_err};
use emlx_axon_kernels::{qmm_with, quantized_linear, Isa, QuantizedMatrix};
use mlx_rs::ops::{quantize, quantized_matmul};
use mlx_rs::random::{key, normal};
use mlx_rs::Array;

struct Case {
    x: Array,
    w: Array,
    scales: Array,
    biases: Array,
    expected: Vec<f32>,
}

fn case(seed: u64, m: i32, n: i32, k: i32, bits: i32, group: i32) -> Case {
    let kx = key(seed).unwrap();
    let kw = key(seed + 1_000).unwrap();
    let x = normal::<f32>(&[m, k][..], None, None, &kx).unwrap();
    let dense = normal::<f32>(&[n, k][..], None, 0.05, &kw).unwrap();
    let (w, scales, biases) = quantize(&dense, group, bits).unwrap();
    let y = quantized_matmul(&x, &w, &scales, &biases, true, group, bits).unwrap();
    y.eval().unwrap();
    Case {
        x,
        w,
        scales,
        biases,
        expected: y.as_slice::<f32>().to_vec(),
    }
}

/// The case's matrix (evaluated) with its packed words at `words`: a copy
/// at another offset.
fn with_words<'a>(
    c: &'a Case,
    words: &'a [u32],
    rows: usize,
    k: i32,
    bits: i32,
    group: i32,
) -> QuantizedMatrix<'a> {
    QuantizedMatrix {
        w: words,
        scales: c.scales.as_slice::<f32>(),
        biases: c.biases.as_slice::<f32>(),
        rows,
        cols: k as usize,
        bits,
        group_size: group,
    }
}

fn run_raw(
    c: &Case,
    isa: Isa,
    threads: usize,
    n: usize,
    k: usize,
    bits: i32,
    group: i32,
) -> Vec<f32> {
    for a in [&c.x, &c.w, &c.scales, &c.biases] {
        a.eval().unwrap();
    }
    let matrix = QuantizedMatrix {
        w: c.w.as_slice::<u32>(),
        scales: c.scales.as_slice::<f32>(),
        biases: c.biases.as_slice::<f32>(),
        rows: n,
        cols: k,
        bits,
        group_size: group,
    };
    let x = c.x.as_slice::<f32>();
    let mut y = vec![f32::NAN; x.len() / k * n];
    qmm_with(isa, threads, x, &matrix, &mut y).unwrap();
    y
}

const SHAPES: [(i32, i32, i32); 4] = [
    // (n, k, m values below) narrow, single-threaded
    (70, 256, 0),
    // wide enough to split across threads; 301 rows: not a multiple of 4 or 2
    (301, 1024, 0),
    (64, 128, 0),
    (129, 384, 0),
];
const BATCHES: [i32; 8] = [1, 2, 3, 4, 5, 7, 17, 33];

#[test]
fn every_variant_matches_mlx_quantized_matmul() {
    on_cpu(|| {
        let mut checked = 0;
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                for (i, &(n, k, _)) in SHAPES.iter().enumerate() {
                    for &m in &BATCHES {
                        let seed = (bits * 1000 + group * 10 + i as i32 * 100 + m) as u64;
                        let c = case(seed, m, n, k, bits, group);
                        for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                            for threads in [1, 0] {
                                let y =
                                    run_raw(&c, isa, threads, n as usize, k as usize, bits, group);
                                let err = rel_err(&y, &c.expected);
                                assert!(
                                    err < 1e-5,
                                    "{isa:?} threads={threads} bits={bits} group={group} m={m} n={n} k={k}: relative error {err}"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked >= 2 * 3 * 4 * 8 * 2);
    })
}

#[test]
fn mlx_primitive_matches_mlx_quantized_matmul() {
    on_cpu(|| {
        for bits in [4, 8] {
            for group in [32, 64, 128] {
                for &m in &[1, 3, 9] {
                    let c = case(7 + m as u64, m, 301, 1024, bits, group);
                    // A batched, lazily computed input: [1, m, k] from an op.
                    let x =
                        c.x.reshape(&[1, m, 1024])
                            .unwrap()
                            .multiply(Array::from_f32(1.0))
                            .unwrap();
                    let y = quantized_linear(&x, &c.w, &c.scales, &c.biases, group, bits)
                        .unwrap()
                        .expect("a CPU float32 product is ours");
                    assert_eq!(y.shape(), &[1, m, 301]);
                    y.eval().unwrap();
                    let err = rel_err(y.as_slice::<f32>(), &c.expected);
                    assert!(
                        err < 1e-5,
                        "bits={bits} group={group} m={m}: relative error {err}"
                    );
                }
            }
        }
    })
}

#[test]
fn a_non_contiguous_input_is_made_contiguous() {
    on_cpu(|| {
        let c = case(99, 5, 70, 256, 4, 64);
        // x as the transpose of a transpose: a strided view.
        let xt = c.x.t().t();
        let y = quantized_linear(&xt.t().t(), &c.w, &c.scales, &c.biases, 64, 4)
            .unwrap()
            .unwrap();
        y.eval().unwrap();
        assert!(rel_err(y.as_slice::<f32>(), &c.expected) < 1e-5);
        // A column slice of W's packed words is not row-contiguous either.
        let wide = case(98, 3, 70, 512, 4, 64);
        use mlx_rs::ops::indexing::IndexOp;
        let w = wide.w.index((.., ..32));
        let s = wide.scales.index((.., ..4));
        let b = wide.biases.index((.., ..4));
        let x = wide.x.index((.., ..256));
        let expected = quantized_matmul(&x, &w, &s, &b, true, 64, 4).unwrap();
        let y = quantized_linear(&x, &w, &s, &b, 64, 4).unwrap().unwrap();
        assert!(rel_err(y.as_slice::<f32>(), expected.as_slice::<f32>()) < 1e-5);
    })
}

#[test]
fn a_strided_view_of_queued_work_is_read_after_that_work() {
    on_cpu(|| {
        use mlx_rs::ops::indexing::IndexOp;
        let c = case(97, 256, 70, 512, 4, 64);
        // x is still being computed on the stream's thread when the product is
        // scheduled, and a column slice of it is strided, so the product packs
        // it: that must wait for the work that writes it.
        let mut computed = c.x.clone();
        for _ in 0..24 {
            computed = computed
                .multiply(Array::from_f32(2.0))
                .unwrap()
                .divide(Array::from_f32(2.0))
                .unwrap();
        }
        let x = computed.index((.., ..256));
        let (w, s, b) = (
            c.w.index((.., ..32)),
            c.scales.index((.., ..4)),
            c.biases.index((.., ..4)),
        );
        let expected = quantized_matmul(c.x.index((.., ..256)), &w, &s, &b, true, 64, 4).unwrap();
        let y = quantized_linear(&x, &w, &s, &b, 64, 4).unwrap().unwrap();
        y.eval().unwrap();
        let err = rel_err(y.as_slice::<f32>(), expected.as_slice::<f32>());
        assert!(err < 1e-5, "relative error {err}");
    })
}

#[test]
fn cases_that_are_not_ours_are_declined() {
    on_cpu(|| {
        let c = case(5, 2, 70, 256, 4, 64);
        // Another bit width, another group size, a dtype, a mismatched shape.
        assert!(quantized_linear(&c.x, &c.w, &c.scales, &c.biases, 64, 3)
            .unwrap()
            .is_none());
        assert!(quantized_linear(&c.x, &c.w, &c.scales, &c.biases, 16, 4)
            .unwrap()
            .is_none());
        let half = c.x.as_dtype(mlx_rs::Dtype::Float16).unwrap();
        assert!(quantized_linear(&half, &c.w, &c.scales, &c.biases, 64, 4)
            .unwrap()
            .is_none());
        let short = c.x.reshape(&[4, 128]).unwrap();
        assert!(quantized_linear(&short, &c.w, &c.scales, &c.biases, 64, 4)
            .unwrap()
            .is_none());
        // And the raw entry point refuses buffers that do not match.
        let matrix = QuantizedMatrix {
            w: &[0; 8],
            scales: &[0.0; 1],
            biases: &[0.0; 1],
            rows: 1,
            cols: 64,
            bits: 4,
            group_size: 64,
        };
        let mut y = [0f32; 1];
        assert!(qmm_with(Isa::Scalar, 1, &[0.0; 63], &matrix, &mut y).is_err());
        assert!(qmm_with(Isa::Scalar, 1, &[0.0; 64], &matrix, &mut y).is_ok());
    })
}

/// Scales and biases as checkpoints store them (bfloat16) give what MLX gives
/// with the same values widened to float32.
#[test]
fn bfloat16_scales_and_biases_are_read_as_stored() {
    on_cpu(|| {
        use mlx_rs::Dtype;
        for bits in [4, 8] {
            for &m in &[1, 6] {
                let c = case(40 + m as u64, m, 301, 1024, bits, 64);
                let s16 = c.scales.as_dtype(Dtype::Bfloat16).unwrap();
                let b16 = c.biases.as_dtype(Dtype::Bfloat16).unwrap();
                let expected = quantized_matmul(
                    &c.x,
                    &c.w,
                    s16.as_dtype(Dtype::Float32).unwrap(),
                    &b16.as_dtype(Dtype::Float32).unwrap(),
                    true,
                    64,
                    bits,
                )
                .unwrap();
                let y = quantized_linear(&c.x, &c.w, &s16, &b16, 64, bits)
                    .unwrap()
                    .expect("bfloat16 scales are ours");
                let err = rel_err(y.as_slice::<f32>(), expected.as_slice::<f32>());
                assert!(err < 1e-5, "bits={bits} m={m}: relative error {err}");
            }
        }
    })
}

#[test]
fn weights_at_any_word_offset_give_the_same_products() {
    // Checkpoint tensors sit at any 4-byte offset; the matrix-vector form
    // reads rows off a cache-line boundary through aligned loads.
    on_cpu(|| {
        for (bits, group, k) in [(4, 64, 1024), (8, 32, 512), (4, 128, 384), (8, 128, 256)] {
            let c = case(41 + bits as u64, 1, 37, k, bits, group);
            for a in [&c.x, &c.w, &c.scales, &c.biases] {
                a.eval().unwrap();
            }
            let words = c.w.as_slice::<u32>();
            let mut padded = vec![0u32; words.len() + 16];
            for offset in 0..16 {
                padded[offset..offset + words.len()].copy_from_slice(words);
                let matrix = with_words(
                    &c,
                    &padded[offset..offset + words.len()],
                    37,
                    k,
                    bits,
                    group,
                );
                for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
                    let mut y = vec![f32::NAN; 37];
                    qmm_with(isa, 1, c.x.as_slice::<f32>(), &matrix, &mut y).unwrap();
                    let err = rel_err(&y, &c.expected);
                    assert!(err < 1e-5, "{isa:?} bits={bits} offset={offset}: {err}");
                }
            }
        }
    })
}

#[test]
fn a_batch_row_gets_its_single_row_products_bit_for_bit() {
    // The AVX-512 matrix-vector form takes up to 8 rows of x in one pass
    // over the weights, summing each output as for one row: a decode batch
    // row then equals its single run. Weights at a word offset included.
    if !Isa::Avx512.supported() {
        return;
    }
    on_cpu(|| {
        for (bits, group, k) in [(4, 64, 1024), (8, 32, 512), (4, 128, 384)] {
            for m in 2..=8 {
                let c = case(500 + bits as u64 * 10 + m as u64, m, 45, k, bits, group);
                for a in [&c.x, &c.w, &c.scales, &c.biases] {
                    a.eval().unwrap();
                }
                let words = c.w.as_slice::<u32>();
                let mut padded = vec![0u32; words.len() + 3];
                padded[3..].copy_from_slice(words);
                let matrix = with_words(&c, &padded[3..], 45, k, bits, group);
                let x = c.x.as_slice::<f32>();
                let mut batch = vec![f32::NAN; m as usize * 45];
                qmm_with(Isa::Avx512, 0, x, &matrix, &mut batch).unwrap();
                for (row, ys) in x.chunks(k as usize).zip(batch.chunks(45)) {
                    let mut single = vec![f32::NAN; 45];
                    qmm_with(Isa::Avx512, 0, row, &matrix, &mut single).unwrap();
                    let same = ys
                        .iter()
                        .zip(&single)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "bits={bits} group={group} k={k} m={m}");
                }
            }
        }
    })
}
