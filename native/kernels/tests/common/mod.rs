//! Shared by the kernels' tests (and the sgemm bench): deterministic data,
//! random cases quantized by MLX, an independent float64 evaluation of the
//! int8 algebra, and the bound on what rounding the activations may change.
#![allow(dead_code)]

use emlx_axon_kernels::{Bf16, QuantizedMatrix};
use mlx_rs::ops::{quantize, quantized_matmul};
use mlx_rs::random::{key, normal};
use mlx_rs::{Array, Dtype};

/// Runs `f` with MLX's CPU stream as the default: these are CPU cases, and on
/// a GPU build MLX's default device is the GPU.
pub fn on_cpu<T>(f: impl FnOnce() -> T) -> T {
    start_mlx_first();
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), f)
}

/// Starts MLX's scheduler, and on a CUDA build the CUDA runtime, before any
/// stream or kernel: the runtime is then torn down after MLX's own CUDA
/// handles at exit, instead of before them, which aborts a test binary
/// whose tests all passed ("Destroy(handle_) failed: driver shutting down").
/// Reading MLX's memory figures creates its allocator, which does that.
pub fn start_mlx_first() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let mut bytes = 0usize;
        // SAFETY: the getter writes the one usize it is given.
        unsafe { mlx_sys::mlx_get_active_memory(&mut bytes) };
    });
}

/// `len` values in [-0.5, 0.5) from `seed` (xorshift): the same on every
/// machine, no MLX needed.
pub fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// Elements of x per activation scale.
pub const BLOCK: usize = 32;

pub struct Case {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub bits: i32,
    pub group: i32,
    pub x: Array,
    pub w: Array,
    /// float32 scales and biases; with `bf16`, values that bfloat16 holds exactly.
    pub scales: Array,
    pub biases: Array,
    pub bf16: bool,
    /// MLX's quantized_matmul with float32 activations.
    pub mlx: Vec<f32>,
}

pub fn case(seed: u64, m: usize, n: usize, k: usize, bits: i32, group: i32, bf16: bool) -> Case {
    let x = normal::<f32>(&[m as i32, k as i32][..], None, None, &key(seed).unwrap()).unwrap();
    let dense = normal::<f32>(
        &[n as i32, k as i32][..],
        None,
        0.05,
        &key(seed + 1_000).unwrap(),
    )
    .unwrap();
    let (w, mut scales, mut biases) = quantize(&dense, group, bits).unwrap();
    if bf16 {
        let round = |a: &Array| {
            a.as_dtype(Dtype::Bfloat16)
                .unwrap()
                .as_dtype(Dtype::Float32)
                .unwrap()
        };
        scales = round(&scales);
        biases = round(&biases);
    }
    let y = quantized_matmul(&x, &w, &scales, &biases, true, group, bits).unwrap();
    for a in [&x, &w, &scales, &biases, &y] {
        a.eval().unwrap();
    }
    Case {
        m,
        n,
        k,
        bits,
        group,
        mlx: y.as_slice::<f32>().to_vec(),
        x,
        w,
        scales,
        biases,
        bf16,
    }
}

impl Case {
    pub fn matrix(&self) -> QuantizedMatrix<'_, f32> {
        QuantizedMatrix {
            w: self.w.as_slice::<u32>(),
            scales: self.scales.as_slice::<f32>(),
            biases: self.biases.as_slice::<f32>(),
            rows: self.n,
            cols: self.k,
            bits: self.bits,
            group_size: self.group,
        }
    }

    /// Scales and biases as bfloat16 bits (exact: `bf16` cases hold
    /// bfloat16 values).
    pub fn bf16_params(&self) -> (Vec<Bf16>, Vec<Bf16>) {
        assert!(self.bf16);
        let bits = |a: &Array| {
            a.as_slice::<f32>()
                .iter()
                .map(|v| {
                    assert_eq!(v.to_bits() & 0xFFFF, 0);
                    Bf16((v.to_bits() >> 16) as u16)
                })
                .collect()
        };
        (bits(&self.scales), bits(&self.biases))
    }

    /// Quantized weight value (n, k), 0..2^bits - 1.
    pub fn q(&self, n: usize, k: usize) -> u32 {
        let per_word = 32 / self.bits as usize;
        let words = self.k / per_word;
        let word = self.w.as_slice::<u32>()[n * words + k / per_word];
        (word >> ((k % per_word) * self.bits as usize)) & ((1 << self.bits) - 1)
    }

    fn param(&self, a: &Array, n: usize, g: usize) -> f64 {
        a.as_slice::<f32>()[n * (self.k / self.group as usize) + g] as f64
    }

    /// Dequantized weight (n, k) as MLX computes it.
    pub fn weight(&self, n: usize, k: usize) -> f64 {
        let g = k / self.group as usize;
        self.param(&self.scales, n, g) * self.q(n, k) as f64 + self.param(&self.biases, n, g)
    }
}

/// x quantized as the kernels do: per row and block of 32, scale
/// max |x| / 127, values round_to_nearest_even(x / scale) in float32.
pub fn quantize_x(x: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    for block in x.chunks(BLOCK) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        scales.push(d);
        q.extend(
            block
                .iter()
                .map(|v| (v * id).round_ties_even().clamp(-127.0, 127.0) as i32),
        );
    }
    (q, scales)
}

/// The int8 algebra in float64: per output, the reference value and the sum
/// of the magnitudes of its terms (what float32 rounding is relative to).
pub fn int8_reference(c: &Case) -> Vec<(f64, f64)> {
    let x = c.x.as_slice::<f32>();
    let (q, d) = quantize_x(x);
    let (k, g) = (c.k, c.group as usize);
    let mut out = Vec::with_capacity(c.m * c.n);
    for m in 0..c.m {
        for n in 0..c.n {
            let (mut y, mut mag) = (0f64, 0f64);
            for grp in 0..k / g {
                let (mut t, mut tmag) = (0f64, 0f64);
                for blk in grp * g / BLOCK..(grp + 1) * g / BLOCK {
                    let dot: i64 = (blk * BLOCK..(blk + 1) * BLOCK)
                        .map(|kk| c.q(n, kk) as i64 * q[m * k + kk] as i64)
                        .sum();
                    let term = d[m * k / BLOCK + blk] as f64 * dot as f64;
                    t += term;
                    tmag += term.abs();
                }
                // The group sum of the quantized x, as the biases multiply it.
                let xsum: f64 = (grp * g / BLOCK..(grp + 1) * g / BLOCK)
                    .map(|blk| {
                        let qsum: i64 = q[m * k + blk * BLOCK..m * k + (blk + 1) * BLOCK]
                            .iter()
                            .map(|&v| v as i64)
                            .sum();
                        d[m * k / BLOCK + blk] as f64 * qsum as f64
                    })
                    .sum();
                let (s, b) = (c.param(&c.scales, n, grp), c.param(&c.biases, n, grp));
                y += s * t + b * xsum;
                mag += (s * tmag).abs() + (b * xsum).abs();
            }
            out.push((y, mag));
        }
    }
    out
}

/// Per output, the most rounding x to int8 can change the exact product:
/// each element moves by at most half its block's scale, so
/// |y_int8 - y| <= sum over blocks of (scale / 2) * sum |w| over the block.
pub fn activation_bound(c: &Case) -> Vec<f64> {
    let (_, d) = quantize_x(c.x.as_slice::<f32>());
    let mut out = Vec::with_capacity(c.m * c.n);
    for m in 0..c.m {
        for n in 0..c.n {
            let mut bound = 0f64;
            for blk in 0..c.k / BLOCK {
                let wsum: f64 = (blk * BLOCK..(blk + 1) * BLOCK)
                    .map(|kk| c.weight(n, kk).abs())
                    .sum();
                bound += d[m * c.k / BLOCK + blk] as f64 / 2.0 * wsum;
            }
            out.push(bound);
        }
    }
    out
}

/// Checks `ours` against MLX's float32 product within the activation bound
/// (plus float32 rounding relative to the largest output); returns the
/// largest error relative to the largest output.
pub fn check_against_mlx(c: &Case, ours: &[f32], what: &str) -> f64 {
    check_within_bound(c, &activation_bound(c), ours, what)
}

/// [`check_against_mlx`] with the case's [`activation_bound`] at hand.
pub fn check_within_bound(c: &Case, bound: &[f64], ours: &[f32], what: &str) -> f64 {
    let scale = c.mlx.iter().fold(1e-6f64, |a, v| a.max(v.abs() as f64));
    let mut worst = 0f64;
    for (i, (&o, &e)) in ours.iter().zip(&c.mlx).enumerate() {
        let err = (o as f64 - e as f64).abs();
        assert!(
            err <= bound[i] * 1.001 + 1e-5 * scale,
            "{what}: output {i}: {o} vs MLX {e}, error {err} over the bound {}",
            bound[i]
        );
        worst = worst.max(err / scale);
    }
    worst
}

/// Largest difference relative to the largest reference magnitude.
pub fn rel_err(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let scale = theirs.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    ours.iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs() / scale))
}
