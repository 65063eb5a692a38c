//! Throughput of each kernel variant on random data in MLX's layout.
//!
//! cargo run --release -p emlx_axon_kernels --example qmm_bench -- [ROWS COLS BITS GROUP]
//! Prints one line per (variant, batch, threads): milliseconds per product,
//! GB/s of weight read and GFLOP/s.

use std::time::Instant;

use emlx_axon_kernels::{qmm_with, Isa, QuantizedMatrix};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS COLS BITS GROUP are numbers"))
        .collect();
    let (n, k, bits, group) = match args[..] {
        [n, k, b, g] => (n, k, b as i32, g as i32),
        _ => (3072, 1024, 4, 64),
    };
    // A fixed pseudo-random pattern: the speed does not depend on the values.
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let w: Vec<u32> = (0..n * k * bits as usize / 32)
        .map(|_| next() as u32)
        .collect();
    let groups = n * k / group as usize;
    let scales: Vec<f32> = (0..groups).map(|i| 0.01 + (i % 7) as f32 * 1e-3).collect();
    let biases: Vec<f32> = (0..groups).map(|i| -0.05 + (i % 5) as f32 * 1e-3).collect();
    let matrix = QuantizedMatrix {
        w: &w,
        scales: &scales,
        biases: &biases,
        rows: n,
        cols: k,
        bits,
        group_size: group,
    };
    let weight_bytes = (w.len() * 4 + groups * 8) as f64;
    for isa in Isa::ALL.into_iter().filter(|i| i.supported()) {
        for m in [1usize, 16, 128] {
            if isa == Isa::Scalar && m > 16 {
                continue;
            }
            let x: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let mut y = vec![0f32; m * n];
            for threads in [1usize, 2] {
                qmm_with(isa, threads, &x, &matrix, &mut y).unwrap();
                let reps = (2_000_000_000 / (m * n * k)).clamp(3, 300);
                let start = Instant::now();
                for _ in 0..reps {
                    qmm_with(isa, threads, &x, &matrix, &mut y).unwrap();
                }
                let s = start.elapsed().as_secs_f64() / reps as f64;
                println!(
                    "{:7} m={m:4} threads={threads}: {:8.3} ms  {:6.1} GB/s weights  {:7.1} GFLOP/s",
                    isa.name(),
                    s * 1e3,
                    weight_bytes / s / 1e9,
                    2.0 * (m * n * k) as f64 / s / 1e9
                );
            }
        }
    }
}
