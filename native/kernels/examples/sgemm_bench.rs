//! Time per call of the dense f32 product on the shapes of batch-1 decode
//! attention (scores = q kᵀ with B transposed, out = p v with B as stored),
//! per variant and thread count.
//!
//! cargo run --release -p emlx_axon_kernels --example sgemm_bench -- [M N K ...]
//!
//! Without shapes: M = 1, 2 (query heads per key head) with K = 128, N = 200
//! (scores at 200 tokens of context) and K = 200, N = 128 (weighted values),
//! plus M = 4, 8 and a 1,000-token context. Prints microseconds per call.

use std::time::{Duration, Instant};

use emlx_axon_kernels::{sgemm_with, Isa, Operand};

#[path = "../tests/common/mod.rs"]
mod common;

use common::data;

/// Microseconds per call: the best of five rounds of at least 50 ms each.
fn time_call(mut f: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let mut calls = 0u64;
        while start.elapsed() < Duration::from_millis(50) {
            for _ in 0..64 {
                f();
            }
            calls += 64;
        }
        best = best.min(start.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    best
}

fn main() {
    let numbers: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("shapes are numbers: M N K ..."))
        .collect();
    let shapes: Vec<(usize, usize, usize)> = if numbers.is_empty() {
        let mut s = Vec::new();
        for m in [1, 2, 4, 8] {
            s.push((m, 200, 128));
            s.push((m, 128, 200));
        }
        s.push((2, 1000, 128));
        s.push((2, 128, 1000));
        s
    } else {
        assert!(
            numbers.len().is_multiple_of(3),
            "shapes come as M N K triples"
        );
        numbers.chunks(3).map(|c| (c[0], c[1], c[2])).collect()
    };
    println!("variant  threads  M     N     K  trans_b  us/call");
    for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
        for &(m, n, k) in &shapes {
            for trans_b in [true, false] {
                let a = data(m * k, 1);
                let b = data(k * n, 2);
                let mut c = vec![0f32; m * n];
                for threads in [1, 2] {
                    let us = time_call(|| {
                        sgemm_with(
                            isa,
                            threads,
                            (m, n, k),
                            1.0,
                            &Operand {
                                data: &a,
                                trans: false,
                                ld: k,
                            },
                            &Operand {
                                data: &b,
                                trans: trans_b,
                                ld: if trans_b { k } else { n },
                            },
                            0.0,
                            &mut c,
                            n,
                        )
                        .unwrap();
                        std::hint::black_box(&mut c);
                    });
                    println!(
                        "{:7}  {threads:7}  {m:1} {n:5} {k:5}  {trans_b:7}  {us:7.2}",
                        isa.name()
                    );
                }
            }
        }
    }
}
