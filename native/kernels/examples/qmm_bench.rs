//! Throughput of the quantized products on random data in MLX's layout:
//! float32 activations against int8 activations, per variant, batch and
//! thread count.
//!
//! cargo run --release -p emlx_axon_kernels --example qmm_bench -- [ROWS COLS BITS GROUP]
//!     [--all-variants] [--batches 1,4,16] [--layers L]
//!
//! Without a shape, the projections of the Qwen3-0.6B-shaped bench checkpoint
//! (hidden 1024, 16 x 128 query heads, 8 x 128 key/value heads, MLP 3072,
//! 4 bits, groups of 64; q/k/v and gate/up stacked as the engine loads them;
//! the tied output head at batch 1 only). Batches 1 (decode), 128 and 512
//! (prefill) unless `--batches`, threads 1 and 2; the selected variant only
//! unless `--all-variants`. Prints one line per case: milliseconds per product,
//! GB/s of weights read (packed values + scales + biases) and GFLOP/s, for
//! each activation precision, and the int8 speed-up. `--layers L` instead
//! runs L layers' products at batch 1 one after another, each layer its own
//! matrices, as a decode step reads them from memory, with each activation
//! precision.

use std::time::Instant;

use emlx_axon_kernels::{qmm_int8_with, qmm_with, Isa, QuantizedMatrix};

struct Shape {
    name: &'static str,
    n: usize,
    k: usize,
    bits: i32,
    group: i32,
    decode_only: bool,
}

fn main() {
    let mut all_variants = false;
    let mut layers = 0usize;
    let mut batches: Option<Vec<usize>> = None;
    let mut numbers = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--all-variants" {
            all_variants = true;
        } else if a == "--layers" {
            layers = args
                .next()
                .and_then(|n| n.parse().ok())
                .expect("--layers takes a number");
        } else if a == "--batches" {
            let list = args.next().expect("--batches takes a list");
            batches = Some(
                list.split(',')
                    .map(|b| b.parse().expect("--batches takes numbers"))
                    .collect(),
            );
        } else {
            numbers.push(
                a.parse::<usize>()
                    .expect("ROWS COLS BITS GROUP are numbers"),
            );
        }
    }
    let shapes = match numbers[..] {
        [n, k, b, g] => vec![Shape {
            name: "custom",
            n,
            k,
            bits: b as i32,
            group: g as i32,
            decode_only: false,
        }],
        _ => {
            let s = |name, n, k, decode_only| Shape {
                name,
                n,
                k,
                bits: 4,
                group: 64,
                decode_only,
            };
            vec![
                s("qkv", 4096, 1024, false),
                s("o", 1024, 2048, false),
                s("gate_up", 6144, 1024, false),
                s("down", 1024, 3072, false),
                s("lm_head", 151936, 1024, true),
            ]
        }
    };
    let isas: Vec<Isa> = if all_variants {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    } else {
        vec![Isa::selected()]
    };
    println!(
        "variants: {}; int8 on AVX-512 uses VNNI: {}",
        isas.iter().map(|i| i.name()).collect::<Vec<_>>().join(", "),
        emlx_axon_kernels::int8_uses_vnni()
    );
    if layers > 0 {
        for &isa in &isas {
            bench_layers(&shapes, layers, isa);
        }
        return;
    }
    for shape in &shapes {
        bench_shape(shape, &isas, batches.as_deref());
    }
}

/// A pseudo-random matrix in MLX's layout: the speed does not depend on the
/// values.
struct Weights {
    w: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
}

impl Weights {
    fn new(shape: &Shape, seed: u64) -> Self {
        let (n, k, bits, group) = (shape.n, shape.k, shape.bits, shape.group);
        let mut state = 0x2545F4914F6CDD1Du64 ^ seed;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let w = (0..n * k * bits as usize / 32)
            .map(|_| next() as u32)
            .collect();
        let groups = n * k / group as usize;
        let scales = (0..groups).map(|i| 0.01 + (i % 7) as f32 * 1e-3).collect();
        let biases = (0..groups).map(|i| -0.05 + (i % 5) as f32 * 1e-3).collect();
        Weights { w, scales, biases }
    }

    fn matrix(&self, shape: &Shape) -> QuantizedMatrix<'_> {
        QuantizedMatrix {
            w: &self.w,
            scales: &self.scales,
            biases: &self.biases,
            rows: shape.n,
            cols: shape.k,
            bits: shape.bits,
            group_size: shape.group,
        }
    }

    fn bytes(&self) -> usize {
        self.w.len() * 4 + (self.scales.len() + self.biases.len()) * 4
    }
}

/// Decode as a model runs it: every layer's products at batch 1, each
/// matrix its own (so the weights stream from memory, not from cache), one
/// after another.
fn bench_layers(shapes: &[Shape], layers: usize, isa: Isa) {
    let per_layer: Vec<&Shape> = shapes.iter().filter(|s| !s.decode_only).collect();
    let mut all = Vec::new();
    for layer in 0..layers {
        for (i, shape) in per_layer.iter().enumerate() {
            all.push((*shape, Weights::new(shape, (layer * 8 + i) as u64)));
        }
    }
    let bytes: usize = all.iter().map(|(_, w)| w.bytes()).sum();
    let widest = all.iter().map(|(s, _)| s.n.max(s.k)).max().unwrap_or(0);
    let x = vec![0.1f32; widest];
    let mut y = vec![0f32; widest];
    for threads in [1usize, 2] {
        let mut run = |int8: bool| {
            time(|| {
                for (shape, w) in &all {
                    let (x, y) = (&x[..shape.k], &mut y[..shape.n]);
                    if int8 {
                        qmm_int8_with(isa, threads, x, &w.matrix(shape), y).unwrap();
                    } else {
                        qmm_with(isa, threads, x, &w.matrix(shape), y).unwrap();
                    }
                }
            })
        };
        let (f, q) = (run(false), run(true));
        println!(
            "{:7} {layers} layers x {} products, m=1 t={threads}: f32 {:8.3} ms {:6.1} GB/s | int8 {:8.3} ms {:6.1} GB/s",
            isa.name(),
            per_layer.len(),
            f * 1e3,
            bytes as f64 / f / 1e9,
            q * 1e3,
            bytes as f64 / q / 1e9
        );
    }
}

fn bench_shape(shape: &Shape, isas: &[Isa], batches: Option<&[usize]>) {
    let (n, k) = (shape.n, shape.k);
    let weights = Weights::new(shape, 0);
    let matrix = weights.matrix(shape);
    // Packed values and float32 scales and biases.
    let weight_bytes = weights.bytes() as f64;
    let batches: &[usize] = match batches {
        Some(list) => list,
        None if shape.decode_only => &[1],
        None => &[1, 128, 512],
    };
    for &isa in isas {
        for &m in batches {
            if isa == Isa::Scalar && m > 17 {
                continue;
            }
            let x: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let mut y = vec![0f32; m * n];
            for threads in [1usize, 2] {
                let f32_s = time(|| qmm_with(isa, threads, &x, &matrix, &mut y).unwrap());
                let int8_s = time(|| qmm_int8_with(isa, threads, &x, &matrix, &mut y).unwrap());
                let line = |s: f64| {
                    format!(
                        "{:8.3} ms {:6.1} GB/s {:6.1} GFLOP/s",
                        s * 1e3,
                        weight_bytes / s / 1e9,
                        2.0 * (m * n * k) as f64 / s / 1e9
                    )
                };
                println!(
                    "{:7} {:7} {n:6}x{k:4} m={m:3} t={threads}: f32 {} | int8 {} | x{:.2}",
                    isa.name(),
                    shape.name,
                    line(f32_s),
                    line(int8_s),
                    f32_s / int8_s
                );
            }
        }
    }
}

/// Seconds per call: one warm-up call, then repeated for at least 0.4 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut reps = 0u32;
    while reps < 3 || start.elapsed().as_secs_f64() < 0.4 {
        f();
        reps += 1;
    }
    start.elapsed().as_secs_f64() / reps as f64
}
