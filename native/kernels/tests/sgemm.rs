//! The dense f32 product against a float64 reference: every variant, both
//! transposes, odd shapes, leading dimensions wider than the rows, alpha and
//! beta; and MLX's own matmul, which resolves `cblas_sgemm` to ours.

mod common;

use common::{data, on_cpu};
use emlx_axon_kernels::{sgemm_with, Isa, Operand};

#[test]
fn every_variant_matches_a_float64_reference() {
    let shapes = [
        (1, 1, 1),
        (1, 77, 128),
        (5, 3, 7),
        (7, 33, 65),
        (37, 70, 300),
        (130, 96, 129),
        (64, 513, 40),
        // Taller than wide: split by rows.
        (301, 40, 260),
        // Few rows (decode attention), unpacked: K and N off the vector
        // widths, and both sides of the row threshold.
        (1, 200, 128),
        (2, 128, 200),
        (2, 5, 3),
        (3, 37, 19),
        (4, 70, 33),
        (4, 16, 513),
        (5, 33, 17),
    ];
    for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for (alpha, beta) in [(1.0f32, 0.0f32), (0.5, 1.0), (-2.0, 0.25)] {
                    let (lda, ldb, ldc) = (
                        if ta { m } else { k } + 3,
                        if tb { k } else { n } + 1,
                        n + 2,
                    );
                    let a = data(if ta { k } else { m } * lda, si as u64 * 7 + 1);
                    let b = data(if tb { n } else { k } * ldb, si as u64 * 7 + 2);
                    let c0 = data(m * ldc, si as u64 * 7 + 3);
                    let at = |i: usize, p: usize| if ta { a[p * lda + i] } else { a[i * lda + p] } as f64;
                    let bt = |p: usize, j: usize| if tb { b[j * ldb + p] } else { b[p * ldb + j] } as f64;
                    for threads in [1, 0] {
                        let mut c = c0.clone();
                        sgemm_with(
                            isa,
                            threads,
                            (m, n, k),
                            alpha,
                            &Operand {
                                data: &a,
                                trans: ta,
                                ld: lda,
                            },
                            &Operand {
                                data: &b,
                                trans: tb,
                                ld: ldb,
                            },
                            beta,
                            &mut c,
                            ldc,
                        )
                        .unwrap();
                        for i in 0..m {
                            for j in 0..ldc {
                                let got = c[i * ldc + j] as f64;
                                let want = if j < n {
                                    let dot: f64 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                                    alpha as f64 * dot + beta as f64 * c0[i * ldc + j] as f64
                                } else {
                                    c0[i * ldc + j] as f64 // padding untouched
                                };
                                let tol = 1e-5 * (k as f64).sqrt().max(1.0) + 1e-6;
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{isa:?} m={m} n={n} k={k} ta={ta} tb={tb} alpha={alpha} beta={beta} threads={threads} at ({i},{j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn beta_zero_ignores_what_c_held() {
    let a = data(6, 1);
    let b = data(6, 2);
    let mut c = vec![f32::NAN; 4];
    sgemm_with(
        Isa::selected(),
        1,
        (2, 2, 3),
        1.0,
        &Operand {
            data: &a,
            trans: false,
            ld: 3,
        },
        &Operand {
            data: &b,
            trans: false,
            ld: 2,
        },
        0.0,
        &mut c,
        2,
    )
    .unwrap();
    assert!(c.iter().all(|v| v.is_finite()));
    let short = [0f32; 5];
    assert!(sgemm_with(
        Isa::Scalar,
        1,
        (2, 2, 3),
        1.0,
        &Operand {
            data: &short,
            trans: false,
            ld: 3
        },
        &Operand {
            data: &b,
            trans: false,
            ld: 2
        },
        0.0,
        &mut c,
        2,
    )
    .is_err());
}

/// A product split over threads (large enough to be split) gives the same
/// bits as on one thread: each element is summed in one fixed order,
/// whether the split is by columns (few rows, unpacked; or a packed product
/// wider than tall) or by rows (a packed product taller than wide).
#[test]
fn products_give_the_same_bits_on_any_thread_count() {
    // Over the size where the product is split (a few million multiply-adds).
    let mut shapes: Vec<(usize, usize, usize)> = (1..=4).map(|m| (m, 4100, 523)).collect();
    shapes.extend([(40, 600, 300), (301, 40, 523)]);
    for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
        for &(m, n, k) in &shapes {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                let (lda, ldb) = (if ta { m } else { k } + 1, if tb { k } else { n } + 5);
                let a = data(if ta { k } else { m } * lda, 21);
                let b = data(if tb { n } else { k } * ldb, 22);
                let run = |threads: usize| {
                    let mut c = vec![0f32; m * n];
                    sgemm_with(
                        isa,
                        threads,
                        (m, n, k),
                        0.75,
                        &Operand {
                            data: &a,
                            trans: ta,
                            ld: lda,
                        },
                        &Operand {
                            data: &b,
                            trans: tb,
                            ld: ldb,
                        },
                        0.0,
                        &mut c,
                        n,
                    )
                    .unwrap();
                    c
                };
                let one = run(1);
                for threads in [2, 3, 0] {
                    assert_eq!(
                        one,
                        run(threads),
                        "{isa:?} m={m} ta={ta} tb={tb} threads={threads}"
                    );
                }
            }
        }
    }
}

/// MLX's matmul gives bit for bit what our product gives, which the wheel's
/// BLAS (another summation order) would not: libmlx is bound to ours.
#[test]
fn mlx_matmul_runs_on_our_sgemm() {
    on_cpu(|| {
        use mlx_rs::{ops::matmul, Array};
        // A general product, and the few-row ones of decode attention:
        // scores = q kᵀ (kᵀ a transposed view) and out = p v.
        for (m, n, k, kt) in [
            (37, 70, 300, false),
            (2, 200, 128, true),
            (1, 133, 128, true),
            (2, 128, 200, false),
            (1, 128, 77, false),
        ] {
            let a = data(m * k, 11);
            let b = data(k * n, 12);
            let b_arr = if kt {
                Array::from_slice(&b, &[n as i32, k as i32]).t()
            } else {
                Array::from_slice(&b, &[k as i32, n as i32])
            };
            let ours_mlx = matmul(Array::from_slice(&a, &[m as i32, k as i32]), b_arr).unwrap();
            ours_mlx.eval().unwrap();
            let mut c = vec![0f32; m * n];
            sgemm_with(
                Isa::selected(),
                0,
                (m, n, k),
                1.0,
                &Operand {
                    data: &a,
                    trans: false,
                    ld: k,
                },
                &Operand {
                    data: &b,
                    trans: kt,
                    ld: if kt { k } else { n },
                },
                0.0,
                &mut c,
                n,
            )
            .unwrap();
            assert_eq!(
                ours_mlx.as_slice::<f32>(),
                &c[..],
                "m={m} n={n} k={k} kt={kt}"
            );
        }
    })
}
